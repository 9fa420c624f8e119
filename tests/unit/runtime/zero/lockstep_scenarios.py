# Copyright (c) the DeepSpeed lockstep fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Training scenarios with rank-dependent parameter usage, and their independent oracle.

Every scenario trains a tiny LLaVA-like model with DeepSpeed on each rank and checks, on all ranks
together (so they fail together):
  1. the parameters are bitwise identical across ranks;
  2. they equal a plain-PyTorch reference that replays the same data in one process, averaging each
     parameter's gradient over the ranks with zeros where a rank produced none (what DDP with
     find_unused_parameters=True computes), then applying the same optimizer.
The reference knows nothing of ZeRO: a gradient that is dropped, mixed up with another parameter's
or reduced twice moves the parameters by about the learning rate, far above the tolerance.
Used by tests/unit/runtime/zero/test_*lockstep*.py and the other ZeRO tests next to it.
"""

import hashlib  # fork-only
import os  # fork-only
import re  # fork-only
from dataclasses import dataclass
from pathlib import Path  # fork-only
from typing import Callable, Dict, Tuple

import torch
import torch.utils.checkpoint

import deepspeed
import deepspeed.comm as dist
from deepspeed.accelerator import get_accelerator

HIDDEN = 8
MICRO_BATCH = 2
LR = 0.05
SEED = 1234
WEIGHT_DECAY = 0.01
CLIP = 1.0  # global-norm clipping, so the norm collectives are part of every check


class TinyLlava(torch.nn.Module):
    """A text path every batch uses, an image projector used only on batches with an image, and two
    equal-size branches chosen by a per-batch route: the branches it runs, in order ("a", "b", or both in
    either order)."""

    def __init__(self, hidden=HIDDEN, checkpoint=False):
        super().__init__()
        # run `block` (True) or the last module, `head` ("head"), under reentrant activation checkpointing
        self.checkpoint = checkpoint
        self.embed = torch.nn.Linear(hidden, hidden)
        self.image_proj = torch.nn.Linear(hidden, hidden)
        self.branch_a = torch.nn.Linear(hidden, hidden)
        self.branch_b = torch.nn.Linear(hidden, hidden)
        self.block = torch.nn.Linear(hidden, 2 * hidden)
        self.head = torch.nn.Linear(2 * hidden, 1)

    def forward(self, x, image=None, route="ab"):
        if self.embed.weight.requires_grad is False:
            x = x.detach().requires_grad_(True)  # like HF's enable_input_require_grads() on a frozen LLM
        h = self.embed(x)
        if image is not None:
            h = h + self.image_proj(image)
        for name in route:
            h = h + torch.tanh((self.branch_a if name == "a" else self.branch_b)(h))
        if self.checkpoint is True:
            h = torch.utils.checkpoint.checkpoint(self._block, h, use_reentrant=True)
        else:
            h = self._block(h)
        if self.checkpoint == "head":
            return torch.utils.checkpoint.checkpoint(self._head, h, use_reentrant=True)
        return self._head(h)

    def _block(self, h):
        return torch.tanh(self.block(torch.tanh(h)))

    def _head(self, h):
        return self.head(h).pow(2).mean()


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    # (rank, step, micro_step) -> (does the batch have an image, branch route)
    usage: Callable[[int, int, int], Tuple[bool, str]]
    frozen: Tuple[str, ...] = ()  # parameter name prefixes frozen before deepspeed.initialize
    param_groups: str = "one"  # how the optimizer's param groups are cut (see param_groups())
    stages: Tuple[int, ...] = (1, 2, 3)  # ZeRO stages the demo runs it under


SCENARIOS: Dict[str, Scenario] = {
    s.name: s
    for s in [
        Scenario("uniform", "every rank runs every module on every batch", lambda r, s, m: (True, "ab")),
        Scenario("llava_4933", "#4933: only rank 0 gets image batches; the projector is unused elsewhere",
                 lambda r, s, m: (r == 0, "ab")),
        Scenario("llava_per_micro_step", "image batches change with rank and micro-step", lambda r, s, m:
                 ((r + s + m) % 2 == 0, "ab")),
        Scenario("order_divergent", "odd ranks run the same two branches in the opposite order", lambda r, s, m:
                 (True, "ab" if r % 2 == 0 else ("b", "a"))),
        Scenario("equal_size_branches", "even ranks use branch a, odd ranks the equal-size branch b", lambda r, s, m:
                 (True, "a" if r % 2 == 0 else "b")),
        Scenario("no_hook_rank",
                 "frozen LLM, only the projector trains; odd ranks see text only, so no gradient hook fires there",
                 lambda r, s, m: (r % 2 == 0, ""),
                 frozen=("embed", "branch_a", "branch_b", "block", "head")),
        Scenario("shape_7991",
                 "#7991: LLaVA-style decay/no-decay x projector/other groups plus a tiny group (high ranks own "
                 "only padding); at step 9 two ranks take a branch the others skip",
                 lambda r, s, m: (True, "ab" if (s == 9 and r in (1, 2)) else "a"),
                 param_groups="llava_7991",
                 stages=(1, 2)),
    ]
}


def param_groups(model, style):
    """Optimizer param groups: one group, or LLaVA-style (#7991)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if style == "one":
        return [{"params": [p for _, p in named]}]
    assert style == "llava_7991"
    tiny = [p for n, p in named if n == "head.bias"]  # 1 element: ranks >= 1 own only padding
    rest = [(n, p) for n, p in named if n != "head.bias"]
    groups = []
    for projector in (True, False):
        for decay in (True, False):
            ps = [p for n, p in rest if n.startswith("image_proj") == projector and (p.dim() > 1) == decay]
            groups.append({"params": ps, "weight_decay": WEIGHT_DECAY if decay else 0.0})
    groups.append({"params": tiny, "weight_decay": 0.0})
    return groups


def device():
    """Where this rank's inputs and flag tensors live: its accelerator device (NCCL takes no CPU tensors)."""
    return get_accelerator().current_device_name()


def batch(scenario, rank, step, micro, dtype=torch.float32, device="cpu"):
    """The inputs of one micro-batch: (x, image or None, route)."""
    has_image, route = scenario.usage(rank, step, micro)
    g = torch.Generator().manual_seed(SEED + 1000 * rank + 10 * step + micro)
    x = torch.randn(MICRO_BATCH, HIDDEN, generator=g)
    image = torch.randn(MICRO_BATCH, HIDDEN, generator=g)
    return x.to(device, dtype), (image.to(device, dtype) if has_image else None), route


def zero_config(stage, gradient_accumulation_steps=1, bf16=False, **zero_overrides):
    zero = {"stage": stage}
    zero.update(zero_overrides)
    extra = {"bf16": {"enabled": True}} if bf16 else {}
    if zero.get("offload_optimizer"):
        extra["zero_force_ds_cpu_optimizer"] = False  # keep the plain torch optimizer of the reference
    return {
        **extra,
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": gradient_accumulation_steps,
        "zero_optimization": zero,
        "gradient_clipping": CLIP,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def make_model(scenario, checkpoint=False):
    torch.manual_seed(SEED)
    model = TinyLlava(checkpoint=checkpoint)
    for name, p in model.named_parameters():
        if name.startswith(scenario.frozen):
            p.requires_grad_(False)
    return model


def make_optimizer(model, scenario):
    # SGD with momentum is linear in the gradient, so float noise stays float noise. (Adam's first
    # step is lr * sign(g): a near-zero gradient element flips by 2 * lr on rounding alone.)
    return torch.optim.SGD(param_groups(model, scenario.param_groups), lr=LR, momentum=0.9, weight_decay=WEIGHT_DECAY)


def make_engine(scenario, config, checkpoint=False):
    """The scenario's model and optimizer under DeepSpeed with ``config``."""
    model = make_model(scenario, checkpoint=checkpoint)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=make_optimizer(model, scenario), config=config)
    return engine


def full_params(model, stage):
    params = list(model.named_parameters())
    if stage == 3:
        with deepspeed.zero.GatheredParameters([p for _, p in params]):
            return {n: p.detach().float().cpu().clone() for n, p in params}
    return {n: p.detach().float().cpu().clone() for n, p in params}


def train_deepspeed(scenario: Scenario, config, steps, backward="engine", checkpoint=False, engine_out=None):
    """Train on this rank; returns {name: full parameter} after `steps` optimizer steps.

    backward: "engine" (engine.backward(loss)), "torch" (PyTorch-style loss.backward()) or
    "engine+allreduce" (engine.backward, then engine.allreduce_gradients() again, as upstream tests do).
    checkpoint: run the model's block under reentrant activation checkpointing. engine_out: a list the engine
    is appended to."""
    rank = dist.get_rank()
    stage = config["zero_optimization"]["stage"]
    engine = make_engine(scenario, config, checkpoint=checkpoint)
    if engine_out is not None:
        engine_out.append(engine)
    dtype = next(p for p in engine.module.parameters()).dtype
    gas = engine.gradient_accumulation_steps()
    for step in range(steps):
        for micro in range(gas):
            x, image, route = batch(scenario, rank, step, micro, dtype=dtype, device=device())
            loss = engine(x, image, route)
            if backward == "torch":
                loss.backward()
            else:
                engine.backward(loss)
            if backward == "engine+allreduce":
                engine.allreduce_gradients()  # an extra epilogue with no backward in between reduces nothing
            engine.step()
    return full_params(engine.module, stage)


def train_reference(scenario: Scenario, world_size, steps, gradient_accumulation_steps=1):
    """Plain PyTorch, one process: per-rank gradients averaged over ranks (zeros where absent), clipped
    by global norm, then the same optimizer."""
    model = make_model(scenario)
    return reference_training(model, make_optimizer(model, scenario), world_size, steps, gradient_accumulation_steps,
                              lambda rank, step, micro: model(*batch(scenario, rank, step, micro)))


def reference_training(model, optimizer, world_size, steps, gradient_accumulation_steps, loss_of):
    """What data-parallel training must compute, in one process: each step, every rank's micro-batch
    gradients (``loss_of(rank, step, micro)``) summed, averaged over the ranks with zeros where a rank
    produced none, clipped by global norm, then one ``optimizer`` step. Returns {name: parameter}."""
    params = [p for p in model.parameters() if p.requires_grad]
    for step in range(steps):
        total = [torch.zeros_like(p) for p in params]
        for rank in range(world_size):
            for micro in range(gradient_accumulation_steps):
                loss = loss_of(rank, step, micro) / gradient_accumulation_steps
                grads = torch.autograd.grad(loss, params, allow_unused=True)
                for t, g in zip(total, grads):
                    if g is not None:
                        t += g
        for p, t in zip(params, total):
            p.grad = t / world_size
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def train_against_reference(model_of, optimizer_of, inputs, config, steps, after_step=None):
    """Train ``model_of()`` with DeepSpeed under ``config`` for ``steps`` steps of one micro-step, this rank on
    ``inputs(rank, step)`` (its forward's arguments, on the CPU; the forward returns the loss), and another
    ``model_of()`` in plain PyTorch on every rank's inputs (``reference_training``): the parameters agree
    (``assert_lockstep``). ``after_step(engine, step)`` runs after each optimizer step. Returns the engine."""
    rank = dist.get_rank()
    model = model_of()
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer_of(model), config=config)
    for step in range(steps):
        args = [a.to(device()) if torch.is_tensor(a) else a for a in inputs(rank, step)]
        engine.backward(engine(*args))
        engine.step()
        if after_step is not None:
            after_step(engine, step)
    mine = full_params(engine.module, config["zero_optimization"]["stage"])
    ref_model = model_of()
    ref = reference_training(ref_model, optimizer_of(ref_model), dist.get_world_size(), steps, 1,
                             lambda r, s, m: ref_model(*inputs(r, s)))
    assert_lockstep(mine, ref, config, steps)
    return engine


