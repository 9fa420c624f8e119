# Copyright (c) the DeepSpeed lockstep fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""#7844: a ZeRO-3 run stuck in engine.step() at step 0. The testcase (zero3_7844.py) is shaped like the
report: six iterations, a route per step and rank, step_begin/step_end markers, a heartbeat and a watchdog.
Every rank must reach step_end of all six iterations within the deadline, with parameters identical across
ranks and equal to a plain-PyTorch reference."""

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


@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("variant", sorted(VARIANTS))
class TestZero3Issue7844(DistributedTest):
    world_size = 2
    exec_timeout = 60

    def test_six_iterations(self, variant, config):
        run_7844(variant, **CONFIGS[config])
