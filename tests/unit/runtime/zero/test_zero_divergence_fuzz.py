# Copyright (c) the DeepSpeed lockstep fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Randomized rank-divergent training: a property test of ZeRO's lockstep.

Each seed draws a ZeRO configuration (stage 1, 2 or 3; bucket sizes, gradient accumulation, contiguous
gradients, reduce-scatter, overlap; for ZeRO-3 prefetch, persistence and CPU parameter offload) and, for
every rank, step and micro-step, a program over a residual stack of blocks: which blocks run, in which
order, a block run twice, an activation without parameters, a block under activation checkpointing, the
model called twice per loss, after how many uniform steps the ranks start to differ, an evaluation forward
under ``no_grad`` on every rank with rank-dependent blocks, a mixture-of-experts block whose experts each rank
picks for itself (some, all or none; under checkpointing; an expert's weight read outside the block), and
now and then a rank whose loss has no gradient (a constant beside outputs with a graph, or a model that
returns a constant without any). Whatever the program, every rank must finish within the deadline
with parameters identical across ranks and equal to a plain-PyTorch reference that averages each
gradient over the ranks with zeros where a rank produced none.

The suite runs a few seeds; ``LOCKSTEP_FUZZ_SEEDS=first-last`` runs others (``-m nightly`` a hundred), and a
failing seed is rerun alone with ``-k "seed-<n>"``."""

import os
import random

import pytest
import torch
import torch.utils.checkpoint

import deepspeed
import deepspeed.comm as dist

from unit.common import DistributedTest
from unit.runtime.zero.lockstep_scenarios import (SEED, assert_lockstep, device, full_params, reference_training,
                                                  zero_config)

HIDDEN = 8
STEPS = 4
BLOCKS = 5
EXPERTS = 3


def _seeds(default):
    spec = os.environ.get("LOCKSTEP_FUZZ_SEEDS")
    if not spec:
        return list(default)
    first, _, last = spec.partition("-")
    return list(range(int(first), int(last or first) + 1))


class Experts(torch.nn.Module):
    """A block of experts in a ``ModuleList`` below the model, weighted by a gate: which experts run is the
    program's (a router's) choice, per rank. Where the ranks choose differently, ZeRO-3's fetch agreement
    fetches the experts with their block."""

    def __init__(self):
        super().__init__()
        self.gate = torch.nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.experts = torch.nn.ModuleList([torch.nn.Linear(HIDDEN, HIDDEN) for _ in range(EXPERTS)])

    def forward(self, h, chosen):
        weights = torch.softmax(self.gate(h), dim=-1)
        out = torch.zeros_like(h)
        for e in chosen:
            out = out + weights[:, e:e + 1] * self.experts[e](h)
        return out


class Residual(torch.nn.Module):
    """A residual stack: the embedding and head run on every batch, the blocks as a program says."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(HIDDEN, HIDDEN)
        self.blocks = torch.nn.ModuleList([
            torch.nn.Linear(HIDDEN, HIDDEN),
            torch.nn.Sequential(torch.nn.Linear(HIDDEN, 2 * HIDDEN), torch.nn.GELU(),
                                torch.nn.Linear(2 * HIDDEN, HIDDEN)),
            torch.nn.Linear(HIDDEN, HIDDEN, bias=False),
            torch.nn.Sequential(torch.nn.LayerNorm(HIDDEN), torch.nn.Linear(HIDDEN, HIDDEN)),
            torch.nn.Linear(HIDDEN, HIDDEN),
        ])
        self.act = torch.nn.Tanh()
        self.tied = torch.nn.Linear(HIDDEN, HIDDEN)
        self.tied.weight = self.blocks[4].weight  # a weight two modules share
        self.head = torch.nn.Linear(HIDDEN, 1)
        self.moe = Experts()

    def forward(self, x, program, graphless=False):
        h = self.embed(x)
        for op in program:
            if op == "act":
                h = self.act(h)
            elif op == "tied":
                h = h + 0.5 * self.tied(h)
            elif op == "external":  # a weight read outside its module (as Hugging Face's T5 feed-forward does)
                h = h + 0.5 * torch.nn.functional.linear(h, self.blocks[2].weight)
            elif isinstance(op, tuple) and op[0] == "moe":  # ("moe", experts chosen, under checkpointing)
                if op[2]:
                    h = h + 0.5 * torch.utils.checkpoint.checkpoint(self.moe, h, op[1], use_reentrant=False)
                else:
                    h = h + 0.5 * self.moe(h, op[1])
            elif isinstance(op, tuple) and op[0] == "expert":  # ("expert", e): its weight read outside the block
                h = h + 0.5 * torch.nn.functional.linear(h, self.moe.experts[op[1]].weight)
            elif isinstance(op, tuple):  # ("ckpt", block): under non-reentrant activation checkpointing
                h = h + 0.5 * torch.utils.checkpoint.checkpoint(self.blocks[op[1]], h, use_reentrant=False)
            else:
                h = h + 0.5 * self.blocks[op](h)
        loss = self.head(h).pow(2).mean()
        # every label masked: a model that returns only its loss returns a constant without a graph
        return loss.new_zeros(()) if graphless else loss


def draw_config(seed):
    """The seed's ZeRO configuration: (config, world size)."""
    rng = random.Random(seed)
    stage = rng.choice([1, 2, 3, 3, 3])
    zero = dict(reduce_bucket_size=rng.choice([40, 100, 500_000_000]),
                contiguous_gradients=rng.random() < 0.7,
                reduce_scatter=rng.random() < 0.7)
    if stage < 3:
        zero["overlap_comm"] = rng.random() < 0.5
        if rng.random() < 0.15:
            zero["offload_optimizer"] = {"device": "cpu"}
    else:
        zero.update(stage3_param_persistence_threshold=rng.choice([0, 0, 100]),
                    stage3_prefetch_bucket_size=rng.choice([0, 64, 50_000_000]))
        if rng.random() < 0.15:
            zero["offload_param"] = {"device": "cpu"}
        if rng.random() < 0.2:
            zero.update(stage3_max_live_parameters=rng.choice([64, 200]),
                        stage3_max_reuse_distance=rng.choice([0, 64]))
    config = zero_config(stage, gradient_accumulation_steps=rng.choice([1, 1, 2]), **zero)
    return config, rng.choice([2, 2, 3])


