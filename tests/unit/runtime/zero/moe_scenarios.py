# Copyright (c) the DeepSpeed lockstep fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""A tiny per-expert MoE model (switch-style top-1 routing, experts in a ModuleList) for the ZeRO-3 tests in
which an expert gets tokens on some ranks only, with its batches, its optimizer, which experts a batch
routes to, and the evaluation check those tests share."""

import torch

from unit.runtime.zero.lockstep_scenarios import LR, SEED, WEIGHT_DECAY, agree_on_every_rank


class SwitchMoE(torch.nn.Module):
    """A switch-style MoE block: experts in a ModuleList, each run only on the tokens routed to it (top-1 of
    a learned router), so an expert with no tokens on a rank does not run there."""

    def __init__(self, hidden, experts):
        super().__init__()
        self.router = torch.nn.Linear(hidden, experts)
        self.experts = torch.nn.ModuleList(self._expert(hidden) for _ in range(experts))

    @staticmethod
    def _expert(hidden):
        return torch.nn.Sequential(torch.nn.Linear(hidden, 2 * hidden), torch.nn.Tanh(),
                                   torch.nn.Linear(2 * hidden, hidden))

    def forward(self, h):
        gate = torch.softmax(self.router(h), dim=-1)
        weight, choice = gate.max(dim=-1)
        out = torch.zeros_like(h)
        for i, expert in enumerate(self.experts):
            routed = choice == i
            if routed.any():
                out[routed] = weight[routed, None] * expert(h[routed])
        return h + out


class TinyMoEModel(torch.nn.Module):

    def __init__(self, hidden=8, experts=4, layers=2):
        super().__init__()
        self.embed = torch.nn.Linear(hidden, hidden)
        self.blocks = torch.nn.ModuleList(SwitchMoE(hidden, experts) for _ in range(layers))
        self.head = torch.nn.Linear(hidden, 1)

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h).pow(2).mean()


def moe_batch(rank, step, tokens=3, hidden=8):
    g = torch.Generator().manual_seed(SEED + 1000 * rank + step)
    return torch.randn(tokens, hidden, generator=g)


def moe_model():
    torch.manual_seed(SEED)
    return TinyMoEModel()


def moe_optimizer(model):
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9, weight_decay=WEIGHT_DECAY)


def experts_used(model, x):
    """Which experts of each block get tokens for batch ``x`` (plain PyTorch, full parameters)."""
    used = []
    with torch.no_grad():
        h = model.embed(x)
        for block in model.blocks:
            used.append(set(block.router(h).argmax(dim=-1).tolist()))
            h = block(h)
    return used


def tiny_switch(vocab, layers, sparse_layers):
    """Hugging Face Switch Transformers with a tiny config (random weights, nothing downloaded): ``layers``
    encoder and decoder layers, ``sparse_layers`` of each with 4 experts; needs ``transformers``."""
    import transformers
    config = transformers.SwitchTransformersConfig(vocab_size=vocab,
                                                   d_model=16,
                                                   d_kv=8,
                                                   d_ff=32,
                                                   num_layers=layers,
                                                   num_decoder_layers=layers,
                                                   num_heads=2,
                                                   num_experts=4,
                                                   expert_capacity=64,
                                                   num_sparse_encoder_layers=sparse_layers,
                                                   num_sparse_decoder_layers=sparse_layers,
                                                   dropout_rate=0.0,
                                                   router_jitter_noise=0.0,
                                                   decoder_start_token_id=0,
                                                   pad_token_id=0,
                                                   eos_token_id=1)
    return transformers.SwitchTransformersForConditionalGeneration(config)


def check_evaluation(losses, ref_model, eval_batches, world_size, rank):
    """The evaluation losses ``losses`` of this rank's ``eval_batches`` equal plain PyTorch's (``ref_model``
    trained as far as the engine was), and the evaluation really routed tokens to different experts per rank."""
    with torch.no_grad():
        expected = [ref_model(x).item() for x in eval_batches]
    routed = [experts_used(ref_model, moe_batch(r, 100)) for r in range(world_size)]
    agree_on_every_rank(routed[0] != routed[1],
                        "the evaluation batches should route tokens to different experts per rank")
    agree_on_every_rank(torch.allclose(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=1e-6),
                        f"rank {rank}: evaluation losses {losses}, plain PyTorch {expected}")
