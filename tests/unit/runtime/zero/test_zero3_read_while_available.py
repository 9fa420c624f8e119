# Copyright (c) the DeepSpeed lockstep fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""ZeRO-3 registers a parameter that a forward reads outside its own module (a weight used functionally by
its parent) as an external parameter of the reading module, whose fetches then gather it and keep it
until that module's release, backward included. It did so only where the read found the parameter
partitioned. A read that found it available by chance (gathered ahead by a prefetch, or by the fetch
schedule's replay for a module that had not run yet) registered nothing: its own module released it after
its own backward, and ZeRO-3's linear backward then gathered it again for the read's backward, on the
reading ranks alone (gloo: mismatch; NCCL: hang). Oracle: every rank finishes within the deadline,
parameters identical across ranks and equal to a plain-PyTorch reference."""

import pytest
import torch
import torch.utils.checkpoint

import deepspeed
import deepspeed.comm as dist

from unit.common import DistributedTest
from unit.runtime.zero.lockstep_scenarios import SEED, assert_lockstep, device, full_params, reference_training, zero_config

HIDDEN = 8


def _optimizer(model):
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


class Blocks(torch.nn.Module):
    """A residual stack whose forward runs a program: block indices, "read" (block 2's weight used by this
    module before block 2 runs) and "ckpt" (block 2 under non-reentrant activation checkpointing)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(HIDDEN, HIDDEN)
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(HIDDEN, HIDDEN) for _ in range(4)])
        self.head = torch.nn.Linear(HIDDEN, 1)

    def forward(self, x, program):
        h = self.embed(x)
        for op in program:
            if op == "read":
                h = h + 0.5 * torch.nn.functional.linear(h, self.blocks[2].weight)
            elif op == "ckpt":
                h = h + 0.5 * torch.utils.checkpoint.checkpoint(self.blocks[2], h, use_reentrant=False)
            else:
                h = h + 0.5 * self.blocks[op](h)
        return self.head(h).pow(2).mean()


# per step, one program for every rank or one per rank
PROGRAMS = {
    # every parameter prefetched from the second step on: block 2's weight is available when rank 0 reads it
    "prefetched": ([[2]], [[2]], [["read", 2], [2]], [["read", 2], [2]]),
    # the schedule (from a step with a checkpoint recompute) replays block 2's fetch on rank 0 before its read
    "replayed": ([["ckpt"]], [[0, 2, 3, 1]], [[0, 3]], [[0, 1, "read", 2], [0, 1, 2, 3]]),
}


def _program(name, rank, step):
    programs = PROGRAMS[name][step]
    return programs[rank] if len(programs) > 1 else programs[0]


def _model():
    torch.manual_seed(SEED)
    return Blocks()


def _batch(rank, step):
    return torch.randn(2, HIDDEN, generator=torch.Generator().manual_seed(SEED + 10 * step + rank))


@pytest.mark.parametrize("name, prefetch", [("prefetched", 50_000_000), ("replayed", 0), ("replayed", 50_000_000)])
class TestWeightReadWhileAvailable(DistributedTest):
    world_size = 2
    exec_timeout = 60

    def test_lockstep(self, name, prefetch):
        rank, steps = dist.get_rank(), len(PROGRAMS[name])
        config = zero_config(3,
                             reduce_bucket_size=40,
                             stage3_param_persistence_threshold=0,
                             stage3_prefetch_bucket_size=prefetch)
        model = _model()
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=_optimizer(model), config=config)
        for step in range(steps):
            engine.backward(engine(_batch(rank, step).to(device()), _program(name, rank, step)))
            engine.step()
        mine = full_params(engine.module, 3)

        ref_model = _model()
        ref = reference_training(ref_model, _optimizer(ref_model), dist.get_world_size(), steps, 1,
                                 lambda r, s, m: ref_model(_batch(r, s), _program(name, r, s)))
        assert_lockstep(mine, ref, config, steps)
