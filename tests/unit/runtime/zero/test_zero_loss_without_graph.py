# Copyright (c) the DeepSpeed lockstep fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""A rank whose loss has no gradient and whose forward returned nothing with a graph (a model that returns
only its loss, and a constant when every label of the micro-batch is masked) must still take part in the
backward's collectives: the other ranks' gradient reductions (ZeRO-1/2/3) and backward parameter fetches
(ZeRO-3). Oracle: every rank finishes within the deadline, parameters are identical across ranks and equal
a plain-PyTorch reference where that rank's gradient at those steps counts as zero in the average."""

import pytest
import torch

import deepspeed
import deepspeed.comm as dist
from unit.common import DistributedTest
from unit.runtime.zero.lockstep_scenarios import (SCENARIOS, assert_lockstep, batch, device, full_params, make_model,
                                                  make_optimizer, reference_training, zero_config)

STEPS = 4
# (rank, step) whose loss has no graph: in ZeRO-3's first step and in a later one
MASKED = ((1, 0), (1, 2))


class MaskedLoss(torch.nn.Module):
    """The scenario's model; its loss is a constant with no graph when every label is masked
    (``if not valid.any(): return logits.new_zeros(())``), so no output of the forward carries a graph."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x, image, route, masked):
        loss = self.model(x, image, route)
        return loss.new_zeros(()) if masked else loss


@pytest.mark.parametrize("zero", [
    dict(stage=1),
    dict(stage=2, overlap_comm=True),
    dict(stage=2, reduce_bucket_size=40),
    dict(stage=3),
    dict(stage=3, stage3_param_persistence_threshold=0),
    dict(stage=3, stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=0),
],
                         ids=["zero1", "zero2", "zero2-buckets", "zero3", "zero3-fetched", "zero3-fetched-noprefetch"])
class TestLossWithoutGraph(DistributedTest):
    world_size = 2
    exec_timeout = 45

    def test_rank_takes_part_with_zero_gradients(self, zero):
        scenario = SCENARIOS["uniform"]
        zero = dict(zero)
        config = zero_config(zero.pop("stage"), **zero)
        rank = dist.get_rank()
        model = MaskedLoss(make_model(scenario))
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=make_optimizer(model, scenario), config=config)
        for step in range(STEPS):
            x, image, route = batch(scenario, rank, step, 0, device=device())
            engine.backward(engine(x, image, route, (rank, step) in MASKED))
            engine.step()
        mine = full_params(engine.module, config["zero_optimization"]["stage"])

        reference_model = MaskedLoss(make_model(scenario))

        def loss_of(r, s, m):
            loss = reference_model(*batch(scenario, r, s, m), False)
            return loss * 0.0 if (r, s) in MASKED else loss

        ref = reference_training(reference_model, make_optimizer(reference_model, scenario), dist.get_world_size(),
                                 STEPS, 1, loss_of)
        assert_lockstep(mine, ref, config, STEPS)
