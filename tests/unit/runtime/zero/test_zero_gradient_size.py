# Copyright (c) the DeepSpeed lockstep fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""ZeRO-3 checks that each gradient has its parameter's full size before reducing it. Which gradient is wrong
is rank-local, so the error must not leave the other ranks waiting in the reduce-scatter: every rank raises
the same error at the optimizer step, within the deadline."""

import pytest

import deepspeed.comm as dist
from unit.common import DistributedTest
from unit.runtime.zero.lockstep_scenarios import SCENARIOS, batch, device, make_engine, zero_config


def _wrong_size_gradient_once(optimizer, at_call):
    """Give one gradient a size other than its parameter's, once, on this rank (a gradient that user code or a
    hook replaced): ZeRO-3 cannot reduce-scatter it."""
    original = optimizer.reduce_ready_partitions_and_remove_grads
    calls = {"n": 0}

    def wrong_size(param, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == at_call and param.grad is not None:
            param.grad.data = param.grad.data.new_zeros(param.ds_numel + 4)
        return original(param, *args, **kwargs)

    optimizer.reduce_ready_partitions_and_remove_grads = wrong_size


@pytest.mark.parametrize("first_step", [True, False], ids=["first_step", "after_steps"])
class TestGradientOfAnotherSize(DistributedTest):
    """ZeRO-3 checks each gradient's size right before its reduce-scatter and raised there, on the rank whose
    gradient was wrong alone: the other ranks waited in that reduce-scatter. Every rank raises at the step."""
    world_size = 2
    exec_timeout = 45

    def test_every_rank_raises_at_the_step(self, first_step):
        scenario = SCENARIOS["uniform"]
        engine = make_engine(scenario, zero_config(3, reduce_bucket_size=100))
        with pytest.raises(RuntimeError, match=r"ranks \[1\] hit an error") as error:
            for step in range(4):
                if step == (0 if first_step else 2) and dist.get_rank() == 1:
                    _wrong_size_gradient_once(engine.optimizer, at_call=2)
                x, image, route = batch(scenario, dist.get_rank(), step, 0, device=device())
                engine.backward(engine(x, image, route))
                engine.step()
        if dist.get_rank() == 1:
            assert "Cannot reduce scatter gradients whose size is not same as the params" in str(error.value)
