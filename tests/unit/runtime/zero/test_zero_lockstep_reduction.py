# Copyright (c) the DeepSpeed lockstep fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""ZeRO-1/2 gradient reduction must issue the same collectives on every rank whatever each rank's data
did (#4933, #7991, #2343). Each case trains on every rank and checks that every rank finishes within the
deadline, that the parameters are identical across ranks and that they equal a plain-PyTorch reference
in which a gradient missing on a rank counts as zero in the average (lockstep_scenarios.py)."""

import pytest

from unit.common import DistributedTest
from unit.runtime.zero.lockstep_scenarios import ZERO12_CONFIGS, check_lockstep, zero_config

DIVERGENT = ["llava_4933", "llava_per_micro_step", "order_divergent", "equal_size_branches", "no_hook_rank"]


def _config(stage, name):
    options = dict(ZERO12_CONFIGS[name])
    return zero_config(stage,
                       gradient_accumulation_steps=options.pop("gradient_accumulation_steps", 1),
                       bf16=options.pop("bf16", False),
                       **options)


def _covering_cases():
    """(scenario, stage, configuration): every scenario with every configuration, and every scenario and every
    configuration on both stages (stage 1 takes two scenarios of each configuration, stage 2 the other three,
    rotating with the configuration), 70 cases; the rest of the product (70 more) under ``-m nightly``."""
    cases = []
    for i, config in enumerate(sorted(ZERO12_CONFIGS)):
        for k, scenario in enumerate(DIVERGENT):
            stage = 1 if (k - i) % len(DIVERGENT) < 2 else 2
            cases.append(pytest.param(scenario, stage, config))
            cases.append(pytest.param(scenario, 3 - stage, config, marks=pytest.mark.nightly))
    return cases


@pytest.mark.parametrize("scenario,stage,config", _covering_cases())
class TestRankDivergentUsage(DistributedTest):
    world_size = 2
    exec_timeout = 45

    def test_lockstep(self, scenario, stage, config):
        check_lockstep(scenario, _config(stage, config), steps=3)


@pytest.mark.parametrize("backward", ["engine", "torch"])
@pytest.mark.parametrize("checkpoint", [False, True], ids=["plain", "reentrant-ckpt"])
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("scenario", ["llava_4933", "no_hook_rank"])
class TestEpilogueTrigger(DistributedTest):
    """The zero-filling epilogue must run once, at the end of backward, on every rank: with
    engine.backward and with PyTorch-style loss.backward(), with and without reentrant checkpointing."""
    world_size = 2
    exec_timeout = 45

    def test_lockstep(self, scenario, stage, checkpoint, backward):
        config = zero_config(stage, overlap_comm=True, reduce_bucket_size=100, gradient_accumulation_steps=2)
        check_lockstep(scenario, config, steps=3, backward=backward, checkpoint=checkpoint)


@pytest.mark.parametrize("stage", [1, 2])
class TestShape7991(DistributedTest):
    """LLaVA-style optimizer groups plus a group so small that most ranks own only padding, and a branch
    taken by two ranks only at step 9 (the shape of #7991, at 4 ranks; 16 under -m nightly)."""
    world_size = 4
    exec_timeout = 120

    def test_lockstep(self, stage):
        check_lockstep("shape_7991", zero_config(stage, overlap_comm=True, reduce_bucket_size=100), steps=10)

    @pytest.mark.nightly
    @pytest.mark.world_size(16)
    def test_lockstep_16_ranks(self, stage):
        check_lockstep("shape_7991", zero_config(stage, overlap_comm=True, reduce_bucket_size=100), steps=10)


@pytest.mark.parametrize("scenario", ["llava_4933", "uniform"])
class TestIgnoreUnusedParametersFalse(DistributedTest):
    """ignore_unused_parameters=False (with CPU offload, where ZeRO-1/2 checks it) must stay an error when a
    parameter gets no gradient on some rank, raised by every rank at the same point; uniform usage trains."""
    world_size = 2
    exec_timeout = 45

    def test_every_rank_raises_together(self, scenario):
        config = zero_config(2, offload_optimizer={"device": "cpu"}, ignore_unused_parameters=False)
        if scenario == "uniform":
            check_lockstep(scenario, config, steps=2)
            return
        with pytest.raises(AssertionError, match="ignore_unused_parameters") as error:
            check_lockstep(scenario, config, steps=2)
        assert "data-parallel ranks [1]" in str(error.value)
