# Copyright (c) the DeepSpeed lockstep fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Real Hugging Face models (tiny configs, random weights, nothing downloaded) whose modules run on some
data-parallel ranks only, with no declaration: LLaVA with images on rank 0 and text only on rank 1 (the
vision tower and projector are skipped there), Switch Transformers with per-expert modules that run only
when tokens are routed to them, and Mixtral (stacked experts, every rank runs every module). Oracles:
every rank finishes within the deadline, parameters identical across ranks and equal to a plain-PyTorch
reference (a gradient missing on a rank counts as zero), and ZeRO-3 parameters partitioned at rest. After
training, every rank evaluates a batch of its own (``engine.eval()``, ``torch.no_grad()``; LLaVA: the image
on rank 0 only), which must give the loss of the plain-PyTorch reference model."""

import pytest
import torch

import deepspeed
import deepspeed.comm as dist
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

from unit.common import DistributedTest
from unit.runtime.zero.lockstep_scenarios import (LR, SEED, assert_lockstep, device, full_params, reference_training,
                                                  zero_config)
from unit.runtime.zero.moe_scenarios import moe_optimizer, tiny_switch

transformers = pytest.importorskip("transformers")

VOCAB = 64
IMAGE_TOKEN = VOCAB - 1
IMAGE_SIZE, PATCH = 8, 4


def _llava():
    vision = transformers.CLIPVisionConfig(hidden_size=16,
                                           intermediate_size=32,
                                           num_hidden_layers=1,
                                           num_attention_heads=2,
                                           image_size=IMAGE_SIZE,
                                           patch_size=PATCH,
                                           projection_dim=16)
    text = transformers.LlamaConfig(hidden_size=16,
                                    intermediate_size=32,
                                    num_hidden_layers=1,
                                    num_attention_heads=2,
                                    num_key_value_heads=2,
                                    vocab_size=VOCAB,
                                    max_position_embeddings=64)
    config = transformers.LlavaConfig(vision_config=vision,
                                      text_config=text,
                                      image_token_id=IMAGE_TOKEN,
                                      vision_feature_layer=-1)
    return transformers.LlavaForConditionalGeneration(config)


def _llava_batch(rank, step):
    """Rank 0 gets an image (its tokens first), the other ranks text only."""
    g = torch.Generator().manual_seed(SEED + 1000 * rank + step)
    text = torch.randint(0, VOCAB - 2, (1, 6), generator=g)
    if rank != 0:
        return dict(input_ids=text, labels=text)
    image_tokens = torch.full((1, (IMAGE_SIZE // PATCH)**2), IMAGE_TOKEN)
    ids = torch.cat([image_tokens, text], dim=1)
    labels = torch.cat([torch.full_like(image_tokens, -100), text], dim=1)
    return dict(input_ids=ids, labels=labels, pixel_values=torch.randn(1, 3, IMAGE_SIZE, IMAGE_SIZE, generator=g))


def _switch():
    return tiny_switch(VOCAB, layers=2, sparse_layers=1)


def _seq2seq_batch(rank, step):
    g = torch.Generator().manual_seed(SEED + 1000 * rank + step)
    return dict(input_ids=torch.randint(2, VOCAB, (1, 5), generator=g),
                labels=torch.randint(2, VOCAB, (1, 3), generator=g))


def _mixtral():
    config = transformers.MixtralConfig(vocab_size=VOCAB,
                                        hidden_size=16,
                                        intermediate_size=32,
                                        num_hidden_layers=1,
                                        num_attention_heads=2,
                                        num_key_value_heads=2,
                                        num_local_experts=4,
                                        num_experts_per_tok=2,
                                        max_position_embeddings=64)
    return transformers.MixtralForCausalLM(config)


def _causal_batch(rank, step):
    g = torch.Generator().manual_seed(SEED + 1000 * rank + step)
    ids = torch.randint(0, VOCAB, (1, 6), generator=g)
    return dict(input_ids=ids, labels=ids)


MODELS = {"llava": (_llava, _llava_batch), "switch": (_switch, _seq2seq_batch), "mixtral": (_mixtral, _causal_batch)}


def _model(name):
    torch.manual_seed(SEED)
    return MODELS[name][0]()


def _loss(model, batch, on=None):
    batch = {k: v.to(on) if on is not None else v for k, v in batch.items()}
    return model(**batch).loss


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("name", ["llava", "switch", "mixtral"])
class TestHFConditionalModules(DistributedTest):
    world_size = 2
    exec_timeout = 120
    steps = 3

    def test_lockstep(self, name, stage):
        # every ZeRO-3 parameter partitioned and fetched, and several buckets
        zero = dict(stage3_param_persistence_threshold=0, reduce_bucket_size=2000) if stage == 3 else {}
        config = zero_config(stage, **zero)
        rank, world_size = dist.get_rank(), dist.get_world_size()
        batch_of = MODELS[name][1]
        model = _model(name)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=moe_optimizer(model), config=config)
        for step in range(self.steps):
            engine.backward(_loss(engine, batch_of(rank, step), on=device()))
            engine.step()
            if stage == 3:  # partitioned at rest, the skipped modules included
                assert all(p.ds_status == ZeroParamStatus.NOT_AVAILABLE for p in engine.module.parameters())
        engine.eval()  # every rank evaluates its own batch (LLaVA: the image on rank 0 only)
        with torch.no_grad():
            evaluated = _loss(engine, batch_of(rank, 100), on=device()).item()
        engine.train()
        mine = full_params(engine.module, stage)

        ref_model = _model(name)
        ref = reference_training(ref_model, moe_optimizer(ref_model), world_size, self.steps, 1,
                                 lambda r, s, m: _loss(ref_model, batch_of(r, s)))
        ref_model.eval()
        with torch.no_grad():
            expected = _loss(ref_model, batch_of(rank, 100)).item()
        _agree(
            abs(evaluated - expected) <= 1e-5 + 1e-4 * abs(expected),
            f"rank {rank}: evaluation loss {evaluated}, plain PyTorch {expected}")
        assert_lockstep(mine, ref, config, self.steps, atol=1e-5, rtol=1e-4)


def _agree(ok, what):
    """Every rank raises together if any rank's check failed."""
    flag = torch.tensor([0 if ok else 1], device=device())
    dist.all_reduce(flag)
    assert flag.item() == 0, what