def check_lockstep(scenario_name, config, steps, backward="engine", checkpoint=False, atol=1e-6, rtol=1e-5):
    """Train with DeepSpeed on every rank and check both oracles; every rank raises together.

    Returns a summary dict (used by the demo)."""
    scenario = SCENARIOS[scenario_name]
    mine = train_deepspeed(scenario, config, steps, backward=backward, checkpoint=checkpoint)
    ref = train_reference(scenario, dist.get_world_size(), steps, config.get("gradient_accumulation_steps", 1))
    return assert_lockstep(mine, ref, config, steps, atol=atol, rtol=rtol)


def agree_on_every_rank(ok, what):
    """Every rank raises together (AssertionError ``what``) if any rank's check failed."""
    flag = torch.tensor([0 if ok else 1], device=device())
    dist.all_reduce(flag)
    assert flag.item() == 0, what


def assert_lockstep(mine, ref, config, steps, atol=1e-6, rtol=1e-5):
    """The two oracles on {name: full parameter} after training: bitwise identical across ranks, and equal
    to the plain-PyTorch reference ``ref``. The verdict is agreed, so all ranks raise (or pass) together."""
    if "bf16" in config and config["bf16"].get("enabled"):
        atol, rtol = 6e-3, 1e-2  # bf16 model weights round at ~2e-3; a lost gradient moves them by ~LR * |g|
    world_size = dist.get_world_size()
    names = sorted(mine)
    flat = torch.cat([mine[n].flatten() for n in names]).to(device())
    gathered = [torch.zeros_like(flat) for _ in range(world_size)]
    dist.all_gather(gathered, flat)
    differing = [r for r in range(world_size) if not torch.equal(gathered[r], gathered[0])]
    worst = {n: (mine[n] - ref[n].float()).abs().max().item() for n in names}
    far = {n: d for n, d in worst.items() if not torch.allclose(mine[n], ref[n].float(), atol=atol, rtol=rtol)}
    # agree on the verdict so that all ranks raise (or pass) together
    bad = torch.tensor([float(bool(far))], device=device())
    dist.all_reduce(bad)
    summary = {
        "steps": steps,
        "identical_across_ranks": not differing,
        "max_abs_diff_vs_reference": max(worst.values()),
    }
    _record_digest(flat)  # fork-only
    assert not differing, f"parameters differ from rank 0's on ranks {differing}"
    assert bad.item() == 0, (f"parameters differ from the plain-PyTorch reference on {int(bad.item())} rank(s); "
                             f"here: {far}")
    return summary


