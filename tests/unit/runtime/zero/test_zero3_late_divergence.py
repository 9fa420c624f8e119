# Copyright (c) the DeepSpeed lockstep fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""ZeRO-3 with the default ``fetch_agreement`` ("auto"), no declaration: the ranks run the same modules at
the first optimizer step (so they agree on the module trace there, and fetch by it with prefetching) and
different ones later. A rank skips a module the trace has (no images any more, an expert without tokens),
runs one the trace lacks (the first batches had no images), runs modules in another order, uses a parameter
of a module every rank runs on some ranks only (its gradient bucket is ready at a rank-dependent point), or
an evaluation after uniform training routes tokens differently per rank. Without the fetch schedule the ranks
issue different all-gathers there: gloo aborts (size mismatch), NCCL hangs.

Oracles: every rank finishes within the deadline; parameters identical across ranks and equal to a
plain-PyTorch reference (a gradient missing on a rank counts as zero); evaluation losses equal the
reference model's; parameters partitioned at rest after each step."""

import contextlib

import pytest
import torch

import deepspeed
import deepspeed.comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

from unit.common import DistributedTest
from unit.runtime.zero.lockstep_scenarios import (SEED, Scenario, agree_on_every_rank, assert_lockstep, batch, device,
                                                  full_params, make_engine, make_model, make_optimizer,
                                                  reference_training, train_against_reference, train_deepspeed,
                                                  train_reference, zero_config)
from unit.runtime.zero.moe_scenarios import check_evaluation, experts_used, moe_batch, moe_model, moe_optimizer

STEPS = 4

# (rank, step, micro) -> (image?, route): the same modules on every rank at step 0, different ones later.
# Each names whether a rank leaves the fetch schedule agreed at step 0 (it runs a module the schedule lacks
# there, or runs modules in another order) or only skips modules of it.
LEAVES = {"extra_after_uniform", "order_after_uniform"}
LATE = {
    # rank 1 stops getting images: it skips a module the agreed trace holds
    "skip_after_uniform": lambda r, s, m: (r == 0 or s == 0, "ab"),
    # no images anywhere at step 0, then on rank 0 only: a module the agreed trace does not hold
    "extra_after_uniform": lambda r, s, m: (r == 0 and s > 0, "ab"),
    # rank 1 runs the two branches in the other order from step 1 on
    "order_after_uniform": lambda r, s, m: (True, "ab" if r == 0 or s == 0 else ("b", "a")),
    # different at step 1, the same again at step 2 (the trace is agreed again), different at step 3
    "differ_agree_differ": lambda r, s, m: (r == 0 or s % 2 == 0, "ab"),
    # every rank leaves the trace the same way at step 2 (no image anywhere): nothing differs across ranks
    "all_change_together": lambda r, s, m: (s < 2, "ab"),
    # a rank leaves the trace in its second micro-step only
    "second_micro_step": lambda r, s, m: (not (r == 1 and s > 0 and m == 1), "ab"),
}

CONFIGS = {
    "default": {},
    "gas2": dict(gradient_accumulation_steps=2),
    "bucket100": dict(reduce_bucket_size=100),
    "contig0-rs0": dict(contiguous_gradients=False, reduce_scatter=False),
    "persist": dict(stage3_param_persistence_threshold=20),  # small parameters resident, the others fetched
    # prefetch one small parameter ahead, or none: the fetches come one module at a time
    "prefetch64": dict(stage3_prefetch_bucket_size=64),
    "prefetch0": dict(stage3_prefetch_bucket_size=0),
    "offload-param": dict(offload_param={"device": "cpu"}),
}

# prefetch one small parameter ahead at most, so that a fetch is not already done for the rest of the pass
# when a rank starts to differ (real models prefetch a few layers ahead, not the whole model)
SHORT_PREFETCH = dict(stage3_prefetch_bucket_size=64)


def _config(**overrides):
    options = dict(stage3_param_persistence_threshold=0)  # every parameter partitioned and fetched
    options.update(overrides)
    return zero_config(3,
                       gradient_accumulation_steps=options.pop("gradient_accumulation_steps", 1),
                       bf16=False,
                       **options)


