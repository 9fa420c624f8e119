# Copyright (c) the DeepSpeed lockstep fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The hang report on real hangs: four CPU ranks (gloo) train a tiny ZeRO-2 model with
``DS_HANG_REPORT_DIR`` set, and at the third step the ranks stop agreeing. Every rank that waits writes its
report within the timeout, one that dies of an exception says so, and ``merge`` names on one screen which
ranks wait where (and in which DeepSpeed collective), and which ranks wrote nothing.

- user collective: ranks 0 and 1 all-reduce on a group of their own (a model collective DeepSpeed does not
  issue), ranks 2 and 3 go on into ZeRO's gradient reduction: both pairs wait forever;
- loader exception: rank 3's data loader raises, the others wait in the gradient reduction;
- killed: rank 3 ends without a word (``os._exit``), the others wait;
- aborted: rank 3 dies of a fatal signal (``os.abort``, as a C++ abort in gloo or NCCL), which leaves no
  Python exception: faulthandler's dump says where.
- ZeRO-3 forward collective (2 ranks): rank 0 all-reduces in a module's forward after the ranks agreed on the
  fetch schedule, rank 1 goes on: each line says where the rank stands in the schedule.

The ranks are plain processes (not the harness's ``DistributedTest``: the hang is the point), killed with
their process group when the reports are in, or at the deadline."""

import glob
import importlib  # fork-only
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
import types  # fork-only

import pytest
import torch

from deepspeed.utils import hang_report
# fork-only: begin
import inspect
import re

from deepspeed.runtime.zero.fetch_schedule import FWD_POST, FWD_PRE, FetchSchedule
# fork-only: end

WORLD_SIZE = 4
# a flight recorder that dumps a gloo process group's collectives (torch 2.3 has none: no fr/ dumps)
needs_flight_recorder = pytest.mark.skipif(not hasattr(torch._C._distributed_c10d, "_dump_fr_trace"),
                                           reason="this torch's flight recorder has no _dump_fr_trace")
TIMEOUT = 3  # seconds without progress before a rank reports
DEADLINE = 120  # for every rank's report to appear

WORKER = textwrap.dedent('''
    import os, sys
    import torch
    from torch import distributed as torch_dist  # the model's own collectives bypass deepspeed.comm on purpose
    import deepspeed
    import deepspeed.comm as dist

    scenario = sys.argv[1]
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    own_group = torch_dist.new_group(list(range(dist.get_world_size())))
    in_backward = [False]  # the model's collective in backward, on this rank at this step
    in_forward = [False]  # the model's collective in forward, on this rank at this step


    class CollectiveInBackward(torch.autograd.Function):

        @staticmethod
        def forward(ctx, h):
            return h.view_as(h)

        @staticmethod
        def backward(ctx, grad):
            torch_dist.all_reduce(torch.ones(4), group=own_group)  # BACKWARD COLLECTIVE
            return grad


    class Tap(torch.nn.Module):

        def __init__(self):
            super().__init__()
            # a frozen parameter: ZeRO-3 hooks the module (one without parameters gets no hooks), so the
            # fetch schedule has its forward's events
            self.unused = torch.nn.Parameter(torch.zeros(2), requires_grad=False)

        def forward(self, h):
            if in_forward[0]:
                torch_dist.all_reduce(torch.ones(4), group=own_group)  # FORWARD COLLECTIVE
            return CollectiveInBackward.apply(h) if in_backward[0] else h


    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), Tap(), torch.nn.Linear(16, 1))
    config = {"train_micro_batch_size_per_gpu": 2, "zero_allow_untested_optimizer": True,
              "zero_optimization": {"stage": 2}}
    if scenario.startswith("zero3"):  # every parameter fetched
        config["zero_optimization"] = {"stage": 3, "stage3_param_persistence_threshold": 0}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                           config=config)


    def load(step):
        if scenario == "loader" and step == 2 and rank == 3:
            raise RuntimeError("the data loader failed on this rank")
        if scenario == "killed" and step == 2 and rank == 3:
            os._exit(3)
        if scenario == "aborted" and step == 2 and rank == 3:
            os.abort()  # a fatal signal, as a C++ abort in gloo or NCCL gives
        return torch.randn(2, 8)


    for step in range(4):
        x = load(step)
        if scenario == "user_collective" and step == 2 and rank in (0, 1):
            torch_dist.all_reduce(torch.ones(4), group=own_group)  # USER COLLECTIVE
        in_backward[0] = scenario == "backward_collective" and step == 2 and rank in (0, 1)
        in_forward[0] = scenario == "zero3_forward_collective" and step == 2 and rank == 0
        engine.backward(engine(x).pow(2).mean())
        engine.step()
''')


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _reports_of_the_hang(reports):
    found = []
    for path in reports.glob("rank-*.json") if reports.is_dir() else []:
        try:
            report = json.loads(path.read_text())
        except ValueError:
            continue
        if report["step"] == 2 or report["exited"]:
            found.append(report["rank"])
    return found


def _run_until_reported(tmp_path, scenario, expected_reports, world_size=WORLD_SIZE, **extra_env):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    reports = tmp_path / "reports"
    port = str(_free_port())
    procs = []
    try:
        for rank in range(world_size):
            env = dict(os.environ,
                       MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=port,
                       RANK=str(rank),
                       LOCAL_RANK=str(rank),
                       WORLD_SIZE=str(world_size),
                       LOCAL_SIZE=str(world_size),
                       OMP_NUM_THREADS="1",
                       DS_ACCELERATOR="cpu",
                       TORCH_EXTENSIONS_DIR=str(tmp_path / "torch-extensions"),
                       DS_HANG_REPORT_DIR=str(reports),
                       DS_HANG_REPORT_TIMEOUT=str(TIMEOUT),
                       **extra_env)
            procs.append(
                subprocess.Popen([sys.executable, str(script), scenario],
                                 env=env,
                                 cwd=tmp_path,
                                 stdout=subprocess.DEVNULL,
                                 stderr=open(tmp_path / f"rank{rank}.log", "w"),
                                 start_new_session=True))
        deadline = time.monotonic() + DEADLINE
        while time.monotonic() < deadline:
            # a rank may report earlier stalls too (a slow start: building DeepSpeed's CPU comm op); a later
            # report replaces its file, so wait for the reports of the hang at the third step
            if len(_reports_of_the_hang(reports)) == expected_reports:
                break
            time.sleep(0.5)
        else:
            logs = "\n".join((tmp_path / f"rank{r}.log").read_text()[-1500:] for r in range(world_size))
            pytest.fail(f"not every rank reported within {DEADLINE} s:\n{logs}")
        # what a user reads while the job hangs (killing the ranks below makes the survivors' gloo calls fail)
        shutil.copytree(reports, tmp_path / "verdict")
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
        # killed ranks leave the shared memory of DeepSpeed's CPU all-reduce behind (69 MB a rank, in RAM)
        for leftover in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{port}_*"):
            os.unlink(leftover)
    return tmp_path / "verdict", _line_of("USER COLLECTIVE")


def _line_of(marker):
    return 1 + WORKER.splitlines().index(next(line for line in WORKER.splitlines() if marker in line))


@pytest.mark.parametrize("world_size", [WORLD_SIZE, pytest.param(16, marks=pytest.mark.nightly)])
def test_user_collective_on_two_ranks(tmp_path, world_size):
    """Two ranks wait in a collective of the model, the others in ZeRO's (at 16 ranks, #7991's shape)."""
    reports, line = _run_until_reported(tmp_path, "user_collective", world_size, world_size)
    verdict = hang_report.merge(reports)
    assert len(verdict) == 2, verdict
    assert verdict[0].startswith("ranks 0, 1: in the torch collective all_reduce ") and \
        f"called in the model at worker.py:{line} " in verdict[0], verdict
    # fork-only: begin
    # the model's collective bypasses deepspeed.comm; the log has it all the same (hang-report-torch-collectives)
    assert verdict[0].startswith(f"ranks 0, 1: in the torch collective all_reduce [4 torch.float32] on ranks "
                                 f"{list(range(world_size))} called in the model"), verdict
    # fork-only: end
    assert "step 2" in verdict[0] and "not in DeepSpeed" in verdict[0], verdict
    others = ", ".join(map(str, range(2, world_size)))
    assert verdict[1].startswith(f"ranks {others}: all_reduce ")
    assert f"on ranks {list(range(world_size))} " in verdict[1] and " issued at stage_1_and_2.py" in verdict[1], verdict
    assert "(backward)" in verdict[1] and "step 2" in verdict[1], verdict
    # the model's line of ZeRO's collective in flight, read from its thread's stack when the report is written
    assert f", from the model at worker.py:{_line_of('engine.backward(engine(x)')} " in verdict[1], verdict
    # what a user runs: the same verdict on stdout
    command = subprocess.run([sys.executable, "-m", "deepspeed.utils.hang_report",
                              str(reports)],
                             env=dict(os.environ, DS_ACCELERATOR="cpu"),
                             capture_output=True,
                             text=True,
                             timeout=120)
    assert command.returncode == 0 and command.stdout.splitlines() == verdict, (command.returncode, command.stdout,
                                                                                command.stderr[-2000:])


# fork-only: begin
def test_collective_in_backward_on_two_ranks(tmp_path):
    """Ranks 0 and 1 wait in a collective the model issues in its backward, before the first layer's
    gradients exist; ranks 2 and 3 finished their backward and wait in ZeRO's reduction. The report of ranks 0
    and 1 says which gradients ZeRO's reduction still waits for there."""
    reports, _ = _run_until_reported(tmp_path, "backward_collective", WORLD_SIZE)
    verdict = hang_report.merge(reports)
    assert len(verdict) == 2, verdict
    assert verdict[0].startswith(
        "ranks 0, 1: in the torch collective all_reduce [4 torch.float32] on ranks "
        f"[0, 1, 2, 3] called in the model at worker.py:{_line_of('BACKWARD COLLECTIVE')}"), verdict
    assert verdict[0].endswith("; ZeRO's reduction waits for 2 gradients (0.bias, 0.weight), 0 of 1 buckets "
                               "launched"), verdict
    assert verdict[1].startswith("ranks 2, 3: all_reduce ") and "waits for" not in verdict[1], verdict
    # the bucket's parameters (hang-report-carried-params)
    assert re.search(r" on ranks \[0, 1, 2, 3\] for (\d\.(weight|bias), ){3}\d\.(weight|bias) \(4 parameters\) ",
                     verdict[1]), verdict


