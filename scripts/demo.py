#!/usr/bin/env python3
# Copyright (c) the DeepSpeed lockstep fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The fork's main job, shown end to end: train a tiny LLaVA-like model with ZeRO on several CPU ranks
(gloo) and report, per scenario and stage, whether every rank finished every step within the deadline,
whether the parameters are identical across ranks, and how far they are from a plain-PyTorch reference.

Then the #7844 testcase (ZeRO-3, 2 ranks, six iterations, a route per step and rank, step_begin/step_end
markers, a heartbeat and a watchdog): every rank must print step_end for all six iterations.

Runs through the test harness (tests/unit/common.py), so a hang is reported with every rank's stack
instead of blocking. Scenarios are in tests/unit/runtime/zero/lockstep_scenarios.py and zero3_7844.py.
"""

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")


def run_scenario(scenario, stage, steps, gas, out):
    """Runs on every rank."""
    import json
    import deepspeed.comm as dist
    from unit.runtime.zero.lockstep_scenarios import check_lockstep, zero_config
    summary = check_lockstep(scenario, zero_config(stage, gradient_accumulation_steps=gas), steps=steps)
    Path(out, f"rank{dist.get_rank()}.json").write_text(json.dumps(summary))


def run_7844(variant, out):
    """Runs on every rank: the #7844 testcase, its markers written to rank<N>.log."""
    import json
    import deepspeed.comm as dist
    from unit.runtime.zero.zero3_7844 import run_7844
    rank = dist.get_rank()
    with open(Path(out, f"rank{rank}.log"), "w") as log:
        summary = run_7844(variant, out=log)
    Path(out, f"rank{rank}.json").write_text(json.dumps(summary))


def verdict_of(result, out, ok):
    """(rank summaries, verdict line) of one launch; `ok` is the verdict's text when every rank passed."""
    import json
    summaries = [json.loads(p.read_text()) for p in sorted(Path(out).glob("rank*.json"))]
    if result.outcome != "passed":
        return summaries, f"FAILED ({result.outcome})"
    diff = max(s["max_abs_diff_vs_reference"] for s in summaries)
    return summaries, f"OK: {ok}, max |param - reference| = {diff:.1e}"


DEFAULT_SCENARIOS = ["uniform", "llava_4933"]
DEFAULT_7844 = ["same_route", "inner_param", "rank_routes", "late_divergence", "conditional_vision"]


def main():
    import tempfile
    import deepspeed
    from unit.common import launch
    from unit.runtime.zero.lockstep_scenarios import SCENARIOS

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario",
                        choices=sorted(SCENARIOS),
                        action="append",
                        help="default: " + " ".join(DEFAULT_SCENARIOS))
    parser.add_argument("--stage",
                        type=int,
                        choices=[1, 2, 3],
                        action="append",
                        help="default: every stage the fork keeps in lockstep for the scenario")
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--gas", type=int, default=1, help="gradient accumulation steps")
    parser.add_argument("--deadline", type=float, default=120, help="seconds before a run counts as hung")
    parser.add_argument("--issue-7844",
                        action="append",
                        metavar="VARIANT",
                        help="#7844 testcase variants to run (default: " + " ".join(DEFAULT_7844) + "; 'none' skips)")
    parser.add_argument("--shape-7991",
                        action="store_true",
                        help="the #7991 shape instead: 16 ranks, LLaVA-style param groups, a tiny group, "
                        "a branch two ranks take at step 9 (10 steps; a few minutes on 2 cores)")
    args = parser.parse_args()
    if args.shape_7991:
        args.scenario, args.world_size, args.steps = ["shape_7991"], 16, 10
        args.deadline = max(args.deadline, 600)

    print(f"deepspeed {deepspeed.__version__} from {Path(deepspeed.__file__).parent}")
    print(f"{args.world_size} CPU ranks (gloo), {args.steps} steps, gradient accumulation {args.gas}\n")
    rows, failures = [], 0
    for name in args.scenario or DEFAULT_SCENARIOS:
        print(f"{name}: {SCENARIOS[name].description}")
        for stage in args.stage or SCENARIOS[name].stages:
            out = tempfile.mkdtemp(prefix="lockstep-demo-")
            result = launch(run_scenario,
                            args.world_size,
                            kwargs=dict(scenario=name, stage=stage, steps=args.steps, gas=args.gas, out=out),
                            timeout=args.deadline)
            summaries, verdict = verdict_of(result, out, "identical on all ranks")
            finished = len(summaries)
            failures += result.outcome != "passed"
            rows.append((name, f"ZeRO-{stage}", f"{finished}/{args.world_size}", f"{result.elapsed:.1f}s", verdict))
            print(f"  ZeRO-{stage}  ranks finished {finished}/{args.world_size}  {verdict}", flush=True)
            if result.outcome != "passed":
                print("\n".join("      " + line for line in result.report().splitlines()[:12]))
    variants = [] if args.shape_7991 else [v for v in (args.issue_7844 or DEFAULT_7844) if v != "none"]
    if variants:
        print("\n#7844 testcase (ZeRO-3, 2 ranks, 6 iterations; heartbeat and watchdog on every rank)")
    for variant in variants:
        from unit.runtime.zero.zero3_7844 import ITERATIONS, VARIANTS
        out = tempfile.mkdtemp(prefix="lockstep-demo-7844-")
        result = launch(run_7844, 2, kwargs=dict(variant=variant, out=out), timeout=args.deadline)
        ends = {}
        for log in sorted(Path(out).glob("rank*.log")):
            ends[log.stem] = [line for line in log.read_text().splitlines() if line.endswith("-> step_end")]
        print(f"{variant}: {VARIANTS[variant].description}")
        for rank, lines in ends.items():
            print(f"  {rank}: {len(lines)}/{ITERATIONS} step_end: " +
                  " | ".join(line.split(" -> ")[0] for line in lines))
        summaries, verdict = verdict_of(result, out, f"step_end x{ITERATIONS} on every rank, identical")
        if result.outcome != "passed":
            failures += 1
            print("\n".join("      " + line for line in result.report().splitlines()[:12]))
        print(f"  {verdict}", flush=True)
        rows.append((f"#7844 {variant}", "ZeRO-3", f"{len(summaries)}/2", f"{result.elapsed:.1f}s", verdict))
    print()
    print("| scenario | stage | ranks finished | time | result |")
    print("|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print(f"\n{len(rows) - failures} of {len(rows)} runs: every rank finished every step with matching parameters"
          if not failures else f"\n{failures} of {len(rows)} runs FAILED")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
