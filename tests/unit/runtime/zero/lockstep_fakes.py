# Copyright (c) the DeepSpeed lockstep fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Fakes for single-process tests of the lockstep mechanisms (``test_zero_lockstep_units.py``,
``test_zero3_routed_experts.py``): a rank as the fetch schedule's participants (its coordinator and optimizer,
logging the collectives the schedule makes it issue), a micro-step that drives a schedule as ZeRO-3 does,
ranks as threads for the step agreement, and a fake coordinator and optimizer for its participants."""

import threading
import types

import torch

from deepspeed.runtime.zero import agreement
from deepspeed.runtime.zero.agreement import DeferredErrors, LateParameters, ModuleTrace, StepAgreement
from deepspeed.runtime.zero.fetch_schedule import BWD_PRE, FWD_POST, FWD_PRE, BWD_POST, FetchSchedule, ScheduleParticipant


class Module:
    """What the schedule needs of a ZeRO-3 module: its ``ds_id``; one parameter with its own ``ds_id``."""

    def __init__(self, ds_id):
        self.ds_id = ds_id
        self.param = torch.nn.Parameter(torch.zeros(1))
        self.param.ds_id = 100 + ds_id


class Rank(ScheduleParticipant):
    """One rank's coordinator and optimizer: logs the collectives the schedule makes it issue. Buckets are
    lists of parameter ``ds_id``s in launch order; ``others_flag`` is what the other ranks' flags add to this
    rank's in the last bucket's reduction."""

    def __init__(self, buckets, others_flag=False):
        self.buckets, self.others_flag = buckets, others_flag
        self.log, self.arrived, self.next = [], set(), 0
        self.flag_sent, self.switched, self.reduced_again = None, 0, []

    def gather(self, kind, module):
        self.log.append(("all_gather", "forward" if kind == FWD_PRE else "backward", module.ds_id))

    def replay_hook(self, kind, module):
        if kind in (FWD_PRE, BWD_PRE):
            self.gather(kind, module)

    def switch_to_votes(self):
        self.switched += 1

    def refetch(self, kind, module):
        self.log.append(("refetch", module.ds_id))

    def any_rank(self, flag):
        return flag or self.others_flag

    def from_every_rank(self, obj):
        return [obj]

    def planned_buckets(self):
        return self.buckets

    def can_carry_flags(self):
        return True

    def buckets_ready(self):
        count = 0
        while self.next + count < len(self.buckets) and set(self.buckets[self.next + count]) <= self.arrived:
            count += 1
        return count

    def launch_buckets(self, count):
        for _ in range(count):
            self.log.append(("reduce_scatter", self.next))
            self.next += 1

    def launch_last_bucket(self, flag):
        self.launch_buckets(len(self.buckets) - self.next)
        self.flag_sent = flag

    def flags_raised(self):
        return self.flag_sent or self.others_flag

    def reduce_again(self, backward_finished):
        self.reduced_again.append(backward_finished)


MODULES = [Module(i) for i in range(4)]
BUCKETS = [[103, 102], [101, 100]]  # backward reaches the last module first


def micro_step(schedule, rank, order):
    """One forward and backward of ``order`` (module indices) as the ZeRO-3 coordinator and optimizer drive
    the schedule: a hook the schedule lets run as without one gathers (a pre hook); each module's gradient
    becomes final after its backward; the epilogue ends the backward and settles the flags."""
    schedule.begin_forward(checked_at_end=False)
    for i in order:
        if schedule.hook(FWD_PRE, MODULES[i]) or not schedule.replaying:
            rank.gather(FWD_PRE, MODULES[i])
        schedule.hook(FWD_POST, MODULES[i])
    schedule.end_forward()
    rank.next, rank.arrived = 0, set()
    for i in reversed(order):
        if schedule.hook(BWD_PRE, MODULES[i]) or not schedule.replaying:
            rank.gather(BWD_PRE, MODULES[i])
        rank.arrived.add(MODULES[i].param.ds_id)
        schedule.record_gradient(MODULES[i].param)
        schedule.bucket_ready()
        schedule.hook(BWD_POST, MODULES[i])
    schedule.end_backward()
    return schedule.settle_backward()


def agreed(others_flag=False):
    """A rank whose first step ran every module (as every rank's did): the schedule adopted at the step."""
    rank = Rank(BUCKETS, others_flag)
    schedule = FetchSchedule(rank, rank, MODULES)
    micro_step(schedule, rank, [0, 1, 2, 3])
    schedule.adopt(ranks_differ=False)
    rank.log = []
    return schedule, rank


def uniform_log():
    schedule, rank = agreed()
    micro_step(schedule, rank, [0, 1, 2, 3])
    return rank.log


class ThreadRanks:
    """``deepspeed.comm`` for ranks that are threads of this process: a collective waits for every rank,
    then each gets the result (enough for the step agreement's all-reduce and all-gather)."""

    ReduceOp = types.SimpleNamespace(SUM="sum")

    def __init__(self, n):
        self.n, self.calls = n, []
        self._barrier, self._slots, self._local = threading.Barrier(n, timeout=30), [None] * n, threading.local()

    def get_world_size(self, group=None):
        return self.n

    def get_rank(self, group=None):
        return self._local.rank

    def _exchange(self, tensor):
        self._slots[self._local.rank] = tensor.clone()
        self._barrier.wait()
        slots = list(self._slots)
        self._barrier.wait()
        return slots

    def all_reduce(self, tensor, op=None, group=None):
        self.calls.append(("all_reduce", self._local.rank, tensor.numel()))
        tensor.copy_(sum(self._exchange(tensor)))

    def all_gather(self, out, tensor, group=None):
        for target, slot in zip(out, self._exchange(tensor)):
            target.copy_(slot)

    def run(self, fn):
        """``fn(rank)`` on every rank at once; each rank's result or exception, in rank order."""
        results = [None] * self.n

        def body(rank):
            self._local.rank = rank
            try:
                results[rank] = fn(rank)
            except Exception as error:  # compared across ranks by the test
                results[rank] = error

        threads = [threading.Thread(target=body, args=(rank, )) for rank in range(self.n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return results


class Coordinator:

    def __init__(self, state, routed=()):
        self.state, self.settled = state, None
        self.routed, self.coalesced = list(routed), None

    def trace_state(self):
        return self.state

    def settle_trace(self, **decision):
        self.settled = decision

    def routed_hosts(self):
        return self.routed

    def coalesce_routed(self, hosts):
        self.coalesced = hosts


def thread_ranks(monkeypatch, n=3):
    """``n`` ranks as threads, standing in for ``deepspeed.comm`` in ``agreement.py``."""
    fake = ThreadRanks(n)
    monkeypatch.setattr(agreement, "dist", fake)
    return fake


def step(ranks, optimizers, coordinators, invalid=None, carry_on_norm=True, policy="warn"):
    """One optimizer step's agreement on every rank: open, the norm's all-reduce, settle."""

    def on_rank(rank):
        participants = [DeferredErrors(optimizers[rank]), LateParameters(optimizers[rank])]
        participants.append(ModuleTrace(lambda: coordinators[rank]))
        step_agreement = optimizers[rank].agreement = getattr(optimizers[rank], "agreement", None) or StepAgreement(
            None, participants)
        step_agreement.open(module="the model", late_policy=policy)
        if carry_on_norm:
            norm = step_agreement.all_reduce_sum(torch.tensor([float(rank + 1)]))
            assert norm.item() == sum(range(1, ranks.n + 1))
        flag = torch.tensor([float(invalid)]) if invalid is not None else None  # computed from the summed norm
        return step_agreement.settle(flag)

    return ranks.run(on_rank)


def optimizer(errors=(), late=()):
    return types.SimpleNamespace(deferred_errors=list(errors), late_parameters=lambda module: list(late))
