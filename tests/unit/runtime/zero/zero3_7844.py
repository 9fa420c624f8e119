# Copyright (c) the DeepSpeed lockstep fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The #7844 testcase: a ZeRO-3 training loop shaped like the report.

Six iterations; each rank picks a `route` per step and prints `R{rank} STEP{i} route={x} -> forward`,
`-> backward`, `-> step_begin` and `-> step_end`; a heartbeat thread prints each rank's phase and its
age, and a watchdog prints `BUG_SIGNAL: HANG ...` when a phase lasts too long (the harness deadline then
fails the test with every rank's stack). After the loop the ranks check together that every rank reached
`step_end` of every iteration, that the parameters are identical across ranks and that they equal a
plain-PyTorch reference (gradients averaged over ranks, zeros where a rank produced none).

The variants are the ways rank-dependent data breaks ZeRO-3's collective schedule: a route chosen per
rank, a parameter used on some ranks only inside a module every rank runs, routes that diverge only after
the trace was recorded, and modules that run on some ranks only (declared conditional, or resident).
"""

import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Tuple

import torch

import deepspeed
import deepspeed.comm as dist
from unit.runtime.zero.lockstep_scenarios import (LR, SEED, WEIGHT_DECAY, assert_lockstep, device, full_params,
                                                  reference_training, zero_config)

HIDDEN = 16
MICRO_BATCH = 4
ITERATIONS = 6


class Gate(torch.nn.Module):
    """Runs on every rank; its `boost` weight takes part only when the batch asks for it."""

    def __init__(self, hidden):
        super().__init__()
        self.proj = torch.nn.Linear(hidden, hidden)
        self.boost = torch.nn.Parameter(torch.full((hidden, ), 0.5))

    def forward(self, h, boost):
        out = self.proj(h)
        if boost:
            out = out * (1 + self.boost)
        return h + torch.tanh(out)


class RouteNet(torch.nn.Module):
    """route 0 runs r0, 1 runs r1 (the same size), 2 runs r0 twice, 3 runs both; `vision` runs only on
    batches with an image, `badge` (small enough to stay resident under a persistence threshold of 100)
    only on batches with a badge; `tiny` has fewer elements than there are ranks."""

    def __init__(self, hidden=HIDDEN):
        super().__init__()
        self.inp = torch.nn.Linear(hidden, hidden)
        self.r0 = torch.nn.Linear(hidden, hidden)
        self.r1 = torch.nn.Linear(hidden, hidden)
        self.gate = Gate(hidden)
        self.vision = torch.nn.Linear(hidden, hidden)
        self.badge = torch.nn.Linear(4, hidden)
        self.out = torch.nn.Linear(hidden, 1)
        self.tiny = torch.nn.Parameter(torch.ones(1))

    def forward(self, x, route, boost=False, image=None, badge=None):
        h = torch.tanh(self.inp(x))
        for _ in range(2 if route == 2 else 1 if route in (0, 3) else 0):
            h = h + torch.tanh(self.r0(h))
        if route in (1, 3):
            h = h + torch.tanh(self.r1(h))
        h = self.gate(h, boost)
        if image is not None:
            h = h + torch.tanh(self.vision(image))
        if badge is not None:
            h = h + torch.tanh(self.badge(badge))
        return (self.out(h) * self.tiny).pow(2).mean()


@dataclass(frozen=True)
class Variant:
    name: str
    description: str
    # (rank, step) -> (route, use the gate's boost, batch has an image, batch has a badge)
    usage: Callable[[int, int], Tuple[int, bool, bool]]
    conditional: Tuple[str, ...] = ()  # submodules declared as running on some ranks only
    zero: Tuple[Tuple[str, object], ...] = ()  # zero_optimization overrides


VARIANTS = {
    v.name: v
    for v in [
        Variant("same_route", "the report's log: route 0 on every rank (control)", lambda r, s:
                (0, False, False, False)),
        Variant("inner_param", "route 0 everywhere; the gate, run by every rank, uses its boost on rank 0 only",
                lambda r, s: (0, r == 0, False, False)),
        Variant("rank_routes", "equal-size rank-dependent routes: even ranks r0, odd ranks r1", lambda r, s:
                (r % 2, False, False, False)),
        Variant("late_divergence", "route 0 on every rank for steps 0-1, rank-dependent from step 2", lambda r, s:
                (0 if s < 2 else r % 2, False, False, False)),
        Variant("conditional_vision",
                "a vision tower declared conditional, run only on image batches (rank 0, and odd steps elsewhere); "
                "nothing else persistent",
                lambda r, s: (3, False, r == 0 or s % 2 == 1, False),
                conditional=("vision", ),
                zero=(("stage3_param_persistence_threshold", 0), )),
        Variant("resident_badge",
                "an undeclared small module (resident under a persistence threshold of 100) run on rank 0 only, "
                "every other module fetched",
                lambda r, s: (3, False, True, r == 0),
                zero=(("stage3_param_persistence_threshold", 100), )),
        Variant("conditional_routes",
                "rank_routes with r0 and r1 declared conditional and nothing else persistent",
                lambda r, s: (r % 2, False, False, False),
                conditional=("r0", "r1"),
                zero=(("stage3_param_persistence_threshold", 0), )),
    ]
}


def make_model(variant):
    torch.manual_seed(SEED)
    model = RouteNet()
    for name in variant.conditional:
        deepspeed.zero.register_conditional_module(getattr(model, name))
    return model


def make_optimizer(model):
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9, weight_decay=WEIGHT_DECAY)


def batch(variant, rank, step, dtype=torch.float32, device="cpu"):
    route, boost, has_image, has_badge = variant.usage(rank, step)
    g = torch.Generator().manual_seed(SEED + 1000 * rank + step)
    x = torch.randn(MICRO_BATCH, HIDDEN, generator=g).to(device, dtype)
    image = torch.randn(MICRO_BATCH, HIDDEN, generator=g).to(device, dtype) if has_image else None
    badge = torch.randn(MICRO_BATCH, 4, generator=g).to(device, dtype) if has_badge else None
    return x, route, boost, image, badge


class Phases:
    """The report's markers, a heartbeat and a watchdog."""

    def __init__(self, rank, heartbeat_s=2.0, watchdog_s=20.0, out=sys.stdout):
        self.rank, self.step, self.route, self.phase = rank, 0, None, "init"
        self.since = time.monotonic()
        self.heartbeat_s, self.watchdog_s, self.out = heartbeat_s, watchdog_s, out
        self.log = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, daemon=True)
        self._thread.start()

    def mark(self, step, route, phase):
        self.step, self.route, self.phase, self.since = step, route, phase, time.monotonic()
        self.log.append((step, phase))
        print(f"R{self.rank} STEP{step} route={route} -> {phase}", file=self.out, flush=True)

    def _beat(self):
        signalled = False
        while not self._stop.wait(self.heartbeat_s):
            age = time.monotonic() - self.since
            print(f"HEARTBEAT rank={self.rank} step={self.step} phase={self.phase} age={age:.1f}s",
                  file=self.out,
                  flush=True)
            if age > self.watchdog_s and not signalled:
                signalled = True
                print(
                    f"BUG_SIGNAL: HANG step={self.step} route={self.route} timeout>{self.watchdog_s:.0f}s "
                    f"last_phase={self.phase}",
                    file=self.out,
                    flush=True)

    def stop(self):
        self._stop.set()
        self._thread.join()


