# Copyright (c) the DeepSpeed lockstep fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Uniform usage trains identically on every rank and matches the plain-PyTorch reference (ZeRO 1/2/3).

This is the baseline the lockstep tests build on: it passes with or without rank-invariant reduction."""

import pytest

from unit.common import DistributedTest
from unit.runtime.zero.lockstep_scenarios import check_lockstep, zero_config


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("gas", [1, 2])
class TestUniformUsage(DistributedTest):
    world_size = 2
    exec_timeout = 120

    def test_matches_reference(self, stage, gas):
        check_lockstep("uniform", zero_config(stage, gradient_accumulation_steps=gas), steps=3)