def draw_program(seed, rank, step, micro, evaluation=False):
    """What a rank runs at (step, micro): (programs, one per forward of the loss; how its loss has no gradient:
    None, "constant" beside an output with a graph, or "graphless" when no output has one). Steps before the
    seed's divergence step are the same on every rank."""
    plan = random.Random(f"{seed}-plan")
    uniform_steps = plan.randrange(STEPS)
    divergent = step >= uniform_steps
    rng = random.Random(f"{seed}-{rank if divergent else 'all'}-{step}-{micro}-{evaluation}")
    programs = []
    for _ in range(2 if not evaluation and rng.random() < 0.15 else 1):  # the model called twice per loss
        program = [b for b in range(BLOCKS) if rng.random() < 0.7]
        if rng.random() < 0.3:
            rng.shuffle(program)
        if program and rng.random() < 0.15:
            program.insert(rng.randrange(len(program) + 1), rng.choice(program))  # a block run twice
        for extra in ("act", "tied", "external"):
            if rng.random() < 0.2:
                program.insert(rng.randrange(len(program) + 1), extra)
        if program and rng.random() < 0.15:
            i = rng.randrange(len(program))
            if isinstance(program[i], int):
                program[i] = ("ckpt", program[i])
        _add_experts(
            program,
            random.Random(f"{seed}-{rank if divergent else 'all'}-{step}-{micro}-{evaluation}-"
                          f"{len(programs)}-moe"))
        programs.append(program)
    gradless = None
    if divergent and not evaluation and rng.random() < 0.08:
        gradless = rng.choice(["constant", "graphless"])
    return programs, gradless


def _add_experts(program, rng):
    """The mixture-of-experts ops, drawn from a stream of their own (the other draws stay as they were)."""
    if rng.random() < 0.5:
        chosen = [e for e in range(EXPERTS) if rng.random() < 0.6]
        rng.shuffle(chosen)
        program.insert(rng.randrange(len(program) + 1), ("moe", tuple(chosen), rng.random() < 0.15))
    if rng.random() < 0.1:
        program.insert(rng.randrange(len(program) + 1), ("expert", rng.randrange(EXPERTS)))


def evaluates(seed, step):
    """Whether every rank runs an evaluation forward before the step's training (rank-dependent blocks)."""
    return random.Random(f"{seed}-eval-{step}").random() < 0.25


def draw_input(seed, rank, step, micro):
    g = torch.Generator().manual_seed(SEED + 7919 * seed + 1000 * rank + 10 * step + micro)
    return torch.randn(2, HIDDEN, generator=g)


def _model():
    torch.manual_seed(SEED)
    return Residual()


def _optimizer(model):
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01)


def _loss(model, seed, rank, step, micro, reference=False):
    """(the loss, the model's outputs). The reference's gradless loss is zero times the loss: zero gradients."""
    programs, gradless = draw_program(seed, rank, step, micro)
    x = draw_input(seed, rank, step, micro)
    x = x if reference else x.to(device())  # the reference trains on the CPU
    outputs = [model(x, program, graphless=gradless == "graphless" and not reference) for program in programs]
    loss = sum(outputs)
    if gradless == "constant" and not reference:
        return torch.zeros_like(loss.detach()), outputs
    return (loss * 0.0 if gradless else loss), outputs


def run_seed(seed):
    config, world_size = draw_config(seed)
    assert dist.get_world_size() == world_size, f"seed {seed} draws {world_size} ranks"
    rank, stage = dist.get_rank(), config["zero_optimization"]["stage"]
    gas = config["gradient_accumulation_steps"]
    model = _model()
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=_optimizer(model), config=config)
    for step in range(STEPS):
        if evaluates(seed, step):
            with torch.no_grad():
                programs, _ = draw_program(seed, rank, step, 0, evaluation=True)
                engine(draw_input(seed, rank, step, 0).to(device()), programs[0])
        for micro in range(gas):
            loss, _outputs = _loss(engine, seed, rank, step, micro)
            engine.backward(loss)
            engine.step()
    mine = full_params(engine.module, stage)

    ref_model = _model()
    ref = reference_training(ref_model, _optimizer(ref_model), dist.get_world_size(), STEPS, gas,
                             lambda r, s, m: _loss(ref_model, seed, r, s, m, reference=True)[0])
    assert_lockstep(mine, ref, config, STEPS)


def _cases(seeds):
    """One case per seed, on the number of ranks its draw says (2, or 3 for uneven partitions)."""
    cases = []
    for seed in seeds:
        world_size = draw_config(seed)[1]
        cases.append(pytest.param(seed, id=f"seed-{seed}-ws{world_size}", marks=pytest.mark.world_size(world_size)))
    return cases


class TestDivergenceFuzz(DistributedTest):
    exec_timeout = 90

    @pytest.mark.parametrize("seed", _cases(_seeds(range(6))))
    def test_lockstep(self, seed):
        run_seed(seed)


@pytest.mark.nightly
class TestDivergenceFuzzNightly(DistributedTest):
    exec_timeout = 90

    @pytest.mark.parametrize("seed", _cases(range(100, 200)))
    def test_lockstep(self, seed):
        run_seed(seed)
