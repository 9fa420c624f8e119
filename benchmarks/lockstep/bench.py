#!/usr/bin/env python3
# Copyright (c) the DeepSpeed lockstep fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Fork vs upstream: step time, peak memory and collectives per step, in one invocation.

For every case (ZeRO stage x usage), runs benchmarks/lockstep/worker.py with the fork's interpreter
(.venv) and with vanilla deepspeed 0.19.8's (.cache/venv-upstream-<version>, made by
`scripts/fork.py verify` or on first use), interleaved and alternating which goes first, --reps times
after a warm-up run each. Reports the median step time (median over repetitions of each run's median
step), its spread (min-max of the per-run medians), peak memory (max RSS over ranks on CPU; max CUDA
memory allocated on GPU), collectives per step (counted by wrapping deepspeed.comm's backend collectives),
the ratios fork/upstream and fork divergent/fork uniform, and whether the final parameters are
bit-identical fork vs upstream (uniform usage) in every repetition. Writes a markdown table and a PNG
plot; exits 1 when uniform usage gives different parameters.

  python3 benchmarks/lockstep/bench.py --world-size 2 --stages 1 2 3 --reps 5

`--model moe` (ZeRO-3 only): per-expert MoE with natural routing, instead of the usages the cases are
the declarations: "leaf" (the MoE block a ZeRO-3 leaf module, fork and upstream) and "none" (the fork
only: it agrees every fetch by vote; 0.19.8 aborts or hangs), with the ratios vs upstream + leaf.

  python3 benchmarks/lockstep/bench.py --model moe --stages 3 --seq 4
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
LOCKSTEP_STAGES = (1, 2, 3)  # stages whose collectives the fork keeps rank-invariant


def run_once(python, case, args, out, collective_log=False):
    cmd = [
        str(python),
        str(ROOT / "benchmarks" / "lockstep" / "worker.py"), "--out", out, "--world-size",
        str(args.world_size), "--stage",
        str(case["stage"]), "--usage", case["usage"], "--hidden",
        str(args.hidden), "--layers",
        str(args.layers), "--seq",
        str(args.seq), "--batch",
        str(args.batch), "--dtype", args.dtype, "--overlap-comm",
        str(int(args.overlap_comm)), "--contiguous-gradients",
        str(int(args.contiguous_gradients)), "--bucket-size",
        str(args.bucket_size), "--registration", args.registration, "--warmup",
        str(args.warmup), "--steps",
        str(args.steps)
    ]
    if args.persistence_threshold is not None:
        cmd += ["--persistence-threshold", str(args.persistence_threshold)]
    if args.prefetch_bucket_size is not None:
        cmd += ["--prefetch-bucket-size", str(args.prefetch_bucket_size)]
    if collective_log:
        cmd += ["--collective-log", "1"]
    if args.model == "moe":
        cmd += ["--model", "moe", "--experts", str(args.experts), "--leaf", str(int(case["declaration"] == "leaf"))]
    # one JIT-extensions dir per interpreter, kept across runs (the harness would build a fresh one each time)
    ext = Path(args.out_dir, "torch-extensions", Path(python).absolute().parent.parent.name)
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_EXTENSIONS_DIR=str(ext), DS_TEST_KEEP_EXTENSIONS_DIR="1")
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        raise SystemExit(f"bench: worker failed with {python}:\n{p.stderr[-3000:]}")


def summarize(lines):
    medians = [statistics.median(l["step_times"]) for l in lines]
    summary = {
        "version": lines[0]["version"],
        "median_step_s": statistics.median(medians),
        "spread_s": (min(medians), max(medians)),
        "peak_rss_mib": max(l["peak_rss"] for l in lines) / 2**20,
        "peak_cuda_mib": max(l["peak_cuda_allocated"] for l in lines) / 2**20,
        "collectives_per_step": sorted({c
                                        for l in lines
                                        for c in l["collectives_per_step"]}),
        "param_digests": sorted({l.get("param_digest", "?")
                                 for l in lines}),
    }
    summary["param_sums"] = [l["param_sum"] for l in lines]
    summary["torch_collectives"] = lines[-1].get("torch_collectives", {})
    if "routing_differs" in lines[0]:  # --model moe
        summary["routing_differs"] = [l["routing_differs"] for l in lines]
        summary["experts_run"] = [l["experts_run"] for l in lines]
    if lines[0].get("collective_log_s"):
        summary["collective_log_s"] = statistics.median(s for l in lines for s in l["collective_log_s"])
    if "schedule_switches" in lines[0]:
        summary["schedule_switches"] = [l["schedule_switches"] for l in lines]
    return summary


