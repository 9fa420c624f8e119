# Copyright (c) the DeepSpeed lockstep fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Stream order of the gradient reduction on CUDA: a slow reduction stream must not change the numbers.

ZeRO reduces gradients on a side stream (ZeRO-1/2 with overlap_comm: the reduction stream; ZeRO-3: the
reduce-and-partition stream) while backward goes on computing gradients on the current stream. Whatever
the timing, training must give the same parameters as with no overlap at all. Timing alone makes an
ordering bug intermittent (a gradient freed by the host while the side stream still reads it is
overwritten only when the allocator hands its memory out first), so these tests make the side stream
slow on purpose: after every reduction it sleeps (CUDA's ``_sleep`` kernel) before it copies the result
into the partition. Memory read or freed without waiting for it, or without recording it on that
stream, then holds the wrong data in every run.

Oracles, on every rank together: the parameters are identical across ranks; bit-identical to the same
training with overlap_comm off (ZeRO-1/2) or without the delay (ZeRO-3); and equal to a plain-PyTorch
reference (gradients averaged over ranks, zeros where a rank skipped a block).

Needs CUDA streams: on the CPU accelerator streams are no-ops and nothing can race, so it skips there.
The ranks share one GPU over gloo when there are fewer GPUs than ranks (tests/unit/common.py).
"""

import os  # fork-only
import pytest
import torch

import deepspeed
import deepspeed.comm as dist
from deepspeed.accelerator import get_accelerator
from unit.common import DistributedTest
from unit.runtime.zero.lockstep_scenarios import assert_lockstep, device, full_params, reference_training

HIDDEN = 512  # weights of 512 x 2048: larger than the small bucket below, so reduced on their own
BLOCKS = 3
TOKENS = 64
MICRO_BATCH = 4
STEPS = 3
LR = 0.05
SEED = 4321
SMALL_BUCKET = 20000  # every weight is an extra-large parameter; LayerNorms and biases share buckets
SLEEP_CYCLES = 20_000_000  # about 10 ms of the side stream after each reduction


class Block(torch.nn.Module):

    def __init__(self, hidden):
        super().__init__()
        self.norm = torch.nn.LayerNorm(hidden)
        self.up = torch.nn.Linear(hidden, 4 * hidden)
        self.down = torch.nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Tower(torch.nn.Module):

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(HIDDEN) for _ in range(BLOCKS))
        self.head = torch.nn.Linear(HIDDEN, 1)

    def forward(self, x, skip=None):
        for i, block in enumerate(self.blocks):
            if i != skip:
                x = block(x)
        return self.head(x).float().pow(2).mean()


def skipped_block(usage, rank):
    """'divergent': odd ranks skip block 1, so its gradients are zero-filled there."""
    return 1 if usage == "divergent" and rank % 2 == 1 else None


def inputs(rank, step, dtype=torch.float32, on="cpu"):
    g = torch.Generator().manual_seed(SEED + 1000 * rank + step)
    return torch.randn(MICRO_BATCH, TOKENS, HIDDEN, generator=g).to(on, dtype)


def make_model():
    torch.manual_seed(SEED)
    return Tower()


def delay_side_stream(optimizer, cycles=SLEEP_CYCLES):
    """Make the optimizer's reduction side stream sleep after each reduction, before it uses the result."""
    if hasattr(optimizer, "average_tensor"):  # ZeRO-1/2
        if not optimizer.overlap_comm:
            return
        average_tensor, allreduce_bucket = optimizer.average_tensor, optimizer.allreduce_bucket

        def delayed_average_tensor(*args, **kwargs):
            out = average_tensor(*args, **kwargs)  # issues the reduction; copies to the partition follow
            with get_accelerator().stream(optimizer.reduction_stream):
                torch.cuda._sleep(cycles)  #ignore-cuda
            return out

        def delayed_allreduce_bucket(*args, **kwargs):  # non-contiguous path, on the reduction stream
            out = allreduce_bucket(*args, **kwargs)
            torch.cuda._sleep(cycles)  #ignore-cuda
            return out

        optimizer.average_tensor = delayed_average_tensor
        optimizer.allreduce_bucket = delayed_allreduce_bucket
    else:  # ZeRO-3: partition_grads runs on the reduce-and-partition stream after the reduce-scatter
        partition_grads = optimizer.partition_grads

        def delayed_partition_grads(*args, **kwargs):
            torch.cuda._sleep(cycles)  #ignore-cuda
            return partition_grads(*args, **kwargs)

        optimizer.partition_grads = delayed_partition_grads


def zero_config(stage, dtype, **zero):
    config = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": 1,
        "zero_optimization": dict(stage=stage, **zero),
        "gradient_clipping": 1.0,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    return config


def train(config, usage, delay):
    rank = dist.get_rank()
    model = make_model()
    if usage == "divergent" and config["zero_optimization"]["stage"] == 3:  # fork-only
        deepspeed.zero.register_conditional_module(model.blocks[1])  # fork-only
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    if delay:
        delay_side_stream(engine.optimizer)
    dtype = next(engine.module.parameters()).dtype
    for step in range(STEPS):
        loss = engine(inputs(rank, step, dtype, on=device()), skip=skipped_block(usage, rank))
        engine.backward(loss)
        engine.step()
    return full_params(engine.module, config["zero_optimization"]["stage"])


def reference():
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    return model, optimizer


def check(stage, dtype, usage, zero):
    delayed = train(zero_config(stage, dtype, **zero), usage, delay=True)
    baseline_zero = dict(zero, overlap_comm=False) if stage != 3 else zero
    baseline = train(zero_config(stage, dtype, **baseline_zero), usage, delay=False)
    model, optimizer = reference()
    ref = reference_training(model, optimizer, dist.get_world_size(), STEPS, 1,
                             lambda r, s, m: model(inputs(r, s), skip=skipped_block(usage, r)))
    config = zero_config(stage, dtype)
    assert_lockstep(baseline, ref, config, STEPS)
    differing = [n for n in sorted(delayed) if not torch.equal(delayed[n], baseline[n])]
    bad = torch.tensor([float(bool(differing))], device=device())
    dist.all_reduce(bad)
    assert bad.item() == 0, (f"with a slow side stream the parameters differ from the run without overlap on "
                             f"{int(bad.item())} rank(s); here: {differing}")
    assert_lockstep(delayed, ref, config, STEPS)


# fork-only: begin (LOCKSTEP_GPU_REPEAT_INSIDE=N, for the GPU verify runs of docs/verify/gpu.md: each case N
# times in the same ranks, a fresh engine and model each time, every repetition against the same oracles)
REPEAT_INSIDE = int(os.environ.get("LOCKSTEP_GPU_REPEAT_INSIDE", "1"))
check_once = check


def check(stage, dtype, usage, zero):
    for repetition in range(1, REPEAT_INSIDE + 1):
        if REPEAT_INSIDE > 1:
            print(f"repetition {repetition} of {REPEAT_INSIDE}", flush=True)  # in the rank's output on a hang
        try:
            check_once(stage, dtype, usage, zero)
        except AssertionError as error:
            raise AssertionError(f"repetition {repetition} of {REPEAT_INSIDE}: {error}") from error
        except Exception as error:
            error.add_note(f"repetition {repetition} of {REPEAT_INSIDE}")
            raise


# fork-only: end

pytestmark = pytest.mark.skipif(get_accelerator().device_name() == "cpu",
                                reason="streams are no-ops on the CPU accelerator: run on a GPU")

ZERO12 = {
    f"contig{int(c)}-rs{int(r)}-{b}":
    dict(overlap_comm=True,
         contiguous_gradients=c,
         reduce_scatter=r,
         reduce_bucket_size=SMALL_BUCKET if b == "xl" else 50_000_000)
    for c in (True, False)
    for r in (False, True)
    for b in ("xl", "big")
}
USAGES = ["uniform"]
# fork-only: begin
# upstream's version of this test runs uniform usage under ZeRO-1/2 (the stages its fix touches); the fork also
# runs ranks that skip a block, and ZeRO-3, which need the rank-invariant reduction plan
USAGES.append("divergent")
ZERO3 = {
    f"contig{int(c)}-rs{int(r)}-{b}":
    dict(contiguous_gradients=c, reduce_scatter=r, reduce_bucket_size=SMALL_BUCKET if b == "xl" else 50_000_000)
    for c in (True, False)
    for r in (False, True)
    for b in ("xl", "big")
}
# fork-only: end


@pytest.mark.parametrize("usage", USAGES)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("config", sorted(ZERO12))
@pytest.mark.parametrize("stage", [1, 2])
class TestSlowReductionStreamZero12(DistributedTest):
    world_size = 2
    exec_timeout = 120
    exec_timeout *= REPEAT_INSIDE  # fork-only

    def test_same_parameters_as_without_overlap(self, stage, config, dtype, usage):
        check(stage, dtype, usage, ZERO12[config])


# fork-only: begin
@pytest.mark.parametrize("usage", USAGES)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("config", sorted(ZERO3))
class TestSlowReduceScatterStreamZero3(DistributedTest):
    world_size = 2
    exec_timeout = 120
    exec_timeout *= REPEAT_INSIDE

    def test_same_parameters_as_without_delay(self, config, dtype, usage):
        check(3, dtype, usage, ZERO3[config])


# fork-only: end