# ZeRO-1/2 configurations every lockstep scenario runs under: overlap_comm x contiguous_gradients x
# reduce_scatter, then multi-rank bucket all-reduce off, small buckets (several buckets, and every weight
# larger than the bucket), CPU offload, bf16 and gradient accumulation.
ZERO12_CONFIGS = {
    f"overlap{int(o)}-contig{int(c)}-rs{int(r)}": dict(overlap_comm=o, contiguous_gradients=c, reduce_scatter=r)
    for o in (False, True)
    for c in (False, True)
    for r in (False, True)
}
ZERO12_CONFIGS.update({
    "rs0-multirank0": dict(reduce_scatter=False, use_multi_rank_bucket_allreduce=False),
    "bucket100": dict(reduce_bucket_size=100, overlap_comm=True),
    "bucket40-xl": dict(reduce_bucket_size=40),
    "offload": dict(offload_optimizer={"device": "cpu"}),
    "bf16": dict(bf16=True),
    "gas2": dict(gradient_accumulation_steps=2, overlap_comm=True),
})

# ZeRO-3 configurations: reduce-scatter or the contiguous all-reduce path, contiguous gradients on/off,
# small buckets (several per micro-step, and weights larger than a bucket; with the per-bucket sanity
# check), bf16, gradient accumulation and CPU offload of the optimizer.
ZERO3_CONFIGS = {
    f"contig{int(c)}-rs{int(r)}": dict(contiguous_gradients=c, reduce_scatter=r)
    for c in (False, True)
    for r in (False, True)
}
ZERO3_CONFIGS.update({
    "bucket40-xl": dict(reduce_bucket_size=40),
    "bucket100-rs0": dict(reduce_bucket_size=100, reduce_scatter=False),
    "bucket100-sanity": dict(reduce_bucket_size=100, enable_sanity_checks=True),
    "offload": dict(offload_optimizer={"device": "cpu"}),
    "bf16": dict(bf16=True),
    "gas2": dict(gradient_accumulation_steps=2),
})


# fork-only: begin (scripts/fork.py verify compares recorded digests; `fork.py pr` leaves this out)
def _record_digest(flat):
    record_for_verify(hashlib.sha256(flat.cpu().numpy().tobytes()).hexdigest())


def record_for_verify(text):
    """With $LOCKSTEP_RECORD_DIR set (scripts/fork.py verify does), rank 0 writes ``text`` (a digest of the
    final parameters, or counts) for the running test, so that runs against upstream and the fork can be
    compared exactly ("same numbers" in the verify table)."""
    out = os.environ.get("LOCKSTEP_RECORD_DIR")
    test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
    if not out or not test or dist.get_rank() != 0:
        return
    name = re.sub(r"[^A-Za-z0-9_.\[\]-]+", "_", test.split("::", 1)[-1])
    Path(out, name + ".sha256").write_text(text)


# fork-only: end
