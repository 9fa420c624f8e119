# Copyright (c) the DeepSpeed lockstep fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""ZeRO-3 decides at each module's release which of its parameters to free: those the module trace does
not use again within ``stage3_max_reuse_distance``. The decision was cached per (module, step of the
trace) for the life of the coordinator, though the trace is recorded again whenever it changes (per-expert
MoE whose routing changes, a new fetch schedule): a module that reached the same step index in a new
trace got the old trace's answer. A parameter the new trace uses again soon was then freed and gathered a
second time in the same step (an extra all-gather every step), and one it does not use again could be
kept. The cached set was also returned to a caller that adds the recompute parameters to it, so they
stayed in it.

Oracle: per-expert MoE with natural routing, every parameter fetched, the default reuse distance (larger
than the model): once the ranks replay their fetch schedule with no switch, no parameter is gathered twice
in a step; and the parameters equal the plain-PyTorch reference."""

import deepspeed
import deepspeed.comm as dist

from unit.common import DistributedTest
from unit.runtime.zero.lockstep_scenarios import (agree_on_every_rank, assert_lockstep, device, full_params,
                                                  reference_training, zero_config)
from unit.runtime.zero.moe_scenarios import moe_batch, moe_model, moe_optimizer

STEPS = 24


def _record_gathers(model, gathered):
    """Append the ds_ids of each parameter all-gather ZeRO-3 launches to ``gathered``."""
    for param in model.parameters():
        launch = param.all_gather_coalesced

        def recorded(params, *args, __launch=launch, **kwargs):
            gathered.extend(p.ds_id for p in params)
            return __launch(params, *args, **kwargs)

        param.all_gather_coalesced = recorded


class TestNoParameterGatheredTwicePerStep(DistributedTest):
    world_size = 2
    exec_timeout = 90

    def test_lockstep(self):
        rank = dist.get_rank()
        config = zero_config(3, stage3_param_persistence_threshold=0)
        model = moe_model()
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=moe_optimizer(model), config=config)
        schedule = engine.optimizer.parameter_offload.get_param_coordinator().fetch_schedule
        gathered = []
        _record_gathers(engine.module, gathered)
        twice = {}
        for step in range(STEPS):
            switches = schedule.switches if schedule is not None else 0
            gathered.clear()
            engine.backward(engine(moe_batch(rank, step).to(device())))
            engine.step()
            replayed_alone = schedule is None or (schedule.replaying and schedule.switches == switches)
            repeated = sorted({i for i in gathered if gathered.count(i) > 1})
            if step >= STEPS // 2 and replayed_alone and repeated:
                twice[step] = repeated
        mine = full_params(engine.module, 3)
        ref_model = moe_model()
        ref = reference_training(ref_model, moe_optimizer(ref_model), dist.get_world_size(), STEPS, 1,
                                 lambda r, s, m: ref_model(moe_batch(r, s)))
        assert_lockstep(mine, ref, config, STEPS)
        agree_on_every_rank(not twice, f"parameters gathered twice in one step (step: ds_ids): {twice}")
