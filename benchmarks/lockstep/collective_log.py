# Copyright (c) the DeepSpeed lockstep fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""What the hang report's collective log and the lockstep check cost per collective, on the host.

One process (gloo, world size 1) issues a small all-reduce through ``deepspeed.comm`` from a call stack of
``--depth`` frames of code that is not DeepSpeed's (the log walks the stack until it finds the model's frame,
so a deep model stack is the worst case), with the log off, with the hang report on, and with the report and
the lockstep check on. The three are interleaved, each timed ``--reps`` times over ``--calls`` calls; the best
repetition of each is reported, and the difference to "off" is what the log adds per collective.
Multiply by the collectives of a step (``bench.py`` counts them) to bound what it adds to a step.

    .venv/bin/python benchmarks/lockstep/collective_log.py [--depth 40] [--calls 2000] [--reps 7]
"""

import argparse
import os
import tempfile
import time


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--depth", type=int, default=40, help="frames of model code above the collective")
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--elements", type=int, default=1000)
    args = p.parse_args()

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29731")
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    import torch
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.utils import hang_report

    deepspeed.init_distributed(dist_backend="gloo")
    tensor = torch.ones(args.elements)

    def nest(depth, calls):  # model-like frames above the collective
        if depth > 0:
            return nest(depth - 1, calls)
        start = time.perf_counter()
        for _ in range(calls):
            dist.all_reduce(tensor)
        return time.perf_counter() - start

    directory = tempfile.mkdtemp(prefix="collective-log-")

    def configure(mode):
        hang_report.stop()
        if mode == "off":
            return
        reporter = hang_report.start(directory, timeout=3600)
        if mode == "report + check":
            os.environ["DS_LOCKSTEP_CHECK"] = "1"
            hang_report.lockstep_check()
        else:
            os.environ.pop("DS_LOCKSTEP_CHECK", None)
        return reporter

    modes = ["off", "report", "report + check"]
    best = {mode: float("inf") for mode in modes}
    for rep in range(args.reps + 1):  # the first repetition warms up
        for mode in (modes if rep % 2 == 0 else list(reversed(modes))):
            reporter = configure(mode)
            seconds = nest(args.depth, args.calls) / args.calls
            if reporter is not None and reporter.fingerprint is not None:
                reporter.fingerprint.take()  # a step: keeps the check's per-step list bounded as it is in training
            if rep > 0:
                best[mode] = min(best[mode], seconds)
    hang_report.stop()
    print(f"{args.elements}-element gloo all_reduce, world size 1, {args.depth} model frames above it, "
          f"best of {args.reps} x {args.calls} calls (torch {torch.__version__})")
    print("| log | us per collective | added us |")
    print("|---|---|---|")
    for mode in modes:
        print(f"| {mode} | {best[mode] * 1e6:.1f} | {(best[mode] - best['off']) * 1e6:+.1f} |")


if __name__ == "__main__":
    main()