def numbers_verdict(entry, world_size=2):
    """Uniform usage must give bit-identical parameters on the fork and on upstream, in every repetition, at
    two ranks. With more ranks the reduction plan's buckets (not 0.19.8's) change the order in which a
    reduce-scatter sums the ranks' gradients, so the last bits may differ: there the sums of the parameters
    must agree to 1e-5 (relative)."""
    fork, up = entry["fork"]["param_digests"], entry["upstream"] and entry["upstream"]["param_digests"]
    if up is None:
        return "fork: " + ("1 digest" if len(fork) == 1 else f"{len(fork)} digests across repetitions")
    if fork == up and len(fork) == 1:
        return "equal"
    sums = entry["fork"]["param_sums"] + entry["upstream"]["param_sums"]
    spread = (max(sums) - min(sums)) / max(abs(s) for s in sums)
    if world_size > 2 and len(fork) == 1 and spread <= 1e-5:
        return f"sums agree to {spread:.1e} (reduction order)"
    return f"DIFFER: fork {fork} upstream {up}"


def label(case):
    return case["usage"] + (f", {case['declaration']}" if "declaration" in case else "")


def markdown(results, args, machine):
    mem_key = "peak_cuda_mib" if any(r["fork"]["peak_cuda_mib"] for r in results) else "peak_rss_mib"
    mem_name = "max CUDA allocated" if mem_key == "peak_cuda_mib" else "peak RSS (max over ranks)"
    mem_name = "max CUDA allocated" if mem_key == "peak_cuda_mib" else "peak RSS (max over ranks)"
    moe = f" per-expert MoE ({args.experts} experts, top-1)" if args.model == "moe" else ""
    lines = [
        f"Machine: {machine}. World size {args.world_size}, {args.dtype}, hidden {args.hidden}, {args.layers}{moe} "
        f"blocks, seq {args.seq}, micro-batch {args.batch}, overlap_comm={bool(args.overlap_comm)}, "
        f"contiguous_gradients={bool(args.contiguous_gradients)}, reduce_bucket_size={args.bucket_size}, "
        f"stage3_param_persistence_threshold={args.persistence_threshold if args.persistence_threshold is not None else 'default'}, "
        f"stage3_prefetch_bucket_size={args.prefetch_bucket_size if args.prefetch_bucket_size is not None else 'default'}, "
        f"{args.registration} registration order; "
        f"{args.reps} interleaved repetitions x {args.steps} timed steps after {args.warmup} warm-up steps.", "",
        f"| stage | usage | upstream step (ms) | fork step (ms) | fork/upstream time | fork spread (ms) | "
        f"upstream {mem_name} (MiB) | fork (MiB) | fork/upstream memory | collectives/step upstream | fork | "
        f"final parameters |", "|---|---|---|---|---|---|---|---|---|---|---|---|"
    ]
    for r in results:
        up, fk = r["upstream"], r["fork"]
        fork_cols = (f"{fk['median_step_s'] * 1e3:.2f}",
                     f"{fk['spread_s'][0] * 1e3:.2f}-{fk['spread_s'][1] * 1e3:.2f}", f"{fk[mem_key]:.1f}",
                     f"{fk['collectives_per_step']}")
        if up is None:
            lines.append(
                f"| {r['stage']} | {label(r)} | fails on upstream | {fork_cols[0]} | - | {fork_cols[1]} | - | "
                f"{fork_cols[2]} | - | - | {fork_cols[3]} | {numbers_verdict(r, args.world_size)} |")
            continue
        lines.append(
            f"| {r['stage']} | {label(r)} | {up['median_step_s'] * 1e3:.2f} | {fork_cols[0]} | "
            f"{fk['median_step_s'] / up['median_step_s']:.3f} | {fork_cols[1]} | {up[mem_key]:.1f} | "
            f"{fork_cols[2]} | {fk[mem_key] / up[mem_key]:.3f} | {up['collectives_per_step']} | {fork_cols[3]} | "
            f"{numbers_verdict(r, args.world_size)} |")
    lines.append("")
    for stage in sorted({r["stage"] for r in results}):
        by = {r["usage"]: r for r in results if r["stage"] == stage}
        if "uniform" in by and "divergent" in by:
            ratio = by["divergent"]["fork"]["median_step_s"] / by["uniform"]["fork"]["median_step_s"]
            lines.append(f"- ZeRO-{stage}: fork divergent / fork uniform step time = {ratio:.3f}")
        by = {r.get("declaration"): r for r in results if r["stage"] == stage}
        if "leaf" in by and "none" in by:
            base, none = by["leaf"]["upstream"], by["none"]["fork"]
            same = "equal" if none["param_digests"] == base["param_digests"] else "differ"
            lines.append(f"- ZeRO-{stage}: fork without declaration / upstream with leaf modules: step time "
                         f"{none['median_step_s'] / base['median_step_s']:.3f}, memory "
                         f"{none[mem_key] / base[mem_key]:.3f}; final parameters {same}")
    for r in results:
        if "collective_log_s" in r["fork"]:
            spent, step = r["fork"]["collective_log_s"], r["fork"]["median_step_s"]
            lines.append(f"- ZeRO-{r['stage']} {label(r)}: the collective log and the lockstep check took "
                         f"{spent * 1e3:.3f} ms of host time per step (median over steps, the slowest rank's), "
                         f"{spent / step:.2%} of the fork's step")
    for r in results:
        if "routing_differs" in r["fork"]:
            first = sum(d[0] for d in r["fork"]["routing_differs"])
            timed = sum(d[1] for d in r["fork"]["routing_differs"])
            total = sum(d[2] for d in r["fork"]["routing_differs"])
            lines.append(f"- ZeRO-{r['stage']} {label(r)}: the ranks ran different experts at the first step in "
                         f"{first} of {len(r['fork']['routing_differs'])} fork runs and in {timed} of {total} timed "
                         f"steps; experts run per block and step: "
                         f"{statistics.mean(r['fork']['experts_run']):.2f} of {args.experts}")
    if any(r["upstream"] is None and "declaration" in r for r in results):
        lines.append("- upstream without a declaration is not run: 0.19.8 aborts with a collective mismatch or hangs "
                     "when the ranks' experts differ")
    if any(r["upstream"] is None and "declaration" not in r for r in results):
        lines.append("- upstream with divergent usage is not run: 0.19.8 aborts with a collective mismatch or hangs")
    lines.append("- final parameters: digests of the parameters after the last step, over all repetitions; "
                 "uniform usage must be bit-identical fork vs upstream")
    lines += [
        "", "Every torch.distributed collective of the last timed step, on every group (op, backend x group "
        "size, elements: count):", ""
    ]
    for r in results:
        for side in ("upstream", "fork"):
            if r[side] is not None:
                sig = r[side]["torch_collectives"]
                lines.append(f"- ZeRO-{r['stage']} {label(r)}, {side}: {sum(sig.values())} collectives: " +
                             ", ".join(f"{k}: {v}" for k, v in sig.items()))
    return "\n".join(lines) + "\n"


