# Copyright (c) the DeepSpeed lockstep fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""A hang-proof distributed test harness with upstream DeepSpeed's `unit.common` API.

Test files written for upstream's harness run here unchanged: `DistributedTest` (class attributes
`world_size` int or list, `backend`, `init_distributed`, `set_dist_env`, `requires_cuda_env`,
`exec_timeout`, ...), `DistributedFixture`, `@pytest.mark.world_size(n)`, the `class_tmpdir` fixture
and the helpers (`preferred_dtype`, `reduce_boolean_flags`, `allclose_on_all_ranks`, ...).

What it adds:
- every test has a deadline (`exec_timeout`, default $DS_UNITTEST_TIMEOUT or 300 s). On expiry the
  test FAILS, the session goes on, and the report shows every rank's Python stack (faulthandler,
  taken while the rank is blocked) and the collective each rank was in;
- a rank that raises reports its traceback; the other ranks are given a short grace period to
  finish or fail, then their stacks are taken and they are killed, so nobody is left blocking;
- each rank runs in its own process group, killed whole: no process outlives its test;
- CPU runs use gloo with what DeepSpeed's CPU accelerator needs (LOCAL_SIZE, a private
  TORCH_EXTENSIONS_DIR whose shm comm op is built once per session before any deadline starts,
  OMP_NUM_THREADS=1); GPU runs use the accelerator's backend (NCCL) with one device per rank when
  there are enough devices, else gloo with the ranks sharing the devices (rank r on device
  r % count: its streams, events and caching allocator are real, so stream-order bugs show);
- ranks are forked from a forkserver that has torch and deepspeed imported, so a fresh set of
  processes per test costs milliseconds, not a re-import: no state leaks between tests.

Failures are classified (`hang`, `mismatch`, `wrong result`, `crash`, `error`) in the first line of
the report, `[lockstep-harness] outcome: <kind>`; scripts/verify.py reads that line.
"""

import faulthandler
import inspect
import json
import multiprocessing
import multiprocessing.connection
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import numpy as np
import pytest
import torch
from _pytest.fixtures import FixtureFunctionMarker, FixtureLookupError

import deepspeed
import deepspeed.comm as dist
from deepspeed.accelerator import get_accelerator

DEEPSPEED_TEST_TIMEOUT = int(os.environ.get("DS_UNITTEST_TIMEOUT", "300"))
# After the first rank fails, how long the others get to finish or fail on their own (gloo
# reports a closed peer within milliseconds; NCCL would block until killed).
RELEASE_GRACE = float(os.environ.get("DS_UNITTEST_RELEASE_GRACE", "5"))
OUTCOME_PREFIX = "[lockstep-harness] outcome:"
# Imported once in the forkserver, so ranks start with them loaded (each costs seconds per rank
# otherwise: DeepSpeed imports torch._dynamo lazily when it builds an engine). Missing ones are skipped.
PRELOAD = [
    "torch", "torch._dynamo", "torch.optim", "deepspeed", "deepspeed.comm", "deepspeed.runtime.engine",
    "deepspeed.runtime.zero.stage_1_and_2", "deepspeed.runtime.zero.stage3",
    "deepspeed.runtime.zero.muon.muon_optimizer", "unit.common"
]

# Messages by which backends report that ranks issued different collectives.
MISMATCH_PATTERNS = (
    "doesn't match expected size",
    "collective mismatch",
    "Detected mismatch between collectives",
    "op.preamble.length <= op.nbytes",
    "Detected a disagreement",
)
TIMEOUT_PATTERNS = ("Timed out", "timed out", "Connection reset", "DeadlineExceeded")


def is_rocm_pytorch():
    return hasattr(torch.version, "hip") and torch.version.hip is not None


def get_xdist_worker_id():
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    return int(worker.replace("gw", "")) if worker else None


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_master_port(base_port=29500, port_range_size=1000):
    """A free TCP port (upstream's name; here simply asked of the kernel)."""
    return str(_free_port())


def _on_cpu():
    return get_accelerator().device_name() == "cpu"


def device_placement(world_size, backend=None):
    """(backend, {rank: local device index}) for a launch of world_size ranks.

    On CPU: the given backend (gloo). With at least world_size devices: one device per rank and the
    accelerator's backend (NCCL). With fewer: gloo, and rank r shares device r % count with the others
    (NCCL cannot run two ranks on one device; gloo moves device tensors through host memory)."""
    backend = backend or get_accelerator().communication_backend_name()
    if _on_cpu() or not get_accelerator().is_available():
        return backend, {r: r for r in range(world_size)}
    count = get_accelerator().device_count()
    if count >= world_size:
        return backend, {r: r for r in range(world_size)}
    return "gloo", {r: r % count for r in range(world_size)}


# --------------------------------------------------------------------------- session set-up


class _Session:
    """Per-pytest-process state: the private extensions dir and the forkserver context."""
    context = None
    extensions_dir = None

    @classmethod
    def get_context(cls):
        if cls.context is not None:
            return cls.context
        if "TORCH_EXTENSIONS_DIR" in os.environ and os.environ.get("DS_TEST_KEEP_EXTENSIONS_DIR"):
            cls.extensions_dir = os.environ["TORCH_EXTENSIONS_DIR"]
        else:
            cls.extensions_dir = tempfile.mkdtemp(prefix="ds-test-torch-ext-")
        os.environ["TORCH_EXTENSIONS_DIR"] = cls.extensions_dir
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        if _on_cpu():
            _prebuild_cpu_comm_op()
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD + os.environ.get("DS_TEST_PRELOAD", "").split())
        warmup = ctx.Process(target=_noop)  # start the server (and its imports) before any deadline runs
        warmup.start()
        warmup.join()
        cls.context = ctx
        return ctx