class _LlavaRows(torch.utils.data.Dataset):
    """Every row with an image on even indices, text only on odd ones; one row per rank and step (no
    shuffling, so with 2 ranks rank 0 always gets the image rows and rank 1 the text-only ones)."""

    def __init__(self, steps, first_step=0):
        self.steps, self.first_step = steps, first_step

    def __len__(self):
        return 2 * self.steps

    def __getitem__(self, i):
        return {k: v[0] for k, v in _llava_batch(i % 2, self.first_step + i // 2).items()}


_IMAGE_BATCHES = {"train": [], "eval": []}  # whether each batch this rank got had an image
_PHASE = ["train"]


def _collate(rows):
    _IMAGE_BATCHES[_PHASE[0]].append("pixel_values" in rows[0])
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}


@pytest.mark.parametrize("stage", [2, 3])
class TestTrainerLlava(DistributedTest):
    """LLaVA through transformers.Trainer (which calls deepspeed.initialize through accelerate), ZeRO-2, and
    ZeRO-3 with every parameter fetched, rank 0 with images and rank 1 text only, then ``Trainer.evaluate``
    likewise: every rank finishes, the parameters are identical across ranks (and partitioned after training
    under ZeRO-3), and the evaluation loss is the plain-PyTorch model's with those parameters."""
    world_size = 2
    exec_timeout = 180
    steps = 3

    def test_trains(self, tmp_path, stage):
        pytest.importorskip("accelerate")
        ref_model = _model("llava")  # plain PyTorch: built before TrainingArguments turns on ZeRO-3 model init
        zero = dict(stage3_param_persistence_threshold=0, reduce_bucket_size=2000) if stage == 3 else {}
        config = zero_config(stage, **zero)
        config.update(train_batch_size="auto",
                      train_micro_batch_size_per_gpu="auto",
                      gradient_accumulation_steps="auto",
                      gradient_clipping="auto")
        args = transformers.TrainingArguments(output_dir=str(tmp_path / f"out{dist.get_rank()}"),
                                              per_device_train_batch_size=1,
                                              per_device_eval_batch_size=1,
                                              max_steps=self.steps,
                                              learning_rate=LR,
                                              max_grad_norm=1.0,
                                              lr_scheduler_type="constant",
                                              deepspeed=config,
                                              report_to=[],
                                              save_strategy="no",
                                              logging_strategy="no",
                                              use_cpu=device() == "cpu",
                                              dataloader_num_workers=0,
                                              remove_unused_columns=False,
                                              average_tokens_across_devices=False,
                                              seed=SEED)
        model = _model("llava")
        train_rows, eval_rows = _LlavaRows(self.steps), _LlavaRows(1, first_step=100)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=train_rows, data_collator=_collate)
        trainer._get_train_sampler = lambda *a, **k: torch.utils.data.SequentialSampler(train_rows)
        trainer.train()
        engine = trainer.model_wrapped
        assert engine.global_steps == self.steps
        if stage == 3:
            assert all(p.ds_status == ZeroParamStatus.NOT_AVAILABLE for p in engine.module.parameters())
        _PHASE[0] = "eval"
        metrics = trainer.evaluate(eval_dataset=eval_rows)
        params = full_params(engine.module, stage)
        flat = torch.cat([params[n].flatten() for n in sorted(params)]).to(device())
        gathered = [torch.zeros_like(flat) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, flat)
        assert all(torch.equal(g, gathered[0]) for g in gathered), "parameters differ across ranks"
        # the data really diverged: images on rank 0 only, in training and in the evaluation
        saw = torch.tensor([[any(_IMAGE_BATCHES[p]), all(_IMAGE_BATCHES[p])] for p in ("train", "eval")],
                           device=device())
        everyone = [torch.zeros_like(saw) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, saw)
        assert [e.tolist() for e in everyone] == [[[True, True]] * 2, [[False, False]] * 2], everyone
        # Trainer's eval_loss: the mean over both ranks' rows, each evaluated with the trained parameters
        ref_model.eval()
        with torch.no_grad():
            for name, p in ref_model.named_parameters():
                p.copy_(params[name])
            rows = [{k: v[None] for k, v in eval_rows[i].items()} for i in range(len(eval_rows))]
            expected = sum(_loss(ref_model, row).item() for row in rows) / len(rows)
        assert abs(metrics["eval_loss"] - expected) <= 1e-5 + 1e-4 * abs(expected), (metrics, expected)
