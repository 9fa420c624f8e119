# Copyright (c) the DeepSpeed lockstep fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The lockstep check (``"lockstep_check": true`` in the config, or ``DS_LOCKSTEP_CHECK=1``): every rank's
collectives since the last optimizer step are compared at the step, on the step agreement.

- A model that issues its own all-reduce from one place on ranks 0 and 1 and from another place on ranks
  2 and 3 (the same size: nothing hangs, and the sums silently mix two quantities), through
  ``deepspeed.comm`` or torch's own ``all_reduce`` (also through a name bound before the check started, or
  torch's functional collective): at that step every rank raises the same error naming both places and the ranks on each side.
- The check on some ranks only (it widens the step agreement, so the ranks' step collectives would differ):
  every rank raises the same error at initialize.
- Uniform usage under ZeRO-1/2/3, the check on: no error, and the parameters equal the plain-PyTorch
  reference (the check adds no collective of its own, only a digest on the step's norm all-reduce).
- Data-parallel peers that issue the same collective on different groups of the same shape (ZeRO++ hpZ's
  secondary groups; a model's own all-reduce on tensor-parallel-like pairs of ranks, [0, 1] and [2, 3]):
  no error, and the parameters equal the reference.
- Ranks that pass the same barrier from two lines (rank 0 first does some work, the others wait for it): no
  error."""

import contextlib
import functools
import importlib
import os
import types

import pytest
import torch
from torch import distributed as torch_dist  # the model's own collectives, bypassing deepspeed.comm

import deepspeed.comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.zero.agreement import RankDisagreementError
from deepspeed.utils import hang_report
from unit.common import DistributedTest
from unit.runtime.zero.lockstep_scenarios import (SCENARIOS, assert_lockstep, batch, device, full_params, make_engine,
                                                  train_reference, zero_config)

STEPS = 3

# bound by name at import, before the check starts, as a model module's ``from ... import all_reduce`` binds it
all_reduce_imported_by_name = torch_dist.all_reduce


def the_model_s_collectives(via):
    """Where the model's own all-reduce comes from; read when it is called, as a module's global name is."""
    if via == "imported by name":
        return types.SimpleNamespace(all_reduce=all_reduce_imported_by_name)
    if via == "functional":  # torch's functional collective (what torch.compile traces), in eager mode
        functional = importlib.import_module(f"{torch_dist.__name__}._functional_collectives")
        return types.SimpleNamespace(
            all_reduce=functools.partial(functional.all_reduce, reduceOp="sum", group=torch_dist.group.WORLD))
    return dist if via == "deepspeed.comm" else torch_dist


@contextlib.contextmanager
def lockstep_check(setting="1"):
    """``DS_LOCKSTEP_CHECK`` set to ``setting`` (None: unset) while the block runs."""
    if setting is not None:
        os.environ["DS_LOCKSTEP_CHECK"] = setting
    try:
        yield
    finally:
        os.environ.pop("DS_LOCKSTEP_CHECK", None)
        hang_report.stop()


def log_the_loss(loss, comm):
    """The model's own collective, here on ranks 0 and 1 ..."""
    t = loss.detach().reshape(1).repeat(4)
    comm.all_reduce(t)
    return t


def sum_a_metric(loss, comm):
    """... and another one of the same size on ranks 2 and 3."""
    t = torch.zeros(4, device=loss.device)
    comm.all_reduce(t)
    return t


class TestModelCollectivesDiffer(DistributedTest):
    world_size = 4
    exec_timeout = 90

    @pytest.mark.parametrize("stage, turned_on_by, via", [(2, "environment", "deepspeed.comm"),
                                                          (3, "config", "deepspeed.comm"), (2, "config", "torch"),
                                                          (3, "environment", "torch"),
                                                          (2, "environment", "imported by name"),
                                                          (3, "config", "functional")])
    def test_every_rank_raises_naming_both_places(self, stage, turned_on_by, via):
        scenario = SCENARIOS["uniform"]
        rank = dist.get_rank()
        config = zero_config(stage)
        if turned_on_by == "config":
            config["lockstep_check"] = True
        with lockstep_check("1" if turned_on_by == "environment" else None):
            engine = make_engine(scenario, config)
            for step in range(STEPS):
                x, image, route = batch(scenario, rank, step, 0, device=device())
                loss = engine(x, image, route)
                if step == 1:
                    (log_the_loss if rank < 2 else sum_a_metric)(loss, the_model_s_collectives(via))
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


@pytest.mark.parametrize("stage, how", [(2, "environment on rank 0"), (3, "config, environment off on rank 1")])
class TestCheckOnSomeRanksOnly(DistributedTest):
    """The check on rank 0 only, by ``DS_LOCKSTEP_CHECK=1`` there, or by the config everywhere with
    ``DS_LOCKSTEP_CHECK=0`` on rank 1: every rank raises at initialize, before a step could mismatch."""
    world_size = 2
    exec_timeout = 60

    def test_every_rank_raises_at_initialize(self, stage, how):
        scenario = SCENARIOS["uniform"]
        config = zero_config(stage)
        rank = dist.get_rank()
        if how.startswith("config"):
            config["lockstep_check"] = True
            setting = "0" if rank == 1 else None
        else:
            setting = "1" if rank == 0 else None
        with lockstep_check(setting):
            with pytest.raises(RankDisagreementError, match=r"step checks \(lockstep_check\); ranks \[0\] vs \[1\]"):
                engine = make_engine(scenario, config)
                for step in range(STEPS):
                    x, image, route = batch(scenario, rank, step, 0, device=device())
                    engine.backward(engine(x, image, route))
                    engine.step()


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


class TestMainProcessFirst(DistributedTest):
    """Rank 0 does some work, then waits in a barrier; the other ranks wait in the barrier first, then do the work
    (accelerate's ``main_process_first``, through torch's own barrier): the same collectives, from two lines. No
    error, and the parameters equal the reference."""
    world_size = 2
    exec_timeout = 60

    def test_no_error_and_the_same_numbers(self):
        scenario = SCENARIOS["uniform"]
        rank = dist.get_rank()
        config = zero_config(2)
        with lockstep_check():
            engine = make_engine(scenario, config)
            for step in range(STEPS):
                if rank != 0:
                    torch_dist.barrier()
                x, image, route = batch(scenario, rank, step, 0, device=device())  # the work
                if rank == 0:
                    torch_dist.barrier()
                engine.backward(engine(x, image, route))
                engine.step()
            mine = full_params(engine.module, 2)
        assert_lockstep(mine, train_reference(scenario, dist.get_world_size(), STEPS), config, STEPS)


@pytest.mark.parametrize("groups", ["hpz", "model_pairs"])
class TestGroupsOfTheSameShape(DistributedTest):
    world_size = 4
    exec_timeout = 90

    def test_no_error_and_the_same_numbers(self, groups):
        if get_accelerator().device_name() == "cuda" and dist.get_backend() == "gloo":
            # hpZ's groups and the model's pairs alike
            pytest.skip("ranks sharing a GPU over gloo: creating a process group there calls perform_nocolor_split, "
                        "which a gloo process group of CUDA torch does not have")
        scenario = SCENARIOS["uniform"]
        rank = dist.get_rank()
        config = (zero_config(3, zero_hpz_partition_size=2, stage3_param_persistence_threshold=0)
                  if groups == "hpz" else zero_config(2))
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group
        with lockstep_check():
            engine = make_engine(scenario, config)
            for step in range(STEPS):
                x, image, route = batch(scenario, rank, step, 0, device=device())
                loss = engine(x, image, route)
                if groups == "model_pairs":  # a metric summed within each pair, as tensor parallelism would
                    dist.all_reduce(loss.detach().reshape(1).repeat(4), group=pairs[rank // 2])
                engine.backward(loss)
                engine.step()
            mine = full_params(engine.module, 3 if groups == "hpz" else 2)
        assert_lockstep(mine, train_reference(scenario, dist.get_world_size(), STEPS), config, STEPS)


class TestPersistentParametersNamed(DistributedTest):
    """ZeRO-3 with DeepSpeed's default persistence threshold (the small parameters stay resident): the gather of
    the persistent parameters after each optimizer step names them in the collective log, the same on every
    rank, as the fetches and the gradient buckets do."""
    world_size = 2
    exec_timeout = 60

    def test_the_gather_after_the_step_names_them(self):
        scenario = SCENARIOS["uniform"]
        with lockstep_check():
            engine = make_engine(scenario, zero_config(3))
            for step in range(2):
                x, image, route = batch(scenario, dist.get_rank(), step, 0, device=device())
                engine.backward(engine(x, image, route))
                engine.step()
            persistent = engine.optimizer.persistent_parameters
            names = {id(p): n for n, p in engine.module.named_parameters()}
            carried = [e["params"] for e in hang_report.active()._log if e.get("params")]
        assert persistent, "the model has no persistent parameter"
        expected = [names[id(p)] for p in persistent]
        expected = [len(persistent)] + (expected if len(expected) <= 4 else expected[:3] + expected[-1:])
        assert carried and carried[-1] == expected, (carried[-3:], expected)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, carried[-1])
        assert all(g == expected for g in gathered), gathered


class TestPhaseOfZeroCollectives(DistributedTest):
    """The collective log records the phase of each collective ZeRO-3 issues (its fetches in the forward, its
    gradient reductions in the backward, the gather of its persistent parameters in the optimizer step), as
    the engine sets it: the log does not walk a ZeRO collective's stack up to the engine."""
    world_size = 2
    exec_timeout = 60

    def test_each_collective_has_its_phase(self):
        scenario = SCENARIOS["uniform"]
        with lockstep_check():
            engine = make_engine(scenario, zero_config(3, stage3_param_persistence_threshold=0))  # every one fetched
            reporter = hang_report.active()

            def phases_of(run):
                """The phases of the collectives ZeRO issues while ``run`` runs."""
                before = reporter._count
                run()
                new = list(reporter._log)[-(reporter._count - before):] if reporter._count > before else []
                return sorted({str(e["phase"]) for e in new if not e["by_model"]})

            seen = []
            for step in range(2):
                x, image, route = batch(scenario, dist.get_rank(), step, 0, device=device())
                loss = []
                seen.append(("forward", phases_of(lambda: loss.append(engine(x, image, route)))))
                seen.append(("backward", phases_of(lambda: engine.backward(loss[0]))))
                seen.append(("optimizer step", phases_of(engine.step)))
        assert all(phases == [name] for name, phases in seen), seen


class TestCheckWithoutZero(DistributedTest):
    """The check on for an engine without ZeRO (stage 0): it is compared at a ZeRO optimizer's step, so every
    rank warns that nothing is checked, and runs no collective log; training is unchanged."""
    world_size = 2
    exec_timeout = 60

    def test_warns_and_logs_nothing(self):
        import logging
        from deepspeed.utils import logger
        records = []
        handler = logging.Handler()
        handler.emit = records.append
        logger.addHandler(handler)
        scenario = SCENARIOS["uniform"]
        try:
            with lockstep_check():
                engine = make_engine(scenario, zero_config(0))
                logging_anyway = hang_report.active()
                for step in range(STEPS):
                    x, image, route = batch(scenario, dist.get_rank(), step, 0, device=device())
                    engine.backward(engine(x, image, route))
                    engine.step()
                mine = full_params(engine.module, 0)
        finally:
            logger.removeHandler(handler)
        assert logging_anyway is None, "the collective log runs with nothing to compare it"
        assert any("does not use ZeRO" in r.getMessage() for r in records), [r.getMessage() for r in records]
        assert_lockstep(mine, train_reference(scenario, dist.get_world_size(), STEPS), zero_config(0), STEPS)


class TestGatheredParametersNamed(DistributedTest):
    """ZeRO-3, the check on: ``GatheredParameters``' all-gather names the parameters it gathers, and with a
    ``modifier_rank`` each broadcast at its exit names its parameter, the same on every rank."""
    world_size = 2
    exec_timeout = 60

    def test_gather_and_broadcast_name_them(self):
        import deepspeed
        scenario = SCENARIOS["uniform"]
        with lockstep_check():
            engine = make_engine(scenario, zero_config(3, stage3_param_persistence_threshold=0))
            reporter = hang_report.active()
            names = {id(p): n for n, p in engine.module.named_parameters()}
            params = sorted(engine.module.parameters(), key=lambda p: p.ds_id)[:2]
            before = reporter._count
            with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
                gathered = reporter._count
                if dist.get_rank() == 0:
                    with torch.no_grad():
                        params[0].mul_(0.5)
            log = list(reporter._log)
            entries = log[len(log) - (reporter._count - before):]
        expected = [names[id(p)] for p in params]
        carried = [e["params"] for e in entries]
        assert carried[:gathered - before] == [[2] + expected] * (gathered - before), carried
        assert carried[gathered - before:] == [[1, name] for name in expected], carried
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, carried)
        assert all(c == carried for c in everyone), everyone
