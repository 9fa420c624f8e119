#!/usr/bin/env bash
# Where the per-expert MoE's step time goes, fork vs 0.19.8, on the GPU machine (see scripts/gpu-verify.sh for
# the set-up it shares: .whl/ and .cache/sdist carried there). Runs worker.py once per case unprofiled (the
# times) and once under cProfile on rank 0 (BENCH_PROFILE), then prints each case's median step time and the
# functions whose host time differs most between two cases.
#   OUT=/tmp/out bash benchmarks/lockstep/moe-profile.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/upstream
[ -d /tmp/upstream/deepspeed-0.19.8 ] || tar -xzf .cache/sdist/deepspeed-0.19.8.tar.gz -C /tmp/upstream
[ -d /tmp/lockstep-site ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
  --target /tmp/lockstep-site .whl/*.whl
declare -A ROOTS=([fork]="$PWD/tree" [upstream]=/tmp/upstream/deepspeed-0.19.8)
# case: side leaf seq (seq 2: 8 tokens per rank, natural routing; seq 16: 64 tokens, every expert everywhere)
CASES=${MOE_CASES:-"upstream:1:2 fork:0:2 fork:1:2 upstream:0:16 fork:0:16"}
STEPS=${MOE_STEPS:-30}
for profile in 0 1; do
  for c in $CASES; do
    IFS=: read -r side leaf seq <<< "$c"
    name="$side-leaf$leaf-seq$seq"
    prof=(); [ "$profile" = 1 ] && prof=(BENCH_PROFILE="$OUT/$name.prof")
    env "${prof[@]}" PYTHONPATH="${ROOTS[$side]}:/tmp/lockstep-site" \
      timeout 300 python3 benchmarks/lockstep/worker.py --out "$OUT/$name-p$profile.jsonl" --stage 3 --model moe \
      --usage routed --leaf "$leaf" --hidden 256 --layers 4 --seq "$seq" --batch 4 --dtype bf16 --warmup 30 \
      --steps "$STEPS" --deadline 240 > "$OUT/$name-p$profile.log" 2>&1 || echo "$name (profile $profile): rc=$?"
  done
done
python3 - "$OUT" $CASES <<'PY'
import json, pstats, sys
from pathlib import Path
out = Path(sys.argv[1])
names = []
for c in sys.argv[2:]:
    side, leaf, seq = c.split(":")
    names.append(f"{side}-leaf{leaf}-seq{seq}")
def table(n):
    s = pstats.Stats(str(out / f"{n}.prof")).stats
    rows = {}  # file(function), without line numbers (they differ between the two sides): calls, tottime, cumtime
    for k, v in s.items():
        key = f"{k[0].split('/')[-1]}({k[2]})"
        old = rows.get(key, (0, 0.0, 0.0))
        rows[key] = (old[0] + v[1], old[1] + v[2], old[2] + v[3])
    return rows
for a, b in (("upstream-leaf1-seq2", "fork-leaf0-seq2"), ("upstream-leaf0-seq16", "fork-leaf0-seq16")):
    if not ((out / f"{a}.prof").exists() and (out / f"{b}.prof").exists()):
        continue
    ta, tb = table(a), table(b)
    print(f"\n== {b} minus {a}: total tottime {sum(v[1] for v in tb.values()):.2f} s vs {sum(v[1] for v in ta.values()):.2f} s")
    keys = set(ta) | set(tb)
    diff = sorted(keys, key=lambda k: -(tb.get(k, (0, 0, 0))[1] - ta.get(k, (0, 0, 0))[1]))
    for k in diff[:30]:
        x, y = ta.get(k, (0, 0, 0)), tb.get(k, (0, 0, 0))
        print(f"{y[1] - x[1]:+8.3f} s  calls {x[0]:>7} -> {y[0]:>7}  cum {x[2]:7.3f} -> {y[2]:7.3f}  {k[:110]}")
    print(f"-- fork-only functions by cumulative time ({b})")
    for k in sorted((k for k in tb if k not in ta), key=lambda k: -tb[k][2])[:15]:
        print(f"  cum {tb[k][2]:7.3f}  calls {tb[k][0]:>7}  {k[:110]}")
print()  # the times last: a command's output is often read from its tail
for n in names:
    for p in (0, 1):
        f = out / f"{n}-p{p}.jsonl"
        if f.exists():
            d = json.loads(f.read_text().splitlines()[-1])
            t = sorted(d["step_times"])
            print(f"{n} profile={p}: median {1000 * t[len(t) // 2]:.1f} ms, collectives {d['collectives_per_step']}, "
                  f"experts run {d.get('experts_run')}, routing differs {d.get('routing_differs')}, "
                  f"switches {d.get('schedule_switches')}")
PY