@needs_flight_recorder
def test_flight_recorder(tmp_path):
    """With PyTorch's flight recorder on, each report comes with its dump (``fr/rank_<N>``, torchfrtrace's
    layout), and the command adds what the dumps say per process group: ranks 0 and 1 issued the model's
    all-reduce on their own group, which ranks 2 and 3 never issued, and ranks 2 and 3 issued ZeRO's bucket
    all-reduce, which ranks 0 and 1 never issued: a cross-group deadlock."""
    reports, _ = _run_until_reported(tmp_path, "user_collective", WORLD_SIZE, TORCH_FR_BUFFER_SIZE="200")
    assert sorted(os.listdir(reports / "fr")) == [f"rank_{rank}" for rank in range(WORLD_SIZE)]
    lines = hang_report.flight_recorder_verdict(reports)
    assert len(lines) == 2, lines
    model = [line for line in lines if "ranks 0, 1: all_reduce [4 Float]; ranks 2, 3: not issued (its last: #" in line]
    zero = [
        line for line in lines if "ranks 0, 1: not issued (its last: #" in line and "ranks 2, 3: all_reduce [161 "
        "Float]" in line
    ]
    assert len(model) == 1 and len(zero) == 1, lines
    command = subprocess.run([sys.executable, "-m", "deepspeed.utils.hang_report",
                              str(reports)],
                             env=dict(os.environ, DS_ACCELERATOR="cpu"),
                             capture_output=True,
                             text=True,
                             timeout=120)
    assert command.stdout.splitlines() == hang_report.merge(reports) + lines, command.stdout


