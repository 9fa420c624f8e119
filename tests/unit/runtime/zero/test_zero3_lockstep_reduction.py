# Copyright (c) the DeepSpeed lockstep fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""ZeRO-3 gradient reduction and parameter fetching must issue the same collectives on every rank whatever
each rank's data did (#7844). Same scenarios and oracle as the ZeRO-1/2 tests (lockstep_scenarios.py):
every rank finishes within the deadline, the parameters are identical across ranks and they equal a
plain-PyTorch reference in which a gradient missing on a rank counts as zero in the average.

TinyLlava's weights are below the default persistence threshold, so they stay resident: a module that runs
on some ranks only fetches nothing, and what must agree is the reduce-scatter and the module trace."""

import pytest

from unit.common import DistributedTest
from unit.runtime.zero.lockstep_scenarios import ZERO3_CONFIGS, check_lockstep, zero_config

DIVERGENT = ["llava_4933", "llava_per_micro_step", "order_divergent", "equal_size_branches", "no_hook_rank"]


def _config(name):
    options = dict(ZERO3_CONFIGS[name])
    return zero_config(3,
                       gradient_accumulation_steps=options.pop("gradient_accumulation_steps", 1),
                       bf16=options.pop("bf16", False),
                       **options)


@pytest.mark.parametrize("config", sorted(ZERO3_CONFIGS))
@pytest.mark.parametrize("scenario", DIVERGENT)
class TestRankDivergentUsageZero3(DistributedTest):
    world_size = 2
    exec_timeout = 45

    def test_lockstep(self, scenario, config):
        check_lockstep(scenario, _config(config), steps=3)


@pytest.mark.parametrize("backward", ["engine", "torch"])
@pytest.mark.parametrize("checkpoint", [False, True], ids=["plain", "reentrant-ckpt"])
@pytest.mark.parametrize("scenario", ["llava_4933", "no_hook_rank"])
class TestEpilogueTriggerZero3(DistributedTest):
    """The zero-filling epilogue runs once per micro-step on every rank, with engine.backward and with
    loss.backward(), with and without reentrant checkpointing."""
    world_size = 2
    exec_timeout = 45

    def test_lockstep(self, scenario, checkpoint, backward):
        config = zero_config(3, reduce_bucket_size=100, gradient_accumulation_steps=2)
        check_lockstep(scenario, config, steps=3, backward=backward, checkpoint=checkpoint)


@pytest.mark.parametrize("backward", ["engine", "torch"])
@pytest.mark.parametrize("stage", [1, 2, 3])
class TestEpilogueTriggerLastModuleCheckpointed(DistributedTest):
    """With the last module under reentrant checkpointing, the first gradient hooks fire inside a nested
    backward; the epilogue must still run once, at the end of the outer backward, on every rank."""
    world_size = 2
    exec_timeout = 45

    def test_lockstep(self, stage, backward):
        config = zero_config(stage, reduce_bucket_size=100, gradient_accumulation_steps=2)
        check_lockstep("llava_4933", config, steps=3, backward=backward, checkpoint="head")


class TestShape7991Zero3(DistributedTest):
    """The #7991 shape under ZeRO-3: LLaVA-style optimizer groups plus a one-element group (ranks >= 1 own
    only padding of it), and a branch two of four ranks take at step 9 only."""
    world_size = 4
    exec_timeout = 120

    def test_lockstep(self):
        check_lockstep("shape_7991", zero_config(3, reduce_bucket_size=100), steps=10)


@pytest.mark.parametrize("stage", [1, 2, 3])
class TestEpilogueRunTwice(DistributedTest):
    """engine.allreduce_gradients() called again after engine.backward (upstream's
    TestZero3ParamPartitioningLargeParam does): the second epilogue has no backward to reduce and must
    leave the reduced gradients alone, on every rank."""
    world_size = 2
    exec_timeout = 45

    def test_lockstep(self, stage):
        check_lockstep("llava_4933", zero_config(stage, reduce_bucket_size=100), steps=3, backward="engine+allreduce")
