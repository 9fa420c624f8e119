#!/usr/bin/env python3
# Copyright (c) the DeepSpeed lockstep fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The lockstep fork is a patch queue over one pinned upstream DeepSpeed release.

Nothing of upstream is committed. upstream.toml pins the PyPI sdist by version and sha256;
patches/series lists our patches (git format-patch files) in the order they apply.

  scripts/fork.py sync     materialize tree/: the sdist as a base commit (tag `upstream`), then one
                           commit per patch. Refuses to throw away work that is not exported.
  (edit in tree/ and `git commit` there, one commit per concern; `git rebase -i upstream` to amend)
  scripts/fork.py export   write tree/'s commits back to patches/ and patches/series (deterministic)
  scripts/fork.py status   exit 1 with a one-line reason when tree/ holds work not in patches/
  scripts/fork.py check    the series applies cleanly to a fresh copy of the sdist and re-exports
                           byte for byte
  scripts/fork.py verify   run tests against vanilla upstream (own venv) and the fork, print a table

  scripts/fork.py pr       the series as upstream pull requests (prs.toml), signed off and checked

The work is done by scripts/patch_queue.py (the queue), scripts/verify.py and scripts/upstream_pr.py.
Offline: LOCKSTEP_SDIST=/path/to/deepspeed-<version>.tar.gz (the hash is still checked).
Only the standard library is used, so this runs before anything is installed.
"""

import argparse
import sys

import upstream_pr
import verify
from patch_queue import ForkError, check, export, local_version, status, sync


def main(argv=None):
    parser = argparse.ArgumentParser(prog="scripts/fork.py",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("sync", help="create or refresh tree/ from the pinned sdist and patches/")
    p.add_argument("--discard", action="store_true", help="throw away unexported work in tree/")
    sub.add_parser("export", help="write tree/'s commits back to patches/ and patches/series")
    sub.add_parser("status", help="exit 1 with a reason when tree/ holds work not in patches/")
    sub.add_parser("check", help="the series applies cleanly to a fresh copy of the sdist")
    sub.add_parser("version", help="print the fork's version (upstream version + local label)")
    p = sub.add_parser("verify", help="run tests against vanilla upstream and against the fork; print a table")
    verify.add_arguments(p)
    p = sub.add_parser("pr", help="write the series as upstream pull requests (prs.toml), signed off, and check them")
    upstream_pr.add_arguments(p)
    args = parser.parse_args(argv)
    try:
        if args.cmd == "sync":
            sync(discard=args.discard)
            return 0
        if args.cmd == "export":
            export()
            return 0
        if args.cmd == "status":
            return status()
        if args.cmd == "check":
            return check()
        if args.cmd == "version":
            print(local_version())
            return 0
        if args.cmd == "verify":
            return verify.run(args)
        if args.cmd == "pr":
            return upstream_pr.run(args)
    except ForkError as e:
        print(f"fork.py {args.cmd}: {e}", file=sys.stderr)
        return 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
