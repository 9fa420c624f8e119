# Copyright (c) the DeepSpeed lockstep fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""scripts/fork.py pr: every patch of the series is in one PR, each PR's patches apply to the pinned release
after its dependencies with the given author and a Signed-off-by: trailer, and its tests go out without
fork-only code."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

import upstream_pr  # noqa: E402


def test_strip_fork_only():
    text = ("# Copyright (c) the DeepSpeed lockstep fork authors.\nimport os  # fork-only\nimport sys\n\n\n"
            "def kept():\n    return sys.argv\n\n\n# fork-only: begin\ndef gone():\n    return os\n# fork-only: end\n")
    out = upstream_pr.strip_fork_only(text)
    assert out == "# Copyright (c) The DeepSpeed Contributors.\nimport sys\n\n\ndef kept():\n    return sys.argv\n"


def test_signed_patch_sets_author_and_trailer():
    patch = ("From 0123 Mon Sep 17 00:00:00 2001\nFrom: Someone <a@b.c>\nDate: x\nSubject: [PATCH] s\n\n"
             "Body line.\n---\n f | 1 +\n")
    out = upstream_pr.signed_patch(patch, "Jane Doe", "jane@example.org")
    assert "From: Jane Doe <jane@example.org>\n" in out
    assert "Body line.\n\nSigned-off-by: Jane Doe <jane@example.org>\n\n---\n" in out


def test_every_pr_applies_signed_and_clean(tmp_path):
    env = dict(os.environ)
    p = subprocess.run([
        sys.executable,
        str(REPO / "scripts" / "fork.py"), "pr", "--author", "Jane Doe <jane@example.org>", "--out",
        str(tmp_path / "pr")
    ],
                       cwd=REPO,
                       env=env,
                       capture_output=True,
                       text=True)
    assert p.returncode == 0, p.stdout + p.stderr
    folders = sorted((tmp_path / "pr").iterdir())
    assert len(folders) == len(upstream_pr.read_prs())
    for folder in folders:
        assert "problems: none" in (folder / "PROOF.md").read_text(), (folder / "PROOF.md").read_text()
        for patch in (folder / "patches").iterdir():
            assert "Signed-off-by: Jane Doe <jane@example.org>" in patch.read_text()
        for test in (folder / "tests").rglob("*.py"):
            assert "fork-only" not in test.read_text() and "lockstep fork" not in test.read_text()