def run_7844(variant_name, bf16=False, out=sys.stdout, **zero):
    """Run the testcase on this rank; returns the checked summary (raises on every rank together)."""
    variant = VARIANTS[variant_name]
    rank = dist.get_rank()
    config = zero_config(3, bf16=bf16, **dict(variant.zero), **zero)
    model = make_model(variant)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=make_optimizer(model), config=config)
    dtype = next(engine.module.parameters()).dtype
    phases = Phases(rank, out=out)
    try:
        for step in range(ITERATIONS):
            x, route, boost, image, badge = batch(variant, rank, step, dtype, device=device())
            phases.mark(step, route, "forward")
            loss = engine(x, route, boost, image, badge)
            phases.mark(step, route, "backward")
            engine.backward(loss)
            phases.mark(step, route, "step_begin")
            engine.step()
            phases.mark(step, route, "step_end")
    finally:
        phases.stop()
    # Every rank reached step_end of every iteration, or the harness deadline fails the test with each rank's
    # stack. The counts are gathered for the report (the demo prints them), not checked: once every rank is
    # here, they cannot differ.
    ends = torch.tensor([sum(1 for _, phase in phases.log if phase == "step_end")], device=device())
    gathered = [torch.zeros_like(ends) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, ends)

    mine = full_params(engine.module, 3)
    reference_model = make_model(variant)
    ref = reference_training(reference_model, make_optimizer(reference_model), dist.get_world_size(), ITERATIONS, 1,
                             lambda r, s, m: reference_model(*batch(variant, r, s)))
    summary = assert_lockstep(mine, ref, config, ITERATIONS)
    summary["step_end_per_rank"] = [int(t) for t in gathered]
    return summary
