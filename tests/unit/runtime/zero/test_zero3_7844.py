# Copyright (c) the DeepSpeed lockstep fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""#7844: a ZeRO-3 run stuck in engine.step() at step 0. The testcase (zero3_7844.py) is shaped like the
report: six iterations, a route per step and rank, step_begin/step_end markers, a heartbeat and a watchdog.
Every rank must reach step_end of all six iterations within the deadline, with parameters identical across
ranks and equal to a plain-PyTorch reference."""

import os  # fork-only
import pytest

from unit.common import DistributedTest
from unit.runtime.zero.zero3_7844 import VARIANTS, run_7844

CONFIGS = {
    "default": {},
    "rs0": dict(reduce_scatter=False),
    "contig0": dict(contiguous_gradients=False),
    "bucket300": dict(reduce_bucket_size=300),
    "bf16": dict(bf16=True),
}

# fork-only: begin (LOCKSTEP_GPU_REPEAT_INSIDE=N, for the GPU verify runs of docs/verify/gpu.md: each case N
# times in the same ranks, a fresh engine and model each time, every repetition against the same oracles)
REPEAT_INSIDE = int(os.environ.get("LOCKSTEP_GPU_REPEAT_INSIDE", "1"))
run_7844_once = run_7844


def run_7844(variant, **zero):
    for repetition in range(1, REPEAT_INSIDE + 1):
        if REPEAT_INSIDE > 1:
            print(f"repetition {repetition} of {REPEAT_INSIDE}", flush=True)  # in the rank's output on a hang
        try:
            run_7844_once(variant, **zero)
        except AssertionError as error:
            raise AssertionError(f"repetition {repetition} of {REPEAT_INSIDE}: {error}") from error
        except Exception as error:
            error.add_note(f"repetition {repetition} of {REPEAT_INSIDE}")
            raise


# fork-only: end


@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("variant", sorted(VARIANTS))
class TestZero3Issue7844(DistributedTest):
    world_size = 2
    exec_timeout = 60
    exec_timeout *= REPEAT_INSIDE  # fork-only

    def test_six_iterations(self, variant, config):
        run_7844(variant, **CONFIGS[config])
