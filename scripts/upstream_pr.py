# Copyright (c) the DeepSpeed lockstep fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""`scripts/fork.py pr`: the series cut into pull requests for upstream DeepSpeed (prs.toml), each written to a
folder ready to submit, and checked.

Per PR, in <out>/<nn>-<name>/:
  patches/       the PR's patches, with the author given (--author, required: a real identity) and a DCO
                 Signed-off-by: trailer, applying to the pinned release after the PRs it depends on; the last
                 patch adds its tests and their helpers at their upstream paths, without the fork-only lines
                 (those ending in `# fork-only`, and `# fork-only: begin` ... `# fork-only: end` blocks)
  tests/         the same tests as files, to read
  docs/          the upstream documentation fragments (docs/upstream/*), each naming the page it goes into;
                 with --upstream-repo, also as a diff of those pages (one more patch: docs/ is not in the sdist)
  DESCRIPTION.md the PR description: problem, fix (the patches' messages), tests, links, how it was checked
  PROOF.md       what the checks found

Checks (always): the PR's patches apply (`git am`) to the pinned release after its dependencies; the
stripped tests compile and hold no fork-only text; upstream's pre-commit checks (yapf, flake8, codespell with
the versions and settings of scripts/lint.sh, and scripts/precommit.py) over the files the PR adds or changes,
where .cache/venv-lint exists (`bash scripts/lint.sh` creates it); the description says which ran. With --upstream-repo (a clone of deepspeedai/DeepSpeed):
the tests run under upstream's own test harness (its tests/conftest.py, tests/pytest.ini, tests/unit/common.py
and util.py, copied from that clone into a scratch directory, never into this repository) on CPU ranks with
gloo, against the pinned release with the PR's patches and their dependencies.
"""

import os
import re
import shutil
import subprocess
import tempfile
import tomllib
from pathlib import Path

import patch_queue

ROOT = patch_queue.ROOT
PRS_FILE = ROOT / "prs.toml"
HARNESS = ("tests/conftest.py", "tests/pytest.ini", "tests/unit/__init__.py", "tests/unit/common.py",
           "tests/unit/util.py")
FORK_ONLY_LINE = re.compile(r".*#\s*fork-only\s*$")
# (DS_LOCKSTEP_CHECK is DeepSpeed's own switch for the lockstep check; the fork's variables start LOCKSTEP_)
FORK_ONLY_WORDS = [re.compile(w) for w in (r"fork-only", r"lockstep fork", r"(?<!DS_)LOCKSTEP_", r"scripts/fork\.py")]


def add_arguments(p):
    p.add_argument("names", nargs="*", help="PRs to write (default: all in prs.toml)")
    p.add_argument("--author",
                   required=True,
                   help='"Name <email>" of a real person: authorship and the Signed-off-by: trailer (DCO)')
    p.add_argument("--out", default=str(ROOT / ".cache" / "pr"), help="where the PR folders go")
    p.add_argument("--upstream-repo", help="a clone of deepspeedai/DeepSpeed: run the tests under its own harness")
    p.add_argument("--upstream-rev", default="HEAD", help="revision of --upstream-repo to take the harness from")


def read_prs():
    prs = tomllib.loads(PRS_FILE.read_text())["pr"]
    names = patch_queue.read_series()
    by_topic = {n[:-len(".patch")]: n for n in names}
    for pr in prs:
        for key in ("patches", "depends"):
            missing = [n for n in pr[key] if n not in by_topic]
            if missing:
                raise patch_queue.ForkError(f"prs.toml: {pr['name']} names patches not in the series: {missing}")
            pr[key] = [by_topic[n] for n in pr[key]]
    fixed = [issue for pr in prs for issue in pr["fixes"]]
    twice = sorted({issue for issue in fixed if fixed.count(issue) > 1})
    if twice:
        raise patch_queue.ForkError(
            f"prs.toml: {twice} in the `fixes` of more than one PR (the first merge would close it)")
    covered = sorted(n for pr in prs for n in pr["patches"])
    if covered != sorted(names):
        raise patch_queue.ForkError(f"prs.toml must put every patch of the series in exactly one PR; got {covered}")
    return prs


# domains reserved for examples and tests (RFC 2606, RFC 6761), and the fork's own placeholder identity
PLACEHOLDER_EMAIL = re.compile(r"@(.*\.)?(example(\.com|\.org|\.net)?|invalid|localhost|test|local)$", re.I)


def author_identity(given):
    """The PR's author, who signs the Developer Certificate of Origin: refused unless it names a real person."""
    m = re.fullmatch(r"\s*(.+?)\s*<([^<>@\s]+@[^<>\s]+)>\s*", given or "")
    if not m:
        raise patch_queue.ForkError(f'--author must look like "Name <email>", not {given!r}')
    name, email = m.group(1), m.group(2)
    if PLACEHOLDER_EMAIL.search(email) or email == patch_queue.IDENTITY[1]:
        raise patch_queue.ForkError(
            f"--author {given!r} is a placeholder: the Signed-off-by: trailer certifies the DCO, "
            "so it must name the person who submits the PR")
    return name, email


patch_subject = patch_queue.patch_subject


def signed_patch(text, name, email):
    """A format-patch file with its From: replaced and a Signed-off-by: trailer added to the message."""
    lines = text.split("\n")
    out, in_header, signed = [], True, False
    for line in lines:
        if in_header and line.startswith("From: "):
            line = f"From: {name} <{email}>"
        if in_header and line == "":
            in_header = False
        if not in_header and not signed and line == "---":
            while out and out[-1] == "":
                out.pop()
            out += ["", f"Signed-off-by: {name} <{email}>", ""]
            signed = True
        out.append(line)
    if not signed:
        raise patch_queue.ForkError("a patch has no '---' separator")
    return "\n".join(out)


def strip_fork_only(text):
    """The file as it goes upstream: fork-only lines and blocks left out, the copyright line neutral."""
    text = re.sub(r"^# Copyright \(c\) the DeepSpeed lockstep fork authors\.$",
                  "# Copyright (c) The DeepSpeed Contributors.",
                  text,
                  flags=re.M)
    out, skipping = [], False
    for line in text.splitlines():
        if re.search(r"#\s*fork-only:\s*begin", line):
            skipping = True
            continue
        if re.search(r"#\s*fork-only:\s*end", line):
            skipping = False
            continue
        if skipping or FORK_ONLY_LINE.match(line):
            continue
        out.append(line)
    text = "\n".join(out).rstrip("\n") + "\n"
    return re.sub(r"\n{4,}", "\n\n\n", text)


def prove_applies(pr, pin, sdist, patch_dir, tmp):
    tree = Path(tmp) / "tree"
    dep_dir = Path(tmp) / "deps"
    dep_dir.mkdir()
    for n in pr["depends"]:
        shutil.copy(patch_queue.PATCHES / n, dep_dir / n)
    for number, n in enumerate(pr["patches"], 1):
        shutil.copy(patch_dir / f"{number:04d}-{n}", dep_dir / n)
    patch_queue.materialize(tree, pin, sdist, pr["depends"] + pr["patches"], source_dir=dep_dir)
    return tree


def stripped_files(pr):
    """The PR's tests and helpers as upstream receives them: {upstream path: text}."""
    return {rel: strip_fork_only((ROOT / rel).read_text()) for rel in pr["tests"] + pr["helpers"]}


def author_env(author):
    """The environment that makes ``author`` (name, email) the author and committer of a commit."""
    name, email = author
    return {
        "GIT_AUTHOR_NAME": name,
        "GIT_AUTHOR_EMAIL": email,
        "GIT_COMMITTER_NAME": name,
        "GIT_COMMITTER_EMAIL": email
    }


def commit_files(tree, files, message, env):
    """Write ``files`` ({path: text}) into ``tree`` and commit them, signed off, with ``message``."""
    for rel, text in files.items():
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_text(text)
    patch_queue.git(tree, "add", "-f", *files)
    patch_queue.git(tree, "commit", "-q", "--no-verify", "--allow-empty", "-s", "-m", message, env=env)


def export_last_commit(tree, number, folder, env):
    """``tree``'s last commit as patch number ``number`` in ``folder``/patches; returns its file name."""
    out = patch_queue.git(tree,
                          *patch_queue.FORMAT_PATCH,
                          "-1",
                          "--start-number",
                          str(number),
                          "-o",
                          str(folder / "patches"),
                          env=env).stdout.strip()
    return Path(out.splitlines()[-1]).name


def commit_tests(pr, prs, tree, author, folder):
    """Add the PR's tests to its series as one more signed-off commit, after the stripped tests of the PRs it
    depends on (so that a helper they share is added once, and grown by a diff)."""
    env = author_env(author)
    message = f"tests: {pr['name']}\n\nThe tests of this change:\n\n" + "\n".join(f"- {rel}" for rel in pr["tests"])
    for files in [stripped_files(dep) for dep in depended_prs(pr, prs)] + [stripped_files(pr)]:
        commit_files(tree, files, message, env)
    return export_last_commit(tree, len(pr["patches"]) + 1, folder, env)


DOCS_TARGET = re.compile(r"<!-- into (\S+), (before|after|replace): (.+?) -->\n")
SECTION_STARTS = ("***", "<i>**", "### ", "#### ")  # where a key's block, or a section, of config-json.md ends


def insert_fragment(page, fragment):
    """``page`` (an upstream documentation page's text) with ``fragment`` (a docs/upstream/ file) put where its
    first line says: ``<!-- into PATH, before: LINE -->`` (before the line that starts with LINE), ``after:
    LINE`` (after the block that line opens: up to the next key or heading) or ``replace: LINE`` (in place of
    that block: a PR that changes what an earlier PR documented)."""
    match = DOCS_TARGET.match(fragment)
    where, anchor = match.group(2), match.group(3)
    body = fragment[match.end():].strip("\n") + "\n"
    lines = page.splitlines(keepends=True)
    at = next((i for i, line in enumerate(lines) if line.startswith(anchor)), None)
    if at is None:
        raise patch_queue.ForkError(f"{match.group(1)} has no line starting with {anchor!r}")
    end = next((i for i in range(at + 1, len(lines)) if lines[i].startswith(SECTION_STARTS)), len(lines))
    if where == "after":
        at = end
    return "".join(lines[:at]) + body + "\n" + "".join(lines[end if where == "replace" else at:])


def docs_pages(pr):
    """{upstream page: [the PR's fragments for it]}."""
    pages = {}
    for rel in pr["docs"]:
        text = (ROOT / rel).read_text()
        match = DOCS_TARGET.match(text)
        if match is None:
            raise patch_queue.ForkError(f"{rel}: its first line does not say where it goes (<!-- into ... -->)")
        pages.setdefault(match.group(1), []).append(text)
    return pages


def commit_docs(pr, prs, tree, author, folder, upstream_repo, rev, number):
    """The PR's documentation as a diff of upstream's pages (taken from ``upstream_repo`` at ``rev``, since the
    release's sdist has no docs/): the pages with the fragments of the PRs it depends on are committed as its
    base, then its own fragments as one more signed-off patch, numbered ``number``. Returns its file name, or
    None when the PRs it depends on bring every fragment it lists."""
    carried = {}
    for dep in depended_prs(pr, prs):
        for page, fragments in docs_pages(dep).items():
            carried.setdefault(page, []).extend(f for f in fragments if f not in carried.get(page, []))
    own = {}
    for page, fragments in docs_pages(pr).items():
        new = [f for f in fragments if f not in carried.get(page, [])]
        if new:
            own[page] = new
    if not own:
        return None  # the PRs it depends on bring its documentation
    pages = {}
    for page in own:
        shown = subprocess.run(["git", "-C", upstream_repo, "show", f"{rev}:{page}"], capture_output=True, text=True)
        if shown.returncode != 0:
            raise patch_queue.ForkError(f"{upstream_repo} has no {page} at {rev}")
        pages[page] = shown.stdout
        for fragment in carried.get(page, []):
            pages[page] = insert_fragment(pages[page], fragment)
    env = author_env(author)
    commit_files(tree, pages, f"docs: upstream's pages as of {rev}, with the PRs this one depends on", env)
    for page, fragments in own.items():
        for fragment in fragments:
            pages[page] = insert_fragment(pages[page], fragment)
    commit_files(tree, pages,
                 f"docs: {pr['name']}\n\nThe documentation of this change, in:\n\n" + "\n".join(f"- {p}" for p in own),
                 env)
    return export_last_commit(tree, number, folder, env)


def depended_prs(pr, prs):
    """The PRs of the series whose patches this PR applies after, in order."""
    return [other for other in prs if other is not pr and set(other["patches"]) & set(pr["depends"])]


def run_checks(folder, tree):
    """Upstream's pre-commit checks over the files the PR adds or changes, as scripts/lint.sh runs them; a
    list of (check, outcome) pairs, each saying whether it ran."""
    changed = [
        f for f in patch_queue.git(tree, "diff", "--name-only", "--diff-filter=AM", patch_queue.BASE_TAG,
                                   "HEAD").stdout.split() if (tree / f).is_file()
    ]
    py = [f for f in changed if f.endswith(".py")]
    venv = ROOT / ".cache" / "venv-lint" / "bin"
    results = []
    p = subprocess.run(["python3", str(ROOT / "scripts" / "precommit.py"), *changed],
                       cwd=tree,
                       capture_output=True,
                       text=True)
    results.append(("license, torchdist, torchcuda, hygiene (scripts/precommit.py)",
                    "ok" if p.returncode == 0 else "FAILED: " + p.stdout.strip().replace("\n", "; ")))
    tools = [
        ("yapf 0.40.0", [str(venv / "yapf"), "--style",
                         str(ROOT / ".style.yapf"), "--diff", *py]),
        ("flake8 5.0.4", [str(venv / "flake8"), "--config",
                          str(ROOT / ".flake8"), *py]),
        ("codespell 2.1.0",
         [str(venv / "codespell"), "--ignore-regex=\\\\n", "--ignore-words-list=youn,unsupport,noe,cann", *changed])
    ]
    for label, cmd in tools:
        if not Path(cmd[0]).exists():
            results.append((label, "not run (no .cache/venv-lint: `bash scripts/lint.sh` creates it)"))
            continue
        p = subprocess.run(cmd, cwd=tree, capture_output=True, text=True)
        results.append((label, "ok" if p.returncode == 0 else f"FAILED ({len(p.stdout.splitlines())} lines)"))
    return [(f"{label} on the {len(changed)} files the PR adds or changes", outcome) for label, outcome in results]


def run_under_upstream_harness(pr, tree, folder, upstream_repo, rev, tmp):
    run = Path(tmp) / "run"
    for rel in HARNESS:
        content = subprocess.run(["git", "-C", upstream_repo, "show", f"{rev}:{rel}"], capture_output=True)
        if content.returncode != 0:
            raise patch_queue.ForkError(f"{upstream_repo} has no {rel} at {rev}")
        (run / rel).parent.mkdir(parents=True, exist_ok=True)
        (run / rel).write_bytes(content.stdout)
    shutil.copytree(folder / "tests", run / "tests", dirs_exist_ok=True)
    python = ROOT / ".venv" / "bin" / "python"
    ext = Path(tmp) / "torch-extensions"
    env = dict(os.environ,
               PYTHONPATH=str(tree),
               DS_ACCELERATOR="cpu",
               LOCAL_SIZE="4",
               OMP_NUM_THREADS="1",
               TORCH_EXTENSIONS_DIR=str(ext))
    # upstream's harness gives a test its deadline (and ends the session when it expires) while the first
    # test JIT-builds DeepSpeed's CPU comm op: build it first, outside any deadline
    build = ("from deepspeed.accelerator import get_accelerator\n"
             "b = get_accelerator().create_op_builder('ShareMemCommBuilder')\n"
             "b.load(verbose=False) if b is not None and b.is_compatible() else None\n")
    subprocess.run([str(python), "-c", build], env=env, capture_output=True)
    tests = [str(Path(t).relative_to("tests")) for t in pr["tests"]]
    p = subprocess.run([str(python), "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rfEs", *tests],
                       cwd=run / "tests",
                       env=env,
                       capture_output=True,
                       text=True)
    lines = re.sub(r"\x1b\[[0-9;]*m", "", p.stdout + p.stderr).splitlines()  # upstream's conftest forces color
    summary = [l for l in lines if re.search(r"\d+ (passed|failed|skipped|error)", l)] or lines[-3:]
    failures = [l for l in lines if l.startswith(("FAILED", "ERROR"))]
    return p.returncode, summary[-1] if summary else "", failures


def write_pr(index, pr, prs, author, out, pin, sdist, upstream_repo, rev):
    name, email = author
    folder = Path(out) / f"{index:02d}-{pr['name']}"
    shutil.rmtree(folder, ignore_errors=True)
    (folder / "patches").mkdir(parents=True)
    messages = []
    for number, n in enumerate(pr["patches"], 1):  # numbered within the PR, as `git format-patch` numbers them
        text = signed_patch((patch_queue.PATCHES / n).read_text(), name, email)
        (folder / "patches" / f"{number:04d}-{n}").write_text(text)
        body = text.split("\n\n", 1)[1].split("\n---\n", 1)[0]
        messages.append((n, patch_subject(text), body.strip()))
    problems = []
    for rel, stripped in stripped_files(pr).items():
        target = folder / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(stripped)
        left = [
            getattr(w, "pattern", w) for w in FORK_ONLY_WORDS
            if (w.search(stripped) if hasattr(w, "search") else w in stripped)
        ]
        if left:
            problems.append(f"{rel}: fork-only text left after stripping: {left}")
        try:
            compile(stripped, rel, "exec")
        except SyntaxError as error:
            problems.append(f"{rel}: does not compile once stripped: {error}")
    for rel in pr["docs"]:
        target = folder / "docs" / Path(rel).name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, target)
    deps = depended_prs(pr, prs)
    checks = []
    with tempfile.TemporaryDirectory() as tmp:
        try:
            tree = prove_applies(pr, pin, sdist, folder / "patches", tmp)
            after = f" after the {len(deps)} PR(s) it depends on" if deps else ""
            checks.append((f"applies to {pin['name']} {pin['version']} (sdist sha256 {pin['sdist_sha256'][:12]}...)"
                           f"{after}", "yes"))
            tests_patch = commit_tests(pr, prs, tree, author, folder)
            checks.append((f"its tests as a patch ({tests_patch})", "yes"))
            checks += run_checks(folder, tree)  # (before the docs: upstream's whole pages are not ours to lint)
            if pr["docs"] and upstream_repo:
                docs_patch = commit_docs(pr, prs, tree, author, folder, upstream_repo, rev, len(pr["patches"]) + 2)
                checks.append((f"its documentation as a diff of upstream's pages at {rev}",
                               f"yes ({docs_patch}; it applies to upstream's repository, whose docs/ the release's "
                               "sdist lacks)" if docs_patch else "none of its own: the PRs it depends on bring it"))
            elif pr["docs"]:
                checks.append(("its documentation as a diff of upstream's pages",
                               "not made (no --upstream-repo): the fragments are in docs/"))
        except patch_queue.ForkError as error:
            problems.append(f"does not apply: {error}")
            tree = None
        if tree is not None and upstream_repo:
            code, summary, failures = run_under_upstream_harness(pr, tree, folder, upstream_repo, rev, tmp)
            checks.append((f"tests under upstream's harness ({upstream_repo} at {rev}; CPU, gloo, LOCAL_SIZE=4)",
                           (summary or "no summary") + "".join(f"; {f}" for f in failures)))
            if code not in (0, 5):
                problems.append(f"tests fail under upstream's harness: {summary}")
        elif tree is not None:
            checks.append(("tests under upstream's harness", "not run (no --upstream-repo)"))
    problems += [f"{check}: {outcome}" for check, outcome in checks if outcome.startswith("FAILED")]
    lines = [f"- {check}: {outcome}" for check, outcome in checks]
    proof = [f"# Checks for PR {index:02d} {pr['name']}", "", *lines]
    proof += [f"- problem: {p}" for p in problems] or ["- problems: none"]
    (folder / "PROOF.md").write_text("\n".join(proof) + "\n")
    description = [
        f"# {pr['title']}", "", *(f"Fixes {issue}" for issue in pr["fixes"]),
        *([f"Related: {', '.join(pr['refs'])}"] if pr["refs"] else []), "", "## Problem and fix", "",
        pr["summary"].strip(), "", "## Patches", ""
    ]
    for n, subject, body in messages:
        description += [f"### {subject}", "", body, ""]
    description += ["## Tests", ""]
    description += [f"- `{t}`" for t in pr["tests"]]
    if deps:
        description += ["", "## Depends on", ""]
        description += [
            f"- PR {prs.index(dep) + 1:02d} of this series, {dep['title']} (`{dep['name']}`)" for dep in deps
        ]
    description += ["", "## How it was checked", "", *lines]
    (folder / "DESCRIPTION.md").write_text("\n".join(description) + "\n")
    return folder, problems


def run(args):
    prs = read_prs()
    wanted = set(args.names) if args.names else {pr["name"] for pr in prs}
    unknown = wanted - {pr["name"] for pr in prs}
    if unknown:
        raise patch_queue.ForkError(f"no such PR in prs.toml: {sorted(unknown)}")
    author = author_identity(args.author)
    pin = patch_queue.read_pin()
    sdist = patch_queue.obtain_sdist(pin)
    status = 0
    for index, pr in enumerate(prs, 1):
        if pr["name"] not in wanted:
            continue
        folder, problems = write_pr(index, pr, prs, author, args.out, pin, sdist, args.upstream_repo,
                                    args.upstream_rev)
        print(f"pr: {folder.relative_to(Path(args.out).parent)}: "
              f"{'ok' if not problems else '; '.join(problems)}")
        status |= bool(problems)
    return status
