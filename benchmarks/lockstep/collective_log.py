# Copyright (c) the DeepSpeed lockstep fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""What the hang report's collective log and the lockstep check cost per collective, in a hot loop.

One process calls ``HangReporter.begin`` and ``end`` (what ``deepspeed.comm`` calls around each collective)
through a stand-in for the comm layer's wrapper, from a call stack of ``--depth`` frames of code that is not
DeepSpeed's (the log walks the stack until it finds the model's frame and DeepSpeed's; a model calling
``deepspeed.comm`` itself walks to the top: the worst case), with the lockstep check's digest on. No collective
is issued, so the time is the log's alone; the best of ``--reps`` repetitions of ``--calls`` calls is reported.
In a running job the same code runs cold, between the model's and ZeRO's work, and costs several times
more: ``worker.py --collective-log`` counts that.

    .venv/bin/python benchmarks/lockstep/collective_log.py [--depth 40] [--calls 2000] [--reps 5]
"""

import argparse
import inspect
import tempfile
import time


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--depth", type=int, default=40, help="frames of model code above the collective")
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()

    import torch
    from deepspeed.utils import hang_report

    reporter = hang_report.HangReporter()
    reporter.directory = tempfile.mkdtemp(prefix="collective-log-")  # no watchdog thread: the log alone
    reporter.fingerprint = hang_report.StepFingerprint()
    signature = inspect.signature(lambda tensor, op=None, group=None, async_op=False: None)
    tensor = torch.ones(1000)

    def all_reduce(tensor, group=None):  # stands in for deepspeed.comm's wrapper: the log reads the frame above it
        reporter.end(reporter.begin("all_reduce", signature, (tensor, ), {"group": group}))

    def nest(depth):
        if depth > 0:
            return nest(depth - 1)
        start = time.perf_counter()
        for _ in range(args.calls):
            all_reduce(tensor)
        return (time.perf_counter() - start) / args.calls

    best = float("inf")
    for rep in range(args.reps + 1):  # the first warms up
        seconds = nest(args.depth)
        reporter.fingerprint.take()  # a step
        if rep > 0:
            best = min(best, seconds)
    print(f"collective log and lockstep check, {args.depth} model frames above the collective, best of "
          f"{args.reps} x {args.calls} calls: {best * 1e6:.1f} us per collective ({hang_report.__file__})")


if __name__ == "__main__":
    main()
