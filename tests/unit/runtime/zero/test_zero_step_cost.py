# Copyright (c) the DeepSpeed lockstep fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""What the ranks must decide together costs nothing when they agree, and nothing is decided inside a
forward: a forward that some ranks run alone (an evaluation or sample generation on rank 0) works whenever
it worked before the ranks had to agree on anything.

- TestRankLocalForward: rank 0 alone runs an evaluation forward (eval mode, no_grad) after the first
  steps, or before the first one, then every rank trains on. Oracle: every rank finishes within the
  deadline, parameters identical across ranks and equal to a plain-PyTorch reference of the training alone.
- TestStepCost: counts, per forward, backward and optimizer step of steady-state training with uniform
  usage, the collectives DeepSpeed issues and the host reads of tensor values its code makes (``item``,
  ``tolist``, ``bool``, ``int``, ``float``: each a host-device sync on an accelerator). A forward whose
  parameters are all resident issues none; every steady step costs the same on every rank. On a CUDA
  device (ranks sharing it, scripts/test-gpu.sh) each phase's implicit host-device synchronizations are
  counted too, by torch's sync debug mode. ZeRO-3's fetch
  votes (on a CPU group, cast only until the ranks agree on a fetch schedule) are counted apart: none in
  steady state, where every rank replays the agreed schedule.
"""

import contextlib
import json  # fork-only
import sys
import warnings
from collections import Counter

import pytest
import torch

import deepspeed
import deepspeed.comm as dist
from unit.common import DistributedTest
from unit.runtime.zero.lockstep_scenarios import (SCENARIOS, assert_lockstep, batch, device, full_params, make_engine,
                                                  train_reference, zero_config)
from unit.runtime.zero.lockstep_scenarios import record_for_verify  # fork-only
# fork-only: begin
try:
    from deepspeed.runtime.zero.fetch_ballot import FetchBallot
except ImportError:  # vanilla DeepSpeed, which scripts/fork.py verify runs this test against
    FetchBallot = None
# fork-only: end

COLLECTIVES = ("all_reduce", "all_reduce_coalesced", "reduce", "reduce_scatter", "reduce_scatter_tensor",
               "reduce_scatter_fn", "all_gather", "all_gather_into_tensor", "all_gather_coalesced", "allgather_fn",
               "broadcast", "all_to_all_single", "barrier", "send", "recv", "isend", "irecv")
HOST_READS = ("item", "tolist", "__bool__", "__int__", "__float__")


class CostRecorder:
    """Counts collectives (through deepspeed.comm's backend, the outermost call only) and host reads of
    tensor values made by DeepSpeed's own code, per named phase."""

    def __init__(self):
        self.counts = Counter()
        self.phase = None
        self._depth = 0
        self._in_vote = 0
        self._undo = []
        backend = deepspeed.comm.comm.cdb
        for name in COLLECTIVES:
            if getattr(backend, name, None) is not None:
                self._wrap(backend, name, self._collective(name, getattr(backend, name)))
        for name in HOST_READS:
            self._wrap(torch.Tensor, name, self._host_read(name, getattr(torch.Tensor, name)))
        # fork-only: begin
        # ZeRO-3's fetch votes, counted apart (an all-reduce and a read of four integers on a CPU group, no
        # device sync)
        if FetchBallot is not None:
            self._wrap(FetchBallot, "_poll", self._vote(FetchBallot._poll))
        # fork-only: end

    def _wrap(self, owner, name, replacement):
        self._undo.append((owner, name, owner.__dict__.get(name, None), name in owner.__dict__))
        setattr(owner, name, replacement)

    def _collective(self, name, fn):

        def counted(*args, **kwargs):
            self._depth += 1
            try:
                if self._depth == 1 and self.phase:
                    self.counts[(self.phase, "collective", name)] += 1
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1

        return counted

    def _vote(self, fn):

        def counted(*args, **kwargs):
            if self.phase:
                self.counts[(self.phase, "fetch votes", "")] += 1
            self._depth += 1  # its all-reduce and its read are the vote's
            self._in_vote += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1
                self._in_vote -= 1

        return counted

    def _host_read(self, name, fn):

        def counted(tensor, *args, **kwargs):
            if self.phase and not self._in_vote and "/deepspeed/" in sys._getframe(1).f_code.co_filename:
                self.counts[(self.phase, "host reads", "")] += 1  # which kind does not matter: one sync each
            return fn(tensor, *args, **kwargs)

        return counted

    @contextlib.contextmanager
    def recording(self, phase):
        """Count ``phase``'s collectives and host reads; on a CUDA device also every implicit host-device
        synchronization the phase makes, whoever makes it (torch's sync debug mode warns at each one)."""
        self.phase = phase
        cuda = torch.device(device()).type == "cuda"
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                if cuda:
                    torch.cuda.set_sync_debug_mode("warn")  #ignore-cuda
                try:
                    yield
                finally:
                    if cuda:
                        torch.cuda.set_sync_debug_mode("default")  #ignore-cuda
            syncs = sum("synchroniz" in str(w.message) for w in caught)
            if syncs:
                self.counts[(phase, "implicit syncs", "")] += syncs
        finally:
            self.phase = None

    def of(self, phase):
        return {f"{kind} {name}".strip(): n for (p, kind, name), n in sorted(self.counts.items()) if p == phase}

    def remove(self):
        for owner, name, original, had in reversed(self._undo):
            if had:
                setattr(owner, name, original)
            else:
                delattr(owner, name)


@pytest.mark.parametrize("when", ["after_steps", "before_first_step"])
@pytest.mark.parametrize("stage", [1, 2, 3])
class TestRankLocalForward(DistributedTest):
    world_size = 2
    exec_timeout = 60

    def test_rank0_evaluates_alone(self, stage, when):
        scenario = SCENARIOS["uniform"]
        config = zero_config(stage)
        engine = make_engine(scenario, config)
        rank = dist.get_rank()
        steps, evaluate_at = 5, (3 if when == "after_steps" else 0)
        for step in range(steps):
            if step == evaluate_at and rank == 0:
                engine.eval()
                with torch.no_grad():
                    x, image, route = batch(scenario, rank, 100, 0, device=device())
                    engine(x, image, route)
                engine.train()
            x, image, route = batch(scenario, rank, step, 0, device=device())
            engine.backward(engine(x, image, route))
            engine.step()
        mine = full_params(engine.module, stage)
        assert_lockstep(mine, train_reference(scenario, dist.get_world_size(), steps), config, steps)


@pytest.mark.parametrize("zero", [
    dict(stage=1),
    dict(stage=2, overlap_comm=True),
    dict(stage=2, bf16=True),
    dict(stage=3),
    dict(stage=3, stage3_param_persistence_threshold=0),
],
                         ids=["zero1", "zero2", "zero2-bf16", "zero3", "zero3-fetched"])
class TestStepCost(DistributedTest):
    world_size = 2
    exec_timeout = 60

    def test_steady_state_counts(self, zero):
        zero = dict(zero)
        stage, bf16 = zero.pop("stage"), zero.pop("bf16", False)
        scenario = SCENARIOS["uniform"]
        engine = make_engine(scenario, zero_config(stage, bf16=bf16, **zero))
        dtype = next(engine.module.parameters()).dtype
        rank, warmup, steps = dist.get_rank(), 2, 3
        recorder = CostRecorder()
        try:
            per_step = []
            for step in range(warmup + steps):
                x, image, route = batch(scenario, rank, step, 0, dtype=dtype, device=device())
                recorder.counts.clear()
                with recorder.recording("forward"):
                    loss = engine(x, image, route)
                with recorder.recording("backward"):
                    engine.backward(loss)
                with recorder.recording("step"):
                    engine.step()
                if step >= warmup:
                    per_step.append({phase: recorder.of(phase) for phase in ("forward", "backward", "step")})
        finally:
            recorder.remove()
        steady = per_step[0]
        assert all(counts == steady for counts in per_step), f"steady steps differ: {per_step}"
        resident = stage != 3 or zero.get("stage3_param_persistence_threshold", 1) != 0
        if resident:
            assert steady["forward"] == {}, f"a forward of resident parameters issued {steady['forward']}"
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, steady)
        assert all(g == steady for g in gathered), f"ranks differ: {gathered}"
        # fork-only: begin
        # no fetch vote in steady state: the ranks replay the fetch schedule agreed at the first step; nothing
        # else differs from vanilla DeepSpeed (verify's numbers)
        votes = {phase: counts.pop("fetch votes", 0) for phase, counts in steady.items()}
        if FetchBallot is not None:
            assert votes == dict(forward=0, backward=0, step=0), f"fetch votes in steady state: {votes}"
        # fork-only: end
        record_for_verify(json.dumps(steady, sort_keys=True))  # fork-only


