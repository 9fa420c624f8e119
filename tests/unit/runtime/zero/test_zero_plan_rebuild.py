# Copyright (c) the DeepSpeed lockstep fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The reduction plan is cut at initialization in reverse registration order. A model whose modules are
registered in another order than backward reaches them (many Hugging Face models) would hold its early
gradients in .grad until their bucket is next, and launch most buckets at the end of backward: no
overlap, and more gradient memory than copying each gradient into the bucket on arrival.
After the first reduction point the plan is rebuilt once from the order rank 0's gradients became ready
(broadcast, the same plan everywhere), as DDP rebuilds its buckets.

Oracle: with modules registered in the opposite order to their use, from the second step on every
gradient goes into its bucket slot on arrival and each bucket is launched as soon as its gradients
arrived (at the first step, all wait for the last one);
parameters identical across ranks and equal to a plain-PyTorch reference (so the rebuilt plan reduces the
right gradients)."""

import pytest
import torch

import deepspeed
import deepspeed.comm as dist
from unit.common import DistributedTest
from unit.runtime.zero.lockstep_scenarios import (LR, SEED, assert_lockstep, device, full_params, reference_training,
                                                  zero_config)

HIDDEN = 8
LAYERS = 6
STEPS = 4


class RegisteredBackwards(torch.nn.Module):
    """Layers registered last-used first: reverse registration order is the forward order, the opposite
    of the order backward produces gradients in."""

    def __init__(self):
        super().__init__()
        for i in reversed(range(LAYERS)):
            self.add_module(f"layer{i}", torch.nn.Linear(HIDDEN, HIDDEN))

    def forward(self, x):
        for i in range(LAYERS):
            x = torch.tanh(getattr(self, f"layer{i}")(x))
        return x.pow(2).mean()


def inputs(rank, step, on="cpu", dtype=torch.float32):
    g = torch.Generator().manual_seed(SEED + 100 * rank + step)
    return torch.randn(4, HIDDEN, generator=g).to(on, dtype)


def make_model():
    torch.manual_seed(SEED)
    return RegisteredBackwards()


class ArrivalWatch:
    """Per backward: how many gradients had to wait in .grad (their bucket was not the next to launch), and
    after how many arrived gradients each bucket was launched."""

    def __init__(self, optimizer):
        self.held, self.arrived, self.launched_at = 0, 0, []
        mark, launch = optimizer._mark_grad_ready, optimizer._launch_planned_bucket

        def mark_grad_ready(param):
            plan = optimizer.reduction_plan
            if plan.is_planned(param):
                self.arrived += 1
                self.held += plan.slot_in_next_bucket(param) is None
            return mark(param)

        def launch_planned_bucket(bucket):
            self.launched_at.append(self.arrived)
            return launch(bucket)

        optimizer._mark_grad_ready = mark_grad_ready
        optimizer._launch_planned_bucket = launch_planned_bucket

    def take(self):
        out = (self.held, tuple(self.launched_at))
        self.held, self.arrived, self.launched_at = 0, 0, []
        return out


@pytest.mark.parametrize("stage", [2, 3])
class TestPlanFollowsBackwardOrder(DistributedTest):
    world_size = 2
    exec_timeout = 60

    def test_rebuilt_after_first_step(self, stage):
        zero = dict(reduce_bucket_size=HIDDEN * HIDDEN + HIDDEN, overlap_comm=True)  # one layer per bucket
        if stage == 3:
            zero = dict(reduce_bucket_size=HIDDEN * HIDDEN + HIDDEN, stage3_param_persistence_threshold=0)
        config = zero_config(stage, **zero)
        model = make_model()
        engine, _, _, _ = deepspeed.initialize(model=model,
                                               optimizer=torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9),
                                               config=config)
        watch = ArrivalWatch(engine.optimizer)
        rank, per_step = dist.get_rank(), []
        for step in range(STEPS):
            engine.backward(engine(inputs(rank, step, on=device())))
            per_step.append(watch.take())
            engine.step()
        # (gradients held in .grad, gradients arrived at each bucket launch) per step
        held, launched_at = per_step[0]
        assert held > 0 and len(set(launched_at)) == 1, f"the first plan already followed backward: {per_step}"
        for held, launched_at in per_step[1:]:
            assert held == 0 and len(set(launched_at)) == len(launched_at) == LAYERS, (
                f"after the first step every gradient must go to its slot on arrival and each bucket launch as "
                f"soon as its gradients arrived: {per_step}")
        reference_model = make_model()
        ref = reference_training(reference_model, torch.optim.SGD(reference_model.parameters(), lr=LR, momentum=0.9),
                                 dist.get_world_size(), STEPS, 1, lambda r, s, m: reference_model(inputs(r, s)))
        assert_lockstep(full_params(engine.module, stage), ref, config, STEPS)
