#!/usr/bin/env bash
# On a lent GPU machine (no network): the GPU verify run of docs/verify/gpu.md. Carry tree/, .cache/sdist
# and .whl (hjson, pydantic and its deps for the machine's Python). Writes logs under $OUT (or /tmp/out).
#   streams   the slow-side-stream tests on the fork, every stage and configuration
#   upstream  the same tests (uniform usage, extra-large parameters) on vanilla 0.19.8
#   no0001    ... and on the fork without its first patch, zero12-extra-large-grad-stream (the regression the
#             tests were written for)
#   suite     the rest of the ZeRO suite on the fork (the #7844 testcase included)
#   bench     the benchmark with parameter digests: fork vs 0.19.8 bit-identical for uniform usage
#   again     the uniform slow-side-stream tests LOCKSTEP_GPU_REPEAT (default 4) more times
#   zero3     the ZeRO-3 fetch schedule's tests (late divergence, Switch Transformers, conditional fetch and
#             evaluation, Hugging Face models, step cost) on the fork
#   stepcost  the step-cost test (collectives, host reads and, on the GPU, implicit syncs per phase) on the
#             fork and on vanilla 0.19.8; prints where the recorded counts differ
#   bench3    ZeRO-3 fork vs 0.19.8, bf16, hidden 1024 x 8 blocks, 2/4/8 ranks sharing the GPU, uniform;
#             images alternating across ranks at 2 ranks
#   benchmoe  per-expert MoE with natural routing: the fork without declaration vs 0.19.8 + leaf modules
# `bash scripts/gpu-verify.sh` runs them all (about 15 minutes on one H200, so two device calls:
# `... streams upstream no0001 bench`, then `... suite again`). Each step has a time limit
# (GPU_VERIFY_LIMIT seconds, default 600) so that a call ends with its logs.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/upstream
tar -xzf .cache/sdist/deepspeed-0.19.8.tar.gz -C /tmp/upstream
UPSTREAM=/tmp/upstream/deepspeed-0.19.8
T=unit/runtime/zero/test_zero_overlap_streams.py
export LOCKSTEP_GPU_WORKERS=${LOCKSTEP_GPU_WORKERS:-12} PYTHONWARNINGS=ignore
step() {  # step <name> <command...>: log to $OUT/<name>.log, print its summary lines
  local name=$1; shift
  echo "=== $name"
  timeout "${GPU_VERIFY_LIMIT:-600}" "$@" > "$OUT/$name.log" 2>&1
  echo "rc=$?"
  grep -E "^(FAILED|ERROR)|passed|failed|test-gpu:|bench:|\| [123] \|" "$OUT/$name.log" | cut -c1-220 | tail -40
}
for what in ${@:-streams upstream no0001 suite bench again}; do
  case $what in
    streams) step streams bash scripts/test-gpu.sh $T -rf --tb=short -p no:benchmark ;;
    upstream) step upstream env PYTHONPATH="$UPSTREAM" bash scripts/test-gpu.sh $T -k "uniform and xl" -rf --tb=line \
      -p no:benchmark ;;
    no0001)
      rm -rf /tmp/no0001 && cp -r tree /tmp/no0001 && git -C /tmp/no0001 apply -R "$PWD"/patches/zero12-extra-large-grad-stream.patch
      step no0001 env PYTHONPATH=/tmp/no0001 bash scripts/test-gpu.sh $T -k "uniform and xl" -rf --tb=line \
        -p no:benchmark ;;
    suite) step suite bash scripts/test-gpu.sh unit/runtime/zero --ignore=$T -rf --tb=short -p no:benchmark ;;
    bench)
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/lockstep-site .whl/*.whl
      for side in fork:"$PWD/tree" upstream:"$UPSTREAM"; do
        printf '#!/bin/sh\nPYTHONPATH=%s:/tmp/lockstep-site exec python3 "$@"\n' "${side#*:}" > "/tmp/py-${side%%:*}"
        chmod +x "/tmp/py-${side%%:*}"
      done
      step bench python3 benchmarks/lockstep/bench.py --world-size 2 --stages 1 2 3 --usages uniform --reps 2 \
        --warmup 2 --steps 5 --hidden 512 --layers 4 --dtype bf16 --overlap-comm --bucket-size 100000 \
        --fork-python /tmp/py-fork --upstream-python /tmp/py-upstream --out-dir "$OUT/bench" ;;
    zero3) step zero3 bash scripts/test-gpu.sh unit/runtime/zero/test_zero3_late_divergence.py \
      unit/runtime/zero/test_zero3_hf_late_divergence.py unit/runtime/zero/test_zero3_conditional_fetch.py \
      unit/runtime/zero/test_zero3_conditional_eval.py unit/runtime/zero/test_zero3_hf_conditional.py \
      unit/runtime/zero/test_zero_step_cost.py -rf --tb=short -p no:benchmark ;;
    stepcost)
      for side in fork upstream; do
        rm -rf "/tmp/cost-$side" && mkdir -p "/tmp/cost-$side"
        extra=(); [ $side = upstream ] && extra=(env PYTHONPATH="$UPSTREAM")
        step "stepcost-$side" "${extra[@]}" env LOCKSTEP_RECORD_DIR="/tmp/cost-$side" bash scripts/test-gpu.sh \
          unit/runtime/zero/test_zero_step_cost.py -k TestStepCost -rf --tb=short -p no:benchmark
      done
      for f in /tmp/cost-fork/*; do
        echo "--- ${f##*/}"; echo "upstream: $(cat "/tmp/cost-upstream/${f##*/}" 2>/dev/null)"; echo "fork:     $(cat "$f")"
      done | tee "$OUT/stepcost.txt" ;;
    bench3|benchmoe)
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/lockstep-site .whl/*.whl
      for side in fork:"$PWD/tree" upstream:"$UPSTREAM"; do
        printf '#!/bin/sh\nPYTHONPATH=%s:/tmp/lockstep-site exec python3 "$@"\n' "${side#*:}" > "/tmp/py-${side%%:*}"
        chmod +x "/tmp/py-${side%%:*}"
      done
      py=(--fork-python /tmp/py-fork --upstream-python /tmp/py-upstream)
      if [ "$what" = bench3 ]; then
        for ws in ${BENCH3_WS:-2 4 8}; do
          usages=uniform; [ "$ws" = 2 ] && usages="uniform divergent"
          step "bench3-ws$ws" python3 benchmarks/lockstep/bench.py --world-size $ws --stages 3 --usages $usages \
            --reps 2 --warmup 3 --steps 6 --hidden 1024 --layers 8 --seq 64 --batch 4 --dtype bf16 "${py[@]}" \
            --out-dir "$OUT/bench3-ws$ws"
        done
      else
        step benchmoe python3 benchmarks/lockstep/bench.py --model moe --stages 3 --world-size 2 --reps 2 --warmup 5 \
          --steps 6 --hidden 256 --layers 4 --seq 16 --batch 4 --dtype bf16 "${py[@]}" --out-dir "$OUT/benchmoe"
      fi ;;
    again) step again env LOCKSTEP_GPU_REPEAT="${LOCKSTEP_GPU_REPEAT:-4}" bash scripts/test-gpu.sh $T -k uniform -rf \
      --tb=short -p no:benchmark ;;
    *) echo "gpu-verify: unknown step $what"; exit 2 ;;
  esac
done
