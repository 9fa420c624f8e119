cd /work/main
UP=/work/main/.cache/venv-upstream-0.19.8/bin/python
run() { # name python leaf rep
  DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 TORCH_EXTENSIONS_DIR=/tmp/moe/ext-$1 timeout 600 $2 benchmarks/lockstep/worker.py --out /tmp/moe/d-$1-$4.jsonl --stage 3 --model moe --usage routed --leaf $3 --hidden 128 --layers 4 --seq 4 --batch 2 --persistence-threshold 0 --warmup 30 --steps 8 > /tmp/moe/d-$1-$4.log 2>&1
  python3 -c "
import json;d=json.loads(open('/tmp/moe/d-$1-$4.jsonl').read().splitlines()[-1]);t=sorted(d['step_times']);print('$1 rep $4 median ms %.1f'%(1000*t[len(t)//2]), d['collectives_per_step'], d.get('param_digest'), d.get('schedule_switches'))"
}
for rep in 1 2 3; do
  case $rep in
    1) order="upleaf fork forkleaf";; 2) order="fork forkleaf upleaf";; 3) order="forkleaf upleaf fork";;
  esac
  for side in $order; do
    case $side in
      upleaf) run upleaf $UP 1 $rep;;
      fork) run fork .venv/bin/python 0 $rep;;
      forkleaf) run forkleaf .venv/bin/python 1 $rep;;
    esac
  done
done
