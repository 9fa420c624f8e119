# Copyright (c) the DeepSpeed lockstep fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The patch queue: the pinned upstream sdist, patches/ and the materialized tree/ (the library behind
scripts/fork.py, scripts/verify.py, scripts/upstream_pr.py and the build backend; it imports none of them).

Nothing of upstream is committed. upstream.toml pins the PyPI sdist by version and sha256;
patches/series lists our patches (git format-patch files, named by topic) in the order they apply; tree/ is
the sdist as a base commit (tag `upstream`) and one commit per patch, whose message carries its file's name in a
`Patch-Name:` trailer (added on import, removed on export: the files never hold it).

Offline: LOCKSTEP_SDIST=/path/to/deepspeed-<version>.tar.gz (the hash is still checked).
Only the standard library is used, so this runs before anything is installed.
"""

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PIN_FILE = ROOT / "upstream.toml"
PATCHES = ROOT / "patches"
SERIES = PATCHES / "series"
TREE = Path(os.environ.get("LOCKSTEP_TREE", ROOT / "tree"))
CACHE = Path(os.environ.get("LOCKSTEP_CACHE", ROOT / ".cache"))

BASE_TAG = "upstream"
BRANCH = "lockstep"
STATE_FILE = "lockstep-state.json"  # inside tree/.git
IDENTITY = ("DeepSpeed lockstep fork", "lockstep-fork@users.noreply.github.com")
LABEL = "lockstep"

# Files of the sdist that upstream's setup.py (re)writes at build time. They are left out of the
# base commit and ignored in the tree, so that building or installing never makes it look edited.
BUILD_OUTPUTS = [
    "/PKG-INFO",
    "/build.txt",
    "/deepspeed/git_version_info_installed.py",
    "*.egg-info/",
    "/build/",
    "/dist/",
    "/.eggs/",
    "__pycache__/",
    "*.pyc",
]

# In tree/'s commit messages only: the name (without .patch) of the file the commit exports to. A commit
# without it (a new one) is named after its subject; adding the trailer picks another name.
NAME_TRAILER = "Patch-Name"
SLUG_LENGTH = 60

FORMAT_PATCH = [
    "-c", "core.abbrev=12", "format-patch", "--no-numbered", "--zero-commit", "--no-signature", "--no-renames",
    "--stat=80"
]


class ForkError(Exception):
    """A failure with a one-line, user-facing reason."""


# --------------------------------------------------------------------------- pin and sdist


def read_pin(path=PIN_FILE):
    """Parse the flat `key = "value"` pin file (no TOML library needed)."""
    pin = {}
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r'([A-Za-z0-9_]+)\s*=\s*"([^"]*)"', line)
        if not m:
            raise ForkError(f"{path.name}:{lineno}: expected key = \"value\"")
        pin[m.group(1)] = m.group(2)
    for key in ("name", "version", "sdist", "sdist_sha256"):
        if key not in pin:
            raise ForkError(f"{path.name}: missing {key}")
    return pin


def sha256_of(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _check_hash(path, pin):
    got = sha256_of(path)
    if got != pin["sdist_sha256"]:
        raise ForkError(f"{path}: sha256 {got} does not match the pinned {pin['sdist_sha256']} "
                        f"({PIN_FILE.name}); this is not the {pin['name']} {pin['version']} sdist")


def _download(pin, dest):
    """Find the pinned file through the package index's simple API (PEP 691) and download it."""
    index = os.environ.get("LOCKSTEP_INDEX_URL", "https://pypi.org/simple").rstrip("/")
    hint = f"offline? set LOCKSTEP_SDIST=/path/to/{pin['sdist']}"
    try:
        req = urllib.request.Request(f"{index}/{pin['name']}/",
                                     headers={"Accept": "application/vnd.pypi.simple.v1+json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            files = json.load(r).get("files", [])
        urls = [f["url"] for f in files if f.get("hashes", {}).get("sha256") == pin["sdist_sha256"]]
        if not urls:
            raise ForkError(f"{index} lists no file of {pin['name']} with the pinned sha256 ({pin['sdist']})")
        tmp = dest.with_suffix(".part")
        with urllib.request.urlopen(urls[0], timeout=300) as r, open(tmp, "wb") as f:
            shutil.copyfileobj(r, f)
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        raise ForkError(f"cannot download {pin['sdist']} from {index} ({reason}); {hint}") from None
    _check_hash(tmp, pin)
    tmp.replace(dest)


def obtain_sdist(pin):
    """The pinned sdist: $LOCKSTEP_SDIST, else the cache, else PyPI. Always hash-checked."""
    local = os.environ.get("LOCKSTEP_SDIST")
    if local:
        path = Path(local)
        if not path.is_file():
            raise ForkError(f"LOCKSTEP_SDIST={local}: no such file")
        _check_hash(path, pin)
        return path
    cached = CACHE / "sdist" / pin["sdist"]
    if cached.is_file():
        if sha256_of(cached) == pin["sdist_sha256"]:
            return cached
        cached.unlink()  # a corrupt or stale download; fetch it again
    cached.parent.mkdir(parents=True, exist_ok=True)
    _download(pin, cached)
    return cached


# --------------------------------------------------------------------------- git helpers


def git(tree, *args, check=True, env=None, input=None):
    """Run git with a neutral configuration so outputs do not depend on the user's settings."""
    full_env = dict(os.environ)
    full_env.update({
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_CONFIG_GLOBAL": os.devnull,
        "GIT_COMMITTER_NAME": IDENTITY[0],
        "GIT_COMMITTER_EMAIL": IDENTITY[1],
        "GIT_AUTHOR_NAME": os.environ.get("GIT_AUTHOR_NAME", IDENTITY[0]),
        "GIT_AUTHOR_EMAIL": os.environ.get("GIT_AUTHOR_EMAIL", IDENTITY[1]),
        "LC_ALL": "C",
        "GIT_TERMINAL_PROMPT": "0",
    })
    full_env.update(env or {})
    p = subprocess.run(["git", "-C", str(tree), *args], capture_output=True, text=True, env=full_env, input=input)
    if check and p.returncode != 0:
        msg = (p.stderr or p.stdout).strip().splitlines()
        raise ForkError(f"git {args[0]} failed in {tree}: {msg[0] if msg else 'exit ' + str(p.returncode)}")
    return p


def read_series():
    if not SERIES.exists():
        return []
    names = [l.strip() for l in SERIES.read_text().splitlines()]
    names = [n for n in names if n and not n.startswith("#")]
    for n in names:
        if not n.endswith(".patch") or not (PATCHES / n).is_file():
            raise ForkError(f"patches/series lists {n}, which is not a .patch file in patches/")
    return names


def series_digest(directory, names):
    h = hashlib.sha256()
    for n in names:
        h.update(n.encode() + b"\0" + (Path(directory) / n).read_bytes() + b"\0")
    return h.hexdigest()


def read_state(tree):
    try:
        return json.loads((tree / ".git" / STATE_FILE).read_text())
    except (OSError, ValueError):
        return {}


def write_state(tree, pin, digest):
    state = {"sdist_sha256": pin["sdist_sha256"], "series_digest": digest}
    (tree / ".git" / STATE_FILE).write_text(json.dumps(state, indent=1) + "\n")


def uncommitted(tree):
    """Tracked files changed, and untracked files that are not ignored build outputs."""
    out = git(tree, "status", "--porcelain", "--untracked-files=all").stdout
    return [line[3:] for line in out.splitlines() if line.strip()]


def in_progress(tree):
    gitdir = tree / ".git"
    for name, what in (("rebase-apply", "git am/rebase"), ("rebase-merge", "git rebase"), ("MERGE_HEAD", "merge")):
        if (gitdir / name).exists():
            return what
    return None


def patch_subject(text):
    """The Subject: of a format-patch file, its folded continuation lines (RFC 5322) unfolded."""
    header = text.split("\n\n", 1)[0]
    m = re.search(r"^Subject: (.*(?:\n[ \t].*)*)", header, re.M)
    subject = re.sub(r"\n[ \t]+", " ", m.group(1)) if m else ""
    return re.sub(r"^\[PATCH[^\]]*\]\s*", "", subject)


def subject_slug(subject):
    """A file name stem for a commit that has no Patch-Name: trailer yet."""
    slug = re.sub(r"[^a-z0-9]+", "-", subject.lower()).strip("-")
    if len(slug) > SLUG_LENGTH:
        slug = slug[:SLUG_LENGTH].rsplit("-", 1)[0]
    return slug or "patch"


def _message_end(lines):
    """Indexes of the blank line that ends the mail header and of the '---' line that ends the message."""
    header_end = lines.index(b"")
    return header_end, lines.index(b"---", header_end) if b"---" in lines[header_end:] else None


def with_name_trailer(data, stem):
    """The patch (bytes) with `Patch-Name: <stem>` as the last paragraph of its message (what git am commits)."""
    lines = data.split(b"\n")
    header_end, sep = _message_end(lines)
    if sep is None:
        raise ForkError(f"{stem}.patch has no '---' line after its message")
    trailer = [f"{NAME_TRAILER}: {stem}".encode()]
    lines[sep:sep] = ([b""] if sep - 1 > header_end else []) + trailer
    return b"\n".join(lines)


def without_name_trailer(data):
    """(stem or None, the patch without its Patch-Name: trailer): the exact inverse of with_name_trailer."""
    lines = data.split(b"\n")
    header_end, sep = _message_end(lines)
    prefix = f"{NAME_TRAILER}: ".encode()
    if sep is None:  # an empty commit (export refuses it)
        return None, data
    last = sep - 1
    if last <= header_end or not lines[last].startswith(prefix):
        return None, data
    stem = lines[last][len(prefix):].decode().strip()
    del lines[last]
    if last - 1 > header_end and lines[last - 1] == b"":
        del lines[last - 1]
    return stem, b"\n".join(lines)


def export_to(tree, outdir):
    """git format-patch upstream..HEAD into outdir, each file named by its commit's Patch-Name: trailer (else
    by its subject) and without the trailer; returns the file names in order."""
    outdir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        out = git(tree, *FORMAT_PATCH, "-o", tmp, f"{BASE_TAG}..HEAD").stdout
        names = []
        for line in out.splitlines():
            if not line.strip():
                continue
            data = Path(line.strip()).read_bytes()
            stem, data = without_name_trailer(data)
            if stem is None:
                stem = subject_slug(patch_subject(data.decode(errors="replace")))
            if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", stem):
                raise ForkError(f"{NAME_TRAILER}: {stem!r} is not a file name (letters, digits, '.', '_', '-')")
            name = stem + ".patch"
            if name in names:
                raise ForkError(f"two commits export to {name}: give one of them another `{NAME_TRAILER}:` trailer "
                                f"in {tree.name}/ (git rebase -i {BASE_TAG}, reword)")
            (outdir / name).write_bytes(data)
            names.append(name)
    return names


def apply_series(tree, names, source_dir=PATCHES):
    for n in names:
        named = tree / ".git" / "lockstep-am.patch"
        named.write_bytes(with_name_trailer((source_dir / n).read_bytes(), n[:-len(".patch")]))
        p = git(tree, "am", "--keep-cr", "--committer-date-is-author-date", "-q", str(named), check=False)
        named.unlink()
        if p.returncode != 0:
            git(tree, "am", "--abort", check=False)
            detail = [l for l in (p.stderr + p.stdout).splitlines() if l.startswith(("error:", "fatal:"))]
            raise ForkError(f"patch {n} does not apply: {detail[0] if detail else 'git am failed'}")


# --------------------------------------------------------------------------- materialize


def _extract(sdist, pin, dest):
    prefix = f"{pin['name']}-{pin['version']}/"
    with tarfile.open(sdist) as tar:
        members = []
        for m in tar.getmembers():
            if not m.name.startswith(prefix) or m.name == prefix.rstrip("/"):
                continue
            m.name = m.name[len(prefix):]
            members.append(m)
        version_member = next(m for m in members if m.name == "version.txt")
        if hasattr(tarfile, "data_filter"):
            tar.extractall(dest, members=members, filter="data")
        else:
            tar.extractall(dest, members=members)
    return version_member.mtime


def materialize(tree, pin, sdist, names, source_dir=PATCHES):
    """Create tree/ from scratch: base commit of the sdist, tag `upstream`, then the series."""
    tree = Path(tree)
    staging = tree.with_name(tree.name + ".new")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        mtime = _extract(sdist, pin, staging)
        for pattern in BUILD_OUTPUTS:
            if not any(c in pattern for c in "*") and not pattern.endswith("/"):
                (staging / pattern.lstrip("/")).unlink(missing_ok=True)
        for egg in staging.glob("*.egg-info"):
            shutil.rmtree(egg)
        git(staging, "init", "-q", "-b", BRANCH)
        git(staging, "config", "core.abbrev", "12")
        (staging / ".git" / "info").mkdir(exist_ok=True)
        (staging / ".git" / "info" / "exclude").write_text("# build outputs of upstream's setup.py\n" +
                                                           "\n".join(BUILD_OUTPUTS) + "\n")
        git(staging, "add", "-A", "-f")
        date = f"@{mtime} +0000"
        msg = (f"{pin['name']} {pin['version']} from the PyPI sdist\n\n"
               f"sha256 {pin['sdist_sha256']}, unmodified except for the build outputs that\n"
               f"setup.py rewrites (PKG-INFO, build.txt, *.egg-info, git_version_info_installed.py).\n")
        git(staging,
            "commit",
            "-q",
            "--no-verify",
            "-m",
            msg,
            env={
                "GIT_AUTHOR_NAME": IDENTITY[0],
                "GIT_AUTHOR_EMAIL": IDENTITY[1],
                "GIT_AUTHOR_DATE": date,
                "GIT_COMMITTER_DATE": date
            })
        git(staging, "tag", BASE_TAG)
        apply_series(staging, names, source_dir)
        write_state(staging, pin, series_digest(source_dir, names))
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    shutil.rmtree(tree, ignore_errors=True)
    staging.rename(tree)


# --------------------------------------------------------------------------- tree state


class TreeState:
    """What tree/ holds relative to patches/ (computed by exporting into a scratch directory)."""

    def __init__(self, tree=TREE):
        self.tree = tree
        self.exists = (tree / ".git").is_dir()
        self.reason = None  # why the tree holds unexported work, or None
        self.behind = False  # patches/ moved on since the tree was synced (and the tree holds nothing new)
        self.n_commits = 0
        if not self.exists:
            return
        busy = in_progress(tree)
        if busy:
            self.reason = f"a {busy} is in progress in {tree.name}/"
            return
        dirty = uncommitted(tree)
        if dirty:
            shown = ", ".join(dirty[:3]) + (f" and {len(dirty) - 3} more" if len(dirty) > 3 else "")
            self.reason = f"{tree.name}/ has uncommitted edits ({shown}): commit them there, then export"
            return
        if git(tree, "rev-parse", "-q", "--verify", f"refs/tags/{BASE_TAG}", check=False).returncode != 0:
            self.reason = f"{tree.name}/ has no `{BASE_TAG}` tag; it was not made by scripts/fork.py sync"
            return
        with tempfile.TemporaryDirectory() as tmp:
            names = export_to(tree, Path(tmp))
            self.n_commits = len(names)
            tree_digest = series_digest(tmp, names)
        series = read_series()
        patches_digest = series_digest(PATCHES, series)
        synced_from = read_state(tree).get("series_digest")
        if tree_digest == patches_digest:
            return
        if tree_digest == synced_from:
            self.behind = True  # nothing new in the tree; patches/ changed (e.g. git pull)
        elif patches_digest == synced_from:
            self.reason = (f"{tree.name}/ has commits not exported to patches/ "
                           f"({self.n_commits} in tree, {len(series)} in series): run scripts/fork.py export")
        else:
            self.reason = (f"{tree.name}/ has commits not exported and patches/ changed since the last sync: "
                           f"compare `git -C {tree.name} log {BASE_TAG}..` with patches/series by hand")


# --------------------------------------------------------------------------- commands


def sync(discard=False, quiet=False):
    pin = read_pin()
    names = read_series()
    say = (lambda *a: None) if quiet else print
    state = TreeState()
    if state.exists and state.reason and not discard:
        raise ForkError(f"refusing to sync: {state.reason} (or pass --discard to throw it away)")
    if state.exists and read_state(TREE).get("sdist_sha256") == pin["sdist_sha256"]:
        if not state.reason and not state.behind:
            say(f"{TREE.name}/ is up to date: {pin['name']} {pin['version']} + {len(names)} patches")
            return TREE
        # Same base: rewind to it and re-apply, keeping ignored build outputs in place.
        git(TREE, "am", "--abort", check=False)
        git(TREE, "checkout", "-q", "-f", "-B", BRANCH, BASE_TAG)
        git(TREE, "clean", "-q", "-f", "-d")
        apply_series(TREE, names)
        write_state(TREE, pin, series_digest(PATCHES, names))
        say(f"{TREE.name}/ refreshed: {pin['name']} {pin['version']} + {len(names)} patches")
        return TREE
    sdist = obtain_sdist(pin)
    materialize(TREE, pin, sdist, names)
    say(f"{TREE.name}/ materialized: {pin['name']} {pin['version']} + {len(names)} patches")
    return TREE


def export():
    if not (TREE / ".git").is_dir():
        raise ForkError(f"no {TREE.name}/ to export; run scripts/fork.py sync")
    busy = in_progress(TREE)
    if busy:
        raise ForkError(f"a {busy} is in progress in {TREE.name}/; finish it first")
    dirty = uncommitted(TREE)
    if dirty:
        raise ForkError(f"{TREE.name}/ has uncommitted edits ({', '.join(dirty[:3])}): commit them first")
    old = read_series()
    with tempfile.TemporaryDirectory() as tmp:
        names = export_to(TREE, Path(tmp))
        empty = [n for n in names if b"\ndiff --git " not in (Path(tmp) / n).read_bytes()]
        if empty:
            raise ForkError(f"empty commit(s) would not apply ({', '.join(empty)}): drop them with "
                            f"`git rebase -i {BASE_TAG}` in {TREE.name}/")
        changed = []
        for n in names:
            new = (Path(tmp) / n).read_bytes()
            dest = PATCHES / n
            if not dest.exists() or dest.read_bytes() != new:
                dest.write_bytes(new)
                changed.append(n)
    removed = [n for n in old if n not in names]
    for n in removed:
        (PATCHES / n).unlink(missing_ok=True)
    for stray in PATCHES.glob("*.patch"):
        if stray.name not in names:
            stray.unlink()
    SERIES.write_text("".join(n + "\n" for n in names))
    write_state(TREE, read_pin(), series_digest(PATCHES, names))
    print(f"exported {len(names)} patches ({len(changed)} written, {len(removed)} removed) to patches/")
    for n in changed:
        print(f"  wrote {n}")
    for n in removed:
        print(f"  removed {n}")


def status():
    if not (TREE / ".git").is_dir():
        print(f"{TREE.name}/ is not materialized (scripts/fork.py sync creates it); nothing unexported")
        return 0
    state = TreeState()
    if state.reason:
        print(state.reason)
        return 1
    if state.behind:
        print(f"{TREE.name}/ holds nothing unexported but is behind patches/: run scripts/fork.py sync")
        return 0
    print(f"{TREE.name}/ matches patches/ ({state.n_commits} patches)")
    return 0


def check():
    pin = read_pin()
    names = read_series()
    listed = set(names)
    strays = sorted(p.name for p in PATCHES.glob("*.patch") if p.name not in listed)
    if strays:
        raise ForkError(f"patches/ holds files not in series: {', '.join(strays)}")
    sdist = obtain_sdist(pin)
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "tree"
        materialize(tree, pin, sdist, names)
        again = Path(tmp) / "export"
        exported = export_to(tree, again)
        if exported != names:
            raise ForkError(f"re-export names {exported} differ from series {names}: run sync + export")
        for n in names:
            if (again / n).read_bytes() != (PATCHES / n).read_bytes():
                raise ForkError(f"{n} applies but does not re-export byte for byte: run sync + export")
    print(f"ok: {len(names)} patches apply cleanly to {pin['name']} {pin['version']} "
          f"(sha256 {pin['sdist_sha256'][:12]}...) and re-export identically")
    return 0


def local_version():
    """The fork's version, e.g. 0.19.8+lockstep.3 (3 patches); `.wip` when tree/ holds unexported work."""
    pin = read_pin()
    state = TreeState()
    n = state.n_commits if state.exists else len(read_series())
    return f"{pin['version']}+{LABEL}.{n}" + (".wip" if state.reason else "")


def prepare_tree_for_build():
    """Used by the build backend: make sure tree/ exists and holds at least the series.

    Unexported work in tree/ is built as it is (that is what a developer iterating there wants);
    a stale tree/ with nothing new in it is brought up to date."""
    state = TreeState()
    if state.exists and state.reason:
        print(f"lockstep: building {TREE.name}/ as it is: {state.reason}", file=sys.stderr)
        return TREE
    if not state.exists or state.behind:
        sync(quiet=True)
    return TREE