def _prebuild_cpu_comm_op():
    """DeepSpeed's CPU backend JIT-builds its shm comm op inside init_distributed. Build it once here,
    outside any test's deadline, in a child process so this process does not load it."""
    code = ("from deepspeed.accelerator import get_accelerator\n"
            "b = get_accelerator().create_op_builder('ShareMemCommBuilder')\n"
            "b.load(verbose=False) if b is not None and b.is_compatible() else None\n")
    subprocess.run([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


# --------------------------------------------------------------------------- rank side


def _noop():
    pass


def _rank_main(spec):
    """Entry point of one rank (runs in a process forked from the forkserver)."""
    os.setpgid(0, 0)  # our own process group: the parent kills it whole
    workdir, rank = Path(spec["workdir"]), spec["rank"]
    log = open(workdir / f"rank{rank}.log", "w", buffering=1)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    stacks = open(workdir / f"rank{rank}.stack", "w")
    faulthandler.enable(file=stacks, all_threads=True)  # fatal signals (e.g. an abort inside gloo)
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)  # the parent's "where are you?"
    (workdir / f"rank{rank}.ready").touch()  # from now on SIGUSR1 dumps stacks instead of killing
    os.environ.update(spec["env"])
    result = {"rank": rank, "pid": os.getpid()}
    try:
        if _on_cpu():
            torch.set_num_threads(1)
        elif get_accelerator().is_available():
            get_accelerator().set_device(spec["device"])  # before init: DeepSpeed binds the group to it
        if spec["init_distributed"]:
            deepspeed.init_distributed(dist_backend=spec["backend"],
                                       init_method=f"file://{workdir}/filestore",
                                       rank=rank,
                                       world_size=spec["world_size"],
                                       timeout=timedelta(seconds=spec["pg_timeout"]),
                                       verbose=False)
        spec["func"](**spec["kwargs"])
        if spec["init_distributed"] and dist.is_initialized():
            dist.barrier()  # every rank finished the same collectives (an extra one shows up as a hang)
        result["status"] = "passed"
    except BaseException as e:  # noqa: B902 - report everything, including pytest outcomes
        if isinstance(e, pytest.skip.Exception):
            result.update(status="skipped", message=str(e.msg))
        else:
            result.update(status="failed",
                          exc_type=type(e).__name__,
                          assertion=isinstance(e, AssertionError),
                          message=str(e)[:4000],
                          traceback=traceback.format_exc())
    result["t_end"] = time.time()
    tmp = workdir / f"rank{rank}.json.tmp"
    tmp.write_text(json.dumps(result))
    tmp.rename(workdir / f"rank{rank}.json")
    if result["status"] == "skipped":
        # A rank that skips right after init must not close its connections while a peer is still setting up
        # the process group (gloo's connectFullMesh then fails on that peer): wait, bounded, for the others.
        deadline = time.time() + 30
        while time.time() < deadline and not all(
            (workdir / f"rank{r}.json").exists() for r in range(spec["world_size"])):
            time.sleep(0.05)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip interpreter teardown: it can block on a dead peer


# --------------------------------------------------------------------------- launcher side


@dataclass
class RankOutcome:
    rank: int
    status: str = "running"  # passed | skipped | failed | died | hung | released
    exc_type: str = ""
    assertion: bool = False
    message: str = ""
    traceback: str = ""
    exitcode: Optional[int] = None
    stack: str = ""
    log: str = ""
    collective: str = ""
    t_end: float = 0.0
    pid: int = 0


@dataclass
class LaunchResult:
    world_size: int
    deadline: float
    elapsed: float
    ranks: List[RankOutcome] = field(default_factory=list)
    timed_out: bool = False

    @property
    def outcome(self):
        return classify(self)

    @property
    def ok(self):
        return self.outcome in ("passed", "skipped")

    def report(self):
        return format_report(self)


_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')
_C10D_FILES = ("torch/distributed/distributed_c10d.py", )
_PLUMBING = ("torch/distributed/", "deepspeed/comm/", "deepspeed/utils/", "unit/common.py", "/threading.py")


def collective_from_stack(stack):
    """'all_reduce <- stage_1_and_2.py:1234 in allreduce_bucket' from a faulthandler dump, or ''.

    faulthandler lists the most recent call first; the main thread is the one marked current
    (the signal is handled there)."""
    blocks = re.split(r"\n(?=(?:Current thread|Thread) 0x)", stack)
    main = next((b for b in blocks if b.startswith("Current thread")), blocks[0] if blocks else "")
    frames = [m.groupdict() for m in map(_FRAME.match, main.splitlines()) if m]
    op = next((f for f in frames if f["file"].endswith(_C10D_FILES)), None)
    if op is None:
        return ""
    start = frames.index(op)
    caller = next((f for f in frames[start:] if not any(p in f["file"] for p in _PLUMBING)), None)
    where = ""
    if caller:
        short = "/".join(Path(caller["file"]).parts[-3:])
        where = f" <- {short}:{caller['line']} in {caller['func']}"
    return f"{op['func']}{where}"


def _read(path, limit=None):
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return ""
    if limit and text.count("\n") > limit:
        text = "...\n" + "\n".join(text.splitlines()[-limit:])
    return text


def _collect_stacks(procs, workdir, wait=3.0):
    """Ask every live rank for its stack (SIGUSR1 -> faulthandler) and wait for the dumps."""
    asked = []
    for r, p in enumerate(procs):
        if p.is_alive() and (workdir / f"rank{r}.ready").exists():
            try:
                os.kill(p.pid, signal.SIGUSR1)
                asked.append(r)
            except ProcessLookupError:
                pass
    end = time.time() + wait
    sizes = {}
    while asked and time.time() < end:
        time.sleep(0.1)
        now = {r: _size(workdir / f"rank{r}.stack") for r in asked}
        if all(now.values()) and now == sizes:
            break
        sizes = now


def _size(path):
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _kill(procs):
    for p in procs:
        if p.is_alive():
            for kill in (lambda: os.killpg(p.pid, signal.SIGKILL), lambda: os.kill(p.pid, signal.SIGKILL)):
                try:
                    kill()
                    break
                except (ProcessLookupError, PermissionError):
                    continue
    for p in procs:
        p.join(timeout=10)


def cleanup_shm(port):
    """Unlink the shared-memory buffers of DeepSpeed's CPU all-reduce of the job on ``port``: killed ranks
    leave them behind (69 MB each, in RAM)."""
    for f in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"):
        try:
            f.unlink()
        except OSError:
            pass


def launch(func: Callable,
           world_size: int,
           kwargs: Optional[Dict[str, Any]] = None,
           timeout: float = DEEPSPEED_TEST_TIMEOUT,
           backend: Optional[str] = None,
           init_distributed: bool = True,
           set_dist_env: bool = True,
           grace: float = RELEASE_GRACE) -> LaunchResult:
    """Run `func(**kwargs)` on `world_size` fresh ranks under a deadline; never raises for rank failures."""
    ctx = _Session.get_context()
    backend, devices = device_placement(world_size, backend)
    port = _free_port()
    workdir = Path(tempfile.mkdtemp(prefix="ds-dist-"))
    # Ranks get this process's environment as it is now (forkserver children would otherwise see the
    # server's, frozen at its start), plus what DeepSpeed's launcher would set.
    env = dict(os.environ)
    env.update({
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(world_size),
        "LOCAL_SIZE": str(world_size),
        "CROSS_RANK": "0",
        "CROSS_SIZE": "1",
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        "TORCH_EXTENSIONS_DIR": _Session.extensions_dir,
    })
    procs, outcomes = [], [RankOutcome(rank=r) for r in range(world_size)]
    start = time.time()
    for rank in range(world_size):
        # LOCAL_RANK is the device a rank uses (DeepSpeed's engine and init_distributed select it)
        rank_env = dict(env, RANK=str(rank), LOCAL_RANK=str(devices[rank])) if set_dist_env else dict(env)
        spec = dict(func=func,
                    device=devices[rank],
                    kwargs=kwargs or {},
                    rank=rank,
                    world_size=world_size,
                    workdir=str(workdir),
                    env=rank_env,
                    backend=backend,
                    init_distributed=init_distributed,
                    pg_timeout=max(timeout + 60, 120))
        p = ctx.Process(target=_rank_main, args=(spec, ), name=f"ds-rank{rank}", daemon=False)
        p.start()
        procs.append(p)

    deadline = start + timeout
    first_failure = None
    timed_out = False
    while True:
        for r, p in enumerate(procs):
            o = outcomes[r]
            if o.status != "running":
                continue
            res = workdir / f"rank{r}.json"
            if res.exists():
                data = json.loads(res.read_text())
                for k in ("status", "exc_type", "assertion", "message", "traceback", "t_end", "pid"):
                    if k in data:
                        setattr(o, k, data[k])
            elif not p.is_alive():
                p.join()
                o.status, o.exitcode, o.t_end = "died", p.exitcode, time.time()
            if o.status in ("failed", "died") and first_failure is None:
                first_failure = time.time()
        live = [p for p, o in zip(procs, outcomes) if o.status == "running" and p.is_alive()]
        if not live:
            break
        now = time.time()
        if now > deadline:
            timed_out = True
            status = "hung"
        elif first_failure is not None and now - first_failure > grace:
            status = "released"
        else:
            multiprocessing.connection.wait([p.sentinel for p in live], timeout=0.1)
            continue
        _collect_stacks(procs, workdir)
        for p, o in zip(procs, outcomes):
            if o.status == "running" and p.is_alive():
                o.status = status
        break
    _kill(procs)
    for r, (p, o) in enumerate(zip(procs, outcomes)):
        if o.exitcode is None:
            o.exitcode = p.exitcode
        o.pid = o.pid or p.pid
        o.stack = _read(workdir / f"rank{r}.stack")
        o.log = _read(workdir / f"rank{r}.log", limit=60)
        o.collective = collective_from_stack(o.stack)
    cleanup_shm(port)
    result = LaunchResult(world_size=world_size,
                          deadline=timeout,
                          elapsed=time.time() - start,
                          ranks=outcomes,
                          timed_out=timed_out)
    if result.ok:
        import shutil
        shutil.rmtree(workdir, ignore_errors=True)
    return result


def classify(result: LaunchResult) -> str:
    ranks = result.ranks
    if all(o.status == "passed" for o in ranks):
        return "passed"
    if all(o.status in ("passed", "skipped") for o in ranks):
        return "skipped"
    if result.timed_out:
        return "hang"
    text = "\n".join(o.message + o.log for o in ranks)
    if any(p in text for p in MISMATCH_PATTERNS):
        return "mismatch"
    failed = sorted((o for o in ranks if o.status in ("failed", "died")), key=lambda o: o.t_end)
    first = failed[0] if failed else None
    if first is not None and first.status == "failed" and first.assertion:
        return "wrong result"
    if any(o.status == "died" for o in ranks):
        return "crash"
    if first is not None and any(p in first.message for p in TIMEOUT_PATTERNS):
        return "hang"
    return "error"


def format_report(result: LaunchResult) -> str:
    kind = classify(result)
    ranks = result.ranks
    failed = sorted((o for o in ranks if o.status in ("failed", "died")), key=lambda o: o.t_end)
    if result.timed_out:
        n = sum(o.status == "hung" for o in ranks)
        head = f"deadline of {result.deadline:.0f}s expired with {n} of {result.world_size} ranks still running"
    elif failed:
        first = failed[0]
        what = (f"raised {first.exc_type}: {first.message.splitlines()[0] if first.message else ''}"
                if first.status == "failed" else f"died (exit code {first.exitcode})")
        head = f"rank {first.rank} {what}"
    else:
        head = "ranks disagree: " + ", ".join(f"rank {o.rank} {o.status}" for o in ranks)
    lines = [f"{OUTCOME_PREFIX} {kind} - {head}", ""]
    for o in ranks:
        where = f" in {o.collective}" if o.collective else ""
        detail = f": {o.exc_type}" if o.status == "failed" else ""
        lines.append(f"  rank {o.rank}: {o.status}{detail}{where}")
    order = failed + [o for o in ranks if o not in failed]  # the first failure first
    for o in order:
        if o.traceback:
            lines += ["", f"---- rank {o.rank} traceback ----", o.traceback.rstrip()]
        if o.stack.strip() and o.status in ("hung", "released", "died"):
            lines += ["", f"---- rank {o.rank} stack (most recent call first) ----", o.stack.rstrip()]
        if o.log.strip() and o.status != "passed":
            lines += ["", f"---- rank {o.rank} output (tail) ----", o.log.rstrip()]
    return "\n".join(lines)


def run_distributed(func, world_size, **launch_kwargs):
    """Run func on world_size ranks; turn anything but success into a pytest outcome."""
    result = launch(func, world_size, **launch_kwargs)
    if result.outcome == "passed":
        return result
    if result.outcome == "skipped":
        msgs = sorted({o.message for o in result.ranks if o.status == "skipped"})
        pytest.skip("; ".join(msgs))
    pytest.fail(result.report(), pytrace=False)


# --------------------------------------------------------------------------- upstream-compatible API


class DistributedExec(ABC):
    """Base of DistributedTest and DistributedFixture: runs `run` on `world_size` ranks."""
    world_size = 2
    backend = get_accelerator().communication_backend_name()
    init_distributed = True
    set_dist_env = True
    requires_cuda_env = True
    reuse_dist_env = False  # accepted for compatibility: ranks are always fresh (and cheap) here
    non_daemonic_procs = False  # accepted for compatibility: ranks are never daemonic here
    _pool_cache = {}
    exec_timeout = DEEPSPEED_TEST_TIMEOUT

    @abstractmethod
    def run(self):
        ...

    def __call__(self, request):
        self._fixture_kwargs = self._get_fixture_kwargs(request, self.run)
        if self.requires_cuda_env and not get_accelerator().is_available():
            pytest.skip("only supported in accelerator environments.")
        self._launch(self.world_size)

    def _get_fixture_kwargs(self, request, func):
        if not request:
            return {}
        kwargs = {}
        params = inspect.getfullargspec(func).args
        if "self" in params:
            params.remove("self")
        for p in params:
            try:
                kwargs[p] = request.getfixturevalue(p)
            except FixtureLookupError:
                pass  # test methods can have arguments that are not fixtures
        return kwargs

    def _launch(self, world_size):
        sizes = world_size if isinstance(world_size, (list, tuple)) else [world_size]
        for n in sizes:
            run_distributed(self._run_on_rank,
                            n,
                            timeout=self.exec_timeout,
                            backend=self.backend,
                            init_distributed=self.init_distributed,
                            set_dist_env=self.set_dist_env)

    def _run_on_rank(self):
        self.run(**self._fixture_kwargs)

    def _close_pool(self, pool, num_procs, force=False):
        """Compatibility no-op: there are no pools to close."""


class DistributedFixture(DistributedExec):
    """A fixture whose `run(self, ...)` executes on `world_size` ranks (one int world size only).

    Use it by naming the class as an argument of a test; results are passed through files
    (e.g. in `class_tmpdir`)."""
    is_dist_fixture = True

    # Placeholders so that pytest recognizes the class as a fixture.
    _pytestfixturefunction = FixtureFunctionMarker(scope="function", params=None)
    __name__ = ""

    def __init__(self):
        assert isinstance(self.world_size, int), "Only one world size is allowed for distributed fixtures"
        self.__name__ = type(self).__name__


class DistributedTest(DistributedExec):
    """Run each `test*` method of the class on `world_size` ranks.

    `world_size` may be an int or a list (each size runs in turn) and can be overridden per test with
    `@pytest.mark.world_size(n)` or a fixture/parameter named `world_size`. Fixtures, parametrize and
    marks work as usual; `pytest.skip` on the ranks skips the test; the deadline is `exec_timeout`."""
    is_dist_test = True

    @pytest.fixture(autouse=True, scope="class")
    def class_tmpdir(self, tmpdir_factory):
        return tmpdir_factory.mktemp(self.__class__.__name__)

    def run(self, **fixture_kwargs):
        self._current_test(**fixture_kwargs)

    def __call__(self, request):
        self._current_test = self._get_current_test_func(request)
        self._fixture_kwargs = self._get_fixture_kwargs(request, self._current_test)
        if self.requires_cuda_env and not get_accelerator().is_available():
            pytest.skip("only supported in accelerator environments.")
        mark = request.node.get_closest_marker("world_size")
        world_size = mark.args[0] if mark else self._fixture_kwargs.get("world_size", self.world_size)
        self._launch(world_size)

    def _get_current_test_func(self, request):
        return getattr(self, request.function.__name__)


# --------------------------------------------------------------------------- helpers used by tests


def get_test_path(filename):
    return str(Path(__file__).parent.joinpath(filename))


def preferred_dtype():
    """bf16 > fp16 > fp32, by what the accelerator supports."""
    if get_accelerator().is_bf16_supported():
        return torch.bfloat16
    if get_accelerator().is_fp16_supported():
        return torch.float16
    return torch.float32


class EnableDeterminism:
    """Seed python/numpy/accelerator RNGs (offset by the rank) and force deterministic kernels."""

    def __init__(self, seed: int):
        self.seed = seed + int(os.getenv("RANK", os.getenv("LOCAL_RANK", "0")))

    def __enter__(self):
        self._saved = (random.getstate(), np.random.get_state(), get_accelerator().get_rng_state(),
                       os.environ.get("CUDA_LAUNCH_BLOCKING",
                                      ""), os.environ.get("CUBLAS_WORKSPACE_CONFIG",
                                                          ""), torch.are_deterministic_algorithms_enabled())
        random.seed(self.seed)
        np.random.seed(self.seed)
        get_accelerator().manual_seed(self.seed)
        get_accelerator().manual_seed_all(self.seed)
        os.environ["CUDA_LAUNCH_BLOCKING"] = "1"
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":16:8"
        torch.use_deterministic_algorithms(True)

    def __exit__(self, *exc):
        py, np_state, acc, blocking, cublas, determ = self._saved
        random.setstate(py)
        np.random.set_state(np_state)
        get_accelerator().set_rng_state(acc)
        os.environ["CUDA_LAUNCH_BLOCKING"] = blocking
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = cublas
        torch.use_deterministic_algorithms(determ)


def enable_determinism(seed: int):

    def decorator(func: Callable) -> Callable:

        def wrapper(*args: Any, **kwargs: Any):
            with EnableDeterminism(seed):
                return func(*args, **kwargs)

        return wrapper

    return decorator


def reduce_boolean_flags(flag: bool, op=all) -> bool:
    """Gather one boolean per rank and combine them with `op` (all ranks get the same answer)."""
    if not dist.is_initialized():
        return flag
    device = get_accelerator().current_device_name()
    mine = torch.tensor(1 if flag else 0, dtype=torch.int, device=device)
    gathered = torch.zeros(dist.get_world_size(), dtype=torch.int, device=device)
    dist.all_gather_into_tensor(gathered, mine)
    return op(bool(f) for f in gathered.tolist())


def allclose_on_all_ranks(actual, expected, assert_message=None, **kwargs) -> None:
    """assert_close on every rank; all ranks fail together if any rank's comparison fails."""
    local_msg = ""
    try:
        torch.testing.assert_close(actual, expected, **kwargs)
        ok = True
    except AssertionError as e:
        ok, local_msg = False, str(e)
    if not reduce_boolean_flags(ok, all):
        raise AssertionError(assert_message
                             or f"tensors differ on some rank(s){': ' + local_msg if local_msg else ''}")
