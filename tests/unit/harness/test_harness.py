# Copyright (c) the DeepSpeed lockstep fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The harness's own tests: a planted hang is reported as a hang with every rank's stack within the
deadline, a rank exception is reported with its traceback and releases the other ranks, skips
propagate, no process outlives its test, and a hanging test fails without stopping the session."""

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
import torch

import deepspeed.comm as dist
from unit.common import DistributedTest, collective_from_stack, launch

DEADLINE = 15


def _sum_ranks():
    t = torch.ones(3) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    assert t.tolist() == [3.0, 3.0, 3.0]


def _planted_hang(pid_dir):
    """Rank 0 all-reduces on WORLD, rank 1 on a second group: each waits for the other forever.
    Each rank also starts a child process, which must not outlive the test either."""
    other = dist.new_group(ranks=[0, 1])
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    Path(pid_dir, f"{dist.get_rank()}.pid").write_text(f"{os.getpid()} {child.pid}")
    t = torch.ones(4)
    if dist.get_rank() == 0:
        dist.all_reduce(t)
    else:
        dist.all_reduce(t, group=other)


def _planted_exception():
    if dist.get_rank() == 1:
        raise ValueError("planted failure on rank 1")
    dist.all_reduce(torch.ones(2))  # rank 0 waits for a peer that is gone


def _planted_wrong_result():
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    assert t.item() == 0.0, f"sum of ranks is {t.item()}"


def _skip_everywhere():
    pytest.skip("nothing to do here")


def _alive(pid):
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_passing_run():
    result = launch(_sum_ranks, world_size=2, timeout=DEADLINE)
    assert result.outcome == "passed", result.report()


def test_planted_asymmetric_collective_is_reported_as_hang(tmp_path):
    t0 = time.time()
    result = launch(_planted_hang, world_size=2, kwargs={"pid_dir": str(tmp_path)}, timeout=DEADLINE)
    elapsed = time.time() - t0
    report = result.report()
    assert result.outcome == "hang", report
    assert elapsed < DEADLINE + 15, f"hang reported after {elapsed:.0f}s"
    assert [o.status for o in result.ranks] == ["hung", "hung"], report
    for o in result.ranks:
        assert "_planted_hang" in o.stack, report  # each rank's own Python stack
        assert o.collective.startswith("all_reduce"), report
        assert "test_harness.py" in o.collective, report  # and the call site that issued it
    assert report.count("stack (most recent call first)") == 2
    # no process outlives the test: not the ranks, not what they started
    pids = [int(p) for f in tmp_path.glob("*.pid") for p in f.read_text().split()]
    assert len(pids) == 4
    assert not [p for p in pids if _alive(p)], "processes left behind"


def test_rank_exception_is_reported_and_others_released():
    t0 = time.time()
    result = launch(_planted_exception, world_size=2, timeout=60)
    elapsed = time.time() - t0
    report = result.report()
    assert result.outcome == "error", report
    assert result.ranks[1].status == "failed" and result.ranks[1].exc_type == "ValueError"
    assert "planted failure on rank 1" in report and "_planted_exception" in result.ranks[1].traceback
    assert report.splitlines()[0].endswith("rank 1 raised ValueError: planted failure on rank 1")
    assert result.ranks[0].status in ("failed", "released"), report  # not left blocking
    assert elapsed < 30, f"took {elapsed:.0f}s: the surviving rank was not released"
    assert not [o.pid for o in result.ranks if _alive(o.pid)]


def test_assertion_on_a_rank_is_a_wrong_result():
    result = launch(_planted_wrong_result, world_size=2, timeout=DEADLINE)
    assert result.outcome == "wrong result", result.report()
    assert "sum of ranks is 1.0" in result.report()


def test_skip_propagates():
    result = launch(_skip_everywhere, world_size=2, timeout=DEADLINE)
    assert result.outcome == "skipped", result.report()
    assert all(o.message == "nothing to do here" for o in result.ranks)


def test_collective_from_stack():
    stack = textwrap.dedent("""\
        Thread 0x00007f (most recent call first):
          File "/usr/lib/python3.11/threading.py", line 320 in wait

        Current thread 0x00007e (most recent call first):
          File "/v/torch/distributed/distributed_c10d.py", line 2890 in all_reduce
          File "/v/torch/distributed/c10d_logger.py", line 81 in wrapper
          File "/v/deepspeed/comm/torch.py", line 215 in all_reduce
          File "/v/deepspeed/comm/comm.py", line 117 in log_wrapper
          File "/v/deepspeed/runtime/zero/stage_1_and_2.py", line 1180 in allreduce_bucket
          File "/t/test_x.py", line 5 in test_x
        """)
    assert collective_from_stack(stack) == "all_reduce <- runtime/zero/stage_1_and_2.py:1180 in allreduce_bucket"
    assert collective_from_stack("Current thread 0x1 (most recent call first):\n  File \"/a.py\", line 1 in f\n") == ""


class TestUpstreamApi(DistributedTest):
    """The upstream API surface: class world_size, the world_size mark, parametrize, class_tmpdir."""
    world_size = 2

    @pytest.mark.parametrize("value", [1, 2])
    def test_parametrized(self, value, class_tmpdir):
        assert int(os.environ["WORLD_SIZE"]) == dist.get_world_size() == 2
        t = torch.tensor([float(value)])
        dist.all_reduce(t)
        assert t.item() == 2 * value
        Path(class_tmpdir, f"rank{dist.get_rank()}-{value}").write_text("ok")

    @pytest.mark.world_size(3)
    def test_world_size_mark(self):
        assert dist.get_world_size() == 3


class TestWorldSizeList(DistributedTest):
    world_size = [1, 2]

    def test_each_size(self):
        assert dist.get_world_size() in (1, 2)


SESSION_FILE = '''
import torch
import deepspeed.comm as dist
from unit.common import DistributedTest


class TestSession(DistributedTest):
    world_size = 2
    exec_timeout = 10

    def test_hangs(self):
        if dist.get_rank() == 0:
            dist.all_reduce(torch.ones(1))

    def test_after_the_hang(self):
        t = torch.ones(1)
        dist.all_reduce(t)
        assert t.item() == 2
'''


def test_hang_fails_the_test_and_the_session_goes_on(tmp_path):
    tests_dir = Path(__file__).resolve().parents[2]
    (tmp_path / "test_session.py").write_text(SESSION_FILE)
    env = dict(os.environ,
               PYTHONPATH=os.pathsep.join([str(tests_dir), os.environ.get("PYTHONPATH", "")]),
               DS_TEST_KEEP_EXTENSIONS_DIR="1")  # reuse this session's built comm op
    p = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "conftest", "-p", "no:cacheprovider", "-q", "test_session.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240)
    out = p.stdout + p.stderr
    assert "1 failed, 1 passed" in out, out
    assert "outcome: hang" in out and "rank 0: hung in all_reduce" in out and "rank 1: hung in barrier" in out, out
