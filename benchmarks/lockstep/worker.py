# Copyright (c) the DeepSpeed lockstep fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""One benchmark run with whatever deepspeed the running interpreter has (upstream or the fork).

Started by bench.py once per (side, repetition). Launches the ranks through the test harness
(tests/unit/common.py: deadlines, no stragglers), trains a transformer-like model with ZeRO, and writes
one JSON line with per-step times, peak memory, collectives per step and a digest of the final
parameters to --out. ``--model moe``: per-expert MoE blocks (experts in a ModuleList, top-1 router, each
expert run only on the tokens routed to it) on fresh random tokens per rank and step, so the ranks run
different experts (natural routing); ``--leaf 1`` declares the block a ZeRO-3 leaf module (0.19.8's
workaround: the block is fetched whole).
"""

import argparse
import hashlib
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

COLLECTIVES = ("all_reduce", "inference_all_reduce", "all_reduce_coalesced", "reduce", "reduce_scatter",
               "reduce_scatter_tensor", "all_gather", "all_gather_into_tensor", "all_gather_coalesced", "broadcast",
               "all_to_all_single", "barrier", "monitored_barrier", "send", "recv", "isend", "irecv")
# every torch.distributed collective, whoever calls it (DeepSpeed's comm layer, a gloo vote group, ...)
TORCH_COLLECTIVES = ("all_reduce", "all_reduce_coalesced", "reduce", "reduce_scatter", "reduce_scatter_tensor",
                     "all_gather", "all_gather_into_tensor", "all_gather_coalesced", "broadcast", "all_to_all",
                     "all_to_all_single", "barrier", "monitored_barrier", "send", "recv", "isend", "irecv",
                     "all_gather_object", "broadcast_object_list", "gather", "scatter")


def count_torch_collectives(signatures):
    """Wrap torch.distributed's collectives: each call adds (op, backend and size of its group, elements) to
    ``signatures`` (a Counter), the outermost call only."""
    import torch
    import torch.distributed as tdist
    depth = [0]

    def numel(args, kwargs):
        for value in list(args) + list(kwargs.values()):
            if isinstance(value, torch.Tensor):
                return value.numel()
            if isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
                return sum(t.numel() for t in value)
        return 0

    for name in TORCH_COLLECTIVES:
        fn = getattr(tdist, name, None)
        if fn is None:
            continue

        def counted(*a, __fn=fn, __name=name, **k):
            depth[0] += 1
            try:
                if depth[0] == 1:
                    group = k.get("group")
                    size = tdist.get_world_size(group) if group is not None else tdist.get_world_size()
                    backend = str(tdist.get_backend(group))
                    signatures[(__name, f"{backend}x{size}", numel(a, k))] += 1
                return __fn(*a, **k)
            finally:
                depth[0] -= 1

        setattr(tdist, name, counted)


def build_model(args):
    import torch

    class Block(torch.nn.Module):

        def __init__(self, d):
            super().__init__()
            self.norm = torch.nn.LayerNorm(d)
            self.up = torch.nn.Linear(d, 4 * d)
            self.down = torch.nn.Linear(4 * d, d)

        def forward(self, h):
            return h + self.down(torch.nn.functional.gelu(self.up(self.norm(h))))

    class MoEBlock(torch.nn.Module):
        """Per-expert MoE: each expert (d->4d->d) runs only on the tokens its top-1 router sends it."""

        def __init__(self, d):
            super().__init__()
            self.norm = torch.nn.LayerNorm(d)
            self.router = torch.nn.Linear(d, args.experts)
            self.experts = torch.nn.ModuleList(
                torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d))
                for _ in range(args.experts))
            self.ran = []  # the experts that got tokens in the last forward

        def forward(self, h):
            x = self.norm(h)
            weight, choice = torch.softmax(self.router(x), dim=-1).max(dim=-1)
            out = torch.zeros_like(h)
            self.ran = []
            for i, expert in enumerate(self.experts):
                routed = choice == i
                if routed.any():
                    out[routed] = weight[routed, None] * expert(x[routed])
                    self.ran.append(i)
            return h + out

    class Model(torch.nn.Module):
        """A stack of MLP (or MoE) blocks; the LLaVA-like variant adds an image projector used on image batches."""

        def __init__(self, d, layers, reversed_registration, block):
            super().__init__()
            if block is Block:
                self.image_proj = torch.nn.Linear(d, d)
            else:  # MoE: no projector; an input layer, so that the first block's input requires grad (as
                # after an embedding: 0.19.8 reduces a leaf module's gradients from a full backward hook, which
                # fires before its parameters' gradients exist when no input of the module requires grad)
                self.embed = torch.nn.Linear(d, d)
            self.blocks = torch.nn.ModuleList(block(d) for _ in range(layers))
            self.head = torch.nn.Linear(d, 1)
            if reversed_registration:  # registered last-used first, like models that define the head first
                self.order = list(range(layers))
                self.blocks = torch.nn.ModuleList(reversed(list(self.blocks)))
                self.order.reverse()

        def forward(self, x, image=None):
            h = self.embed(x) if hasattr(self, "embed") else x
            if image is not None:
                h = h + self.image_proj(image)
            for i in getattr(self, "order", range(len(self.blocks))):
                h = self.blocks[i](h)
            return self.head(h).pow(2).mean()

    torch.manual_seed(0)
    return Model(args.hidden, args.layers, args.registration == "reversed", MoEBlock if args.model == "moe" else Block)


def time_the_collective_log():
    """``--collective-log``: the hang report's collective log and the lockstep check are on (``main`` set their
    environment); count the host time spent in them: the log's entry and exit around each collective and the
    check's digest at the step. Returns a dict: under 0 the seconds so far, and per function its seconds and
    calls (the initialization's collectives included). The timer adds a frame to each collective's stack walk:
    what it counts is a slight overestimate."""
    from deepspeed.utils import hang_report
    spent = {0: 0.0}

    def timed(fn):

        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                seconds = time.perf_counter() - t0
                spent[0] += seconds
                spent[fn.__name__] = spent.get(fn.__name__, 0.0) + seconds
                spent["n_" + fn.__name__] = spent.get("n_" + fn.__name__, 0) + 1

        return wrapper

    for cls, name in ((hang_report.HangReporter, "begin"), (hang_report.HangReporter, "end"),
                      (hang_report.StepFingerprint, "take")):
        setattr(cls, name, timed(getattr(cls, name)))
    return spent


def rank_main(args):
    import collections
    import torch
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.accelerator import get_accelerator

    signatures = collections.Counter()
    count_torch_collectives(signatures)
    backend = deepspeed.comm.comm.cdb  # keeps references to two of them from before
    if backend is not None and getattr(backend, "all_gather_function", None) is not None:
        backend.all_gather_function = backend.get_all_gather_function()
        backend.reduce_scatter_function = backend.get_reduce_scatter_function()

    # Count every collective ZeRO issues: they all go through deepspeed.comm's backend object.
    counts = {"n": 0}
    backend = deepspeed.comm.comm.cdb
    for name in COLLECTIVES:
        fn = getattr(backend, name, None)
        if fn is None:
            continue

        def counted(*a, __fn=fn, **k):
            counts["n"] += 1
            return __fn(*a, **k)

        setattr(backend, name, counted)

    log_seconds = time_the_collective_log() if args.collective_log else None

    rank = dist.get_rank()
    device = get_accelerator().current_device_name()
    config = {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "zero_optimization": {
            "stage": args.stage,
            "overlap_comm": args.overlap_comm,
            "contiguous_gradients": args.contiguous_gradients,
            "reduce_bucket_size": args.bucket_size,
        },
    }
    if args.dtype == "bf16":
        config["bf16"] = {"enabled": True}
    if args.persistence_threshold is not None:
        config["zero_optimization"]["stage3_param_persistence_threshold"] = args.persistence_threshold
    if args.prefetch_bucket_size is not None:
        config["zero_optimization"]["stage3_prefetch_bucket_size"] = args.prefetch_bucket_size
    model = build_model(args)
    if args.leaf:
        deepspeed.utils.set_z3_leaf_modules(model, [type(model.blocks[0])])
    engine, _, _, _ = deepspeed.initialize(model=model,
                                           optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4),
                                           config=config)
    dtype = next(engine.module.parameters()).dtype
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, args.seq, args.hidden, generator=g).to(device=device, dtype=dtype)
    image = torch.randn(args.batch, args.seq, args.hidden, generator=g).to(device=device, dtype=dtype)
    if args.model == "moe":  # fresh tokens per step, made before timing: the routing changes every step
        tokens = [
            torch.randn(args.batch, args.seq, args.hidden, generator=g).to(device=device, dtype=dtype)
            for _ in range(args.warmup + args.steps)
        ]

    def uses_image(step):
        if args.usage == "uniform":
            return True
        return (rank + step) % 2 == 0  # divergent: half the ranks have an image batch, alternating

    times, collectives, routes, last_signatures, log_times = [], [], [], {}, []
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    profiler = None
    for step in range(args.warmup + args.steps):
        get_accelerator().synchronize()
        dist.barrier()
        if step == args.warmup and rank == 0 and os.environ.get("BENCH_PROFILE"):
            import cProfile  # BENCH_PROFILE=file: rank 0's timed steps under cProfile (host time only)
            profiler = cProfile.Profile()
            profiler.enable()
        before = counts["n"]
        signatures.clear()
        log_before = log_seconds[0] if log_seconds else 0.0
        t0 = time.perf_counter()
        if args.model == "moe":
            loss = engine(tokens[step])
            routes.append([tuple(block.ran) for block in engine.module.blocks])
        else:
            loss = engine(x, image if uses_image(step) else None)
        engine.backward(loss)
        engine.step()
        get_accelerator().synchronize()
        t1 = time.perf_counter()
        if step >= args.warmup:
            times.append(t1 - t0)
            collectives.append(counts["n"] - before)
            if log_seconds:
                log_times.append(log_seconds[0] - log_before)
            last_signatures = dict(signatures)
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(os.environ["BENCH_PROFILE"])
    per_step = torch.tensor(times, device=device)  # the job's step time is the slowest rank's
    dist.all_reduce(per_step, op=dist.ReduceOp.MAX)
    # the host time this rank spent in the collective log and the lockstep check, per timed step (the slowest rank's)
    log_per_step = torch.tensor(log_times or [0.0], device=device)
    dist.all_reduce(log_per_step, op=dist.ReduceOp.MAX)
    peak_rss = torch.tensor([float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024], device=device)
    dist.all_reduce(peak_rss, op=dist.ReduceOp.MAX)
    peak_cuda = float(torch.cuda.max_memory_allocated()) if torch.cuda.is_available() else 0.0
    # The numbers, not only the time: a digest of the final parameters (every rank's must agree).
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), enabled=args.stage == 3):
        flat = torch.cat([p.detach().float().flatten().cpu() for p in engine.module.parameters()])
    digest = hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16]
    digests = [None] * dist.get_world_size()
    dist.all_gather_object(digests, digest)
    all_routes = [None] * dist.get_world_size()
    dist.all_gather_object(all_routes, routes)
    if rank == 0:
        out = {
            "version": deepspeed.__version__,
            "step_times": per_step.tolist(),
            "peak_rss": peak_rss.item(),
            "peak_cuda_allocated": peak_cuda,
            "collectives_per_step": sorted(set(collectives)),
            "collective_log_s": log_per_step.tolist() if args.collective_log else None,
            "collective_log_parts": {
                k: v
                for k, v in log_seconds.items() if k
            } if args.collective_log else None,
            "param_digest": digest if len(set(digests)) == 1 else "ranks differ: " + ",".join(digests),
            "param_sum": flat.sum().item(),
            # the last timed step's torch.distributed collectives, on every group: "op backendxsize elements"
            "torch_collectives": {
                f"{op} {group} {n}": c
                for (op, group, n), c in sorted(last_signatures.items())
            },
        }
        schedule = getattr(getattr(engine.optimizer, "parameter_offload", None), "get_param_coordinator", None)
        schedule = getattr(schedule(), "fetch_schedule", None) if schedule is not None else None
        if schedule is not None:  # the fork's ZeRO-3 fetch schedule: how often the ranks switched to votes
            out["schedule_switches"] = schedule.switches
        if args.model == "moe":  # did the ranks run different experts (at the first step: votes stay on)?
            differ = [len({str(r[s]) for r in all_routes}) > 1 for s in range(len(routes))]
            out["routing_differs"] = [differ[0], sum(differ[args.warmup:]), args.steps]
            runs = [len(ran) for r in all_routes for step in r for ran in step]  # per rank, step and block
            out["experts_run"] = sum(runs) / len(runs)
        with open(args.out, "a") as f:
            f.write(json.dumps(out) + "\n")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--usage", choices=["uniform", "divergent", "routed"], default="uniform")  # routed: --model moe
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--overlap-comm", type=int, default=0)
    p.add_argument("--contiguous-gradients", type=int, default=1)
    p.add_argument("--bucket-size", type=int, default=500_000_000)
    p.add_argument("--registration", choices=["forward", "reversed"], default="forward")
    p.add_argument("--model", choices=["mlp", "moe"], default="mlp")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--leaf", type=int, default=0, help="--model moe: the MoE block as a ZeRO-3 leaf module")
    p.add_argument("--persistence-threshold", type=int, default=None, help="ZeRO-3 (default: DeepSpeed's)")
    p.add_argument("--prefetch-bucket-size", type=int, default=None, help="ZeRO-3 (default: DeepSpeed's)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--deadline", type=float, default=600)
    p.add_argument(
        "--collective-log",
        type=int,
        default=0,
        help="the fork: the hang report's collective log and the lockstep check on, their host time counted")
    args = p.parse_args()
    if args.collective_log:
        os.environ.update(DS_HANG_REPORT_DIR=tempfile.mkdtemp(prefix="bench-hang-report-"),
                          DS_HANG_REPORT_TIMEOUT="3600",
                          DS_LOCKSTEP_CHECK="1")
    from unit.common import launch
    result = launch(rank_main, args.world_size, kwargs={"args": args}, timeout=args.deadline)
    if result.outcome != "passed":
        print(result.report(), file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
