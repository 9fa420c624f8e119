# Copyright (c) the DeepSpeed lockstep fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Ranks that build different optimizer layouts must fail together at deepspeed.initialize, with an error
naming the first difference, instead of hanging in step() (#7844: per-rank param groups or sub_group_size
give each rank a different number of norm all-reduces; a per-rank persistence threshold a different
number of persistent all-gathers)."""

import pytest
import torch

import deepspeed
import deepspeed.comm as dist
from unit.common import DistributedTest
from unit.runtime.zero.lockstep_scenarios import (LR, SCENARIOS, assert_lockstep, batch, device, full_params,
                                                  make_model, reference_training, zero_config)


def _train(stage, param_groups_of, steps=2, **zero):
    model = make_model(SCENARIOS["uniform"])
    optimizer = torch.optim.SGD(param_groups_of(model), lr=LR)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=zero_config(stage, **zero))
    for step in range(steps):
        x, image, route = batch(SCENARIOS["uniform"], dist.get_rank(), step, 0, device=device())
        engine.backward(engine(x, image, route))
        engine.step()
    return engine


def _one_group(model):
    return [{"params": list(model.parameters())}]


def _per_rank_groups(model):
    """The same trainable set everywhere, cut into one group on rank 0 and two on the others."""
    if dist.get_rank() == 0:
        return _one_group(model)
    params = list(model.parameters())
    return [{"params": params[:4]}, {"params": params[4:], "weight_decay": 0.0}]


@pytest.mark.parametrize("stage", [1, 2, 3])
class TestPerRankParamGroups(DistributedTest):
    world_size = 2
    exec_timeout = 45

    def test_every_rank_raises_at_initialize(self, stage):
        with pytest.raises(RuntimeError, match="different layouts") as error:
            _train(stage, _per_rank_groups)
        assert "number of optimizer param groups" in str(error.value)
        assert "ranks [0] vs [1]" in str(error.value)


class TestPerRankZero3Settings(DistributedTest):
    world_size = 2
    exec_timeout = 45

    @pytest.mark.parametrize("setting", ["sub_group_size", "stage3_param_persistence_threshold"])
    def test_every_rank_raises_at_initialize(self, setting):
        value = {"sub_group_size": [10**12, 100], "stage3_param_persistence_threshold": [10**5, 0]}[setting]
        with pytest.raises(RuntimeError, match="different layouts") as error:
            _train(3, _one_group, **{setting: value[dist.get_rank() % 2]})
        assert setting in str(error.value)

    def test_same_layout_trains(self):
        """The check lets equal layouts through, also with several sub-groups: training matches the reference."""
        steps = 2
        engine = _train(3, _one_group, steps=steps, sub_group_size=100)
        model = make_model(SCENARIOS["uniform"])
        ref = reference_training(model, torch.optim.SGD(_one_group(model), lr=LR), dist.get_world_size(), steps, 1,
                                 lambda r, s, m: model(*batch(SCENARIOS["uniform"], r, s, m)))
        assert_lockstep(full_params(engine.module, 3), ref, zero_config(3), steps)
