# Copyright (c) the DeepSpeed lockstep fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""ZeRO-3 keeps a stack of the modules whose forward runs (``FWD_MODULE_STACK``): a parameter read outside
its own module is registered with the module on top of it. A module is pushed by its pre-forward hook and
popped by its forward hook, which does not run when the forward raises, and torch's non-reentrant
activation checkpointing ends each recompute by raising inside the recomputed forward once backward has
what it needs (early stop, torch's default). Every checkpointed call left its modules on the stack: the
stack grew by one entry per checkpointed module and step, for the whole run, and those modules counted as
running in every later forward. Oracle: after every step the stack is as it was after the first, every
rank finishes, parameters identical across ranks and equal to a plain-PyTorch reference."""

import pytest
import torch
import torch.utils.checkpoint

import deepspeed
import deepspeed.comm as dist
from deepspeed.runtime.zero import parameter_offload

from unit.common import DistributedTest
from unit.runtime.zero.lockstep_scenarios import (SEED, agree_on_every_rank, assert_lockstep, device, full_params,
                                                  reference_training, zero_config)

STEPS = 4
HIDDEN = 8


class CheckpointedBlocks(torch.nn.Module):

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(HIDDEN, HIDDEN)
        self.blocks = torch.nn.ModuleList([
            torch.nn.Linear(HIDDEN, HIDDEN),
            torch.nn.Sequential(torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, HIDDEN)),
        ])
        self.head = torch.nn.Linear(HIDDEN, 1)

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = h + 0.5 * torch.utils.checkpoint.checkpoint(block, h, use_reentrant=False)
        return self.head(h).pow(2).mean()


def _model():
    torch.manual_seed(SEED)
    return CheckpointedBlocks()


def _optimizer(model):
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _batch(rank, step):
    return torch.randn(4, HIDDEN, generator=torch.Generator().manual_seed(SEED + 100 * step + rank))


@pytest.mark.parametrize("prefetch", [0, 50_000_000])
class TestModuleStackAfterCheckpointRecompute(DistributedTest):
    world_size = 2
    exec_timeout = 60

    def test_lockstep(self, prefetch):
        rank = dist.get_rank()
        config = zero_config(3, stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=prefetch)
        model = _model()
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=_optimizer(model), config=config)
        depths = []
        for step in range(STEPS):
            engine.backward(engine(_batch(rank, step).to(device())))
            engine.step()
            depths.append(len(parameter_offload.FWD_MODULE_STACK))
        agree_on_every_rank(len(set(depths)) == 1, f"the module stack's depth after each step: {depths}")
        mine = full_params(engine.module, 3)

        ref_model = _model()
        ref = reference_training(ref_model, _optimizer(ref_model), dist.get_world_size(), STEPS, 1,
                                 lambda r, s, m: ref_model(_batch(r, s)))
        assert_lockstep(mine, ref, config, STEPS)