@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("usage", sorted(LATE))
class TestModulesDifferAfterUniformStep(DistributedTest):
    world_size = 2
    exec_timeout = 60

    def test_lockstep(self, usage, config):
        if usage == "second_micro_step" and config != "gas2":
            pytest.skip("needs two micro-steps")
        scenario = Scenario(usage, usage, LATE[usage])
        config = _config(**CONFIGS[config])
        engines = []
        mine = train_deepspeed(scenario, config, steps=STEPS, engine_out=engines)
        ref = train_reference(scenario, dist.get_world_size(), STEPS, config["gradient_accumulation_steps"])
        assert_lockstep(mine, ref, config, STEPS)
        _assert_replayed(engines[0], leaves=usage in LEAVES)


def _seeded(model_class):
    """A function that builds ``model_class()`` from the same seed each time."""

    def model_of():
        torch.manual_seed(SEED)
        return model_class()

    return model_of


def _assert_replayed(engine, leaves):
    """The ranks replayed the schedule agreed at step 0: a rank that skipped modules took part in their
    fetches without a vote (no switch), one that left the schedule made every rank switch to votes."""
    schedule = engine.optimizer.parameter_offload.get_param_coordinator().fetch_schedule
    replayed = torch.tensor([schedule.replayed], device=device())
    dist.all_reduce(replayed)
    assert replayed.item() > 0, "no rank replayed a skipped event"
    assert (schedule.switches > 0) == leaves, f"{schedule.switches} switches to votes"


@pytest.mark.parametrize("usage", ["extra_after_uniform", "skip_after_uniform"])
@pytest.mark.parametrize("prefetch", ["short", "default"])
class TestTrainingForwardWithoutBackward(DistributedTest):
    """At step 1 a training-mode forward with autograd on (its loss dropped, no backward) runs before the
    step's real forward and backward: rank 0 runs the image projector there, which the schedule agreed at
    step 0 lacks (it leaves the schedule; no images elsewhere), or rank 1 skips it (images everywhere
    else). Parameters are released after each use
    (``stage3_max_reuse_distance: 0``), so the backward fetches again. The schedule has no second forward
    before a backward: at the forward after the dropped one every rank leaves the schedule (it replays the
    backward that did not come) and the ranks switch to votes for the rest of the step; that forward's
    gradients count nowhere."""
    world_size = 2
    exec_timeout = 60

    def test_lockstep(self, usage, prefetch):
        dropped = Scenario(usage, usage, LATE[usage])
        images = usage != "extra_after_uniform"  # the step's own batches: images everywhere, or nowhere
        scenario = Scenario("images" if images else "no_images", "", lambda r, s, m: (images, "ab"))
        config = _config(stage3_max_reuse_distance=0, **(SHORT_PREFETCH if prefetch == "short" else {}))
        engine = make_engine(scenario, config)
        rank = dist.get_rank()
        for step in range(STEPS):
            if step == 1:
                x, image, route = batch(dropped, rank, step, 0, device=device())
                engine(x, image, route)
            x, image, route = batch(scenario, rank, step, 0, device=device())
            engine.backward(engine(x, image, route))
            engine.step()
        mine = full_params(engine.module, 3)
        assert_lockstep(mine, train_reference(scenario, dist.get_world_size(), STEPS), config, STEPS)
        _assert_replayed(engine, leaves=True)
        # the step after the dropped forward's replayed its second forward's fetches; the ranks agreed there
        # on a schedule of one forward again
        forwards = engine.optimizer.parameter_offload.get_param_coordinator().fetch_schedule.forwards
        agree_on_every_rank(forwards == 1, f"the schedule has {forwards} forwards before its backward")