def test_zero3_forward_collective_on_one_rank(tmp_path):
    """ZeRO-3, 2 ranks: after the ranks agreed on the fetch schedule (step 0), rank 0 all-reduces in the forward
    of the model's third module at step 2 and rank 1 goes on into ZeRO's reductions. Each rank's line says
    where it stands in the schedule: replaying it, and, for rank 0, the event the schedule has next there."""
    reports, _ = _run_until_reported(tmp_path, "zero3_forward_collective", 2, world_size=2)
    verdict = hang_report.merge(reports)
    assert len(verdict) == 2, verdict
    assert verdict[0].startswith("rank 0: in the torch collective all_reduce [4 torch.float32] on ranks [0, 1] "
                                 f"called in the model at worker.py:{_line_of('FORWARD COLLECTIVE')}"), verdict
    assert re.search(r"; ZeRO-3 fetch schedule: replaying, event \d+ of \d+, next: end of the forward of 2$",
                     verdict[0]), verdict
    assert verdict[1].startswith("rank 1: reduce_scatter_tensor ") and "; ZeRO-3 fetch schedule: replaying, event " \
        in verdict[1], verdict
    assert " issued at nvtx.py" not in verdict[1], verdict  # where ZeRO-3 issued it, not its profiling wrapper
    # the parameters of the bucket, and of the last fetch (hang-report-carried-params)
    assert re.search(r" on ranks \[0, 1\] for (\d\.(weight|bias), ){3}\d\.(weight|bias) \(4 parameters\) ",
                     verdict[1]), verdict
    assert re.search(r"the last DeepSpeed collective: all_gather_into_tensor for \d\.(weight|bias)",
                     verdict[0]), verdict
    state = json.loads((reports / "rank-0.json").read_text())["fetch_schedule"]
    assert state["next"][:2] == ["end of the forward of 2", "forward of 3"], state
    assert state["left"] is False and state["switches"] == 0 and state["forwards"] == 1, state


