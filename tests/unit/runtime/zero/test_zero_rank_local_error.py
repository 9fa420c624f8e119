# Copyright (c) the DeepSpeed lockstep fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""A rank-local exception just before a gradient reduction (injected on rank 1 into the code that puts a
gradient into its bucket, before or after that code did its work) must not leave the other ranks waiting
in that reduction: the failing rank puts its bucket back as it was, finishes the reduction with zeros, and
every rank raises the same error at the optimizer step, within the deadline."""

import pytest

import deepspeed.comm as dist
from unit.common import DistributedTest
from unit.runtime.zero.lockstep_scenarios import SCENARIOS, batch, device, make_engine, zero_config


def _inject_once(optimizer, after_work):
    """Make rank-local code that puts a gradient into its bucket fail once: before it did anything, or after
    it did all of it (the gradient is in the bucket; a retry must not add it twice)."""
    original = optimizer.reduce_independent_p_g_buckets_and_remove_grads
    state = {"raised": False}

    def failing(*args, **kwargs):
        if not state["raised"]:
            state["raised"] = True
            if after_work:
                original(*args, **kwargs)
            raise RuntimeError("injected rank-local failure")
        return original(*args, **kwargs)

    optimizer.reduce_independent_p_g_buckets_and_remove_grads = failing


@pytest.mark.parametrize("when", ["before_work", "after_work"])
@pytest.mark.parametrize("stage", [1, 2, 3])
class TestRankLocalErrorBeforeReduction(DistributedTest):
    world_size = 2
    exec_timeout = 45

    def test_every_rank_raises_at_the_step(self, stage, when):
        scenario = SCENARIOS["uniform"]
        engine = make_engine(scenario, zero_config(stage, reduce_bucket_size=100))
        if dist.get_rank() == 1:
            _inject_once(engine.optimizer, after_work=when == "after_work")
        with pytest.raises(RuntimeError, match=r"ranks \[1\] hit an error") as error:
            for step in range(3):
                x, image, route = batch(scenario, dist.get_rank(), step, 0, device=device())
                engine.backward(engine(x, image, route))
                engine.step()
        if dist.get_rank() == 1:
            assert "injected rank-local failure" in str(error.value)
