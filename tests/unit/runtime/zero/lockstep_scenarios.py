# Copyright (c) the DeepSpeed lockstep fork authors.
# SPDX-License-Identifier: Apache-2.0
"""Training scenarios with rank-dependent parameter usage, and their independent oracle.

Every scenario trains a tiny LLaVA-like model with DeepSpeed on each rank and checks, on all ranks
together (so they fail together):
  1. the parameters are bitwise identical across ranks;
  2. they equal a plain-PyTorch reference that replays the same data in one process, averaging each
     parameter's gradient over the ranks with zeros where a rank produced none (what DDP with
     find_unused_parameters=True computes), then applying the same optimizer.
The reference knows nothing of ZeRO: a gradient that is dropped, mixed up with another parameter's
or reduced twice moves the parameters by about the learning rate, far above the tolerance.
Used by tests/unit/runtime/zero/test_*lockstep*.py and by scripts/demo.py.
"""

from dataclasses import dataclass
from typing import Callable, Dict

import torch

import deepspeed
import deepspeed.comm as dist

HIDDEN = 8
MICRO_BATCH = 2
LR = 0.05
SEED = 1234
CLIP = 1.0  # global-norm clipping, so the norm collectives are part of every check


class TinyLlava(torch.nn.Module):
    """A text path every batch uses and an image projector used only on batches with an image."""

    def __init__(self, hidden=HIDDEN):
        super().__init__()
        self.embed = torch.nn.Linear(hidden, hidden)
        self.image_proj = torch.nn.Linear(hidden, hidden)
        self.block = torch.nn.Linear(hidden, hidden)
        self.head = torch.nn.Linear(hidden, 1)

    def forward(self, x, image):
        h = self.embed(x)
        if image is not None:
            h = h + self.image_proj(image)
        h = torch.tanh(self.block(torch.tanh(h)))
        return self.head(h).pow(2).mean()


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    uses_image: Callable[[int, int, int], bool]  # (rank, step, micro_step) -> does this batch have an image?


SCENARIOS: Dict[str, Scenario] = {
    s.name: s
    for s in [
        Scenario("uniform", "every rank sees an image on every batch", lambda rank, step, micro: True),
    ]
}


def batch(rank, step, micro, dtype=torch.float32, uses_image=True):
    g = torch.Generator().manual_seed(SEED + 1000 * rank + 10 * step + micro)
    x = torch.randn(MICRO_BATCH, HIDDEN, generator=g)
    image = torch.randn(MICRO_BATCH, HIDDEN, generator=g)
    return x.to(dtype), (image.to(dtype) if uses_image else None)


def zero_config(stage, gradient_accumulation_steps=1, **zero_overrides):
    zero = {"stage": stage}
    zero.update(zero_overrides)
    return {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": gradient_accumulation_steps,
        "zero_optimization": zero,
        "gradient_clipping": CLIP,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def make_model():
    torch.manual_seed(SEED)
    return TinyLlava()


def make_optimizer(params):
    # SGD with momentum is linear in the gradient, so float noise stays float noise. (Adam's first
    # step is lr * sign(g): a near-zero gradient element flips by 2 * lr on rounding alone.)
    return torch.optim.SGD(params, lr=LR, momentum=0.9, weight_decay=0.01)


def _full_params(model, stage):
    params = list(model.named_parameters())
    if stage == 3:
        with deepspeed.zero.GatheredParameters([p for _, p in params]):
            return {n: p.detach().float().clone() for n, p in params}
    return {n: p.detach().float().clone() for n, p in params}


def train_deepspeed(scenario: Scenario, config, steps):
    """Train on this rank; returns {name: full parameter} after `steps` optimizer steps."""
    rank = dist.get_rank()
    stage = config["zero_optimization"]["stage"]
    model = make_model()
    engine, _, _, _ = deepspeed.initialize(model=model,
                                           optimizer=make_optimizer(model.parameters()),
                                           config=config)
    gas = engine.gradient_accumulation_steps()
    for step in range(steps):
        for micro in range(gas):
            x, image = batch(rank, step, micro, uses_image=scenario.uses_image(rank, step, micro))
            loss = engine(x, image)
            engine.backward(loss)
            engine.step()
    return _full_params(engine.module, stage)


def train_reference(scenario: Scenario, world_size, steps, gradient_accumulation_steps=1):
    """Plain PyTorch, one process: per-rank gradients averaged over ranks (zeros where absent), clipped
    by global norm, then the same optimizer."""
    model = make_model()
    opt = make_optimizer(model.parameters())
    params = list(model.parameters())
    for step in range(steps):
        total = [torch.zeros_like(p) for p in params]
        for rank in range(world_size):
            for micro in range(gradient_accumulation_steps):
                x, image = batch(rank, step, micro, uses_image=scenario.uses_image(rank, step, micro))
                loss = model(x, image) / gradient_accumulation_steps
                grads = torch.autograd.grad(loss, params, allow_unused=True)
                for t, g in zip(total, grads):
                    if g is not None:
                        t += g
        for p, t in zip(params, total):
            p.grad = t / world_size
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def check_lockstep(scenario_name, config, steps, atol=1e-6, rtol=1e-5):
    """Train with DeepSpeed on every rank and check both oracles; every rank raises together.

    Returns a summary dict (used by the demo)."""
    scenario = SCENARIOS[scenario_name]
    world_size = dist.get_world_size()
    mine = train_deepspeed(scenario, config, steps)
    names = sorted(mine)
    flat = torch.cat([mine[n].flatten() for n in names])
    gathered = [torch.zeros_like(flat) for _ in range(world_size)]
    dist.all_gather(gathered, flat)
    differing = [r for r in range(world_size) if not torch.equal(gathered[r], gathered[0])]
    ref = train_reference(scenario, world_size, steps, config.get("gradient_accumulation_steps", 1))
    worst = {n: (mine[n] - ref[n]).abs().max().item() for n in names}
    far = {n: d for n, d in worst.items() if not torch.allclose(mine[n], ref[n], atol=atol, rtol=rtol)}
    # agree on the verdict so that all ranks raise (or pass) together
    bad = torch.tensor([float(bool(far))])
    dist.all_reduce(bad)
    summary = {
        "steps": steps,
        "identical_across_ranks": not differing,
        "max_abs_diff_vs_reference": max(worst.values()),
    }
    assert not differing, f"parameters differ from rank 0's on ranks {differing}"
    assert bad.item() == 0, (f"parameters differ from the plain-PyTorch reference on {int(bad.item())} rank(s); "
                             f"here: {far}")
    return summary