def test_the_collective_log_names_each_calling_line():
    """The collective log's entry on one process: the line that issued a collective (two call sites of one
    function stay two lines; a site seen again keeps its line), its tensors and group, and whether the model
    issued it."""
    reporter = hang_report.HangReporter()
    signature = inspect.signature(lambda tensor, group=None, async_op=False: None)

    def all_reduce(tensor, group=None):  # stands in for deepspeed.comm's wrapper: the caller is above it
        return reporter.begin("all_reduce", signature, (tensor, ), {"group": group})

    first_line = inspect.currentframe().f_lineno + 3
    entries = []
    for _ in range(2):
        entries.append(all_reduce(torch.ones(2, 3)))
        entries.append(all_reduce(torch.ones(4, dtype=torch.bfloat16)))
    where = "test_hang_report.py:{} in test_the_collective_log_names_each_calling_line"
    assert [e["issued_at"] for e in entries] == [where.format(first_line), where.format(first_line + 1)] * 2
    assert [e["model_at"] for e in entries] == [e["issued_at"] for e in entries]  # the model's own collective
    assert all(e["by_model"] for e in entries)
    assert [e["tensors"] for e in entries] == [[[[2, 3], "torch.float32"]], [[[4], "torch.bfloat16"]]] * 2
    assert [e["index"] for e in entries] == [0, 1, 2, 3]
    reporter.end(entries[-1])
    json.dumps(entries)