@pytest.mark.parametrize("usage", ["uniform", "skip_after_uniform", "extra_after_uniform"])
class TestTwoForwardsOneBackward(DistributedTest):
    """Each micro-step runs two training forwards of its batch and one backward of their mean (a model
    called twice per loss): the schedule agreed at step 0 has both forwards before the backward, so with
    uniform usage no rank replays anything (no backward replayed at the second forward) and nothing is
    voted. The gradients equal one forward's; the ranks may differ after step 0 as above."""
    world_size = 2
    exec_timeout = 60

    def test_lockstep(self, usage):
        scenario = Scenario(usage, usage, LATE.get(usage, lambda r, s, m: (True, "ab")))
        config = _config(stage3_max_reuse_distance=0, **SHORT_PREFETCH)
        engine = make_engine(scenario, config)
        rank = dist.get_rank()
        for step in range(STEPS):
            x, image, route = batch(scenario, rank, step, 0, device=device())
            engine.backward((engine(x, image, route) + engine(x, image, route)) / 2)
            engine.step()
        mine = full_params(engine.module, 3)
        assert_lockstep(mine, train_reference(scenario, dist.get_world_size(), STEPS), config, STEPS)
        if usage == "uniform":
            schedule = engine.optimizer.parameter_offload.get_param_coordinator().fetch_schedule
            agree_on_every_rank(
                schedule.replayed == 0 and schedule.switches == 0 and schedule.forwards == 2,
                f"uniform usage replayed {schedule.replayed} events, {schedule.switches} switches, "
                f"{schedule.forwards} forwards scheduled")
        else:
            _assert_replayed(engine, leaves=usage in LEAVES)


# (rank, step) -> whether each training forward before the micro-step's one backward gets an image: how many
# forwards a rank runs per loss, and which modules, after uniform step 0
FORWARDS = {
    # step 0: two forwards everywhere; then one on rank 0 (it replays the second one's fetches)
    "fewer_here": lambda r, s: [False] if r == 0 and s > 0 else [False, False],
    # step 0: one forward everywhere; then two on rank 1 (it leaves the schedule at the second one)
    "more_here": lambda r, s: [False, False] if r == 1 and s > 0 else [False],
    # two forwards everywhere; after step 0 rank 0's first one runs the image projector the schedule lacks
    "extra_in_first": lambda r, s: [r == 0 and s > 0, False],
}


@pytest.mark.parametrize("gas", [1, 2], ids=["gas1", "gas2"])
@pytest.mark.parametrize("usage", sorted(FORWARDS))
class TestForwardsPerLossDiffer(DistributedTest):
    """A model called several times per loss (one backward of the mean of its forwards, all of the same
    batch), as many times on every rank at step 0 (the schedule is agreed there), then a different number
    of times per rank (a loss over a rank's own number of chunks), or a module the schedule lacks in the
    first of two forwards. Parameters are released after each use. The gradients equal one forward's (with
    the image projector's share where it ran)."""
    world_size = 2
    exec_timeout = 60

    def test_lockstep(self, usage, gas):
        scenario = Scenario(usage, usage, lambda r, s, m: (True, "ab"))
        config = _config(stage3_max_reuse_distance=0, gradient_accumulation_steps=gas, **SHORT_PREFETCH)
        engine = make_engine(scenario, config)
        rank, world_size = dist.get_rank(), dist.get_world_size()

        def loss_of(model, r, s, m, dev="cpu"):
            x, image, route = batch(scenario, r, s, m, device=dev)
            outs = [model(x, image if with_image else None, route) for with_image in FORWARDS[usage](r, s)]
            return sum(outs) / len(outs)

        for step in range(STEPS):
            for micro in range(gas):  # (with gas 2, a rank that leaves in the first micro-step votes in both)
                engine.backward(loss_of(engine, rank, step, micro, device()))
                engine.step()
        mine = full_params(engine.module, 3)
        ref_model = make_model(scenario)
        ref = reference_training(ref_model, make_optimizer(ref_model, scenario), world_size, STEPS, gas,
                                 lambda r, s, m: loss_of(ref_model, r, s, m))
        assert_lockstep(mine, ref, config, STEPS)
        _assert_replayed(engine, leaves=usage != "fewer_here")


