#!/usr/bin/env bash
# The benchmark on one GPU of a device machine (no network there). Run from the repository root with
# the materialized tree/, the pinned sdist (.cache/sdist) and wheels for what the GPU image lacks (.whl:
# hjson, pydantic and its deps) carried along; see docs/benchmarks.md. Arguments go to bench.py.
set -euo pipefail
cd "$(dirname "$0")/../.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
mkdir -p /tmp/upstream && tar -xzf .cache/sdist/deepspeed-0.19.8.tar.gz -C /tmp/upstream
# one interpreter, two deepspeeds: the fork from tree/, vanilla 0.19.8 from its sdist
for side in fork:"$PWD/tree" upstream:/tmp/upstream/deepspeed-0.19.8; do
  printf '#!/bin/sh\nPYTHONPATH=%s:/tmp/site exec python3 "$@"\n' "${side#*:}" > "/tmp/py-${side%%:*}"
  chmod +x "/tmp/py-${side%%:*}"
  "/tmp/py-${side%%:*}" -c "import deepspeed, torch; print('${side%%:*}:', deepspeed.__version__, 'torch', torch.__version__)"
done
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
export PYTHONUNBUFFERED=1
python3 benchmarks/lockstep/bench.py --world-size 1 --fork-python /tmp/py-fork --upstream-python /tmp/py-upstream \
  --out-dir "${OUT:-/tmp/bench-out}" "$@"
