# Copyright (c) the DeepSpeed lockstep fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""`scripts/fork.py verify`: run the same tests against vanilla upstream and against the fork.

Vanilla upstream lives in its own venv (.cache/venv-upstream-<version>: torch==2.13.0 plus the pinned
sdist, hash-checked); the fork is the venv of the README's set-up (.venv) unless --fork-python says
otherwise. Each side runs pytest with a JUnit report; each test's outcome is read from the first line
of the harness's failure report (`[lockstep-harness] outcome: hang|mismatch|wrong result|...`).
The table shows whether a test reproduces a bug upstream and passes on the fork.
"""

import os
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

import patch_queue

TESTS = patch_queue.ROOT / "tests"
TEST_REQUIREMENTS = patch_queue.ROOT / "requirements-test.txt"
TORCH = "torch==2.13.0"
OUTCOME_PREFIX = "[lockstep-harness] outcome:"


def add_arguments(p):
    p.add_argument("tests", nargs="*", default=["tests/unit/runtime/zero"], help="pytest node ids or paths")
    p.add_argument("--upstream-python", help="python of an environment with vanilla deepspeed (default: own venv)")
    p.add_argument("--fork-python", help="python of an environment with the fork installed (default: .venv)")
    p.add_argument("-k", dest="keyword", help="pytest -k expression")
    p.add_argument("-m", dest="markexpr", help="pytest -m expression (replaces pytest.ini's default)")
    p.add_argument("--markdown", help="also write the table to this file")
    p.add_argument("--require-reproduction",
                   action="store_true",
                   help="exit 1 unless every test fails upstream and passes on the fork")


def upstream_python(pin):
    venv = patch_queue.CACHE / f"venv-upstream-{pin['version']}"
    python = venv / "bin" / "python"
    stamp = venv / ".lockstep-ready"
    if stamp.exists():
        return python
    sdist = patch_queue.obtain_sdist(pin)
    print(f"verify: creating {venv} (vanilla {pin['name']} {pin['version']}) ...", file=sys.stderr)
    steps = [[sys.executable, "-m", "venv", "--clear", str(venv)], [str(python), "-m", "pip", "install", "-q", TORCH],
             [str(python), "-m", "pip", "install", "-q",
              str(sdist), "-r", str(TEST_REQUIREMENTS)]]
    for cmd in steps:
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode != 0:
            tail = (p.stderr or p.stdout).strip().splitlines()[-1:]
            raise patch_queue.ForkError(f"creating the upstream venv failed at `{' '.join(cmd[-3:])}`: {tail}")
    stamp.write_text(pin["sdist_sha256"] + "\n")
    return python


def _version(python):
    p = subprocess.run([str(python), "-c", "import deepspeed; print(deepspeed.__version__)"],
                       capture_output=True,
                       text=True,
                       env=dict(os.environ, DS_ACCELERATOR=os.environ.get("DS_ACCELERATOR", "cpu")))
    if p.returncode != 0:
        raise patch_queue.ForkError(f"{python} cannot import deepspeed")
    return p.stdout.strip().splitlines()[-1]


def _outcome(case):
    if case.find("skipped") is not None:
        return "skip"
    bad = case.find("failure")
    if bad is None:
        bad = case.find("error")
    if bad is None:
        return "pass"
    text = (bad.get("message") or "") + "\n" + (bad.text or "")
    for line in text.splitlines():
        if OUTCOME_PREFIX in line:
            return line.split(OUTCOME_PREFIX, 1)[1].split(" - ", 1)[0].strip()
    return "wrong result" if "AssertionError" in text or "assert " in text else "error"


def _relative_to_tests(arg):
    """tests/unit/x.py::T::t (from the repo root or anywhere) -> unit/x.py::T::t (pytest runs in tests/)."""
    path, sep, rest = arg.partition("::")
    p = Path(path)
    if not p.is_absolute():
        p = (Path.cwd() / p) if (Path.cwd() / p).exists() else patch_queue.ROOT / p
    try:
        return str(p.resolve().relative_to(TESTS)) + sep + rest
    except ValueError:
        return arg


def _test_id(case):
    """unit.runtime.zero.test_x.TestX + test_y[a] -> test_x.py::TestX::test_y[a]."""
    parts = case.get("classname", "").split(".")
    module = next((i for i, part in enumerate(parts) if part.startswith("test_")), len(parts) - 1)
    return "::".join([parts[module] + ".py", *parts[module + 1:], case.get("name")])


def _digest_name(test_id):
    """The name lockstep_scenarios._record_digest gives a test's parameter digest."""
    return re.sub(r"[^A-Za-z0-9_.\[\]-]+", "_", test_id.split("::", 1)[-1]) + ".sha256"


