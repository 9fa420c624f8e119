# Copyright (c) the DeepSpeed lockstep fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""A real Hugging Face Switch Transformers model (tiny config, random weights, nothing downloaded) under ZeRO-3
with natural routing and no declaration: each rank trains on its own batches drawn from the whole vocabulary.
For the first three optimizer steps every rank happens to route tokens to every expert of every sparse layer
(so the ranks agree on the module trace), and at the fourth step the ranks' experts differ. Without
the fetch schedule (and with per-fetch votes that only start once the trace breaks) the run hangs there: one
rank waits in a parameter all-gather for an expert the other rank does not run.

Oracles: every rank finishes within the deadline; the routing really was uniform, then different (checked on
the plain-PyTorch reference); parameters identical across ranks and equal to the reference (a gradient missing
on a rank counts as zero); ZeRO-3 parameters partitioned at rest after every step."""

import pytest
import torch

import deepspeed
import deepspeed.comm as dist
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

from unit.common import DistributedTest
from unit.runtime.zero.lockstep_scenarios import (agree_on_every_rank, assert_lockstep, device, full_params,
                                                  reference_training, zero_config)
from unit.runtime.zero.moe_scenarios import moe_optimizer, tiny_switch

transformers = pytest.importorskip("transformers")

VOCAB = 64
SEED = 1255  # a model whose routing uses every expert on both ranks for three steps, then not
STEPS = 5
UNIFORM_STEPS = 3


def _switch():
    torch.manual_seed(SEED)
    return tiny_switch(VOCAB, layers=4, sparse_layers=2)


def _batch(rank, step):
    g = torch.Generator().manual_seed(SEED + 1000 * rank + step)
    return dict(input_ids=torch.randint(2, VOCAB, (2, 16), generator=g),
                labels=torch.randint(2, VOCAB, (2, 16), generator=g))


def _experts(model):
    return [(name, m) for name, m in model.named_modules() if name.split(".")[-2:-1] == ["experts"]]


@pytest.mark.parametrize("prefetch", [4096, 0])
class TestSwitchExpertsDifferAfterUniformSteps(DistributedTest):
    """The configuration of the report: fp32, 4096-element buckets, small parameters resident, prefetching on
    (4096) or off."""
    world_size = 2
    exec_timeout = 90

    def test_lockstep(self, prefetch):
        rank, world_size = dist.get_rank(), dist.get_world_size()
        config = zero_config(3,
                             reduce_bucket_size=4096,
                             stage3_param_persistence_threshold=100,
                             stage3_prefetch_bucket_size=prefetch)
        model = _switch()
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=moe_optimizer(model), config=config)
        for step in range(STEPS):
            batch = {k: v.to(device()) for k, v in _batch(rank, step).items()}
            engine.backward(engine(**batch).loss)
            engine.step()
            assert all(p.ds_status == ZeroParamStatus.NOT_AVAILABLE for p in engine.module.parameters()
                       if not p.ds_persist)
        mine = full_params(engine.module, 3)

        ref_model = _switch()
        used, routed = set(), {}
        for name, m in _experts(ref_model):
            m.register_forward_hook(lambda m, i, o, name=name: used.add(name))

        def loss_of(r, s, micro):
            used.clear()
            loss = ref_model(**_batch(r, s)).loss
            routed[(r, s)] = frozenset(used)
            return loss

        ref = reference_training(ref_model, moe_optimizer(ref_model), world_size, STEPS, 1, loss_of)
        every = frozenset(name for name, _ in _experts(ref_model))
        agree_on_every_rank(
            all(routed[(r, s)] == every for r in range(world_size) for s in range(UNIFORM_STEPS))
            and any(routed[(0, s)] != routed[(1, s)] for s in range(UNIFORM_STEPS, STEPS)),
            "the routing should use every expert on every rank at first, and differ across ranks later")
        assert_lockstep(mine, ref, config, STEPS, atol=1e-5, rtol=1e-4)