# fork-only: begin
# (the fetch schedule's property: upstream receives it with the schedule's PR, not this one)
class TestStepCostTwoForwardsPerLoss(DistributedTest):
    """ZeRO-3 with every parameter fetched, a model called twice per loss (one backward of both forwards,
    a Siamese or contrastive loss), uniform usage: in steady state the first forward, the backward and the
    step issue exactly what they issue when the model is called once per loss (no flag read between the
    forwards), and the second forward issues nothing the first does not (no gradient reduction, no
    backward's fetches), on every rank the same."""
    world_size = 2
    exec_timeout = 90

    @staticmethod
    def _steady_counts(forwards):
        scenario = SCENARIOS["uniform"]
        engine = make_engine(scenario, zero_config(3, stage3_param_persistence_threshold=0))
        rank, warmup, steps = dist.get_rank(), 2, 3
        phases = [f"forward {i + 1}" for i in range(forwards)] + ["backward", "step"]
        recorder = CostRecorder()
        try:
            per_step = []
            for step in range(warmup + steps):
                x, image, route = batch(scenario, rank, step, 0, device=device())
                recorder.counts.clear()
                outputs = []
                for phase in phases[:forwards]:
                    with recorder.recording(phase):
                        outputs.append(engine(x, image, route))
                with recorder.recording("backward"):
                    engine.backward(sum(outputs) / forwards)
                with recorder.recording("step"):
                    engine.step()
                if step >= warmup:
                    per_step.append({p: recorder.of(p) for p in phases})
        finally:
            recorder.remove()
            engine.destroy()
        steady = per_step[0]
        assert all(counts == steady for counts in per_step), f"steady steps differ: {per_step}"
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, steady)
        assert all(g == steady for g in gathered), f"ranks differ: {gathered}"
        return steady

    def test_second_forward(self):
        once = self._steady_counts(forwards=1)
        twice = self._steady_counts(forwards=2)
        for phase in ("backward", "step"):
            assert twice[phase] == once[phase], f"{phase}: called twice {twice[phase]} vs once {once[phase]}"
        first, second = twice["forward 1"], twice["forward 2"]
        assert first == once["forward 1"], f"the first forward: called twice {first} vs once {once['forward 1']}"
        assert not any("reduce" in what and "all_reduce" not in what for what in second), \
            f"the second forward reduced gradients: {second}"
        assert all(n <= first.get(what, 0) for what, n in second.items()), \
            f"the second forward issued more than the first: {second} vs {first}"
        record_for_verify(json.dumps(twice, sort_keys=True))  # fork-only


# fork-only: end
