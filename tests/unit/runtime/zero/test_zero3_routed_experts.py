# Copyright (c) the DeepSpeed lockstep fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""ZeRO-3, per-expert MoE with natural routing and no declaration: once a forward ran some experts of a
``ModuleList`` and skipped others, every rank fetches the module holding the list (the MoE block) as one,
as a leaf module declared with ``set_z3_leaf_modules`` is fetched, instead of fetching each expert through
its own module hooks and replaying the gathers of the experts it skipped. Oracles: every rank finishes within
the deadline, the parameters are identical across ranks and equal a plain-PyTorch reference (a gradient
missing on a rank counts as zero), they stay partitioned at rest, and the fetch schedule the ranks replay at
the end holds the MoE blocks' fetches and none of their experts' (with ``fetch_agreement: "replay"``, a
block larger than ``stage3_max_live_parameters``, or a container every forward runs wholly or not at all, the
experts keep their own fetches)."""

import collections

import pytest
import torch

import deepspeed
import deepspeed.comm as dist
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from deepspeed.utils import z3_leaf_module

from unit.common import DistributedTest
from unit.runtime.zero.lockstep_scenarios import (SEED, assert_lockstep, device, full_params, reference_training,
                                                  zero_config)
from unit.runtime.zero.moe_scenarios import SwitchMoE, experts_used, moe_batch, moe_model, moe_optimizer, tiny_switch

STEPS = 7  # votes, replay (experts skipped: the blocks coalesce at its step), votes, then replay as one


def _loss(model, batch):
    """A model's loss on a batch: positional arguments, or keyword arguments of a Hugging Face model."""
    return model(**batch).loss if isinstance(batch, dict) else model(*batch)


def _train(config, model, batch_of, steps=STEPS):
    rank = dist.get_rank()
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=moe_optimizer(model), config=config)
    for step in range(steps):
        engine.backward(_loss(engine, batch_of(rank, step, device())))
        engine.step()
        assert all(p.ds_status == ZeroParamStatus.NOT_AVAILABLE for p in engine.module.parameters())
    return engine


def _scheduled_modules(engine):
    """The modules whose forward the fetch schedule the ranks replay fetches for, by name."""
    from deepspeed.runtime.zero.fetch_schedule import FWD_PRE
    schedule = engine.optimizer.parameter_offload.get_param_coordinator().fetch_schedule
    assert schedule.replaying, "the ranks should replay an agreed fetch schedule at the end"
    names = {m.ds_id: name for name, m in engine.module.named_modules()}
    return [names[what] for kind, what in schedule._events if kind == FWD_PRE]


def _check_against_reference(engine, config, model_of, batch_of, steps=STEPS, observe=None):
    """``observe(reference model)`` before it trains (to hook its modules)."""
    ref_model = model_of()
    if observe is not None:
        observe(ref_model)
    ref = reference_training(ref_model, moe_optimizer(ref_model), dist.get_world_size(), steps, 1,
                             lambda r, s, m: _loss(ref_model, batch_of(r, s, "cpu")))
    assert_lockstep(full_params(engine.module, 3), ref, config, steps)


def _moe_batch(rank, step, on):
    return (moe_batch(rank, step).to(on), )