def test_torch_collectives_are_logged_once(monkeypatch):
    """While a reporter runs, a collective the model calls through torch's own namespace is logged (marked so,
    with its calling line); the calls ``deepspeed.comm`` makes into torch, logged by ``deepspeed.comm``, are not
    logged twice; ``stop`` puts torch's function back, and a wrapper taken before logs nothing after it."""
    from torch import distributed as torch_dist
    calls = []

    def torch_all_reduce(tensor, op=None, group=None, async_op=False):  # torch's, without a process group
        calls.append(list(tensor.shape))

    monkeypatch.setattr(torch_dist, "all_reduce", torch_all_reduce)
    reporter = hang_report.HangReporter()
    monkeypatch.setattr(hang_report, "_reporter", reporter)
    reporter.log_torch_collectives()
    wrapped = torch_dist.all_reduce  # as deepspeed.comm's backend takes it while a reporter runs
    signature = inspect.signature(torch_all_reduce)

    def comm_all_reduce(tensor):  # stands in for deepspeed.comm: logs the op, then calls torch
        entry = reporter.begin("all_reduce", signature, (tensor, ), {})
        try:
            return torch_dist.all_reduce(tensor)
        finally:
            reporter.end(entry)

    try:
        line = inspect.currentframe().f_lineno + 1
        torch_dist.all_reduce(torch.ones(3))
        comm_all_reduce(torch.ones(5))
        torch_dist.all_reduce(torch.ones(7), group=None)
    finally:
        reporter.stop()
    monkeypatch.setattr(hang_report, "_reporter", None)
    wrapped(torch.ones(9))  # after stop: passes through, logs nothing
    assert torch_dist.all_reduce is torch_all_reduce and calls == [[3], [5], [7], [9]]
    log = list(reporter._log)
    assert [(e["op"], e["via"], e["tensors"][0][0]) for e in log] == [("all_reduce", "torch", [3]),
                                                                      ("all_reduce", None, [5]),
                                                                      ("all_reduce", "torch", [7])]
    assert log[0]["issued_at"] == f"test_hang_report.py:{line} in test_torch_collectives_are_logged_once", log[0]
    assert log[0]["by_model"] and log[0]["model_at"] == log[0]["issued_at"]


@pytest.mark.parametrize("called_as", ["distributed_c10d", "imported by name"])
def test_torch_collectives_by_other_names_are_logged(monkeypatch, called_as):
    """A collective called by its name in torch's ``distributed_c10d`` module (where torch defines it), or through
    a name a module bound before the log started (``from ... import broadcast``), is logged too, and put back by
    ``stop``."""
    from torch import distributed as torch_dist
    calls = []

    def torch_broadcast(tensor, src=0, group=None, async_op=False):  # torch's, without a process group
        calls.append(list(tensor.shape))

    monkeypatch.setattr(torch_dist.distributed_c10d, "broadcast", torch_broadcast)
    caller = torch_dist.distributed_c10d
    if called_as == "imported by name":
        monkeypatch.setattr(torch_dist, "broadcast", torch_broadcast)
        caller = types.ModuleType("a_model_module")
        caller.broadcast = torch_dist.broadcast  # bound before the log starts
        monkeypatch.setitem(sys.modules, caller.__name__, caller)
    reporter = hang_report.HangReporter()
    monkeypatch.setattr(hang_report, "_reporter", reporter)
    reporter.log_torch_collectives()
    try:
        caller.broadcast(torch.ones(2), src=0)
    finally:
        reporter.stop()
    assert caller.broadcast is torch_broadcast and calls == [[2]]
    assert [(e["op"], e["via"], e["tensors"]) for e in reporter._log] == [("broadcast", "torch", [[[2],
                                                                                                   "torch.float32"]])]


def test_functional_collectives_are_logged(monkeypatch):
    """A functional collective (torch's ``_functional_collectives``, what ``torch.compile`` traces) called in eager
    mode is logged with its group's ranks, and put back by ``stop``."""
    from torch import distributed as torch_dist
    functional = importlib.import_module(f"{torch_dist.__name__}._functional_collectives")
    calls = []

    def torch_all_reduce(self, reduceOp, group, tag=""):  # torch's, without a process group
        calls.append(list(self.shape))
        return self

    monkeypatch.setattr(functional, "all_reduce", torch_all_reduce)
    reporter = hang_report.HangReporter()
    monkeypatch.setattr(hang_report, "_reporter", reporter)
    reporter.log_torch_collectives()
    try:
        functional.all_reduce(torch.ones(2), "sum", [0, 1])
        functional.all_reduce(torch.ones(3), "sum", group=[2, 3])
    finally:
        reporter.stop()
    assert functional.all_reduce is torch_all_reduce and calls == [[2], [3]]
    assert [(e["op"], e["via"], e["tensors"], e["group"])
            for e in reporter._log] == [("all_reduce", "torch", [[[2], "torch.float32"]], [0, 1]),
                                        ("all_reduce", "torch", [[[3], "torch.float32"]], [2, 3])]


