# Copyright (c) the DeepSpeed lockstep fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Parameters that get gradients but that the ZeRO optimizer does not manage (attached or unfrozen after
deepspeed.initialize, or left out of model_parameters) were never reduced nor updated while their .grad
grew, or (ZeRO-3, attached) crashed with an AttributeError deep in the parameter coordinator.

- zero_optimization.late_parameters='error': every rank raises the same clear error at the optimizer step
  (ZeRO-3: a parameter attached to a partitioned module, where the forward first meets it), within the
  deadline.
- 'warn' (the default, upstream's behaviour made loud): every rank warns once, naming the parameters, and
  training goes on without them: they stay as they were, and the rest is identical on every rank."""

import logging

import pytest
import torch

import deepspeed
import deepspeed.comm as dist
from unit.common import DistributedTest
from unit.runtime.zero.lockstep_scenarios import LR, SCENARIOS, batch, device, make_model, zero_config

CASES = ["attached", "attached_module", "unfrozen", "left_out"]

LATE_NAME = {"attached": "head.scale", "attached_module": "extra.weight"}


def _train(stage, case, steps=3, **zero):
    """Train with a late parameter of the given case; returns the engine and the late parameter's value when it
    became late (on CPU)."""
    scenario = SCENARIOS["uniform"]
    model = make_model(scenario)
    if case == "unfrozen":
        model.image_proj.requires_grad_(False)
    params = [p for n, p in model.named_parameters() if not (case == "left_out" and n.startswith("image_proj"))]
    optimizer = torch.optim.SGD([p for p in params if p.requires_grad], lr=LR)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=zero_config(stage, **zero))
    initial = _full(engine, "image_proj.weight", stage) if case == "left_out" else None
    for step in range(steps):
        if step == 1 and case == "unfrozen":
            initial = _full(engine, "image_proj.weight", stage)
            engine.module.image_proj.requires_grad_(True)
        if step == 1 and case == "attached":
            engine.module.head.scale = torch.nn.Parameter(torch.ones(1, device=device()))
            initial = _full(engine, "head.scale", stage)
        if step == 1 and case == "attached_module":
            engine.module.extra = torch.nn.Linear(8, 1, device=device())
            initial = _full(engine, "extra.weight", stage)
        x, image, route = batch(scenario, dist.get_rank(), step, 0, device=device())
        loss = engine(x, image, route)
        if hasattr(engine.module, "extra"):
            loss = loss + engine.module.extra(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
    return engine, initial


def _full(engine, name, stage):
    param = dict(engine.module.named_parameters())[name]
    with deepspeed.zero.GatheredParameters([param], enabled=stage == 3 and hasattr(param, "ds_id")):
        return param.detach().float().cpu().clone()


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("stage", [1, 2, 3])
class TestLateParameters(DistributedTest):
    world_size = 2
    exec_timeout = 45

    def test_every_rank_raises(self, stage, case):
        with pytest.raises(RuntimeError, match="does not manage (the )?parameters") as error:
            _train(stage, case, late_parameters="error")
        if stage == 3 and case == "attached":  # found by the forward's fetch of head, the same on every rank
            assert "['scale'] of Linear" in str(error.value)
            return
        name = {"attached": "head.scale", "attached_module": "extra.weight"}.get(case, "image_proj.weight")
        assert name in str(error.value) and "data-parallel ranks [0, 1]" in str(error.value)

    @pytest.mark.parametrize("policy", ["default", "warn"])
    def test_warn_keeps_training(self, stage, case, policy):
        if stage == 3 and case.startswith("attached"):
            pytest.skip("ZeRO-3 cannot fetch or release an unpartitioned parameter: 'warn' keeps upstream's crash")
        warnings = _Collect()
        deepspeed.utils.logger.addHandler(warnings)
        try:
            engine, initial = _train(stage,
                                     case,
                                     steps=4,
                                     **({} if policy == "default" else dict(late_parameters="warn")))
        finally:
            deepspeed.utils.logger.removeHandler(warnings)
        name = LATE_NAME.get(case, "image_proj.weight")
        late = [m for m in warnings.messages if "does not manage parameters" in m]
        assert len(late) == 1 and name in late[0], f"expected one warning naming {name}, got {late}"
        assert torch.equal(_full(engine, name, stage), initial), f"{name} was updated, or changed"
        every = torch.cat([_full(engine, n, stage).flatten() for n, _ in sorted(engine.module.named_parameters())])
        every = every.to(device())
        gathered = [torch.zeros_like(every) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, every)
        assert all(torch.equal(g, every) for g in gathered), "parameters differ across ranks"


class _Collect(logging.Handler):

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())
