# Copyright (c) the DeepSpeed lockstep fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""A gradient that arrives twice in one backward on one rank: a parameter used both inside and outside a
reentrant activation checkpoint (a refinement block that reuses the embedding's weight, run on rank 1's
batches only). The checkpoint's recompute runs its own backward, which finishes that parameter's gradient
once; the outer backward finishes it again. ZeRO-2 and ZeRO-3 do not support a second gradient after the
parameter's bucket was reduced and raised "has already been reduced" on rank 1 alone, inside its backward:
the other rank waited in the next reduction (over gloo it failed when rank 1 went away).

Oracles: where the stage handles it (ZeRO-1 reduces at the end of backward; ZeRO-3 while the ranks vote on
each fetch, at the first step), every rank finishes every step with parameters identical across ranks and
equal to a plain-PyTorch reference (the same model without checkpointing); elsewhere every rank raises the
same ``RankDisagreementError`` at that step's ``engine.step()``, naming rank 1 and, there, the cause,
within the deadline."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import deepspeed
import deepspeed.comm as dist
from deepspeed.accelerator import get_accelerator
from unit.common import DistributedTest
from unit.runtime.zero.lockstep_scenarios import CLIP, assert_lockstep, full_params, reference_training

STEPS = 4
HIDDEN = 8


class TiedRefinement(torch.nn.Module):
    """An embedding, then on some batches a refinement that reuses the embedding's weight (under a reentrant
    checkpoint, or plainly for the reference), then a head."""

    def __init__(self, checkpointed):
        super().__init__()
        self.embed = torch.nn.Linear(HIDDEN, HIDDEN)
        self.other = torch.nn.Linear(HIDDEN, HIDDEN)
        self.head = torch.nn.Linear(HIDDEN, 1)
        self.checkpointed = checkpointed

    def refine(self, h):
        return torch.tanh(F.linear(h, self.embed.weight))

    def forward(self, x, refine):
        h = torch.tanh(self.embed(x))
        if refine:
            h = checkpoint(self.refine, h, use_reentrant=True) if self.checkpointed else self.refine(h)
        return self.head(torch.tanh(self.other(h))).pow(2).mean()


def _batch(rank, step):
    return torch.randn(2, HIDDEN, generator=torch.Generator().manual_seed(1000 * step + rank))


def _model(checkpointed):
    torch.manual_seed(0)
    model = TiedRefinement(checkpointed)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


# (stage, step at which rank 1 refines) where the stage reduces the second gradient with the first
HANDLED = {(1, 0), (1, 2), (3, 0)}


@pytest.mark.parametrize("refine_at", [0, 2], ids=["first_step", "after_steps"])
@pytest.mark.parametrize("stage", [1, 2, 3])
class TestGradientArrivesTwiceOnOneRank(DistributedTest):
    world_size = 2
    exec_timeout = 45

    def test_every_rank_trains_or_raises_together(self, stage, refine_at):
        model, optimizer = _model(checkpointed=True)
        config = {
            "train_micro_batch_size_per_gpu": 2,
            "zero_allow_untested_optimizer": True,
            "gradient_clipping": CLIP,  # the reference clips by it
            "zero_optimization": {
                "stage": stage,
                "reduce_bucket_size": 50
            }
        }
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        rank = dist.get_rank()

        def train(steps):
            for step in steps:
                x = _batch(rank, step).to(get_accelerator().current_device_name())
                engine.backward(engine(x, rank == 1 and step == refine_at))
                engine.step()

        if (stage, refine_at) not in HANDLED:
            train(range(refine_at))
            with pytest.raises(RuntimeError, match=r"ranks \[1\] hit an error") as error:
                train([refine_at])
            assert type(error.value).__name__ == "RankDisagreementError", repr(error.value)
            assert (rank == 1) == ("has already been reduced" in str(error.value)), str(error.value)
            return
        train(range(STEPS))
        reference, reference_optimizer = _model(checkpointed=False)
        expected = reference_training(reference, reference_optimizer, dist.get_world_size(), STEPS, 1,
                                      lambda r, s, m: reference(_batch(r, s), r == 1 and s == refine_at))
        assert_lockstep(full_params(engine.module, stage), expected, config, STEPS)
