# Copyright (c) the DeepSpeed lockstep fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The lockstep check (``DS_LOCKSTEP_CHECK=1``): every rank's collectives since the last optimizer step are
compared at the step, on the step agreement.

- A model that issues its own all-reduce from one place on ranks 0 and 1 and from another place on ranks
  2 and 3 (the same size: nothing hangs, and the sums silently mix two quantities): at that step every rank
  raises the same error naming both places and the ranks on each side.
- Uniform usage under ZeRO-1/2/3, the check on: no error, and the parameters equal the plain-PyTorch
  reference (the check adds no collective of its own, only a digest on the step's norm all-reduce)."""

import contextlib
import os

import pytest
import torch

import deepspeed.comm as dist
from deepspeed.runtime.zero.agreement import RankDisagreementError
from deepspeed.utils import hang_report
from unit.common import DistributedTest
from unit.runtime.zero.lockstep_scenarios import (SCENARIOS, assert_lockstep, batch, device, full_params, make_engine,
                                                  train_reference, zero_config)

STEPS = 3


@contextlib.contextmanager
def lockstep_check():
    os.environ["DS_LOCKSTEP_CHECK"] = "1"
    try:
        yield
    finally:
        del os.environ["DS_LOCKSTEP_CHECK"]
        hang_report.stop()


def log_the_loss(loss):
    """The model's own collective, here on ranks 0 and 1 ..."""
    t = loss.detach().reshape(1).repeat(4)
    dist.all_reduce(t)
    return t


def sum_a_metric(loss):
    """... and another one of the same size on ranks 2 and 3."""
    t = torch.zeros(4, device=loss.device)
    dist.all_reduce(t)
    return t


class TestModelCollectivesDiffer(DistributedTest):
    world_size = 4
    exec_timeout = 90

    @pytest.mark.parametrize("stage", [2, 3])
    def test_every_rank_raises_naming_both_places(self, stage):
        scenario = SCENARIOS["uniform"]
        rank = dist.get_rank()
        with lockstep_check():
            engine = make_engine(scenario, zero_config(stage))
            for step in range(STEPS):
                x, image, route = batch(scenario, rank, step, 0, device=device())
                loss = engine(x, image, route)
                if step == 1:
                    (log_the_loss if rank < 2 else sum_a_metric)(loss)
                engine.backward(loss)
                if step == 0:
                    engine.step()
                    continue
                with pytest.raises(RankDisagreementError, match="lockstep check") as error:
                    engine.step()
                break
        message = str(error.value)
        assert "ranks 0, 1: all_reduce [4 torch.float32]" in message and "in log_the_loss" in message, message
        assert "ranks 2, 3: all_reduce [4 torch.float32]" in message and "in sum_a_metric" in message, message


@pytest.mark.parametrize("stage", [1, 2, 3])
class TestUniformUsageWithTheCheck(DistributedTest):
    world_size = 2
    exec_timeout = 60

    def test_no_error_and_the_same_numbers(self, stage):
        scenario = SCENARIOS["uniform"]
        config = zero_config(stage)
        with lockstep_check():
            engine = make_engine(scenario, config)
            for step in range(STEPS):
                x, image, route = batch(scenario, dist.get_rank(), step, 0, device=device())
                engine.backward(engine(x, image, route))
                engine.step()
            mine = full_params(engine.module, stage)
        assert_lockstep(mine, train_reference(scenario, dist.get_world_size(), STEPS), config, STEPS)
