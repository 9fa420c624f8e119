# Copyright (c) the DeepSpeed lockstep fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""pytest hooks that hand DistributedTest / DistributedFixture classes to the harness in unit/common.py."""

import os

import pytest

# The CPU accelerator reads these when it is first used; the harness sets them per rank as well.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_configure(config):
    config.option.durations = config.option.durations if config.option.durations is not None else 0
    config.option.durations_min = 1


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item):
    """Run DistributedTest methods on their ranks instead of in this process."""
    if getattr(item.cls, "is_dist_test", False):
        item.cls()(item._request)
        item.runtest = lambda: True  # already run on the ranks


@pytest.hookimpl(tryfirst=True)
def pytest_fixture_setup(fixturedef, request):
    if getattr(fixturedef.func, "is_dist_fixture", False):
        fixturedef.func()(request)
