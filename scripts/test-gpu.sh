#!/usr/bin/env bash
# The test suite on a CUDA machine: N ranks per test on the GPUs there are (one GPU per rank over NCCL
# when there are enough, else the ranks share them over gloo, so streams, events and the caching
# allocator are real). Extra arguments go to pytest; the default selection is the ZeRO suite.
#
#   bash scripts/test-gpu.sh                                   # tests/unit/runtime/zero, once
#   LOCKSTEP_GPU_REPEAT=5 bash scripts/test-gpu.sh tests/unit/runtime/zero/test_zero_overlap_streams.py
#
# Uses the Python that has a CUDA torch (PYTHON, default python3). If that Python has no deepspeed
# installed (`pip install -e .` is the usual way), the materialized tree/ is put on PYTHONPATH; on a
# machine without network, wheels for what it lacks can be carried in .whl/ (installed to a scratch dir).
# Tests run in parallel with pytest-xdist when it is installed (LOCKSTEP_GPU_WORKERS, default 8).
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/lockstep-site \
    .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/lockstep-site${PYTHONPATH:+:$PYTHONPATH}"
fi
if ! "$PYTHON" -c "import deepspeed" 2>/dev/null; then
  [ -d tree/deepspeed ] || { echo "test-gpu: no deepspeed and no tree/ (run: python3 scripts/fork.py sync)"; exit 1; }
  export PYTHONPATH="$PWD/tree${PYTHONPATH:+:$PYTHONPATH}"
  # package metadata too, since accelerate and transformers ask importlib.metadata whether deepspeed is
  # installed (Trainer's DeepSpeed integration refuses to start otherwise)
  version=$("$PYTHON" -c "import deepspeed; print(deepspeed.__version__)" 2>/dev/null | tail -1)
  mkdir -p "/tmp/lockstep-meta/deepspeed-$version.dist-info"
  printf 'Metadata-Version: 2.1\nName: deepspeed\nVersion: %s\n' "$version" \
    > "/tmp/lockstep-meta/deepspeed-$version.dist-info/METADATA"
  export PYTHONPATH="/tmp/lockstep-meta:$PYTHONPATH"
fi
"$PYTHON" -c "import torch, deepspeed; assert torch.cuda.is_available(), 'no CUDA device';
print('test-gpu: deepspeed', deepspeed.__version__, 'from', deepspeed.__path__[0], '| torch', torch.__version__,
      '|', torch.cuda.device_count(), 'x', torch.cuda.get_device_name(0))" || exit 1
export OMP_NUM_THREADS=1 NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
unset DS_ACCELERATOR
args=("${@#tests/}")  # paths may be given from the repository root
[ ${#args[@]} -gt 0 ] || args=(unit/runtime/zero)
xdist=()
"$PYTHON" -c "import xdist" 2>/dev/null && xdist=(-n "${LOCKSTEP_GPU_WORKERS:-8}")
rc=0
for run in $(seq 1 "${LOCKSTEP_GPU_REPEAT:-1}"); do
  echo "test-gpu: run $run of ${LOCKSTEP_GPU_REPEAT:-1}"
  (cd tests && "$PYTHON" -m pytest -p no:cacheprovider -q "${xdist[@]}" "${args[@]}") || rc=1
done
exit $rc