@pytest.mark.parametrize("usage", ["skip_after_uniform", "extra_after_uniform", "order_after_uniform"])
class TestModulesDifferUnderCheckpointing(DistributedTest):
    """The same with the model's block under reentrant activation checkpointing: its forward runs again in
    the middle of backward (the recompute), among backward's fetches."""
    world_size = 2
    exec_timeout = 60

    def test_lockstep(self, usage):
        scenario = Scenario(usage, usage, LATE[usage])
        config = _config(**SHORT_PREFETCH)
        engines = []
        mine = train_deepspeed(scenario, config, steps=STEPS, checkpoint=True, engine_out=engines)
        ref = train_reference(scenario, dist.get_world_size(), STEPS)
        assert_lockstep(mine, ref, config, STEPS)
        _assert_replayed(engines[0], leaves=usage in LEAVES)


class TestMoERoutingDiffersAfterUniformStep(DistributedTest):
    """Per-expert MoE, natural routing: every rank trains on the same batch at step 0 (the same experts
    run everywhere, so the trace is agreed), then on its own batches (experts get tokens on some ranks
    only). The parameters stay partitioned at rest after every step."""
    world_size = 2
    exec_timeout = 90

    def test_lockstep(self):
        data = lambda r, s: moe_batch(0 if s == 0 else r, s)
        check = moe_model()
        agree_on_every_rank(
            any(experts_used(check, data(0, s)) != experts_used(check, data(1, s)) for s in range(1, STEPS)),
            "after step 0 the batches should route tokens to different experts on different ranks")

        def partitioned_at_rest(engine, step):
            assert all(p.ds_status == ZeroParamStatus.NOT_AVAILABLE for p in engine.module.parameters())

        train_against_reference(moe_model, moe_optimizer, lambda r, s: (data(r, s), ), _config(**SHORT_PREFETCH),
                                STEPS, partitioned_at_rest)


class TestEvaluateAfterUniformTraining(DistributedTest):
    """Every rank trains on the same batches (the fetch schedule is agreed at the first step), then each rank
    evaluates its own batches, whose tokens go to different experts per rank, then training goes on with the
    same batches everywhere."""
    world_size = 2
    exec_timeout = 90

    def test_lockstep(self):
        rank, world_size = dist.get_rank(), dist.get_world_size()
        config = _config(**SHORT_PREFETCH)
        model = moe_model()
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=moe_optimizer(model), config=config)
        train_batch = lambda r, s: moe_batch(0, s)  # the same on every rank
        eval_batches = [moe_batch(rank, 100 + i) for i in range(2)]
        for step in range(STEPS):
            if step == 2:
                engine.eval()
                with torch.no_grad():
                    losses = [engine(x.to(device())).item() for x in eval_batches]
                engine.train()
            engine.backward(engine(train_batch(rank, step).to(device())))
            engine.step()
        mine = full_params(engine.module, 3)

        ref_model = moe_model()
        loss_of = lambda r, s, m: ref_model(train_batch(r, s))
        reference_training(ref_model, moe_optimizer(ref_model), world_size, 2, 1, loss_of)
        check_evaluation(losses, ref_model, eval_batches, world_size, rank)

        ref_model = moe_model()
        ref = reference_training(ref_model, moe_optimizer(ref_model), world_size, STEPS, 1,
                                 lambda r, s, m: ref_model(train_batch(r, s)))
        assert_lockstep(mine, ref, config, STEPS)


