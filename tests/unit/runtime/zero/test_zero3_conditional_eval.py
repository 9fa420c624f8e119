# Copyright (c) the DeepSpeed lockstep fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""ZeRO-3 evaluation on every rank (``engine.eval()`` and ``torch.no_grad()``, as ``Trainer.evaluate``
runs it) while the ranks run different modules: experts that get tokens on some ranks only, an image
projector on the rank with images. Fetches in such a forward must be the same collectives on every rank,
as in training; without this change they abort (gloo: size mismatch) or hang.

Oracles: every rank finishes within the deadline; each rank's evaluation losses equal those of a
plain-PyTorch model trained by the reference algorithm to the same step; training after the evaluation
goes on in lockstep (parameters identical across ranks, equal to the reference)."""

import pytest
import torch

import deepspeed
import deepspeed.comm as dist

from unit.common import DistributedTest
from unit.runtime.zero.lockstep_scenarios import (SCENARIOS, agree_on_every_rank, assert_lockstep, batch, device,
                                                  full_params, make_engine, make_model, reference_training,
                                                  train_reference, zero_config)
from unit.runtime.zero.moe_scenarios import check_evaluation, moe_batch, moe_model, moe_optimizer

FETCHED = dict(stage3_param_persistence_threshold=0)  # every parameter is partitioned and fetched
STEPS = 3
EVAL_BATCHES = 2


@pytest.mark.parametrize("evaluate_at", [0, 2], ids=["before_training", "after_steps"])
class TestEvaluateMoEOnEveryRank(DistributedTest):
    """Per-expert MoE, natural routing: each rank evaluates its own batches, whose tokens go to different
    experts on different ranks, then training goes on."""
    world_size = 2
    exec_timeout = 90

    def test_lockstep(self, evaluate_at):
        rank, world_size = dist.get_rank(), dist.get_world_size()
        config = zero_config(3, **FETCHED)
        model = moe_model()
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=moe_optimizer(model), config=config)
        eval_batches = [moe_batch(rank, 100 + i) for i in range(EVAL_BATCHES)]
        losses = None
        for step in range(STEPS):
            if step == evaluate_at:
                engine.eval()
                with torch.no_grad():
                    losses = [engine(x.to(device())).item() for x in eval_batches]
                engine.train()
            engine.backward(engine(moe_batch(rank, step).to(device())))
            engine.step()
        mine = full_params(engine.module, 3)

        ref_model = moe_model()
        loss_of = lambda r, s, m: ref_model(moe_batch(r, s))
        reference_training(ref_model, moe_optimizer(ref_model), world_size, evaluate_at, 1, loss_of)
        check_evaluation(losses, ref_model, eval_batches, world_size, rank)

        ref_model = moe_model()
        ref = reference_training(ref_model, moe_optimizer(ref_model), world_size, STEPS, 1,
                                 lambda r, s, m: ref_model(moe_batch(r, s)))
        assert_lockstep(mine, ref, config, STEPS)


class TestEvaluateImagesOnOneRank(DistributedTest):
    """The #4933 shape at evaluation: after training on images on rank 0 only, each rank evaluates its own
    batches, with images on rank 0 only (the projector's fetch runs on rank 0 only)."""
    world_size = 2
    exec_timeout = 90

    def test_lockstep(self):
        scenario = SCENARIOS["llava_4933"]
        config = zero_config(3, **FETCHED)
        rank, world_size = dist.get_rank(), dist.get_world_size()
        engine = make_engine(scenario, config)
        for step in range(STEPS):
            x, image, route = batch(scenario, rank, step, 0, device=device())
            engine.backward(engine(x, image, route))
            engine.step()
        engine.eval()
        with torch.no_grad():
            x, image, route = batch(scenario, rank, STEPS, 0, device=device())
            assert (image is not None) == (rank == 0), "the scenario should give images to rank 0 only"
            loss = engine(x, image, route).item()
        engine.train()
        x, image, route = batch(scenario, rank, STEPS, 0, device=device())
        engine.backward(engine(x, image, route))
        engine.step()
        mine = full_params(engine.module, 3)

        ref_model = make_model(scenario)
        ref_params = train_reference(scenario, world_size, STEPS)
        with torch.no_grad():
            for name, p in ref_model.named_parameters():
                p.copy_(ref_params[name])
            expected = ref_model(*batch(scenario, rank, STEPS, 0)).item()
        agree_on_every_rank(
            abs(loss - expected) <= 1e-6 + 1e-5 * abs(expected),
            f"rank {rank}: evaluation loss {loss}, plain PyTorch {expected}")
        assert_lockstep(mine, train_reference(scenario, world_size, STEPS + 1), config, STEPS + 1)
