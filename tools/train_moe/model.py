"""The trained architecture (transformers' Qwen3MoeForCausalLM, i.e. GGUF arch `qwen3moe`) and the
losses and routing statistics the recipe trains and judges it with.

The model is transformers' own class, not a re-implementation: what is trained is exactly what is
saved with save_pretrained and converted by llama.cpp's converter, so there is no weight-porting step
that could go wrong.

Load balance is measured and enforced per layer. transformers' `load_balancing_loss_func` pools the
router outputs of all layers before computing the balance, which lets one layer's overused experts
cancel another layer's underused ones; here every MoE layer gets its own Switch-style term
n_expert * sum_e f_e * P_e (f_e: share of the layer's top-k selections that went to expert e, P_e:
mean router probability of e), which is 1 when that layer is balanced, and the terms are summed.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class ArchConfig:
    vocab_size: int = 3072
    hidden_size: int = 256
    num_hidden_layers: int = 6
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    num_experts: int = 16
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 192
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6

    def as_dict(self) -> dict:
        return asdict(self)


def hf_config(arch: ArchConfig):
    """transformers.Qwen3MoeConfig for `arch`. Tied input/output embeddings (the converter then writes
    only token_embd, and llama.cpp and sharpi use it as the output matrix). norm_topk_prob is True
    because llama.cpp's qwen3moe graph always renormalises the top-k weights."""
    import transformers

    config = transformers.Qwen3MoeConfig(
        vocab_size=arch.vocab_size,
        hidden_size=arch.hidden_size,
        num_hidden_layers=arch.num_hidden_layers,
        num_attention_heads=arch.num_attention_heads,
        num_key_value_heads=arch.num_key_value_heads,
        head_dim=arch.head_dim,
        intermediate_size=4 * arch.moe_intermediate_size,  # unused: every layer is MoE
        moe_intermediate_size=arch.moe_intermediate_size,
        num_experts=arch.num_experts,
        num_experts_per_tok=arch.num_experts_per_tok,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        tie_word_embeddings=True,
        max_position_embeddings=arch.max_position_embeddings,
        rms_norm_eps=arch.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": arch.rope_theta},
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=None,
        output_router_logits=False,
        router_aux_loss_coef=0.0,  # our own per-layer loss replaces transformers' pooled one
    )
    config._attn_implementation = "sdpa"
    return config


def build_model(arch: ArchConfig, seed: int):
    """A freshly initialised float32 model (transformers' init: N(0, 0.02^2) matrices, unit norms)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    return transformers.Qwen3MoeForCausalLM(hf_config(arch)).to(torch.float32)


def per_layer_balance_losses(router_logits, top_k: int):
    """[n_layer] tensor: n_expert * sum_e f_e * P_e per layer (1.0 = perfectly balanced).

    router_logits: one [n_tokens, n_expert] tensor per MoE layer (what transformers returns with
    output_router_logits=True). f_e counts top-k selections and carries no gradient; P_e does."""
    import torch

    losses = []
    for logits in router_logits:
        probs = torch.softmax(logits.float(), dim=-1)
        n_expert = probs.shape[-1]
        selected = torch.topk(probs, top_k, dim=-1).indices
        counts = torch.zeros(n_expert, dtype=torch.float32).scatter_add_(
            0, selected.reshape(-1), torch.ones(selected.numel(), dtype=torch.float32)
        )
        share = counts / counts.sum()
        losses.append(n_expert * torch.sum(share * probs.mean(dim=0)))
    return torch.stack(losses)


def router_z_loss(router_logits):
    """Mean squared log-partition of the router logits, summed over layers (keeps logits small)."""
    import torch

    return torch.stack([torch.logsumexp(l.float(), dim=-1).pow(2).mean() for l in router_logits]).sum()


def selection_shares(router_logits, top_k: int):
    """numpy [n_layer, n_expert]: each expert's share of its layer's top-k selections (rows sum to 1)."""
    import numpy as np
    import torch

    rows = []
    with torch.no_grad():
        for logits in router_logits:
            n_expert = logits.shape[-1]
            selected = torch.topk(logits, top_k, dim=-1).indices.reshape(-1)
            rows.append(torch.bincount(selected, minlength=n_expert).double().numpy())
    counts = np.stack(rows)
    return counts / counts.sum(axis=1, keepdims=True)