@pytest.mark.parametrize("fetching", ["default", "replay", "max_live"])
class TestRoutedExpertsFetchedWithTheirBlock(DistributedTest):
    world_size = 2
    exec_timeout = 120

    def test_lockstep(self, fetching):
        options = dict(stage3_param_persistence_threshold=0)
        if fetching == "replay":
            options["fetch_agreement"] = "replay"
        elif fetching == "max_live":  # one MoE block (4 experts) is larger than this
            options["stage3_max_live_parameters"] = 200
        config = zero_config(3, **options)
        check_model = moe_model()
        assert any(
            experts_used(check_model, moe_batch(0, s)) != experts_used(check_model, moe_batch(1, s))
            for s in range(STEPS)), "the test data should route tokens to different experts on different ranks"
        assert any(
            len(used) < len(check_model.blocks[0].experts) for s in range(STEPS)
            for used in experts_used(check_model, moe_batch(0, s))), "some forward should skip an expert"

        engine = _train(config, moe_model(), _moe_batch)
        _check_against_reference(engine, config, moe_model, _moe_batch)

        blocks = [m for m in engine.module.modules() if isinstance(m, SwitchMoE)]
        scheduled = _scheduled_modules(engine)
        if fetching == "default":
            assert all(z3_leaf_module(block) for block in blocks)
            assert all(below.ds_coalesced_into is block for block in blocks for below in list(block.modules())[1:])
            assert not [name for name in scheduled if ".experts." in name], scheduled
            assert [name for name in scheduled if name.startswith("blocks.")] == ["blocks.0", "blocks.1"], scheduled
        else:  # each expert keeps its own fetch
            assert not any(z3_leaf_module(block) for block in blocks)
            assert [name for name in scheduled if ".experts." in name], scheduled


SWITCH_SEED = 1255  # tiny_switch's routing: every expert on both ranks for three steps, then not
SWITCH_VOCAB = 64


def _switch():
    torch.manual_seed(SWITCH_SEED)
    return tiny_switch(SWITCH_VOCAB, layers=4, sparse_layers=2)


def _switch_batch(rank, step, on):
    g = torch.Generator().manual_seed(SWITCH_SEED + 1000 * rank + step)
    return dict(input_ids=torch.randint(2, SWITCH_VOCAB, (2, 16), generator=g).to(on),
                labels=torch.randint(2, SWITCH_VOCAB, (2, 16), generator=g).to(on))


class TestHFSwitchExpertsFetchedWithTheirLayer(DistributedTest):
    """Hugging Face Switch Transformers (tiny config, random weights, natural routing, nothing declared): once the
    ranks' routing leaves experts out, each sparse layer's MLP fetches its experts as one module on every rank."""
    world_size = 2
    exec_timeout = 120

    def test_lockstep(self):
        pytest.importorskip("transformers")
        config = zero_config(3, reduce_bucket_size=4096, stage3_param_persistence_threshold=0)
        engine = _train(config, _switch(), _switch_batch, steps=6)
        ran = []  # per forward of the reference, the experts that ran, by sparse layer

        def observe(model):
            for name, m in model.named_modules():
                if name.split(".")[-2:-1] == ["experts"]:
                    layer = name.rsplit(".experts.", 1)[0]
                    m.register_forward_pre_hook(lambda m, i, layer=layer, name=name: ran[-1][layer].add(name))
            model.register_forward_pre_hook(lambda m, i: ran.append(collections.defaultdict(set)))

        _check_against_reference(engine, config, _switch, _switch_batch, steps=6, observe=observe)
        experts = {name: m for name, m in engine.module.named_modules() if name.split(".")[-2:-1] == ["experts"]}
        layers = {name.rsplit(".experts.", 1)[0] for name in experts}
        routed = {layer for forward in ran for layer, names in forward.items() if 0 < len(names) < 4}
        coalesced = {
            layer
            for layer in layers if all(
                getattr(experts[f"{layer}.experts.{e}"], "ds_coalesced_into", None) is not None
                for e in ("expert_0", "expert_1", "expert_2", "expert_3"))
        }
        # the first step's forwards run every expert: what a forward skipped is known only from what ran before
        assert not [layer for forward in ran[:self.world_size]
                    for layer, names in forward.items() if len(names) < 4], ran[:self.world_size]
        # every layer a forward ran in part is fetched as one, whether that step replayed a schedule or voted
        assert coalesced == routed, (coalesced, routed)
        assert all(z3_leaf_module(engine.module.get_submodule(layer)) for layer in coalesced)
        scheduled = _scheduled_modules(engine)
        assert not [name for name in scheduled if ".experts." in name and name.split(".experts.")[0] in coalesced]
        assert [name for name in scheduled if name in coalesced], scheduled