@pytest.mark.parametrize("mode", ["no_grad", "eval"])
class TestEvaluationRunsAModuleTheScheduleLacks(DistributedTest):
    """Training without images on every rank (the schedule has no projector), then an evaluation forward
    with an image on rank 0 only, under ``torch.no_grad()`` or with the module in eval mode (autograd on):
    rank 0 leaves the schedule and no backward follows, so the flags ride on the evaluation's end, where
    every rank switches to votes. Its loss equals the plain-PyTorch model's; training then goes on."""
    world_size = 2
    exec_timeout = 60

    def test_lockstep(self, mode):
        rank, world_size = dist.get_rank(), dist.get_world_size()
        scenario = Scenario("text_only", "", lambda r, s, m: (False, "ab"))
        config = _config(**SHORT_PREFETCH)
        engine = make_engine(scenario, config)
        evaluated = None
        for step in range(STEPS):
            if step == 2:
                x, image, route = batch(scenario, rank, 100, 0, device=device())
                image = torch.ones_like(x) if rank == 0 else None
                engine.eval()
                with torch.no_grad() if mode == "no_grad" else contextlib.nullcontext():
                    evaluated = engine(x, image, route).item()
                engine.train()
            x, image, route = batch(scenario, rank, step, 0, device=device())
            engine.backward(engine(x, image, route))
            engine.step()
        mine = full_params(engine.module, 3)
        schedule = engine.optimizer.parameter_offload.get_param_coordinator().fetch_schedule
        assert schedule.switches == 1, f"{schedule.switches} switches to votes"

        ref_model = make_model(scenario)
        ref_optimizer = make_optimizer(ref_model, scenario)
        reference_training(ref_model, ref_optimizer, world_size, 2, 1,
                           lambda r, s, m: ref_model(*batch(scenario, r, s, m)))
        with torch.no_grad():
            x, _, route = batch(scenario, rank, 100, 0)
            expected = ref_model(x, torch.ones_like(x) if rank == 0 else None, route).item()
        agree_on_every_rank(
            abs(evaluated - expected) <= 1e-6 + 1e-5 * abs(expected),
            f"rank {rank}: evaluation loss {evaluated}, plain PyTorch {expected}")
        assert_lockstep(mine, train_reference(scenario, world_size, STEPS), config, STEPS)


class GatedLayer(torch.nn.Module):
    """A layer every rank runs; its ``gate`` weight is used only when the batch asks for it."""

    def __init__(self, hidden):
        super().__init__()
        self.main = torch.nn.Parameter(0.3 * torch.randn(hidden, hidden))
        self.gate = torch.nn.Parameter(0.3 * torch.randn(hidden, hidden))

    def forward(self, h, gated):
        out = torch.tanh(h @ self.main)
        if gated:
            out = out + torch.tanh(h @ self.gate)
        return h + out


class GatedModel(torch.nn.Module):

    def __init__(self, hidden=8, layers=4):
        super().__init__()
        self.layers = torch.nn.ModuleList(GatedLayer(hidden) for _ in range(layers))
        self.head = torch.nn.Linear(hidden, 1)

    def forward(self, x, gated):
        for layer in self.layers:
            x = layer(x, gated)
        return self.head(x).pow(2).mean()


class TestParameterUsedOnSomeRanksAfterUniformStep(DistributedTest):
    """Every rank uses the gates at step 0, only rank 0 later: the modules (and the trace) are the same on
    every rank, but the gates' gradients exist on rank 0 only, so with buckets of 100 elements a bucket is
    ready mid-backward on rank 0 and only at the end on rank 1. (Per-fetch agreement without the schedule handles
    this shape too; without either, gloo reports a size mismatch.)"""
    world_size = 2
    exec_timeout = 60

    def test_lockstep(self):
        train_against_reference(_seeded(GatedModel), moe_optimizer, lambda r, s: (moe_batch(r, s), r == 0 or s == 0),
                                _config(reduce_bucket_size=100, **SHORT_PREFETCH), STEPS)


class SharedWeightModel(torch.nn.Module):
    """``shared`` belongs to a module that never runs its own forward; a batch uses it in the last layer, or
    (``early``) in the first one. Backward reaches the first layer last, so an early use makes its gradient
    arrive later in backward than a late use does."""

    def __init__(self, hidden=8, layers=3):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(hidden, hidden) for _ in range(layers))
        self.shared = torch.nn.Linear(hidden, hidden, bias=False)
        self.head = torch.nn.Linear(hidden, 1)

    def forward(self, x, early):
        for i, layer in enumerate(self.layers):
            x = torch.tanh(layer(x))
            if i == (0 if early else len(self.layers) - 1):
                x = x + torch.tanh(x @ self.shared.weight)
        return self.head(x).pow(2).mean()


