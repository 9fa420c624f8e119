#!/usr/bin/env python3
# Copyright (c) the DeepSpeed lockstep fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The checks of upstream DeepSpeed's pre-commit set that are not yapf or flake8, over given files.

Written for this repository after upstream's `.pre-commit-config.yaml` (hygiene hooks of pre-commit-hooks,
and its local hooks check-license, check-torchdist, check-torchcuda, check-extraindexurl); codespell runs
separately (scripts/lint.sh) with upstream's arguments. Exit 1 with one line per finding.

  python3 scripts/precommit.py FILE...
"""

import json
import re
import sys
from pathlib import Path

LICENSE_SUFFIXES = (".py", ".c", ".cpp", ".cu", ".cc", ".h", ".hpp", ".cuh", ".hip", ".tr")
LICENSE_LINES = (re.compile(r"^(#|//) SPDX-License-Identifier: Apache-2\.0( AND BSD-3-Clause)?$",
                            re.M), re.compile(r"^(#|//) DeepSpeed Team$", re.M))
# upstream's exclusions for these two checks that concern files we can touch
TORCHDIST_EXCLUDE = re.compile(
    r"(^|/)(deepspeed/comm/|docs/|benchmarks/|deepspeed/moe/sharded_moe\.py|"
    r"deepspeed/runtime/comm/coalesced_collectives\.py|deepspeed/elasticity/elastic_agent\.py|"
    r"deepspeed/launcher/launch\.py|tests/unit/comm/test_dist\.py)")
TORCHCUDA_EXCLUDE = re.compile(r"(^|/)(accelerator/cuda_accelerator\.py|deepspeed/inference/engine\.py|setup\.py|"
                               r"op_builder/builder\.py|\.github/workflows/.*)$")
TORCHDIST = re.compile(r"torch\.distributed |torch\.distributed(?!\.nn)")
TORCHCUDA = re.compile(r"\.cuda\(\)")
# upstream also rejects the string "torch.cuda" in any file unless its line says #ignore-cuda: checked on what goes
# upstream (the tree's files, tests/, docs/upstream/), not on this repository's own scripts and docs
TORCH_CUDA = re.compile(r"torch\.cuda")
UPSTREAM_BOUND = re.compile(r"(^|/)(tree|tests|docs/upstream)/")
IS_CUDA = re.compile(r"\.is_cuda")


def check(path: Path):
    raw = path.read_bytes()
    name = path.as_posix()
    if raw.startswith(b"\xef\xbb\xbf"):
        yield "byte-order marker"
    text = raw.decode("utf-8", errors="replace")
    if b"\r\n" in raw:
        yield "CRLF line endings (upstream: mixed-line-ending --fix=lf)"
    if raw and not raw.endswith(b"\n"):
        yield "no newline at end of file"
    if raw.endswith(b"\n\n"):
        yield "blank lines at end of file"
    for number, line in enumerate(text.splitlines(), 1):
        if line != line.rstrip():
            yield f"line {number}: trailing whitespace"
    if name.endswith(".json"):
        try:
            json.loads(text)
        except ValueError as error:
            yield f"invalid JSON: {error}"
    if name.endswith(LICENSE_SUFFIXES) and raw.strip() and not all(line.search(text) for line in LICENSE_LINES):
        yield "missing license (SPDX-License-Identifier: Apache-2.0 and DeepSpeed Team lines)"
    if not TORCHDIST_EXCLUDE.search(name) and not name.endswith("scripts/precommit.py"):
        for number, line in enumerate(text.splitlines(), 1):
            if TORCHDIST.search(line):
                yield f'line {number}: "torch.distributed" (use deepspeed.comm)'
    if not TORCHCUDA_EXCLUDE.search(name) and not name.endswith("scripts/precommit.py"):
        for number, line in enumerate(text.splitlines(), 1):
            strict = UPSTREAM_BOUND.search(name) and TORCH_CUDA.search(line) and "#ignore-cuda" not in line
            if strict or TORCHCUDA.search(line) or (name.endswith(".py") and IS_CUDA.search(line)):
                yield f"line {number}: torch.cuda, .cuda() or .is_cuda (use get_accelerator(), or #ignore-cuda)"
    if name.endswith((".yml", ".yaml", ".sh", ".py")) and not name.endswith("scripts/precommit.py"):
        if "--extra-index-url" in text:
            yield "--extra-index-url"


def main(paths):
    problems = [f"{path}: {problem}" for path in map(Path, paths) if path.is_file() for problem in check(path)]
    lower = {}
    for path in paths:  # check-case-conflict
        lower.setdefault(path.lower(), []).append(path)
    problems += [f"{' / '.join(names)}: names differ only in case" for names in lower.values() if len(names) > 1]
    for problem in problems:
        print(problem)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
