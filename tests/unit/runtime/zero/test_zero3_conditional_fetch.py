# Copyright (c) the DeepSpeed lockstep fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""ZeRO-3 modules that run on some ranks only, with their parameters partitioned (fetched), and no
declaration: a projector used on image batches only, branches taken by some ranks or in another order,
per-expert MoE layers whose experts get tokens on some ranks only. Without this change ZeRO-3 aborts in the forward's
parameter all-gather (gloo: size mismatch) or hangs (a rank in backward's reduce-scatter, another in the
next fetch). The same oracles as the other lockstep tests: every rank finishes within the deadline, the
parameters are identical across ranks and equal a plain-PyTorch reference (a gradient missing on a rank
counts as zero), and the parameters stay partitioned at rest."""

import pytest

import deepspeed
import deepspeed.comm as dist
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

from unit.common import DistributedTest
from unit.runtime.zero.lockstep_scenarios import (Scenario, assert_lockstep, check_lockstep, device, full_params,
                                                  reference_training, train_deepspeed, train_reference, zero_config)
from unit.runtime.zero.moe_scenarios import SwitchMoE, experts_used, moe_batch, moe_model, moe_optimizer

FETCHED = dict(stage3_param_persistence_threshold=0)  # every parameter is partitioned and fetched


def _config(**overrides):
    options = dict(FETCHED)
    options.update(overrides)
    return zero_config(3,
                       gradient_accumulation_steps=options.pop("gradient_accumulation_steps", 1),
                       bf16=options.pop("bf16", False),
                       **options)


CONFIGS = {
    "default": {},
    "contig0-rs0": dict(contiguous_gradients=False, reduce_scatter=False),
    "bucket100": dict(reduce_bucket_size=100),
    "gas2": dict(gradient_accumulation_steps=2),
}


@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("scenario", ["llava_4933", "llava_per_micro_step", "order_divergent", "equal_size_branches"])
class TestConditionalModulesFetched(DistributedTest):
    world_size = 2
    exec_timeout = 60

    def test_lockstep(self, scenario, config):
        check_lockstep(scenario, _config(**CONFIGS[config]), steps=3)


class TestLateDivergenceAlwaysAgreed(DistributedTest):
    """Every rank sees images at the first step, only rank 0 later: the first step finds the same modules
    everywhere, so the trace is agreed there; fetch_agreement="always" keeps deciding every fetch by vote
    instead (with the default, the votes go on checking the trace: test_zero3_late_divergence.py)."""
    world_size = 2
    exec_timeout = 60

    def test_lockstep(self):

        def usage(rank, step, micro):
            return rank == 0 or step == 0, "ab"

        scenario = Scenario("late_divergence", "images everywhere at step 0, on rank 0 only later", usage)
        config = _config(fetch_agreement="always")
        mine = train_deepspeed(scenario, config, steps=3)
        assert_lockstep(mine, train_reference(scenario, dist.get_world_size(), steps=3), config, steps=3)


@pytest.mark.parametrize("config", ["default", "bucket100", "leaf"])
class TestPerExpertMoE(DistributedTest):
    """Natural routing: which experts run on each rank changes with its tokens and with training. "leaf":
    upstream's workaround (the MoE block as a ZeRO-3 leaf module, fetched whole) still works."""
    world_size = 2
    exec_timeout = 90
    steps = 4

    def test_lockstep(self, config):
        leaf = config == "leaf"
        config = _config(**CONFIGS["default" if leaf else config])
        rank, world_size = dist.get_rank(), dist.get_world_size()
        model = moe_model()
        if leaf:
            deepspeed.utils.set_z3_leaf_modules(model, [SwitchMoE])
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=moe_optimizer(model), config=config)
        for step in range(self.steps):
            engine.backward(engine(moe_batch(rank, step).to(device())))
            engine.step()
            # partitioned at rest: no expert parameter is held whole between steps
            assert all(p.ds_status == ZeroParamStatus.NOT_AVAILABLE for p in engine.module.parameters())
        mine = full_params(engine.module, 3)

        ref_model = moe_model()
        ref = reference_training(ref_model, moe_optimizer(ref_model), world_size, self.steps, 1,
                                 lambda r, s, m: ref_model(moe_batch(r, s)))
        # the routing really differs across ranks (else this test would not test anything)
        check_model = moe_model()
        differs = any(
            experts_used(check_model, moe_batch(0, s)) != experts_used(check_model, moe_batch(1, s))
            for s in range(self.steps))
        assert differs, "the test data should route tokens to different experts on different ranks"
        assert_lockstep(mine, ref, config, self.steps)