class Picked(torch.nn.Module):
    """A block whose experts (a ModuleList) run as the batch picks them."""

    def __init__(self, hidden, experts=3):
        super().__init__()
        self.mix = torch.nn.Linear(hidden, hidden)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(hidden, hidden) for _ in range(experts))

    def forward(self, h, picked):
        h = torch.tanh(self.mix(h))
        return h + sum(torch.tanh(self.experts[e](h)) for e in picked)


class PickedModel(torch.nn.Module):

    def __init__(self, hidden=8):
        super().__init__()
        self.embed = torch.nn.Linear(hidden, hidden)
        self.blocks = torch.nn.ModuleList(Picked(hidden) for _ in range(2))
        self.head = torch.nn.Linear(hidden, 1)

    def forward(self, x, picks):
        h = self.embed(x)
        for block, picked in zip(self.blocks, picks):
            h = block(h, picked)
        return self.head(h).pow(2).mean()


def _picked_model():
    torch.manual_seed(SEED)
    return PickedModel()


EVERY = (0, 1, 2)
# (step, rank) -> the experts each block runs (every one elsewhere): block 0 in part on rank 0 in step 1 (the
# ranks replay the schedule of step 0), block 1 in part on rank 1 in step 2 only (the step that votes after
# block 0 was coalesced)
PICKS = {(1, 0): ((0, ), EVERY), (2, 1): (EVERY, (1, 2))}


def _picked_batch(rank, step, on):
    g = torch.Generator().manual_seed(SEED + 1000 * rank + step)
    return torch.randn(3, 8, generator=g).to(on), PICKS.get((step, rank), (EVERY, EVERY))


class TestRoutedOnlyWhileVotingCoalesces(DistributedTest):
    """A block whose experts a rank ran in part only in a step that votes (after another block was coalesced,
    every other step running them all) is fetched as one from the step after it too."""
    world_size = 2
    exec_timeout = 120

    def test_lockstep(self):
        config = zero_config(3, stage3_param_persistence_threshold=0)
        engine = _train(config, _picked_model(), _picked_batch, steps=6)
        _check_against_reference(engine, config, _picked_model, _picked_batch, steps=6)
        coalesced = [i for i, block in enumerate(engine.module.blocks) if z3_leaf_module(block)]
        assert coalesced == [0, 1], f"blocks fetched as one: {coalesced}"
        scheduled = _scheduled_modules(engine)
        assert not [name for name in scheduled if ".experts." in name], scheduled
        assert [name for name in scheduled if name.startswith("blocks.")] == ["blocks.0", "blocks.1"], scheduled


class Tower(torch.nn.Module):
    """An image tower whose layers sit in a ModuleList: a forward runs all of them or none."""

    def __init__(self, hidden):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(hidden, hidden) for _ in range(2))

    def forward(self, image):
        for layer in self.layers:
            image = torch.tanh(layer(image))
        return image


class TowerModel(torch.nn.Module):

    def __init__(self, hidden=8):
        super().__init__()
        self.embed = torch.nn.Linear(hidden, hidden)
        self.tower = Tower(hidden)
        self.head = torch.nn.Linear(hidden, 1)

    def forward(self, x, image=None):
        h = self.embed(x)
        if image is not None:
            h = h + self.tower(image)
        return self.head(h).pow(2).mean()


def _tower_model():
    torch.manual_seed(SEED)
    return TowerModel()


def _tower_batch(rank, step, on):
    g = torch.Generator().manual_seed(SEED + 1000 * rank + step)
    x = torch.randn(3, 8, generator=g).to(on)
    image = torch.randn(3, 8, generator=g).to(on) if (rank + step) % 2 == 0 else None
    return x, image


