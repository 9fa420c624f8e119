# Copyright (c) the DeepSpeed lockstep fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Single-process tests of the mechanisms that keep ranks in lockstep, through their own protocols and
without a process group: the reduction plan (which bucket a gradient goes in, when a bucket may launch),
the ZeRO-3 fetch schedule (what a rank that skips, adds or reorders modules issues) and the step agreement
(its participants' fields carried on the norm's all-reduce, decided the same on every rank; ranks are
threads here).

The fetch schedule drives two participants (``ScheduleParticipant``): the parameter coordinator, whose
replayed and followed hooks gather parameters, and the optimizer, which launches gradient buckets. A fake
rank here logs the collectives those calls stand for; the invariant under test is that a rank that skips
modules logs the same collectives as a rank that runs them all, and that a rank that runs a module the
schedule lacks still logs them up to the end of backward, where its flag makes every rank switch."""

import random

import pytest
import torch

from deepspeed.runtime.zero import agreement
from deepspeed.runtime.zero.fetch_schedule import _merge
from deepspeed.runtime.zero.reduction_plan import ReductionPlan

from unit.runtime.zero.lockstep_fakes import (Coordinator, agreed, micro_step, optimizer, step, thread_ranks,
                                              uniform_log)


def test_replay_of_the_agreed_step_issues_its_collectives():
    schedule, rank = agreed()
    assert not micro_step(schedule, rank, [0, 1, 2, 3])
    forward = [("all_gather", "forward", i) for i in range(4)]
    backward = [("all_gather", "backward", 3), ("all_gather", "backward", 2), ("reduce_scatter", 0),
                ("all_gather", "backward", 1), ("all_gather", "backward", 0), ("reduce_scatter", 1)]
    assert rank.log == forward + backward
    assert schedule.replayed == 0 and schedule.switches == 0 and rank.flag_sent is False


@pytest.mark.parametrize("order", [[0, 1, 3], [0, 3], [1, 2, 3], [0, 1, 2], []])
def test_a_rank_that_skips_modules_issues_the_same_collectives(order):
    schedule, rank = agreed()
    assert not micro_step(schedule, rank, order)
    assert rank.log == uniform_log()
    assert schedule.replaying and schedule.switches == 0 and schedule.replayed > 0
    assert rank.flag_sent is False and rank.reduced_again == []


@pytest.mark.parametrize("order", [[0, 2, 1, 3], [3, 2, 1, 0], [0, 1, 1, 2, 3]])
def test_a_rank_off_the_schedule_flags_it_at_the_end_of_backward(order):
    schedule, rank = agreed()
    micro_step(schedule, rank, order)
    # until the switch it replayed the schedule: the collectives every rank issues
    assert [e for e in rank.log if e[0] != "refetch"][:len(uniform_log())] == uniform_log()
    assert rank.flag_sent is True and rank.switched == 1 and schedule.switches == 1
    # it left in the forward and replayed the schedule to its end: every bucket went with zeros for its
    # gradients, which its own backward produces after the switch and reduces again
    assert rank.reduced_again == [False]
    assert not schedule.replaying


def test_a_rank_on_the_schedule_switches_with_the_rank_that_left():
    schedule, rank = agreed(others_flag=True)  # another rank raised its flag in the last bucket
    assert micro_step(schedule, rank, [0, 1, 2, 3])
    assert rank.log == uniform_log() and rank.flag_sent is False
    assert rank.switched == 1 and rank.reduced_again == [True] and not schedule.replaying


def test_merge_keeps_every_sequence_as_a_subsequence():

    def is_subsequence(small, big):
        it = iter(big)
        return all(any(x == y for y in it) for x in small)

    rng = random.Random(1)
    for _ in range(200):
        sequences = [[(rng.randrange(3), rng.randrange(6)) for _ in range(rng.randrange(8))] for _ in range(3)]
        merged = _merge(sequences)
        assert all(is_subsequence(s, merged) for s in sequences)
        assert merged == _merge([list(s) for s in sequences])  # the same wherever it is computed


def plan(sizes, bucket_size, dtypes=None):
    params = [
        torch.nn.Parameter(torch.zeros(n, dtype=(dtypes or {}).get(i, torch.float32))) for i, n in enumerate(sizes)
    ]
    return params, ReductionPlan([(0, p) for p in params], bucket_size, comm_dtype_of=lambda p: p.dtype)


def test_plan_cuts_buckets_in_reverse_registration_order():
    params, p = plan([4, 4, 4, 20, 4], bucket_size=8)
    index = {id(q): i for i, q in enumerate(params)}
    ids = [[index[id(q)] for _, q in b.entries] for b in p.buckets]
    assert ids == [[4], [3], [2, 1], [0]]  # an oversized parameter is a bucket of its own
    assert all(b.numel <= 8 or len(b.entries) == 1 for b in p.buckets)
    assert p.buckets[2].offsets == {id(params[2]): 0, id(params[1]): 4}


def test_plan_separates_communication_dtypes():
    params, p = plan([2, 2, 2, 2], bucket_size=100, dtypes={1: torch.bfloat16, 3: torch.bfloat16})
    assert [{q.dtype for _, q in b.entries} for b in p.buckets] == [{torch.bfloat16}, {torch.float32}]


def test_plan_launches_in_index_order_whatever_the_arrival_order():
    params, p = plan([4, 4, 4, 4], bucket_size=8)  # buckets: [3, 2], [1, 0]
    p.open()
    assert p.mark_ready(params[0]) == [] and p.mark_ready(params[1]) == []  # bucket 1 full, bucket 0 not
    assert p.ready_count() == 0 and not p.is_launched(params[0])
    assert p.mark_ready(params[2]) == []
    launched = p.mark_ready(params[3])
    assert [b.index for b in launched] == [0, 1] and p.is_launched(params[0])
    assert p.remaining() == []


def test_plan_launches_what_never_arrived_at_the_end():
    params, p = plan([4, 4, 4, 4], bucket_size=8)
    p.open()
    assert p.mark_ready(params[3]) == []  # params[2] never gets a gradient on this rank
    assert [b.index for b in p.remaining()] == [0, 1]  # zeros for what is missing, every bucket once
    p.reset()
    assert p.remaining() == []  # no backward opened this reduction point: nothing to reduce


@pytest.fixture
def ranks(monkeypatch):
    return thread_ranks(monkeypatch)


def test_step_agreement_rides_on_the_norm_and_decides_the_same_everywhere(ranks):
    optimizers = [optimizer() for _ in range(3)]
    coordinators = [Coordinator((False, True, 1234)) for _ in range(3)]
    # the norm's invalid flag is read with the agreement (one transfer)
    assert step(ranks, optimizers, coordinators, invalid=True) == [True, True, True]
    assert [c[0] for c in ranks.calls] == ["all_reduce"] * 3  # the norm's, nothing else
    assert all(c.settled == dict(all_complete=False, all_recorded_same=True, all_recorded=True) for c in coordinators)


def test_step_agreement_without_a_norm_agrees_on_its_own(ranks):
    optimizers = [optimizer() for _ in range(3)]
    coordinators = [Coordinator((True, False, 0)) for _ in range(3)]
    assert step(ranks, optimizers, coordinators, carry_on_norm=False) == [False, False, False]
    assert len(ranks.calls) == 3
    assert all(c.settled["all_complete"] for c in coordinators)


def test_different_traces_are_found_on_every_rank(ranks):
    optimizers = [optimizer() for _ in range(3)]
    coordinators = [Coordinator((False, True, digest)) for digest in (7, 7, 8)]
    step(ranks, optimizers, coordinators)
    assert [c.settled["all_recorded_same"] for c in coordinators] == [False, False, False]


def test_an_error_on_one_rank_is_raised_on_every_rank(ranks):
    optimizers = [optimizer(), optimizer([ValueError("planted")]), optimizer()]
    coordinators = [Coordinator((True, False, 0)) for _ in range(3)]
    results = step(ranks, optimizers, coordinators)
    assert all(isinstance(r, agreement.RankDisagreementError) and "ranks [1]" in str(r) for r in results), results
    assert isinstance(results[1].__cause__, ValueError) and results[0].__cause__ is None
    assert all(c.settled is None for c in coordinators)  # nothing after the error is applied


@pytest.mark.parametrize("policy", ["warn", "error"])
def test_late_parameters_on_one_rank(ranks, policy):
    optimizers = [optimizer(), optimizer(), optimizer(late=["head.weight"])]
    coordinators = [None] * 3
    results = step(ranks, optimizers, coordinators, policy=policy)
    if policy == "error":
        assert all(isinstance(r, agreement.LateParametersError) and "ranks [2]" in str(r) for r in results)
    else:
        assert results == [False, False, False]
        assert all(o.agreement.participants[1]._warned for o in optimizers)  # warned once, on every rank