def run_side(python, args, label, record_dir):
    """Run pytest with `python`; return {test id: outcome}. Tests that record a digest of their final
    parameters write it to record_dir."""
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "junit.xml"
        cmd = [str(python), "-m", "pytest", "-p", "no:cacheprovider", "-q", f"--junitxml={xml}"]
        cmd += [_relative_to_tests(t) for t in args.tests]
        if args.keyword:
            cmd += ["-k", args.keyword]
        if args.markexpr:
            cmd += ["-m", args.markexpr]
        print(f"verify: running against {label} ...", file=sys.stderr)
        env = dict(os.environ,
                   DS_ACCELERATOR=os.environ.get("DS_ACCELERATOR", "cpu"),
                   LOCKSTEP_RECORD_DIR=str(record_dir))
        subprocess.run(cmd, cwd=TESTS, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if not xml.exists():
            raise patch_queue.ForkError(f"pytest produced no report against {label}")
        return {_test_id(case): _outcome(case) for case in ET.parse(xml).getroot().iter("testcase")}


def table(rows, up_label, fork_label):
    """rows: (test, upstream outcome, fork outcome, same numbers)."""
    width = max([len(r[0]) for r in rows] + [4])
    lines = [
        f"| {'test':<{width}} | {up_label} | {fork_label} | same numbers | verdict |",
        f"|{'-' * (width + 2)}|---|---|---|---|"
    ]
    for name, up, mine, same in rows:
        if mine not in ("pass", "skip"):
            verdict = "FORK FAILS"
        elif up not in ("pass", "skip"):
            verdict = "reproduced, fixed"
        else:
            verdict = "passes on both"
        lines.append(f"| {name:<{width}} | {up} | {mine} | {same} | {verdict} |")
    return "\n".join(lines)


def _same_numbers(name, up, mine, up_dir, fork_dir):
    a, b = Path(up_dir, _digest_name(name)), Path(fork_dir, _digest_name(name))
    if up != "pass" or mine != "pass" or not a.exists() or not b.exists():
        return "-"
    return "identical" if a.read_text() == b.read_text() else "differ"


def run(args):
    pin = patch_queue.read_pin()
    up_python = Path(args.upstream_python) if args.upstream_python else upstream_python(pin)
    fork_python = Path(args.fork_python) if args.fork_python else patch_queue.ROOT / ".venv" / "bin" / "python"
    if not fork_python.exists():
        raise patch_queue.ForkError(f"{fork_python} not found: run the README's set-up first (or pass --fork-python)")
    up_version, fork_version = _version(up_python), _version(fork_python)
    if "+lockstep" in up_version:
        raise patch_queue.ForkError(f"{up_python} has the fork ({up_version}), not vanilla upstream")
    if "+lockstep" not in fork_version:
        raise patch_queue.ForkError(f"{fork_python} has deepspeed {fork_version}, not the fork")
    with tempfile.TemporaryDirectory() as up_dir, tempfile.TemporaryDirectory() as fork_dir:
        up = run_side(up_python, args, f"deepspeed {up_version}", up_dir)
        mine = run_side(fork_python, args, f"deepspeed {fork_version}", fork_dir)
        rows = [(name, up.get(name,
                              "-"), mine.get(name,
                                             "-"), _same_numbers(name, up.get(name), mine.get(name), up_dir, fork_dir))
                for name in sorted(set(up) | set(mine))]
    text = table(rows, f"upstream {up_version}", f"fork {fork_version}")
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")
    fork_ok = all(m in ("pass", "skip") for _, _, m, _ in rows)
    reproduced = all(u not in ("pass", "skip", "-") for _, u, _, _ in rows)
    if not rows:
        print("verify: no tests ran", file=sys.stderr)
        return 1
    if not fork_ok or (args.require_reproduction and not reproduced):
        return 1
    return 0