class TestTowerSkippedWhollyKeepsItsLayersFetches(DistributedTest):
    """A container whose children a forward runs all or none of (an image tower on text-only batches) is not
    routing: its layers keep their own fetches (fetching the tower as one would only hold more memory)."""
    world_size = 2
    exec_timeout = 120

    def test_lockstep(self):
        config = zero_config(3, stage3_param_persistence_threshold=0)
        engine = _train(config, _tower_model(), _tower_batch)
        _check_against_reference(engine, config, _tower_model, _tower_batch)
        assert not z3_leaf_module(engine.module.tower)
        assert [name for name in _scheduled_modules(engine) if name.startswith("tower.layers.")], \
            _scheduled_modules(engine)


# Single-process: the fetch schedule marks the host, the step agreement makes every rank coalesce. (The fakes are
# imported in each test, so that the distributed tests above also run where these mechanisms do not exist.)


@pytest.fixture
def ranks(monkeypatch):
    from unit.runtime.zero import lockstep_fakes as fakes
    return fakes.thread_ranks(monkeypatch)


def test_a_forward_that_runs_part_of_a_container_marks_its_host():
    """Modules 1 and 2 are the children of one container held by module 9 (its first container): a forward that skips one and runs the
    other (an MoE layer's experts) marks 9; one that runs both, or skips both (a tower not used), does not."""
    from unit.runtime.zero import lockstep_fakes as fakes
    for order, marked in (([0, 1, 3], [9]), ([0, 2, 3], [9]), ([0, 1, 2, 3], []), ([0, 3], [])):
        schedule, rank = fakes.agreed()
        schedule.watch_routing({1: (9, 0), 2: (9, 0)}, {(9, 0): [1, 2]})  # container 0 of module 9
        fakes.micro_step(schedule, rank, order)
        assert schedule.take_routed_hosts() == marked, order
        assert schedule.take_routed_hosts() == []  # taken once per step
        assert rank.log == fakes.uniform_log(), "a rank that skips modules issues the same collectives"


def test_a_forward_that_votes_marks_the_host_of_a_container_it_ran_in_part():
    """While the ranks vote (no schedule replayed), a forward that runs a container's children in part marks its
    host where a child it skipped ran here before or is in the last agreed schedule; nothing is known skipped in
    the first forward, and a container skipped wholly is not marked."""
    from deepspeed.runtime.zero.fetch_schedule import FetchSchedule
    from unit.runtime.zero import lockstep_fakes as fakes
    for first, order, marked in (([0, 1, 2, 3], [0, 1, 3], [9]), (None, [0, 2, 3], [9]), (None, [0, 3], []),
                                 ([], [0, 1, 3], []), ([0, 1, 3], [0, 2, 3], [9])):
        if first is None:  # the ranks replayed a schedule with both children, then switched to votes
            schedule, rank = fakes.agreed()
            schedule.drop()
        else:
            rank = fakes.Rank(fakes.BUCKETS)
            schedule = FetchSchedule(rank, rank, fakes.MODULES)
        schedule.watch_routing({1: (9, 0), 2: (9, 0)}, {(9, 0): [1, 2]})
        if first:
            fakes.micro_step(schedule, rank, first)
            assert schedule.take_routed_hosts() == [], first
        fakes.micro_step(schedule, rank, order)
        assert schedule.take_routed_hosts() == marked, (first, order)


def test_a_routed_container_on_one_rank_coalesces_on_every_rank(ranks):
    """One rank marked a host: the step agreement's flag makes every rank coalesce, at the same step (the real
    coordinator then exchanges the hosts); no rank marked one: none coalesces."""
    from unit.runtime.zero import lockstep_fakes as fakes
    for marked_on in (1, None):
        coordinators = [
            fakes.Coordinator((True, False, 0), routed=[9] if r == marked_on else []) for r in range(ranks.n)
        ]
        results = fakes.step(ranks, [fakes.optimizer() for _ in range(ranks.n)], coordinators)
        assert not any(isinstance(r, Exception) for r in results), results
        expected = [[9] if r == marked_on else [] for r in range(ranks.n)] if marked_on is not None else [None] * 3
        assert [c.coalesced for c in coordinators] == expected