@pytest.mark.parametrize("prefetch", [64, 0])
class TestGradientArrivesLaterThanAgreed(DistributedTest):
    """Every rank uses ``shared`` in the last layer at step 0 (where its bucket's place in the schedule comes
    from); rank 1 uses it in the first layer later, so its gradient arrives after its bucket was reduced
    (with zeros for it) there, and its forward reads the parameter where the schedule does not fetch it.
    Every rank switches to votes together and the gradient is reduced once more."""
    world_size = 2
    exec_timeout = 60

    def test_lockstep(self, prefetch):
        engine = train_against_reference(_seeded(SharedWeightModel), moe_optimizer, lambda r, s:
                                         (moe_batch(r, s), r == 1 and s > 0),
                                         _config(reduce_bucket_size=100, stage3_prefetch_bucket_size=prefetch), STEPS)
        _assert_replayed(engine, leaves=True)


class ProjectedInput(torch.nn.Module):
    """An image projection added to the raw input on batches with an image: the first block's input needs a
    gradient on those batches only, so its post-backward hook fires on those ranks only."""

    def __init__(self, hidden=8, layers=3):
        super().__init__()
        self.image_proj = torch.nn.Linear(hidden, hidden)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(hidden, hidden) for _ in range(layers))
        self.head = torch.nn.Linear(hidden, 1)

    def forward(self, x, image=None):
        h = x if image is None else x + self.image_proj(image)
        for block in self.blocks:
            h = torch.tanh(block(h))
        return self.head(h).pow(2).mean()


class TestImagesAlternateAcrossRanks(DistributedTest):
    """Images on one rank, then the other, at every step, added to the raw input: after the first step (where
    the ranks vote and their merged events become the schedule) no step votes or switches, and the
    parameters are the reference's."""
    world_size = 2
    exec_timeout = 60

    def test_lockstep(self, monkeypatch):
        from deepspeed.runtime.zero.fetch_ballot import FetchBallot  # new in this change
        polls = []
        real_poll = FetchBallot._poll
        monkeypatch.setattr(FetchBallot, "_poll", lambda ballot, key: polls.append(key) or real_poll(ballot, key))

        def data(r, s):
            g = torch.Generator().manual_seed(SEED + 1000 * r + s)
            x, image = torch.randn(2, 8, generator=g), torch.randn(2, 8, generator=g)
            return x, (image if (r + s) % 2 == 0 else None)

        counts = []

        def count_polls(engine, step):
            counts.append(len(polls) - sum(counts))

        engine = train_against_reference(_seeded(ProjectedInput), moe_optimizer, data,
                                         _config(reduce_bucket_size=100, **SHORT_PREFETCH), STEPS, count_polls)
        schedule = engine.optimizer.parameter_offload.get_param_coordinator().fetch_schedule
        assert counts[0] > 0 and counts[1:] == [0] * (STEPS - 1) and schedule.switches == 0, (counts,
                                                                                              schedule.switches)


class TestVotesOfAnNcclJob(DistributedTest):
    """An NCCL job's votes go on its data-parallel group, as accelerator tensors: ZeRO-3 builds no process
    group of its own (no gloo twin of the data-parallel group). The CPU machine has no NCCL, so every group's
    backend is reported as "nccl" for the whole run (the CPU accelerator's tensors still go through gloo),
    and every process group built through DeepSpeed's comm is recorded; a rank stops getting images after
    the first step."""
    world_size = 2
    exec_timeout = 60

    def test_lockstep(self, monkeypatch):
        from deepspeed.runtime.zero.fetch_ballot import FetchBallot  # new in this change
        polls, built = [], []
        real_poll, real_new_group = FetchBallot._poll, deepspeed.comm.new_group
        monkeypatch.setattr(FetchBallot, "_poll", lambda ballot, key: polls.append(key) or real_poll(ballot, key))
        monkeypatch.setattr(deepspeed.comm, "get_backend", lambda group=None: "nccl")
        monkeypatch.setattr(deepspeed.comm, "new_group",
                            lambda *args, **kwargs: built.append(kwargs) or real_new_group(*args, **kwargs))
        scenario = Scenario("skip_after_uniform", "", LATE["skip_after_uniform"])
        config = _config()
        engine = make_engine(scenario, config)
        built.clear()  # initialize's own groups are upstream's
        rank = dist.get_rank()
        for step in range(STEPS):
            x, image, route = batch(scenario, rank, step, 0, device=device())
            engine.backward(engine(x, image, route))
            engine.step()
        mine = full_params(engine.module, 3)
        assert_lockstep(mine, train_reference(scenario, dist.get_world_size(), STEPS), config, STEPS)
        assert polls, "the first step did not vote"
        assert built == [], f"process groups built after initialize: {built}"


