# Copyright (c) the DeepSpeed lockstep fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""scripts/fork.py on a scratch copy of the repository: sync -> edit -> commit -> export -> fresh sync
round-trips a patch, export is deterministic, status/sync protect unexported work, check passes."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def repo(tmp_path):
    root = tmp_path / "repo"
    for item in ("scripts", "patches", "upstream.toml", "requirements-test.txt"):
        src = REPO / item
        (shutil.copytree if src.is_dir() else shutil.copy)(src, root / item)
    # reuse the downloaded sdist when there is one (it is hash-checked either way)
    cache = REPO / ".cache"
    env = dict(os.environ, LOCKSTEP_CACHE=str(cache if cache.exists() else tmp_path / "cache"))
    env.pop("LOCKSTEP_TREE", None)

    def fork(*args, check=True):
        p = subprocess.run([sys.executable, str(root / "scripts" / "fork.py"), *args],
                           cwd=root,
                           env=env,
                           capture_output=True,
                           text=True)
        if check:
            assert p.returncode == 0, p.stdout + p.stderr
        return p

    def git(*args):
        return subprocess.run(["git", "-C", str(root / "tree"), *args],
                              check=True,
                              capture_output=True,
                              text=True,
                              env=dict(env,
                                       GIT_AUTHOR_NAME="t",
                                       GIT_AUTHOR_EMAIL="t@t",
                                       GIT_COMMITTER_NAME="t",
                                       GIT_COMMITTER_EMAIL="t@t")).stdout

    return root, fork, git


def test_round_trip(repo):
    root, fork, git = repo
    n_before = len((root / "patches" / "series").read_text().split())
    fork("sync")
    assert fork("status").returncode == 0
    version_file = root / "tree" / "deepspeed" / "runtime" / "zero" / "__init__.py"
    version_file.write_text(version_file.read_text() + "\n# lockstep round-trip test\n")

    dirty = fork("status", check=False)
    assert dirty.returncode == 1 and "uncommitted edits" in dirty.stdout
    refused = fork("sync", check=False)
    assert refused.returncode == 1 and "refusing to sync" in refused.stderr

    git("commit", "-q", "-a", "-m", "zero: a round-trip test patch")
    unexported = fork("status", check=False)
    assert unexported.returncode == 1 and "not exported" in unexported.stdout
    assert fork("version").stdout.strip().endswith(f"+lockstep.{n_before + 1}.wip")

    fork("export")
    series = (root / "patches" / "series").read_text().split()
    assert len(series) == n_before + 1 and series[-1] == "zero-a-round-trip-test-patch.patch"
    exported = {p.name: p.read_bytes() for p in (root / "patches").glob("*.patch")}
    assert fork("status").returncode == 0
    assert fork("version").stdout.strip().endswith(f"+lockstep.{n_before + 1}")

    # a fresh tree holds the patch, and exporting it again changes no byte
    shutil.rmtree(root / "tree")
    fork("sync")
    assert "round-trip test patch" in git("log", "-1", "--format=%s")
    assert "# lockstep round-trip test" in version_file.read_text()
    fork("export")
    assert {p.name: p.read_bytes() for p in (root / "patches").glob("*.patch")} == exported
    assert "ok:" in fork("check").stdout


def test_a_patch_inserted_mid_series_renames_no_other(repo):
    """Patches are named by topic, not by position: a commit inserted after the first patch exports to the name
    its Patch-Name: trailer gives, every other file keeps its name and bytes, and no file holds the trailer."""
    root, fork, git = repo
    before = (root / "patches" / "series").read_text().split()
    files = {n: (root / "patches" / n).read_bytes() for n in before}
    fork("sync")
    assert git("log", "-1", "--format=%(trailers:key=Patch-Name,valueonly)").strip() == before[-1][:-len(".patch")]
    first = git("rev-list", "--reverse", "upstream..HEAD").split()[0]
    git("checkout", "-q", "-b", "inserted", first)
    readme = root / "tree" / "README.md"
    readme.write_text(readme.read_text() + "\nan inserted patch\n")
    git("commit", "-q", "-a", "-m", "docs: an inserted patch\n\nWhy it is here.\n\nPatch-Name: docs-inserted")
    git("rebase", "-q", "--onto", "inserted", first, "lockstep")
    fork("export")
    after = (root / "patches" / "series").read_text().split()
    assert after == before[:1] + ["docs-inserted.patch"] + before[1:]
    assert {n: (root / "patches" / n).read_bytes() for n in before} == files
    assert b"Patch-Name" not in (root / "patches" / "docs-inserted.patch").read_bytes()
    assert "ok:" in fork("check").stdout

    # two commits that would export to one file: export refuses, naming the trailer to change
    readme.write_text(readme.read_text() + "\nagain\n")
    git("commit", "-q", "-a", "-m", "docs: again\n\nPatch-Name: docs-inserted")
    clash = fork("export", check=False)
    assert clash.returncode == 1 and "two commits export to docs-inserted.patch" in clash.stderr


def test_behind_tree_is_refreshed_not_refused(repo):
    root, fork, git = repo
    fork("sync")
    # someone else's patch arrives in patches/ (e.g. git pull): the tree holds nothing new, so it is
    # only behind, and sync brings it up to date
    readme = root / "tree" / "README.md"
    readme.write_text(readme.read_text() + "\nanother developer's change\n")
    git("commit", "-q", "-a", "-m", "docs: another developer's change")
    other = root.parent / "other"
    fork("export")
    shutil.copytree(root / "patches", other)
    git("reset", "-q", "--hard", "HEAD~1")
    fork("export")
    shutil.rmtree(root / "patches")
    shutil.copytree(other, root / "patches")
    status = fork("status")
    assert "behind" in status.stdout
    fork("sync")
    assert git("log", "-1", "--format=%s").strip() == "docs: another developer's change"


def test_empty_commit_is_refused_by_export(repo):
    root, fork, git = repo
    fork("sync")
    git("commit", "-q", "--allow-empty", "-m", "empty")
    p = fork("export", check=False)
    assert p.returncode == 1 and "empty commit" in p.stderr


def test_wrong_sdist_hash_is_one_clear_line(repo, tmp_path):
    root, fork, _ = repo
    bogus = tmp_path / "deepspeed-0.19.8.tar.gz"
    bogus.write_bytes(b"not the sdist")
    p = subprocess.run([sys.executable, str(root / "scripts" / "fork.py"), "sync"],
                       cwd=root,
                       env=dict(os.environ, LOCKSTEP_SDIST=str(bogus), LOCKSTEP_CACHE=str(tmp_path / "c")),
                       capture_output=True,
                       text=True)
    assert p.returncode == 1
    assert len(p.stderr.strip().splitlines()) == 1 and "does not match the pinned" in p.stderr
