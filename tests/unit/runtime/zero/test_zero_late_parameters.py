# Copyright (c) the DeepSpeed lockstep fork authors.
# SPDX-License-Identifier: Apache-2.0
"""Parameters that get gradients but that the ZeRO optimizer does not manage (attached or unfrozen after
deepspeed.initialize, or left out of model_parameters) were never reduced nor updated while their .grad
grew, or (ZeRO-3, attached) crashed with an AttributeError deep in the parameter coordinator. Every rank
must raise the same clear error at the start of the backward that would give them gradients (ZeRO-3: a
parameter attached to a partitioned module, at the forward that would fetch it), within the deadline;
zero_optimization.late_parameters='warn' keeps training as before."""

import pytest
import torch

import deepspeed
import deepspeed.comm as dist
from unit.common import DistributedTest
from unit.runtime.zero.lockstep_scenarios import LR, SCENARIOS, batch, device, make_model, zero_config

CASES = ["attached", "attached_module", "unfrozen", "left_out"]


def _train(stage, case, steps=3, **zero):
    scenario = SCENARIOS["uniform"]
    model = make_model(scenario)
    if case == "unfrozen":
        model.image_proj.requires_grad_(False)
    params = [p for n, p in model.named_parameters() if not (case == "left_out" and n.startswith("image_proj"))]
    optimizer = torch.optim.SGD([p for p in params if p.requires_grad], lr=LR)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=zero_config(stage, **zero))
    for step in range(steps):
        if step == 1 and case == "unfrozen":
            engine.module.image_proj.requires_grad_(True)
        if step == 1 and case == "attached":
            engine.module.head.scale = torch.nn.Parameter(torch.ones(1, device=device()))
        if step == 1 and case == "attached_module":
            engine.module.extra = torch.nn.Linear(8, 1, device=device())
        x, image, route = batch(scenario, dist.get_rank(), step, 0, device=device())
        loss = engine(x, image, route)
        if hasattr(engine.module, "extra"):
            loss = loss + engine.module.extra(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
    return engine


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("stage", [1, 2, 3])
class TestLateParameters(DistributedTest):
    world_size = 2
    exec_timeout = 45

    def test_every_rank_raises(self, stage, case):
        with pytest.raises(RuntimeError, match="does not manage (the )?parameters") as error:
            _train(stage, case)
        if stage == 3 and case == "attached":  # found by the forward's fetch of head, the same on every rank
            assert "['scale'] of Linear" in str(error.value)
            return
        name = {"attached": "head.scale", "attached_module": "extra.weight"}.get(case, "image_proj.weight")
        assert name in str(error.value) and "data-parallel ranks [0, 1]" in str(error.value)

    def test_warn_keeps_training(self, stage, case):
        if stage == 3 and case.startswith("attached"):
            pytest.skip("ZeRO-3 cannot fetch or release an unpartitioned parameter: 'warn' keeps upstream's crash")
        _train(stage, case, late_parameters="warn")