# usages whose ranks differ from the first step on, at every step
FROM_THE_START = {
    "images_on_rank0": lambda r, s, m: (r == 0, "ab"),  # #4933: the projector runs on rank 0 only
    "order_by_rank": lambda r, s, m: (True, "ab" if r == 0 else ("b", "a")),
}


@pytest.mark.parametrize("usage", ["uniform", "skip_after_uniform", "extra_after_uniform", *FROM_THE_START])
@pytest.mark.parametrize("policy", ["auto", "always"])
class TestVotesPerStep(DistributedTest):
    """How many fetch votes each step casts. "auto": the first step votes (no agreed schedule yet) and its
    events, merged over the ranks where they differ, become the schedule; from then on no step votes, with
    uniform usage, when a rank skips modules (it takes part in their fetches without votes), and when the
    ranks differ from the start (the merged schedule holds every rank's modules). A rank that runs a module
    the schedule lacks makes every rank switch to votes for the rest of that step; the schedule then merges
    what the ranks ran. "always": every step votes."""
    world_size = 2
    exec_timeout = 60

    def test_votes(self, usage, policy, monkeypatch):
        from deepspeed.runtime.zero.fetch_ballot import FetchBallot  # new in this change
        polls = []
        real_poll = FetchBallot._poll
        monkeypatch.setattr(FetchBallot, "_poll", lambda ballot, key: polls.append(key) or real_poll(ballot, key))
        scenario = Scenario(usage, "", {**LATE, **FROM_THE_START}.get(usage, lambda r, s, m: (True, "ab")))
        config = _config(fetch_agreement=policy)
        engine = make_engine(scenario, config)
        rank, counts = dist.get_rank(), []
        for step in range(STEPS + 2):
            polls.clear()
            x, image, route = batch(scenario, rank, step, 0, device=device())
            engine.backward(engine(x, image, route))
            engine.step()
            counts.append(len(polls))
        schedule = engine.optimizer.parameter_offload.get_param_coordinator().fetch_schedule
        if policy == "always":
            assert schedule is None and all(c > 0 for c in counts), counts
        elif usage == "extra_after_uniform":  # leaves the schedule at step 1, which then holds the projector
            assert counts[0] > 0 and counts[2:] == [0] * STEPS and schedule.switches == 1, (counts, schedule.switches)
        else:  # the first step votes and its events become the schedule
            assert counts[0] > 0 and counts[1:] == [0] * (STEPS + 1) and schedule.switches == 0, (counts,
                                                                                                  schedule.switches)
        mine = full_params(engine.module, 3)
        assert_lockstep(mine, train_reference(scenario, dist.get_world_size(), STEPS + 2), config, STEPS + 2)


@pytest.mark.parametrize("usage", ["skip_after_uniform", "extra_after_uniform"])
class TestHierarchicalPartitions(DistributedTest):
    """ZeRO++ hierarchical partitioning (``zero_hpz_partition_size``: a secondary copy of the parameters
    partitioned within groups of 2 ranks, fetched from there in backward): four ranks, the same modules at
    step 0, different ones later."""
    world_size = 4
    exec_timeout = 90

    def test_lockstep(self, usage):
        if get_accelerator().device_name() == "cuda" and dist.get_backend() == "gloo":
            pytest.skip("ranks sharing a GPU over gloo: upstream's hpZ group creation calls perform_nocolor_split, "
                        "which a gloo process group of CUDA torch does not have")
        scenario = Scenario(usage, usage, LATE[usage])
        config = _config(zero_hpz_partition_size=2)
        mine = train_deepspeed(scenario, config, steps=STEPS)
        assert_lockstep(mine, train_reference(scenario, dist.get_world_size(), STEPS), config, STEPS)