def plot(results, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("bench: matplotlib not available; no plot", file=sys.stderr)
        return False
    labels = [f"Z{r['stage']} {label(r)}" for r in results]
    xs = range(len(results))
    fig, ax = plt.subplots(figsize=(max(6, len(results) * 1.2), 4))
    w = 0.38
    for off, side, color in ((-w / 2, "upstream", "#999999"), (w / 2, "fork", "#2a7ab0")):
        vals = [r[side]["median_step_s"] * 1e3 if r[side] else 0 for r in results]
        lo = [v - r[side]["spread_s"][0] * 1e3 if r[side] else 0 for v, r in zip(vals, results)]
        hi = [r[side]["spread_s"][1] * 1e3 - v if r[side] else 0 for v, r in zip(vals, results)]
        ax.bar([x + off for x in xs], vals, w, yerr=[lo, hi], label=side, color=color, capsize=3)
    ax.set_xticks(list(xs))
    ax.set_xticklabels(labels)
    ax.set_ylabel("median step time (ms)")
    missing = any(r["upstream"] is None for r in results)
    ax.set_title("lockstep fork vs deepspeed 0.19.8" +
                 (" (upstream fails where missing, not plotted)" if missing else ""))
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--usages", nargs="+", default=["uniform", "divergent"], choices=["uniform", "divergent"])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--overlap-comm", action="store_true")
    p.add_argument("--no-contiguous-gradients", dest="contiguous_gradients", action="store_false")
    p.add_argument("--bucket-size", type=int, default=500_000_000)
    p.add_argument("--persistence-threshold",
                   type=int,
                   help="ZeRO-3 stage3_param_persistence_threshold (default: DeepSpeed's; 0: every parameter fetched)")
    p.add_argument("--prefetch-bucket-size",
                   type=int,
                   help="ZeRO-3 stage3_prefetch_bucket_size (default: DeepSpeed's)")
    p.add_argument("--registration",
                   choices=["forward", "reversed"],
                   default="forward",
                   help="module registration order: 'reversed' registers the blocks last-used first")
    p.add_argument("--model",
                   choices=["mlp", "moe"],
                   default="mlp",
                   help="'moe': per-expert MoE blocks with natural routing (ZeRO-3); cases by --declarations")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--declarations", nargs="+", default=["leaf", "none"], choices=["leaf", "none"])
    p.add_argument("--upstream-none",
                   action="store_true",
                   help="--model moe: run upstream without declaration too (only where every rank runs every expert: "
                   "enough tokens per rank, else 0.19.8 hangs until the deadline)")
    p.add_argument("--fork-python", default=str(ROOT / ".venv" / "bin" / "python"))
    p.add_argument("--upstream-python", help="default: the venv scripts/fork.py verify uses (created if missing)")
    p.add_argument("--collective-log",
                   action="store_true",
                   help="the fork side runs with the hang report's collective log and the lockstep check on, and the "
                   "host time spent in them is counted (with --upstream-python set to the fork's: on vs off)")
    p.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "lockstep" / "out"))
    args = p.parse_args()
    if args.model == "moe" and args.stages != [3]:
        p.error("--model moe measures ZeRO-3 only: pass --stages 3")

    if args.upstream_python is None:
        import patch_queue
        import verify
        args.upstream_python = str(verify.upstream_python(patch_queue.read_pin()))
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    machine = (f"{platform.machine()}, {os.cpu_count()} CPU cores, {platform.python_version()}, "
               f"{time.strftime('%Y-%m-%d')}")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for stage in args.stages:
            cases = [{"stage": stage, "usage": usage} for usage in args.usages]
            if args.model == "moe":
                cases = [{"stage": stage, "usage": "routed", "declaration": d} for d in args.declarations]
            for case in cases:
                usage = case["usage"]
                name = f"{stage}-{label(case).replace(', ', '-')}"
                files = {side: str(Path(tmp, f"{side}-{name}.jsonl")) for side in ("fork", "upstream")}
                sides = [("fork", args.fork_python), ("upstream", args.upstream_python)]
                if case.get("declaration") == "none" and args.world_size > 1 and not args.upstream_none:
                    sides = sides[:1]  # vanilla upstream cannot run it (collective mismatch / hang)
                if usage == "divergent" and args.world_size > 1:
                    if stage not in LOCKSTEP_STAGES:
                        print(f"bench: skipping ZeRO-{stage} divergent: not in lockstep yet", file=sys.stderr)
                        continue
                    sides = sides[:1]  # vanilla upstream cannot run it (collective mismatch / hang)
                for rep in range(args.reps):
                    order = sides if rep % 2 == 0 else list(reversed(sides))
                    for side, python in order:
                        print(f"bench: ZeRO-{stage} {label(case)} rep {rep + 1}/{args.reps} {side}", file=sys.stderr)
                        run_once(python, case, args, files[side], args.collective_log and side == "fork")
                entry = dict(case)
                for side, _ in sides:
                    entry[side] = summarize([json.loads(l) for l in Path(files[side]).read_text().splitlines()])
                entry.setdefault("upstream", None)  # divergent usage, no declaration: upstream aborts or hangs
                results.append(entry)
                table = markdown(results, args, machine)  # after every case: a cut-short run keeps its results
                (out_dir / "results.md").write_text(table)
                (out_dir / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    plotted = plot(results, out_dir / "step_time.png")
    print(table)
    wrong = [r for r in results if r["upstream"] is not None and "DIFFER" in numbers_verdict(r, args.world_size)]
    print(f"bench: wrote {out_dir / 'results.md'}" + (f" and {out_dir / 'step_time.png'}" if plotted else ""))
    if wrong:
        print(f"bench: the final parameters differ fork vs upstream in {len(wrong)} case(s)", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
