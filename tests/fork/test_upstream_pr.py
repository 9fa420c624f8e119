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

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

import patch_queue  # noqa: E402
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


AUTHOR = "Jane Doe <jane.doe@users.noreply.github.com>"


def run_pr(*args):
    return subprocess.run([sys.executable, str(REPO / "scripts" / "fork.py"), "pr", *args],
                          cwd=REPO,
                          capture_output=True,
                          text=True)


def test_pr_refuses_without_a_real_author(tmp_path):
    p = run_pr("--out", str(tmp_path))
    assert p.returncode != 0 and "--author" in p.stderr
    for placeholder in ("Jane Doe <jane@example.org>", "A <a@b.example>", "Me <me@localhost>", "no email"):
        p = run_pr("--author", placeholder, "--out", str(tmp_path))
        assert p.returncode == 1 and p.stderr.startswith("fork.py pr: "), p.stderr
        assert "Traceback" not in p.stderr
    assert not any(tmp_path.iterdir())


def test_patch_subject_unfolds_a_wrapped_line():
    patch = (
        "From 0123 Mon Sep 17 00:00:00 2001\nFrom: Someone <a@b.c>\nSubject: [PATCH] ZeRO-3: a long subject that\n"
        " git format-patch wrapped\n\nBody.\n---\n")
    assert upstream_pr.patch_subject(patch) == "ZeRO-3: a long subject that git format-patch wrapped"


def test_every_pr_applies_signed_and_clean(tmp_path):
    env = dict(os.environ)
    p = subprocess.run(
        [sys.executable,
         str(REPO / "scripts" / "fork.py"), "pr", "--author", AUTHOR, "--out",
         str(tmp_path / "pr")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True)
    assert p.returncode == 0, p.stdout + p.stderr
    folders = sorted((tmp_path / "pr").iterdir())
    fixes = [
        line for f in folders for line in (f / "DESCRIPTION.md").read_text().splitlines() if line.startswith("Fixes")
    ]
    assert len(fixes) == len(set(fixes)), fixes  # an issue is closed by one PR, not by whichever merges first
    assert len(folders) == len(upstream_pr.read_prs())
    for folder in folders:
        assert "problems: none" in (folder / "PROOF.md").read_text(), (folder / "PROOF.md").read_text()
        for patch in (folder / "patches").iterdir():
            assert f"Signed-off-by: {AUTHOR}" in patch.read_text()
        tests_patch = sorted((folder / "patches").iterdir())[-1].read_text()
        assert "Subject: [PATCH] tests: " in tests_patch, tests_patch[:400]
        description = (folder / "DESCRIPTION.md").read_text()
        assert "- - " not in description and ".patch`" not in description
        assert "pre-commit" not in description  # says which checks ran, not that hooks did
        assert "## Depends on" not in description or "- PR 0" in description
        for test in (folder / "tests").rglob("*.py"):
            assert "fork-only" not in test.read_text() and "lockstep fork" not in test.read_text()


def test_doc_fragments_go_where_their_first_line_says():
    page = ("### ZeRO\n\n***stage***: [integer]\n\n| Description | Default |\n| 0-3 | `0` |\n\n"
            "***other***: [boolean]\n\n| x | y |\n\n### Compression\ntext\n")
    after = "<!-- into docs/_pages/config-json.md, after: ***stage*** -->\n\n***new_key***: [boolean]\n\n| a | b |\n"
    before = "<!-- into docs/_pages/config-json.md, before: ### Compression -->\n\n### New section\n\nbody\n"
    out = upstream_pr.insert_fragment(upstream_pr.insert_fragment(page, after), before)
    assert out.index("***stage***") < out.index("| 0-3 |") < out.index("***new_key***") < out.index("***other***")
    assert out.index("| x | y |") < out.index("### New section") < out.index("### Compression")
    assert "<!--" not in out
    # a later PR's fragment in place of the block an earlier one added
    replace = "<!-- into docs/_pages/config-json.md, replace: ***new_key*** -->\n\n***new_key***: [string]\n\n| c | d |\n"
    changed = upstream_pr.insert_fragment(out, replace)
    assert "| a | b |" not in changed and "[boolean]\n\n| a" not in changed
    assert changed.index("| 0-3 |") < changed.index("***new_key***: [string]") < changed.index("| c | d |")
    assert changed.index("| c | d |") < changed.index("***other***") and changed.count("***new_key***") == 1
    with pytest.raises(patch_queue.ForkError, match="no line starting with"):
        upstream_pr.insert_fragment(page, "<!-- into p.md, before: ### Missing -->\nx\n")
    # every fragment a PR lists says where it goes
    for pr in upstream_pr.read_prs():
        upstream_pr.docs_pages(pr)
