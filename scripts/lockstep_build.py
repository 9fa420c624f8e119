# Copyright (c) the DeepSpeed lockstep fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""PEP 517/660 in-tree build backend: upstream DeepSpeed + patches/, built by upstream's setup.py.

Every hook first makes sure tree/ is materialized (scripts/patch_queue.py), then runs setuptools'
legacy backend with tree/ as the working directory, so that upstream's setup.py, its package
list, scripts (`deepspeed`, `ds_report`, ...) and requirements are used unchanged. The version
gets the fork's local label through upstream's own DS_BUILD_STRING mechanism
(0.19.8 -> 0.19.8+lockstep.N, N = number of patches). Failures (no network, a wrong sdist hash, a
patch that does not apply) stop the build with a one-line reason instead of a traceback.
"""

import contextlib
import os
import sys

import patch_queue


@contextlib.contextmanager
def _in_tree():
    try:
        tree = patch_queue.prepare_tree_for_build()
        version = patch_queue.local_version()
    except patch_queue.ForkError as e:
        raise SystemExit(f"lockstep build: {e}") from None
    os.environ["DS_BUILD_STRING"] = version[version.index("+"):]
    old = os.getcwd()
    os.chdir(tree)
    sys.path.insert(0, str(tree))  # setup.py imports its own accelerator/ and op_builder/
    try:
        from setuptools import build_meta
        yield build_meta.__legacy__
    finally:
        sys.path.remove(str(tree))
        os.chdir(old)


def _absolute(path):
    return os.path.abspath(path) if path else path


def get_requires_for_build_wheel(config_settings=None):
    with _in_tree() as backend:
        return backend.get_requires_for_build_wheel(config_settings)


def get_requires_for_build_sdist(config_settings=None):
    with _in_tree() as backend:
        return backend.get_requires_for_build_sdist(config_settings)


def get_requires_for_build_editable(config_settings=None):
    with _in_tree() as backend:
        return backend.get_requires_for_build_editable(config_settings)


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    metadata_directory = _absolute(metadata_directory)
    with _in_tree() as backend:
        return backend.prepare_metadata_for_build_wheel(metadata_directory, config_settings)


def prepare_metadata_for_build_editable(metadata_directory, config_settings=None):
    metadata_directory = _absolute(metadata_directory)
    with _in_tree() as backend:
        return backend.prepare_metadata_for_build_editable(metadata_directory, config_settings)


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    wheel_directory, metadata_directory = _absolute(wheel_directory), _absolute(metadata_directory)
    with _in_tree() as backend:
        return backend.build_wheel(wheel_directory, config_settings, metadata_directory)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    wheel_directory, metadata_directory = _absolute(wheel_directory), _absolute(metadata_directory)
    with _in_tree() as backend:
        return backend.build_editable(wheel_directory, config_settings, metadata_directory)


def build_sdist(sdist_directory, config_settings=None):
    """An sdist of the *patched* DeepSpeed (its build.txt carries the local label)."""
    sdist_directory = _absolute(sdist_directory)
    with _in_tree() as backend:
        return backend.build_sdist(sdist_directory, config_settings)