def test_torch_compile_graphs_stay_whole(monkeypatch, tmp_path):
    """While the log runs, a function ``torch.compile`` traces that calls a functional collective keeps one graph:
    the log's wrapper steps aside while the compiler traces (the collective goes into the graph, not the log);
    called eagerly, the same function's collective is logged."""
    from torch import distributed as torch_dist
    functional = importlib.import_module(f"{torch_dist.__name__}._functional_collectives")
    torch_dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    reporter = hang_report.HangReporter()
    monkeypatch.setattr(hang_report, "_reporter", reporter)

    def f(t):
        return functional.all_reduce(t * 2, "sum", torch_dist.group.WORLD) + 1

    try:
        reporter.log_torch_collectives()
        torch._dynamo.reset()
        explained = torch._dynamo.explain(f)(torch.ones(3))
        eager = f(torch.ones(3))
    finally:
        reporter.stop()
        torch_dist.destroy_process_group()
    assert explained.graph_count == 1 and explained.graph_break_count == 0, explained.break_reasons
    assert eager.tolist() == [3.0, 3.0, 3.0] and [e["op"] for e in reporter._log] == ["all_reduce"]
    # deepspeed.comm's collectives ask ``active`` for the log: none while the compiler traces
    assert hang_report.active() is reporter
    monkeypatch.setattr(hang_report, "_compiling", lambda: True)
    assert hang_report.active() is None


def test_step_fingerprint_digest():
    """The lockstep check's digest of a step: equal for the same collectives, whatever the step before was,
    different when two collectives swap places or one is missing; the first ``keep`` entries are kept."""

    def entry(op, n):
        return dict(op=op, group=[0, 1], tensors=[[[n], "torch.float32"]], model_at=None, by_model=False)

    steps = [[entry("all_reduce", n) for n in range(5)]]
    steps.append(steps[0][:2] + [steps[0][3], steps[0][2]] + steps[0][4:])  # two swapped
    steps.append(steps[0][:-1])  # one missing
    fingerprint = hang_report.StepFingerprint(keep=2)
    digests = []
    for step in steps + steps[:1]:
        for e in step:
            fingerprint.add(e)
        digest, kept, count = fingerprint.take()
        assert (kept, count) == (step[:2], len(step))
        digests.append(digest)
    assert digests[0] == digests[3] and len(set(digests[:3])) == 3, digests


def test_collectives_carry_their_parameters(monkeypatch):
    """A collective issued inside ``carrying`` (a ZeRO-3 fetch, a gradient bucket) names the parameters it
    carries: how many, and the first three and the last, by their names in the engine's module, in a
    rank-invariant order (by ``ds_id`` for a set); a nested ``carrying`` gives way to the outer one when it
    ends. The lockstep check's digest differs when two collectives of the same sizes carry different
    parameters, and the first difference names them."""
    module = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(3)])
    params = list(module.parameters())  # 0.weight, 0.bias, 1.weight, ..., 2.bias
    for ds_id, param in enumerate(params):
        param.ds_id = ds_id
    reporter = hang_report.HangReporter()
    reporter.engine = type("Engine", (), {"module": module})()
    monkeypatch.setattr(hang_report, "_reporter", reporter)
    signature = inspect.signature(lambda tensor, group=None: None)

    def reduce(tensor):
        return reporter.begin("all_reduce", signature, (tensor, ), {})

    entries = [reduce(torch.ones(2))]
    with hang_report.carrying(params):  # a bucket
        entries.append(reduce(torch.ones(2)))
        with hang_report.carrying({params[3], params[1]}, ordered=False):  # a fetch of a set
            entries.append(reduce(torch.ones(2)))
        entries.append(reduce(torch.ones(2)))
    entries.append(reduce(torch.ones(2)))
    for e in entries:
        reporter.end(e)
    everything = [6, "0.weight", "0.bias", "1.weight", "2.bias"]
    assert [e["params"] for e in entries] == [None, everything, [2, "0.bias", "1.bias"], everything, None]
    assert hang_report._params(entries[1]) == " for 0.weight, 0.bias, 1.weight, ..., 2.bias (6 parameters)"

    fingerprint = hang_report.StepFingerprint()
    digests, kept = [], []
    for carried in (entries[1], entries[2]):  # the same op and sizes, other parameters
        fingerprint.add(entries[0])
        fingerprint.add(carried)
        digest, step, count = fingerprint.take()
        digests.append(digest)
        kept.append((step, count))
    assert digests[0] != digests[1]
    difference = hang_report.first_difference(kept)
    assert difference.startswith("collective #1 of the step differs: rank 0: all_reduce [2 torch.float32] on ranks "
                                 "None for 0.weight, 0.bias, 1.weight, ..., 2.bias (6 parameters)"), difference
    assert "rank 1: all_reduce [2 torch.float32] on ranks None for 0.bias, 1.bias (2 parameters)" in difference


