# Copyright (c) the DeepSpeed lockstep fork authors.
# SPDX-License-Identifier: Apache-2.0
"""Parameters that get gradients but that the ZeRO optimizer does not manage (attached or unfrozen after
deepspeed.initialize, or left out of model_parameters) were never reduced nor updated while their .grad
grew, or (ZeRO-3, attached) crashed with an AttributeError deep in the parameter coordinator. Every rank
must raise the same clear error at the first training forward that would use them, within the deadline;
zero_optimization.late_parameters='warn' keeps training as before."""

import pytest
import torch

import deepspeed
import deepspeed.comm as dist
from unit.common import DistributedTest
from unit.runtime.zero.lockstep_scenarios import LR, SCENARIOS, batch, make_model, zero_config

CASES = ["attached", "unfrozen", "left_out"]


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
            engine.module.head.scale = torch.nn.Parameter(torch.ones(1))
        x, image, route = batch(scenario, dist.get_rank(), step, 0)
        engine.backward(engine(x, image, route))
        engine.step()
    return engine


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("stage", [1, 2, 3])
class TestLateParameters(DistributedTest):
    world_size = 2
    exec_timeout = 45

    def test_every_rank_raises(self, stage, case):
        with pytest.raises(RuntimeError, match="does not manage parameters") as error:
            _train(stage, case)
        name = "head.scale" if case == "attached" else "image_proj.weight"
        assert name in str(error.value) and "data-parallel ranks [0, 1]" in str(error.value)

    def test_warn_keeps_training(self, stage, case):
        if stage == 3 and case == "attached":
            pytest.skip("an unpartitioned parameter cannot be fetched: upstream's AttributeError, by design")
        _train(stage, case, late_parameters="warn")
