# Copyright (c) the DeepSpeed lockstep fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""ZeRO-3 gathers a parameter that a forward reads outside its own module's forward (a weight used
functionally by its parent, as Hugging Face's T5 feed-forward reads ``self.wo.weight``) when it is read, and
registers it as an external parameter of the module running then: from then on that module's fetch gathers
it too. The registration is made by the ranks whose data took that path only, so once they replay the
same module trace, that module's fetch gathers one more parameter on those ranks than on the others (gloo:
size mismatch; NCCL: hang or mixed-up parameters). Oracle: every rank finishes within the deadline,
parameters identical across ranks and equal to a plain-PyTorch reference."""

import pytest
import torch

import deepspeed
import deepspeed.comm as dist

from unit.common import DistributedTest
from unit.runtime.zero.lockstep_scenarios import SEED, assert_lockstep, device, full_params, reference_training, zero_config

STEPS = 5
HIDDEN = 8


class ReadsSiblingWeight(torch.nn.Module):

    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(HIDDEN, HIDDEN)
        self.side = torch.nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.second = torch.nn.Linear(HIDDEN, HIDDEN)
        self.head = torch.nn.Linear(HIDDEN, 1)

    def forward(self, x, read_side):
        h = self.first(x)
        if read_side:  # side's weight used by this module, outside side's own forward
            h = h + torch.nn.functional.linear(h, self.side.weight)
        return self.head(self.second(h)).pow(2).mean()


# whether a rank reads the weight outside its module at a step
USAGES = {
    "rank0_from_start": lambda rank, step: rank == 0,
    "rank0_after_uniform": lambda rank, step: step >= 2 and rank == 0,
    "rank0_once": lambda rank, step: step == 1 and rank == 0,
}


def _model():
    torch.manual_seed(SEED)
    return ReadsSiblingWeight()


def _batch(usage, rank, step):
    g = torch.Generator().manual_seed(SEED + 100 * step + rank)
    return torch.randn(4, HIDDEN, generator=g), USAGES[usage](rank, step)


def _optimizer(model):
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


@pytest.mark.parametrize("evaluate_first", [False, True], ids=["", "evaluate_first"])
@pytest.mark.parametrize("prefetch", [64, 0])
@pytest.mark.parametrize("usage", sorted(USAGES))
class TestWeightReadOutsideItsModule(DistributedTest):
    world_size = 2
    exec_timeout = 60

    def test_lockstep(self, usage, prefetch, evaluate_first):
        rank = dist.get_rank()
        config = zero_config(3, stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=prefetch)
        model = _model()
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=_optimizer(model), config=config)
        if evaluate_first:  # an evaluation before training in which rank 0 alone reads the weight
            with torch.no_grad():
                engine(_batch(usage, rank, 0)[0].to(device()), rank == 0)
        for step in range(STEPS):
            x, read_side = _batch(usage, rank, step)
            engine.backward(engine(x.to(device()), read_side))
            engine.step()
        with torch.no_grad():  # an evaluation on every rank, each with its own path
            engine(x.to(device()), rank == 1)
        mine = full_params(engine.module, 3)

        ref_model = _model()
        ref = reference_training(ref_model, _optimizer(ref_model), dist.get_world_size(), STEPS, 1,
                                 lambda r, s, m: ref_model(*_batch(usage, r, s)))
        assert_lockstep(mine, ref, config, STEPS)


class ReadsWeightsOfOthers(torch.nn.Module):
    """``second``'s weight and ``other``'s weight read outside their modules, as a program says."""

    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(HIDDEN, HIDDEN)
        self.second = torch.nn.Linear(HIDDEN, HIDDEN)
        self.other = torch.nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.head = torch.nn.Linear(HIDDEN, 1)

    def forward(self, x, program):
        h = x
        for op in program:
            if op in ("first", "second"):
                h = h + 0.5 * getattr(self, op)(h)
            else:  # "read_second", "read_other": the weight used by this module, outside its own module
                h = h + 0.5 * torch.nn.functional.linear(h, getattr(self, op[len("read_"):]).weight)
        return self.head(h).pow(2).mean()


# (rank, step, micro) -> the programs of the loss's forwards; an evaluation at step 0 before it ("eval")
HELD_READ_PROGRAMS = {
    (0, "eval"): [["read_second", "read_other"]],
    (1, "eval"): [["read_second"]],
    (0, 0, 0): [["first", "read_second"], ["read_second"]],
    (1, 0, 0): [["second"], ["first"]],
}


def _held_read_loss(model, rank, step, micro, on=None):
    programs = HELD_READ_PROGRAMS.get((rank, step, micro), [["first", "second", "read_other"]])
    g = torch.Generator().manual_seed(SEED + 100 * step + 10 * micro + rank)
    x = torch.randn(2, HIDDEN, generator=g)
    return sum(model(x.to(on) if on else x, program) for program in programs)


class TestWeightHeldWhileOtherRanksFetch(DistributedTest):
    """Both ranks read ``second``'s weight in an evaluation, rank 0 ``other``'s too: each rank's model registers
    the weights it read as its external parameters. In the next forward rank 0's model fetches them while
    voting: ``second``'s weight is still gathered, ``other``'s is not, and while rank 0 waits for its vote it
    takes part in rank 1's fetch of ``second``, which released that weight (no running module held it).
    Rank 0's fetch then gathered it alone (a hang). A rank taking part in another's fetch now leaves what it
    held gathered."""
    world_size = 2
    exec_timeout = 60

    def test_lockstep(self):
        rank, steps, gas = dist.get_rank(), 3, 2
        config = zero_config(3,
                             gradient_accumulation_steps=gas,
                             reduce_bucket_size=40,
                             stage3_param_persistence_threshold=0,
                             stage3_prefetch_bucket_size=0)
        torch.manual_seed(SEED)
        model = ReadsWeightsOfOthers()
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=_optimizer(model), config=config)
        for step in range(steps):
            if step == 0:
                with torch.no_grad():
                    for program in HELD_READ_PROGRAMS[(rank, "eval")]:
                        engine(torch.ones(2, HIDDEN, device=device()), program)
            for micro in range(gas):
                engine.backward(_held_read_loss(engine, rank, step, micro, on=device()))
                engine.step()
        mine = full_params(engine.module, 3)

        torch.manual_seed(SEED)
        ref_model = ReadsWeightsOfOthers()
        ref = reference_training(ref_model, _optimizer(ref_model), dist.get_world_size(), steps, gas,
                                 lambda r, s, m: _held_read_loss(ref_model, r, s, m))
        assert_lockstep(mine, ref, config, steps)