class _Participant:
    """Fetches and reductions that do nothing (a ``ScheduleParticipant`` for one process)."""

    def __getattr__(self, name):
        return lambda *args, **kwargs: []


def test_fetch_schedule_describe():
    """``FetchSchedule.describe`` on one process: voting before a schedule is agreed, replaying after, with
    the next events named; where this rank left it; and a description that cannot be made is an error entry,
    not an exception (the hang report calls it from its watchdog thread)."""
    root, layer, extra = torch.nn.Sequential(), torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)
    for ds_id, module in enumerate((root, layer, extra)):
        module.ds_id = ds_id
    names = dict(zip(map(id, (root, layer, extra)), ("model", "layer", "extra")))
    schedule = FetchSchedule(_Participant(), _Participant(), [root, layer, extra], names=names)
    state = schedule.describe()
    assert (state["mode"], state["agreed"], state["next"]) == ("voting", False, []), state
    assert hang_report._schedule_position(dict(fetch_schedule=state)) == \
        "; ZeRO-3 fetch schedule: voting (no schedule agreed yet)"
    events = [(FWD_PRE, root), (FWD_PRE, layer), (FWD_POST, layer), (FWD_POST, root)]
    schedule.begin_forward(checked_at_end=False)
    for kind, module in events:
        schedule.hook(kind, module)
    schedule.end_forward()
    schedule.end_backward()
    schedule.adopt()
    schedule.begin_forward(checked_at_end=False)
    schedule.hook(FWD_PRE, root)
    state = schedule.describe()
    assert (state["mode"], state["cursor"], state["events"], state["recorded"]) == ("replaying", 1, 6, 1), state
    assert state["next"] == [
        "forward of layer", "end of the forward of layer", "end of the forward of model", "end of forward"
    ], state
    assert hang_report._schedule_position(dict(fetch_schedule=state)) == \
        "; ZeRO-3 fetch schedule: replaying, event 1 of 6, next: forward of layer"
    schedule.hook(FWD_PRE, extra)  # not in the schedule: this rank leaves it (and, alone, switches at once)
    state = schedule.describe()
    assert (state["mode"], state["left"], state["left_at"]) == ("voting", True, "the forward of extra"), state
    assert hang_report._schedule_position(dict(fetch_schedule=state)) == \
        "; ZeRO-3 fetch schedule: voting (switched this step), this rank left it at the forward of extra"
    json.dumps(state)
    schedule._modules = None  # as if a training thread replaced it meanwhile
    schedule._events, schedule._cursor = tuple(events), 0
    assert "error" in schedule.describe()


# fork-only: end

DYING = ["loader", "killed"]
# fork-only: begin
# a rank that dies of a fatal signal needs the hang report's follow-up patch (faulthandler), in another PR
DYING.append("aborted")
# fork-only: end


