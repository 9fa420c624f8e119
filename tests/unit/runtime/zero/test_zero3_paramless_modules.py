# Copyright (c) the DeepSpeed lockstep fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""ZeRO-3 modules without parameters (activations, dropouts, containers of them) have nothing to fetch,
yet ZeRO-3 hooked every module: each call pushed a trace entry and wrapped the module's inputs and outputs
in autograd nodes. So an activation applied on some ranks' batches only (an optional ``Tanh`` in a
``Sequential``) made those ranks' module traces differ from the others': in 0.19.8 a rank whose trace no
longer matches stops prefetching while the others prefetch, and their all-gathers differ (gloo: size
mismatch; NCCL: hang); the fork's fetch schedule, agreed without the activation, saw a module it did not
have on the rank that applied it and made every rank switch to per-fetch votes for the step. Now a module
with no parameter in its subtree gets no fetch, release or trace work and no autograd nodes.

Oracles: every rank finishes within the deadline; parameters identical across ranks and equal to a
plain-PyTorch reference; no rank leaves the fetch schedule; a forward adds no ZeRO-3 autograd node for a
module without parameters."""

import pytest
import torch

import deepspeed
import deepspeed.comm as dist

from unit.common import DistributedTest
from unit.runtime.zero.lockstep_scenarios import (SEED, agree_on_every_rank, assert_lockstep, device, full_params,
                                                  reference_training, zero_config)

STEPS = 4
HIDDEN = 8


class OptionalActivation(torch.nn.Module):

    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(HIDDEN, HIDDEN)
        self.act = torch.nn.GELU()
        self.optional = torch.nn.Sequential(torch.nn.Tanh())  # no parameters, applied on some batches only
        self.second = torch.nn.Linear(HIDDEN, HIDDEN)
        self.third = torch.nn.Linear(HIDDEN, HIDDEN)
        self.head = torch.nn.Linear(HIDDEN, 1)

    def forward(self, x, squash):
        h = self.act(self.first(x))
        if squash:
            h = self.optional(h)
        return self.head(self.third(self.second(h))).pow(2).mean()


def _model():
    torch.manual_seed(SEED)
    return OptionalActivation()


# whether a rank applies the activation at a step: at step 0 the ranks agree on the module trace (the fork's
# fetch schedule), so later a rank skips a module the trace has, or runs one it lacks
USAGES = {
    "skip_after_uniform": lambda rank, step: step == 0 or rank == 0,
    "extra_after_uniform": lambda rank, step: step > 0 and rank == 0,
}


def _batch(usage, rank, step):
    g = torch.Generator().manual_seed(SEED + 100 * step + rank)
    return torch.randn(4, HIDDEN, generator=g), USAGES[usage](rank, step)


def _optimizer(model):
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _zero3_wrappers(loss):
    """ZeRO-3's backward-hook autograd nodes in the graph of ``loss``."""
    seen, todo, count = set(), [loss.grad_fn], 0
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        count += type(node).__name__ in ("PreBackwardFunctionForModuleBackward", "PostBackwardFunctionModuleBackward")
        todo.extend(next_node for next_node, _ in node.next_functions)
    return count


@pytest.mark.parametrize("prefetch", [64, 0])
@pytest.mark.parametrize("usage", sorted(USAGES))
class TestActivationOnSomeRanks(DistributedTest):
    world_size = 2
    exec_timeout = 60

    def test_lockstep(self, usage, prefetch):
        rank = dist.get_rank()
        config = zero_config(3, stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=prefetch)
        model = _model()
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=_optimizer(model), config=config)
        wrappers = []
        for step in range(STEPS):
            x, squash = _batch(usage, rank, step)
            loss = engine(x.to(device()), squash)
            wrappers.append(_zero3_wrappers(loss))
            engine.backward(loss)
            engine.step()
        mine = full_params(engine.module, 3)

        ref_model = _model()
        ref = reference_training(ref_model, _optimizer(ref_model), dist.get_world_size(), STEPS, 1,
                                 lambda r, s, m: ref_model(*_batch(usage, r, s)))
        assert_lockstep(mine, ref, config, STEPS)

        schedule = getattr(engine.optimizer.parameter_offload.get_param_coordinator(), "fetch_schedule", None)
        if schedule is not None:  # with the ZeRO-3 fetch schedule: the activation is not in it
            agree_on_every_rank(schedule.switches == 0, f"{schedule.switches} switches to per-fetch votes")
        # with and without the activation, the same wrappers: those of the modules with parameters
        agree_on_every_rank(len(set(wrappers)) == 1, f"ZeRO-3 autograd nodes per forward: {wrappers}")
