# Copyright (c) the DeepSpeed lockstep fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""A rank whose loss has no gradient at one step (e.g. every label of its micro-batch masked, so the loss is
a constant) must take part in that step with zero gradients instead of failing alone in engine.backward
while the other ranks wait in their gradient reductions. Oracle: every rank finishes within the deadline,
parameters are identical across ranks and equal a plain-PyTorch reference where that rank's gradient at
that step counts as zero in the average."""

import pytest
import torch

import deepspeed.comm as dist
from unit.common import DistributedTest
from unit.runtime.zero.lockstep_scenarios import (SCENARIOS, assert_lockstep, batch, device, full_params, make_engine,
                                                  make_model, make_optimizer, reference_training, zero_config)

STEPS = 3
GRADLESS = (1, 1)  # (rank, step) whose loss has no gradient


def _gradless(rank, step):
    return (rank % dist.get_world_size(), step) == GRADLESS


@pytest.mark.parametrize("zero", [
    dict(stage=1),
    dict(stage=2, overlap_comm=True),
    dict(stage=3),
    dict(stage=3, stage3_param_persistence_threshold=0),
],
                         ids=["zero1", "zero2", "zero3", "zero3-fetched"])
class TestGradientlessLoss(DistributedTest):
    world_size = 2
    exec_timeout = 45

    def test_rank_takes_part_with_zero_gradients(self, zero):
        scenario = SCENARIOS["uniform"]
        zero = dict(zero)
        config = zero_config(zero.pop("stage"), **zero)
        rank = dist.get_rank()
        engine = make_engine(scenario, config)
        for step in range(STEPS):
            x, image, route = batch(scenario, rank, step, 0, device=device())
            output = engine(x, image, route)
            # like a masked-out micro-batch: a constant loss, no grad_fn
            loss = torch.zeros_like(output.detach()) if _gradless(rank, step) else output
            engine.backward(loss)
            engine.step()
        mine = full_params(engine.module, config["zero_optimization"]["stage"])

        reference_model = make_model(scenario)

        def loss_of(r, s, m):
            loss = reference_model(*batch(scenario, r, s, m))
            return loss * 0.0 if _gradless(r, s) else loss

        ref = reference_training(reference_model, make_optimizer(reference_model, scenario), dist.get_world_size(),
                                 STEPS, 1, loss_of)
        assert_lockstep(mine, ref, config, STEPS)