@pytest.mark.parametrize("scenario", DYING)
def test_a_rank_that_dies(tmp_path, scenario):
    """Over gloo the survivors' collectives fail once a peer is gone (over NCCL they would wait): either way
    the verdict names the rank that went first, and how."""
    reports, _ = _run_until_reported(tmp_path, scenario, WORLD_SIZE if scenario == "loader" else WORLD_SIZE - 1)
    verdict = hang_report.merge(reports)
    rank3 = [line for line in verdict if line.startswith("rank 3: ")]
    assert len(rank3) == 1, verdict
    if scenario == "loader":
        assert rank3[0].startswith("rank 3: exited: RuntimeError: the data loader failed on this rank (at worker.py:")
        assert "step 2" in rank3[0], verdict
        others = [line for line in verdict if not line.startswith("rank 3: ")]
        if any(": exited: " in line for line in others):  # gloo failed the survivors' collective after rank 3 left
            assert "the first rank to exit" in rank3[0], verdict
        else:  # they still wait in it (as over NCCL; gloo of torch 2.4 waits past the report's timeout)
            assert len(others) == 1 and others[0].startswith("ranks 0, 1, 2: all_reduce "), verdict
    elif scenario == "aborted":
        assert rank3[0].startswith("rank 3: died: Aborted (") and "the model at worker.py:" in rank3[0], verdict
    else:  # no word from rank 3 since its start
        assert "no report" in rank3[0] or "may have died since" in rank3[0], verdict
    others = [line for line in verdict if not line.startswith("rank 3: ")]
    assert all("step 2" in line and "the first rank to exit" not in line for line in others), verdict


# fork-only: begin
# (the withdrawal comes with the lockstep-check PR's hang report follow-ups)
@pytest.mark.parametrize("flight_recorder", [False, pytest.param(True, marks=needs_flight_recorder)],
                         ids=["report", "with_flight_recorder"])
def test_a_stall_report_is_withdrawn_when_progress_resumes(tmp_path, monkeypatch, flight_recorder):
    """A rank that stalled past the timeout (a slow start) and then went on must not leave its report behind:
    a later merge would read it as waiting there (and not as silent, had it died since without a word). The
    progress itself withdraws it: a rank that goes on and dies within the watchdog's poll (CI's
    ``test_a_rank_that_dies[killed]``, rank 3 slow in ``deepspeed.initialize``) must not leave it either. With
    PyTorch's flight recorder on, its dump written with the report goes too."""
    if flight_recorder:
        monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "100")
    reporter = hang_report.HangReporter()
    reporter.watch(str(tmp_path), timeout=0.2)
    try:
        deadline = time.monotonic() + 30
        while not list(tmp_path.glob("rank-*.json")) and time.monotonic() < deadline:
            time.sleep(0.05)
        reports = list(tmp_path.glob("rank-*.json"))
        assert len(reports) == 1, f"no report after a stall: {reports}"
        report = reports[0]
        dumps = list(tmp_path.glob(f"{hang_report.FLIGHT_RECORDER}/rank_*"))
        assert len(dumps) == int(flight_recorder), f"flight recorder dumps: {dumps}"
        reporter.step()  # progress: withdrawn by it, not at the watchdog's next poll (the rank may die before)
        assert not report.exists(), "the stall report stayed after progress resumed"
        assert not any(d.exists() for d in dumps), "the flight recorder's dump stayed after progress resumed"
        reporter.step()
        assert not list(tmp_path.glob("rank-*.json")), "a no-progress report came back without a stall"
    finally:
        reporter.stop()


@needs_flight_recorder
def test_a_report_appears_with_its_flight_recorder_dump(tmp_path, monkeypatch):
    """A reader (``merge``, the harness at a deadline, the test above) takes a rank's report as complete once
    it is on disk: the flight recorder's dump written with it must already be beside it. Each time the dump is
    written, the report must not be visible yet."""
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "100")
    visible_before_dump = []
    dump = hang_report._dump_flight_recorder

    def watched(directory, rank):
        visible_before_dump.append(sorted(p.name for p in tmp_path.glob("rank-*.json")))
        return dump(directory, rank)

    monkeypatch.setattr(hang_report, "_dump_flight_recorder", watched)
    reporter = hang_report.HangReporter()
    reporter.watch(str(tmp_path), timeout=600)
    try:
        path = reporter.write("asked")
    finally:
        reporter.stop()
    assert os.path.exists(path) and len(list(tmp_path.glob(f"{hang_report.FLIGHT_RECORDER}/rank_*"))) == 1
    assert visible_before_dump == [[]], f"the report was on disk before its dump: {visible_before_dump}"


# fork-only: end
