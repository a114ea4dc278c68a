"""A float64 numpy reference forward pass for GGUF decoder-only models, dense and Mixture-of-Experts.

This is the oracle the engine's logits are checked against. It owns nothing but the arrays it reads:
it opens a GGUF file with `gguf.GGUFReader`, dequantizes every tensor with `gguf.quants.dequantize`
(the gguf package's own numpy code, not sharpi's), widens everything to float64 and computes all
positions of a token sequence (causal, from position 0) in plain numpy, following llama.cpp's
semantics for each architecture. It must never import sharpi, never cache results across calls and
never be "optimised" into something a reader cannot check line by line against the model's
definition; speed is irrelevant here. Every weight is held in float64, so it is meant for the tiny
test models (a few MB), not for real checkpoints.

Architectures (GGUF `general.architecture`):
  llama     dense, or Mixtral-style MoE when llama.expert_count > 0. Normal RoPE (pairs 2i, 2i+1):
            llama.cpp's converter reorders attn_q/attn_k rows so that this equals HF's rotate_half.
  qwen2     dense, q/k/v biases, NeoX RoPE (pairs i, i + n_rot/2).
  qwen3     dense, per-head RMSNorm of q and k (attn_q_norm/attn_k_norm, [head_dim]) before RoPE.
  qwen2moe  MoE, q/k/v biases, top-k weights NOT renormalised, plus a shared expert scaled by
            sigmoid(ffn_gate_inp_shexp . x).
  qwen3moe  MoE, per-head q/k RMSNorm, top-k weights renormalised to sum 1.
  olmoe     MoE, RMSNorm over the whole q and k projections (weights [n_head*head_dim] and
            [n_head_kv*head_dim]) before splitting into heads; top-k weights NOT renormalised.
  deepseek2 DeepSeek-V2/V3: multi-head latent attention computed in the EXPANDED form (each head's
            keys and values rebuilt from the latent with attn_k_b / attn_v_b, then ordinary
            attention; the engine uses the absorbed form), q LoRA, YaRN, leading dense layers,
            shared experts, softmax (V2) or sigmoid + selection-bias (V3) group-limited routing,
            top-k weights scaled by expert_weights_scale.
  deepseek32 DeepSeek-V3.2: deepseek2 (V3 routing) plus DSA's lightning indexer choosing each
            query's top_k keys (dsa_indexer_selection); the attention masks the others.
  glm4moe   GLM-4.5/4.6/4.7: q/k/v biases, per-head q/k RMSNorm when the file has attn_q_norm,
            partial NeoX RoPE (rope.dimension_count < head_dim), FFN norm post_attention_norm,
            leading dense layers, sigmoid routing choosing on score + exp_probs_b, top-k weights
            (the unbiased scores) renormalised and scaled by expert_weights_scale, plus an ungated
            shared expert. The nextn (MTP) block after the trunk is not run.
  minimax-m2
            MiniMax-M2: RMSNorm over the whole q and k projections (as olmoe), partial NeoX RoPE,
            no biases; every layer MoE without a shared expert: sigmoid routing choosing on
            score + exp_probs_b, the k unbiased scores renormalised to sum 1 (llama.cpp's norm_w).
  qwen3next, qwen35moe
            hybrid: Gated DeltaNet on the recurrent layers (attention.recurrent_layers), gated
            attention elsewhere (attn_q yields [query | gate] per head; per-head q/k RMSNorm;
            partial NeoX RoPE; output * sigmoid(gate)); MoE with top-k renormalised plus the
            sigmoid-gated shared expert; FFN norm post_attention_norm. The DeltaNet runs in its
            plain recurrent form (transformers' torch_recurrent_gated_delta_rule), token by token.
            The nextn (MTP) blocks after the trunk are not run.
  llama4    Llama 4 text model, with the numbers llama.cpp hard-codes for it (the file carries none):
            layers il % 4 < 3 rotate q/k (normal RoPE, rope_freqs factors) and attend within their
            chunk of 8192 positions; every fourth layer is global, without RoPE, its queries scaled
            by ln(floor((p + 1) / 8192) + 1) * 0.1 + 1. RoPE layers L2-normalise q and k per head
            after RoPE (RMSNorm without weight; not in 128-expert files). Layers (il + 1) %
            interleave_moe_layer_step == 0 are MoE: top-1 by router logit, weight sigmoid(logit)
            applied to the expert's INPUT, plus an unscaled shared expert; the others dense SwiGLU.

Array orientation: every weight is stored the PyTorch way, [out_features, in_features] (numpy shape
= reversed ggml ne), so a projection is `x @ W.T`; stacked experts are [n_expert, out, in].
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize

SUPPORTED_ARCHS = (
    "llama", "qwen2", "qwen3", "qwen2moe", "qwen3moe", "olmoe", "deepseek2", "qwen3next", "qwen35moe", "glm4moe",
    "llama4", "minimax-m2", "deepseek32", "nemotron_h_moe",
)  # fmt: skip
# Architectures whose router may use sigmoid scores, a selection bias, expert groups and a weight scale.
DEEPSEEK_ROUTER_ARCHS = ("deepseek2", "deepseek32", "glm4moe", "minimax-m2", "nemotron_h_moe")
# llama.cpp's llama4 constants (llama_model_llama4::load_arch_hparams).
LLAMA4_CHUNK = 8192
LLAMA4_LAYER_PATTERN = 4
LLAMA4_TEMP_FLOOR_SCALE = 8192
LLAMA4_TEMP_SCALE = 0.1
HYBRID_ARCHS = ("qwen3next", "qwen35moe")

# llama.cpp's rope type per architecture: NORM rotates adjacent pairs, NEOX rotates (i, i + n_rot/2).
NEOX_ROPE_ARCHS = frozenset(
    {"qwen2", "qwen3", "qwen2moe", "qwen3moe", "olmoe", "qwen3next", "qwen35moe", "glm4moe", "minimax-m2"}
)

# Whether the selected experts' softmax weights are renormalised to sum to 1 (the `norm_w` argument
# llama.cpp's graph builders pass to build_moe_ffn for each architecture).
RENORMALISE_TOPK = {
    "llama": True, "qwen3moe": True, "qwen2moe": False, "olmoe": False, "qwen3next": True, "qwen35moe": True,
    "minimax-m2": True,
}  # fmt: skip


@dataclass(frozen=True)
class HParams:
    arch: str
    n_vocab: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim_k: int
    head_dim_v: int
    n_rot: int  # leading dimensions of each head that RoPE rotates (the rest pass through)
    rms_eps: float
    rope_base: float
    rope_freq_scale: float  # 1 / linear scaling factor; 1 when unscaled
    neox_rope: bool
    n_expert: int  # 0 for dense models
    n_expert_used: int
    renormalise_topk: bool
    # deepseek2 only (defaults leave the other architectures unchanged)
    n_lora_kv: int = 0
    head_dim_k_mla: int = 0
    head_dim_v_mla: int = 0
    # deepseek2 and glm4moe (DEEPSEEK_ROUTER_ARCHS): the router's gating, groups and weight scale
    sigmoid_gating: bool = False
    n_group: int = 1
    n_group_used: int = 1
    expert_weights_scale: float = 1.0
    yarn_ext_factor: float = 0.0  # YaRN on when > 0 (rope_freq_scale is then 1 / factor)
    yarn_n_ctx_orig: int = 0
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    kq_scale: float = 0.0  # 0: 1 / sqrt(head_dim_k)
    # deepseek32 only: DeepSeek Sparse Attention's lightning indexer (attention.indexer.*; 0: none)
    indexer_n_head: int = 0
    indexer_head_dim: int = 0
    indexer_top_k: int = 0
    # Hybrid archs only: which layers are Gated DeltaNet, and its shape (ssm.* keys).
    recurrent: tuple = ()
    ssm_conv: int = 0
    ssm_k_heads: int = 0
    ssm_v_heads: int = 0
    ssm_head_k: int = 0
    ssm_inner: int = 0
    # llama4 only: per layer, whether it rotates q/k and its attention chunk (0: global); the
    # NoPE layers' temperature floor (0: none); L2 q/k norm; router weight on the expert input.
    rope_layers: tuple = ()
    chunk_layers: tuple = ()
    temp_floor_scale: int = 0
    temp_scale: float = 0.0
    qk_l2_norm: bool = False
    weight_before_ffn: bool = False
    # nemotron_h_moe only: per block "mamba", "attention" or "moe" (from the per-layer
    # head_count_kv / feed_forward_length arrays); the Mamba-2 shape uses the ssm_* fields above
    # (ssm_k_heads = groups, ssm_v_heads = heads, ssm_head_k = state size).
    block_kinds: tuple = ()


class ReferenceModel:
    """All tensors of one GGUF file, dequantized to float64, plus the hyper-parameters to run it."""

    def __init__(self, path):
        self.path = str(path)
        reader = GGUFReader(self.path)
        self.metadata = {name: _field_value(f) for name, f in reader.fields.items()}
        self.tensors: dict[str, np.ndarray] = {}
        self.tensor_types = {}
        for t in reader.tensors:
            numpy_shape = tuple(int(d) for d in reversed(t.shape))
            values = dequantize(t.data, t.tensor_type)
            if values.size != int(np.prod(numpy_shape)):
                raise ValueError(
                    f"{self.path}: tensor {t.name} dequantized to {values.size} values, "
                    f"expected {numpy_shape}"
                )
            self.tensors[t.name] = values.reshape(numpy_shape).astype(np.float64)
            self.tensor_types[t.name] = t.tensor_type
        self.hparams = self._read_hparams()

    def has(self, name: str) -> bool:
        return name in self.tensors

    def get(self, name: str) -> np.ndarray:
        if name not in self.tensors:
            raise KeyError(f"{self.path}: missing tensor {name}")
        return self.tensors[name]

    def _key(self, key: str, default=None):
        value = self.metadata.get(key, default)
        if value is None:
            raise KeyError(f"{self.path}: missing metadata key {key}")
        return value

    def _read_hparams(self) -> HParams:
        arch = self._key("general.architecture")
        if arch not in SUPPORTED_ARCHS:
            raise NotImplementedError(f"{self.path}: architecture {arch!r} is not in {SUPPORTED_ARCHS}")

        n_embd = int(self._key(f"{arch}.embedding_length"))
        n_head = int(self._key(f"{arch}.attention.head_count"))
        n_head_kv = self._key(f"{arch}.attention.head_count_kv", n_head)
        block_kinds = ()
        if isinstance(n_head_kv, list):
            # nemotron_h_moe: one entry per block, 0 where the block has no attention.
            ff = list(self._key(f"{arch}.feed_forward_length"))
            block_kinds = tuple(
                "attention" if kv > 0 else "moe" if f > 0 else "mamba" for kv, f in zip(n_head_kv, ff)
            )
            n_head_kv = max(n_head_kv) or n_head
        n_head_kv = int(n_head_kv)
        # Keys may be absent (qwen2moe files carry no key_length): derive as llama.cpp does.
        head_dim_k = int(self._key(f"{arch}.attention.key_length", n_embd // n_head))
        head_dim_v = int(self._key(f"{arch}.attention.value_length", n_embd // n_head))
        n_rot = int(self._key(f"{arch}.rope.dimension_count", head_dim_k))

        scaling_type = self._key(f"{arch}.rope.scaling.type", "linear")
        scaling_factor = float(self.metadata.get(f"{arch}.rope.scaling.factor", 0.0) or 0.0)
        mla = {}
        if arch in ("deepseek2", "deepseek32"):
            n_lora_kv = int(self._key(f"{arch}.attention.kv_lora_rank"))
            head_dim_k_mla = int(self._key(f"{arch}.attention.key_length_mla"))
            mscale = 1.0
            if scaling_type == "yarn":
                # HF DeepSeek: softmax scale * yarn_get_mscale(factor, mscale_all_dim)^2; the
                # converter stores 0.1 * mscale_all_dim as yarn_log_multiplier.
                log_mul = float(self.metadata.get(f"{arch}.rope.scaling.yarn_log_multiplier", 0.0) or 0.0)
                mscale = 1.0 + log_mul * np.log(scaling_factor)
                mla.update(
                    yarn_ext_factor=1.0,
                    yarn_n_ctx_orig=int(self._key(f"{arch}.rope.scaling.original_context_length")),
                    yarn_beta_fast=float(self.metadata.get(f"{arch}.rope.scaling.yarn_beta_fast", 32.0)),
                    yarn_beta_slow=float(self.metadata.get(f"{arch}.rope.scaling.yarn_beta_slow", 1.0)),
                )
                scaling_type = "linear"
            mla.update(
                n_lora_kv=n_lora_kv,
                head_dim_k_mla=head_dim_k_mla,
                head_dim_v_mla=int(self._key(f"{arch}.attention.value_length_mla")),
                kq_scale=mscale * mscale / np.sqrt(head_dim_k_mla),
            )
        if arch == "deepseek32":
            mla.update(
                indexer_n_head=int(self._key(f"{arch}.attention.indexer.head_count")),
                indexer_head_dim=int(self._key(f"{arch}.attention.indexer.key_length")),
                indexer_top_k=int(self._key(f"{arch}.attention.indexer.top_k")),
            )
        if arch in DEEPSEEK_ROUTER_ARCHS:
            # The gating when the key is absent: softmax for deepseek2 (llama.cpp's default), sigmoid for
            # glm4moe (llama.cpp's) and minimax-m2 (transformers' only router; llama.cpp aborts).
            default_gating = 2 if arch in ("glm4moe", "minimax-m2", "deepseek32", "nemotron_h_moe") else 1
            mla.update(
                sigmoid_gating=int(self.metadata.get(f"{arch}.expert_gating_func", default_gating) or 1) == 2,
                n_group=int(self.metadata.get(f"{arch}.expert_group_count", 1) or 1),
                n_group_used=int(self.metadata.get(f"{arch}.expert_group_used_count", 1) or 1),
                expert_weights_scale=float(self.metadata.get(f"{arch}.expert_weights_scale", 1.0) or 1.0),
            )
        if scaling_type == "none":
            rope_freq_scale = 1.0
        elif scaling_type == "linear":
            rope_freq_scale = 1.0 if scaling_factor == 0.0 else 1.0 / scaling_factor
        else:
            raise NotImplementedError(f"{self.path}: rope scaling type {scaling_type!r}")
        if float(self.metadata.get(f"{arch}.rope.scaling.attn_factor", 1.0)) != 1.0:
            raise NotImplementedError(f"{self.path}: rope.scaling.attn_factor != 1")

        n_expert = int(self.metadata.get(f"{arch}.expert_count", 0) or 0)
        n_expert_used = int(self.metadata.get(f"{arch}.expert_used_count", 0) or 0)
        if arch in ("qwen2moe", "qwen3moe", "olmoe") and (n_expert == 0 or n_expert_used == 0):
            raise ValueError(f"{self.path}: {arch} needs expert_count and expert_used_count > 0")
        if n_expert_used > n_expert:
            raise ValueError(f"{self.path}: expert_used_count {n_expert_used} > expert_count {n_expert}")

        token_embd = self.get("token_embd.weight")
        # block_count counts the nextn (MTP) blocks too; they follow the trunk and are not run.
        n_layer = int(self._key(f"{arch}.block_count")) - int(self.metadata.get(f"{arch}.nextn_predict_layers", 0) or 0)
        hybrid = {}
        if arch == "nemotron_h_moe":
            block_kinds = block_kinds[:n_layer]
            hybrid = {
                "recurrent": tuple(kind == "mamba" for kind in block_kinds),
                "ssm_conv": int(self._key(f"{arch}.ssm.conv_kernel")),
                "ssm_k_heads": int(self._key(f"{arch}.ssm.group_count")),
                "ssm_v_heads": int(self._key(f"{arch}.ssm.time_step_rank")),
                "ssm_head_k": int(self._key(f"{arch}.ssm.state_size")),
                "ssm_inner": int(self._key(f"{arch}.ssm.inner_size")),
                "block_kinds": block_kinds,
            }
        if arch in HYBRID_ARCHS:
            flags = self.metadata.get(f"{arch}.attention.recurrent_layers")
            if flags is None:
                interval = int(self.metadata.get(f"{arch}.full_attention_interval", 4))
                flags = [(il + 1) % interval != 0 for il in range(n_layer)]
            hybrid = {
                "recurrent": tuple(bool(x) for x in list(flags)[:n_layer]),
                "ssm_conv": int(self._key(f"{arch}.ssm.conv_kernel")),
                "ssm_k_heads": int(self._key(f"{arch}.ssm.group_count")),
                "ssm_v_heads": int(self._key(f"{arch}.ssm.time_step_rank")),
                "ssm_head_k": int(self._key(f"{arch}.ssm.state_size")),
                "ssm_inner": int(self._key(f"{arch}.ssm.inner_size")),
            }
        llama4 = {}
        if arch == "llama4":
            chunked = int(self.metadata.get(f"{arch}.attention.sliding_window", 1) or 0) != 0
            if chunked:
                rope_layers = tuple(il % LLAMA4_LAYER_PATTERN < LLAMA4_LAYER_PATTERN - 1 for il in range(n_layer))
            else:
                rope_layers = tuple((il + 1) % n_layer != 0 for il in range(n_layer))
            llama4 = {
                "rope_layers": rope_layers,
                "chunk_layers": tuple(LLAMA4_CHUNK if chunked and r else 0 for r in rope_layers),
                "temp_floor_scale": LLAMA4_TEMP_FLOOR_SCALE if chunked else 0,
                "temp_scale": LLAMA4_TEMP_SCALE,
                "qk_l2_norm": n_expert != 128,
                "weight_before_ffn": True,
                "sigmoid_gating": True,
            }
        return HParams(
            arch=arch,
            n_vocab=token_embd.shape[0],
            n_embd=n_embd,
            n_layer=n_layer,
            n_head=n_head,
            n_head_kv=n_head_kv,
            head_dim_k=head_dim_k,
            head_dim_v=head_dim_v,
            n_rot=n_rot,
            rms_eps=float(
                self.metadata.get(f"{arch}.attention.layer_norm_rms_epsilon")
                or self._key(f"{arch}.attention.layer_norm_epsilon")
            ),
            rope_base=float(self._key(f"{arch}.rope.freq_base", 10000.0)),
            rope_freq_scale=rope_freq_scale,
            neox_rope=arch in NEOX_ROPE_ARCHS,
            n_expert=n_expert,
            n_expert_used=n_expert_used,
            renormalise_topk=bool(self.metadata.get(f"{arch}.expert_weights_norm", RENORMALISE_TOPK.get(arch, False))),
            **mla,
            **hybrid,
            **llama4,
        )


def _field_value(f):
    """A metadata field as a Python value (strings decoded; arrays as lists)."""
    return f.contents() if f.types else None


@dataclass
class ForwardResult:
    logits: np.ndarray  # [n_tokens, n_vocab] float64
    # Per MoE layer (empty for dense models): the router's raw logits [n_tokens, n_expert], the
    # selected experts [n_tokens, n_expert_used] in descending router order, and their weights.
    router_logits: list = field(default_factory=list)
    selected_experts: list = field(default_factory=list)
    expert_weights: list = field(default_factory=list)
    # Named activations "<name>-<layer>", each [n_tokens, width], in computation order:
    #   attn_norm, Qcur/Kcur/Vcur (projections, with bias), Qcur_normed/Kcur_normed (olmoe, qwen3*),
    #   Qcur_rope/Kcur_rope, kqv_out (attention, before attn_output), attn_out, ffn_inp, ffn_norm,
    #   ffn_moe_logits, ffn_moe_probs, ffn_moe_weights ([n_tokens, n_expert_used], in descending
    #   router order), ffn_moe_out (routed experts only), ffn_shexp_out (qwen2moe, gated),
    #   ffn_out (whole FFN), l_out; then "result_norm" and "result_output" (the logits).
    intermediates: dict = field(default_factory=dict)


# ----------------------------------------------------------------------------------------------
# Building blocks. Every function takes and returns float64 arrays; x is [n_tokens, width].


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x / sqrt(mean(x^2) + eps) * weight, over the last axis."""
    mean_square = np.mean(x * x, axis=-1, keepdims=True)
    return x / np.sqrt(mean_square + eps) * weight


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def softmax(x: np.ndarray) -> np.ndarray:
    shifted = np.exp(x - np.max(x, axis=-1, keepdims=True))
    return shifted / np.sum(shifted, axis=-1, keepdims=True)


def rope(x: np.ndarray, positions: np.ndarray, hp: HParams, freq_factors=None) -> np.ndarray:
    """Rotary position embedding of x [n_tokens, n_heads, head_dim] as ggml_rope_ext computes it
    without YaRN: dimension pair i (i < n_rot/2) turns by pos * freq_scale * base^(-2i/n_rot) / ff_i.
    Normal RoPE pairs dimensions (2i, 2i+1); NeoX pairs (i, i + n_rot/2). Dimensions >= n_rot pass
    through unchanged."""
    n_rot = hp.n_rot
    half = n_rot // 2
    inv_freq = hp.rope_base ** (-2.0 * np.arange(half, dtype=np.float64) / n_rot)
    if freq_factors is not None:
        inv_freq = inv_freq / freq_factors
    if hp.yarn_ext_factor > 0.0:
        # YaRN (HF _compute_yarn_parameters): frequencies below the correction range are
        # interpolated (freq_scale), those above it kept, a linear ramp between.
        def correction_dim(n_rotations):
            return n_rot * np.log(hp.yarn_n_ctx_orig / (n_rotations * 2 * np.pi)) / (2 * np.log(hp.rope_base))

        low = max(np.floor(correction_dim(hp.yarn_beta_fast)), 0.0)
        high = min(np.ceil(correction_dim(hp.yarn_beta_slow)), n_rot - 1.0)
        ramp = np.clip((np.arange(half) - low) / max(high - low, 0.001), 0.0, 1.0)
        keep = (1.0 - ramp) * hp.yarn_ext_factor  # weight of the un-interpolated frequency
        inv_freq = inv_freq * hp.rope_freq_scale * (1.0 - keep) + inv_freq * keep
        angle = positions.astype(np.float64)[:, None] * inv_freq[None, :]
    else:
        angle = hp.rope_freq_scale * positions.astype(np.float64)[:, None] * inv_freq[None, :]
    cos = np.cos(angle)[:, None, :]  # [n_tokens, 1, half], broadcast over heads
    sin = np.sin(angle)[:, None, :]

    out = x.copy()
    if hp.neox_rope:
        first, second = x[..., :half], x[..., half:n_rot]
        out[..., :half] = first * cos - second * sin
        out[..., half:n_rot] = first * sin + second * cos
    else:
        even, odd = x[..., 0:n_rot:2], x[..., 1:n_rot:2]
        out[..., 0:n_rot:2] = even * cos - odd * sin
        out[..., 1:n_rot:2] = even * sin + odd * cos
    return out


def causal_attention(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, scale=None, chunk: int = 0, allowed=None
) -> np.ndarray:
    """Scaled dot-product attention with a causal mask and grouped KV heads.
    q [T, n_head, Dk], k [T, n_head_kv, Dk], v [T, n_head_kv, Dv] -> [T, n_head * Dv].
    Query head h reads KV head h // (n_head / n_head_kv): consecutive query heads share a KV head,
    as both llama.cpp's broadcast and HF's repeat_kv arrange them. chunk > 0 (llama4): position p
    also reads no key before floor(p / chunk) * chunk (llama.cpp's LLAMA_SWA_TYPE_CHUNKED). allowed
    [T query, T key] (deepseek32's indexer selection): keys outside it are masked too."""
    n_tokens, n_head, head_dim = q.shape
    group = n_head // k.shape[1]
    scale = 1.0 / np.sqrt(head_dim) if scale is None else scale
    future = np.triu(np.ones((n_tokens, n_tokens), dtype=bool), k=1)
    if chunk > 0:
        position = np.arange(n_tokens)
        future |= (position[None, :] // chunk) != (position[:, None] // chunk)
    if allowed is not None:
        future |= ~allowed
    out = np.empty((n_tokens, n_head, v.shape[2]))
    for h in range(n_head):
        kv = h // group
        scores = (q[:, h, :] @ k[:, kv, :].T) * scale  # [T query, T key]
        scores[future] = -np.inf
        out[:, h, :] = softmax(scores) @ v[:, kv, :]
    return out.reshape(n_tokens, n_head * v.shape[2])


class _Layer:
    """Weight lookup for one block: `w("attn_q")` is blk.<il>.attn_q.weight; `b(...)` its bias or None."""

    def __init__(self, model: ReferenceModel, il: int):
        self.model = model
        self.prefix = f"blk.{il}."

    def w(self, name: str) -> np.ndarray:
        return self.model.get(self.prefix + name + ".weight")

    def b(self, name: str):
        key = self.prefix + name + ".bias"
        return self.model.tensors.get(key)

    def has(self, name: str) -> bool:
        return self.model.has(self.prefix + name + ".weight")


def linear(x: np.ndarray, weight: np.ndarray, bias=None) -> np.ndarray:
    y = x @ weight.T
    return y if bias is None else y + bias


def attention_block(model: ReferenceModel, il: int, x: np.ndarray, positions, record) -> np.ndarray:
    """Self-attention of block il on the normed input x [T, n_embd]; returns [T, n_embd]."""
    hp = model.hparams
    layer = _Layer(model, il)
    n_tokens = x.shape[0]

    q = linear(x, layer.w("attn_q"), layer.b("attn_q"))
    gate = None
    if hp.arch in HYBRID_ARCHS:
        # Gated attention: each head's attn_q rows are [query (head_dim) | output gate (head_dim)].
        both = q.reshape(n_tokens, hp.n_head, 2 * hp.head_dim_k)
        q = both[:, :, : hp.head_dim_k].reshape(n_tokens, -1)
        gate = both[:, :, hp.head_dim_k :].reshape(n_tokens, -1)
    k = linear(x, layer.w("attn_k"), layer.b("attn_k"))
    v = linear(x, layer.w("attn_v"), layer.b("attn_v"))
    record("Qcur", q)
    record("Kcur", k)
    record("Vcur", v)

    whole_qk_norm = hp.arch in ("olmoe", "minimax-m2")
    if whole_qk_norm:
        # OLMoE and MiniMax-M2 normalise the whole projection (all heads together) before splitting into heads.
        q = rms_norm(q, layer.w("attn_q_norm"), hp.rms_eps)
        k = rms_norm(k, layer.w("attn_k_norm"), hp.rms_eps)

    q = q.reshape(n_tokens, hp.n_head, hp.head_dim_k)
    k = k.reshape(n_tokens, hp.n_head_kv, hp.head_dim_k)
    v = v.reshape(n_tokens, hp.n_head_kv, hp.head_dim_v)

    per_head_qk_norm = hp.arch in ("qwen3", "qwen3moe") or hp.arch in HYBRID_ARCHS
    if hp.arch == "glm4moe":
        per_head_qk_norm = layer.has("attn_q_norm")  # GLM-4.5 (use_qk_norm) has them, 4.5-Air not
    if per_head_qk_norm:
        # Qwen3 normalises each head separately (weights of size head_dim).
        q = rms_norm(q, layer.w("attn_q_norm"), hp.rms_eps)
        k = rms_norm(k, layer.w("attn_k_norm"), hp.rms_eps)
    if whole_qk_norm or per_head_qk_norm:
        record("Qcur_normed", q.reshape(n_tokens, -1))
        record("Kcur_normed", k.reshape(n_tokens, -1))

    if hp.arch != "nemotron_h_moe":  # Nemotron-H's attention has no positional encoding
        # llama3-style per-frequency factors, shared by all layers when present.
        freq_factors = model.tensors.get("rope_freqs.weight")
        q = rope(q, positions, hp, freq_factors)
        k = rope(k, positions, hp, freq_factors)
    record("Qcur_rope", q.reshape(n_tokens, -1))
    record("Kcur_rope", k.reshape(n_tokens, -1))

    kqv = causal_attention(q, k, v)
    record("kqv_out", kqv)
    if gate is not None:
        kqv = kqv * sigmoid(gate)
    return linear(kqv, layer.w("attn_output"), layer.b("attn_output"))


def llama4_attention_block(model: ReferenceModel, il: int, x: np.ndarray, positions, record) -> np.ndarray:
    """Llama 4 self-attention of block il (see the module docstring); returns [T, n_embd]."""
    hp = model.hparams
    layer = _Layer(model, il)
    n_tokens = x.shape[0]
    q = linear(x, layer.w("attn_q")).reshape(n_tokens, hp.n_head, hp.head_dim_k)
    k = linear(x, layer.w("attn_k")).reshape(n_tokens, hp.n_head_kv, hp.head_dim_k)
    v = linear(x, layer.w("attn_v")).reshape(n_tokens, hp.n_head_kv, hp.head_dim_v)
    if hp.rope_layers[il]:
        freq_factors = model.tensors.get("rope_freqs.weight")
        q = rope(q, positions, hp, freq_factors)
        k = rope(k, positions, hp, freq_factors)
        if hp.qk_l2_norm:
            q = rms_norm(q, 1.0, hp.rms_eps)
            k = rms_norm(k, 1.0, hp.rms_eps)
    elif hp.temp_floor_scale:
        temperature = np.log(np.floor((positions + 1.0) / hp.temp_floor_scale) + 1.0) * hp.temp_scale + 1.0
        q = q * temperature[:, None, None]
    record("Qcur_pos", q.reshape(n_tokens, -1))
    record("Kcur_pos", k.reshape(n_tokens, -1))
    kqv = causal_attention(q, k, v, chunk=hp.chunk_layers[il])
    record("kqv_out", kqv)
    return linear(kqv, layer.w("attn_output"))


def layer_norm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float) -> np.ndarray:
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * weight + bias


def dsa_indexer_selection(model: ReferenceModel, il: int, x: np.ndarray, q_lora: np.ndarray, positions, record):
    """deepseek32's lightning indexer, as transformers' DeepseekV32Indexer computes it: per query t,
    score_j = sum_h w_h / sqrt(n_head * head) * relu(q_h . k_j) over keys j <= t, with q from the
    q LoRA, k = LayerNorm(attn_k x) (eps 1e-6), NeoX RoPE on the first n_rot dimensions of both.
    Returns the [T, T] mask of the selected keys: the top_k scores (every key j <= t while t + 1 <=
    top_k), equal scores to the earlier position (sharpi's rule; the references leave it open).
    Records each query's gap between its top_k-th and next score (indexer_margin; inf when all are
    kept), which a test compares with the engine's f32 rounding."""
    import dataclasses

    hp = model.hparams
    layer = _Layer(model, il)
    n_tokens = x.shape[0]
    n_head, head = hp.indexer_n_head, hp.indexer_head_dim
    neox = dataclasses.replace(hp, neox_rope=True)
    q = rope(linear(q_lora, layer.w("indexer.attn_q_b")).reshape(n_tokens, n_head, head), positions, neox)
    k = layer_norm(linear(x, layer.w("indexer.attn_k")), layer.w("indexer.k_norm"), layer.b("indexer.k_norm"), 1e-6)
    k = rope(k[:, None, :], positions, neox)[:, 0, :]
    w = linear(x, layer.w("indexer.proj")) / np.sqrt(n_head * head)
    scores = np.einsum("th,thj->tj", w, np.maximum(np.einsum("thd,jd->thj", q, k), 0.0))
    allowed = np.zeros((n_tokens, n_tokens), dtype=bool)
    margin = np.full(n_tokens, np.inf)
    for t in range(n_tokens):
        if t + 1 <= hp.indexer_top_k:
            allowed[t, : t + 1] = True
            continue
        order = np.argsort(-scores[t, : t + 1], kind="stable")
        allowed[t, order[: hp.indexer_top_k]] = True
        margin[t] = scores[t, order[hp.indexer_top_k - 1]] - scores[t, order[hp.indexer_top_k]]
    record("indexer_margin", margin)
    return allowed


def mla_attention_block(model: ReferenceModel, il: int, x: np.ndarray, positions, record, sparse=True) -> np.ndarray:
    """deepseek2's multi-head latent attention, expanded: every head's keys and values are rebuilt
    from the cached latent c with the converter's per-head halves of kv_b (attn_k_b holds W_kb_h
    transposed, numpy [n_head, kv_lora, qk_nope]; attn_v_b holds W_vb_h, [n_head, v_head, kv_lora]),
    then ordinary causal attention over [k_nope_h, k_pe] with the one RoPE key k_pe shared by all heads."""
    hp = model.hparams
    layer = _Layer(model, il)
    n_tokens = x.shape[0]
    n_head, n_rot, n_lora_kv = hp.n_head, hp.n_rot, hp.n_lora_kv
    qk_nope = hp.head_dim_k_mla - n_rot
    allowed = None
    if layer.has("attn_q_a"):
        q_lora = rms_norm(linear(x, layer.w("attn_q_a")), layer.w("attn_q_a_norm"), hp.rms_eps)
        q = linear(q_lora, layer.w("attn_q_b"))
        if hp.indexer_top_k and sparse:
            allowed = dsa_indexer_selection(model, il, x, q_lora, positions, record)
    else:
        q = linear(x, layer.w("attn_q"))
    record("Qcur", q)
    q = q.reshape(n_tokens, n_head, hp.head_dim_k_mla)
    kv = linear(x, layer.w("attn_kv_a_mqa"))  # [T, kv_lora + n_rot]
    c = rms_norm(kv[:, :n_lora_kv], layer.w("attn_kv_a_norm"), hp.rms_eps)
    k_pe = rope(kv[:, None, n_lora_kv:], positions, hp)  # [T, 1, n_rot]
    q_pe = rope(q[:, :, qk_nope:], positions, hp)  # [T, n_head, n_rot]
    k_b = layer.w("attn_k_b")  # [n_head, kv_lora, qk_nope]
    v_b = layer.w("attn_v_b")  # [n_head, v_head, kv_lora]
    k = np.empty((n_tokens, n_head, hp.head_dim_k_mla))
    v = np.empty((n_tokens, n_head, hp.head_dim_v_mla))
    for h in range(n_head):
        k[:, h, :qk_nope] = c @ k_b[h]
        k[:, h, qk_nope:] = k_pe[:, 0, :]
        v[:, h, :] = c @ v_b[h].T
    q = np.concatenate([q[:, :, :qk_nope], q_pe], axis=2)
    record("Qcur_rope", q.reshape(n_tokens, -1))
    kqv = causal_attention(q, k, v, scale=hp.kq_scale, allowed=allowed)
    record("kqv_out", kqv)
    return linear(kqv, layer.w("attn_output"))


def select_experts(model: ReferenceModel, il: int, router_logits: np.ndarray):
    """Gating scores [T, n_expert], selected experts [T, k] (best first) and the scores the choice
    was made on, following the HF DeepSeek routers for deepseek2 and plain softmax top-k otherwise."""
    hp = model.hparams
    k = hp.n_expert_used
    if not hp.sigmoid_gating:
        probs = softmax(router_logits)
    else:
        probs = sigmoid(router_logits)
    # llama4 ranks by the logits themselves (llama.cpp: sigmoid only after the top-k).
    choice = router_logits.copy() if hp.arch == "llama4" else probs.copy()
    bias = model.tensors.get(f"blk.{il}.exp_probs_b.bias")
    if bias is not None:
        choice = choice + bias
    if hp.n_group > 1 and hp.n_group_used < hp.n_group:
        grouped = choice.reshape(choice.shape[0], hp.n_group, -1)
        if hp.sigmoid_gating:  # V3: a group's score is the sum of its two best
            group_score = np.sort(grouped, axis=2)[:, :, -2:].sum(axis=2)
        else:  # V2 group_limited_greedy: its best
            group_score = grouped.max(axis=2)
        top_groups = np.argsort(-group_score, axis=1, kind="stable")[:, : hp.n_group_used]
        allowed = np.zeros_like(group_score, dtype=bool)
        np.put_along_axis(allowed, top_groups, True, axis=1)
        allowed = np.repeat(allowed, grouped.shape[2], axis=1)
        choice = np.where(allowed, choice, -np.inf)
    selected = np.argsort(-choice, axis=1, kind="stable")[:, :k]
    return probs, selected, np.where(np.isfinite(choice), choice, -1e9)


def deltanet_block(model: ReferenceModel, il: int, x: np.ndarray, record) -> np.ndarray:
    """Gated DeltaNet token mixer of block il on the normed input x [T, n_embd], from position 0
    (zero conv and recurrent state), in the recurrent form; returns [T, n_embd]."""
    hp = model.hparams
    layer = _Layer(model, il)
    T = x.shape[0]
    nk, nv, dk = hp.ssm_k_heads, hp.ssm_v_heads, hp.ssm_head_k
    dv = hp.ssm_inner // nv
    r = nv // nk

    qkv = linear(x, layer.w("attn_qkv"))  # [T, 2 nk dk + nv dv]: conv channels q | k | v
    z = linear(x, layer.w("attn_gate")).reshape(T, nv, dv)
    if layer.has("ssm_ba"):
        # qwen3next: per key head [beta x r, alpha x r] (value heads grouped by key head).
        ba = linear(x, layer.w("ssm_ba")).reshape(T, nk, 2 * r)
        b, a = ba[:, :, :r].reshape(T, nv), ba[:, :, r:].reshape(T, nv)
    else:
        b, a = linear(x, layer.w("ssm_beta")), linear(x, layer.w("ssm_alpha"))
    beta = sigmoid(b)
    pre = a + model.get(f"blk.{il}.ssm_dt.bias")
    softplus = np.where(pre > 20.0, pre, np.log1p(np.exp(np.minimum(pre, 20.0))))
    g = model.get(f"blk.{il}.ssm_a") * softplus  # ssm_a = -exp(A_log): log decays <= 0

    # Causal depthwise conv1d over time (zero history), then SiLU.
    kernel = model.get(f"blk.{il}.ssm_conv1d.weight")  # [channels, K]
    K = kernel.shape[1]
    padded = np.concatenate([np.zeros((K - 1, qkv.shape[1])), qkv])
    conv = np.stack([np.sum(kernel.T * padded[t : t + K], axis=0) for t in range(T)])
    conv = silu(conv)
    record("conv_output_silu", conv)

    q = conv[:, : nk * dk].reshape(T, nk, dk)
    k = conv[:, nk * dk : 2 * nk * dk].reshape(T, nk, dk)
    v = conv[:, 2 * nk * dk :].reshape(T, nv, dv)
    q = q / np.sqrt(np.sum(q * q, axis=-1, keepdims=True) + 1e-6) / np.sqrt(dk)
    k = k / np.sqrt(np.sum(k * k, axis=-1, keepdims=True) + 1e-6)

    out = np.zeros((T, nv, dv))
    for h in range(nv):
        # The converter tiles qwen35moe's value heads over key heads; qwen3next keeps them grouped.
        kh = h % nk if hp.arch == "qwen35moe" else h // r
        S = np.zeros((dk, dv))
        for t in range(T):
            S = S * np.exp(g[t, h])
            delta = beta[t, h] * (v[t, h] - S.T @ k[t, kh])
            S = S + np.outer(k[t, kh], delta)
            out[t, h] = S.T @ q[t, kh]
    record("core_attn_out", out.reshape(T, -1))
    normed = rms_norm(out, model.get(f"blk.{il}.ssm_norm.weight"), hp.rms_eps) * silu(z)
    return linear(normed.reshape(T, -1), layer.w("ssm_out"))


def mamba2_block(model: ReferenceModel, il: int, x: np.ndarray, record) -> np.ndarray:
    """Mamba-2 token mixer of block il on the normed input x [T, n_embd], from position 0 (zero conv
    and SSM state), in the sequential (recurrent) form of the selective scan; returns [T, n_embd]."""
    hp = model.hparams
    layer = _Layer(model, il)
    T = x.shape[0]
    n_head, n_group, d_state, d_inner = hp.ssm_v_heads, hp.ssm_k_heads, hp.ssm_head_k, hp.ssm_inner
    head_dim = d_inner // n_head
    channels = d_inner + 2 * n_group * d_state

    zxbcdt = linear(x, layer.w("ssm_in"))  # [T, d_inner + channels + n_head]
    z, xbc, dt = zxbcdt[:, :d_inner], zxbcdt[:, d_inner : d_inner + channels], zxbcdt[:, d_inner + channels :]
    kernel = model.get(f"blk.{il}.ssm_conv1d.weight")  # [channels, K]
    K = kernel.shape[1]
    padded = np.concatenate([np.zeros((K - 1, channels)), xbc])
    conv = np.stack([np.sum(kernel.T * padded[t : t + K], axis=0) for t in range(T)])
    conv_bias = model.tensors.get(f"blk.{il}.ssm_conv1d.bias")
    if conv_bias is not None:
        conv = conv + conv_bias
    conv = silu(conv)
    record("conv_output_silu", conv)

    xs = conv[:, :d_inner].reshape(T, n_head, head_dim)
    B = conv[:, d_inner : d_inner + n_group * d_state].reshape(T, n_group, d_state)
    C = conv[:, d_inner + n_group * d_state :].reshape(T, n_group, d_state)
    pre = dt + model.get(f"blk.{il}.ssm_dt.bias")
    dt = np.where(pre > 20.0, pre, np.log1p(np.exp(np.minimum(pre, 20.0))))  # softplus
    A = model.get(f"blk.{il}.ssm_a").reshape(-1)  # -exp(A_log)
    D = model.get(f"blk.{il}.ssm_d").reshape(-1)
    y = np.zeros((T, n_head, head_dim))
    per_group = n_head // n_group
    for h in range(n_head):
        g = h // per_group
        S = np.zeros((head_dim, d_state))
        for t in range(T):
            S = S * np.exp(dt[t, h] * A[h]) + dt[t, h] * np.outer(xs[t, h], B[t, g])
            y[t, h] = S @ C[t, g] + D[h] * xs[t, h]
    y = y.reshape(T, d_inner) * silu(z)
    record("mamba2_y", y)
    # RMSNorm over each group of d_inner / n_group channels (the gate applied before the norm).
    groups = y.reshape(T, n_group, d_inner // n_group)
    weight = model.get(f"blk.{il}.ssm_norm.weight").reshape(n_group, -1)
    normed = groups / np.sqrt(np.mean(groups * groups, axis=-1, keepdims=True) + hp.rms_eps) * weight
    return linear(normed.reshape(T, d_inner), layer.w("ssm_out"))


def relu_sqr_ffn(x, up_w, down_w):
    """down(relu(up x)^2) for x [T, n_embd] (Nemotron-H's experts and shared expert)."""
    return linear(np.maximum(linear(x, up_w), 0.0) ** 2, down_w)


def swiglu_ffn(x, gate_w, up_w, down_w, gate_b=None, up_b=None, down_b=None):
    """down(silu(gate x) * up x) for x [T, n_embd]."""
    return linear(silu(linear(x, gate_w, gate_b)) * linear(x, up_w, up_b), down_w, down_b)


def moe_block(model: ReferenceModel, il: int, x: np.ndarray, result: ForwardResult, record):
    """Routed experts (and qwen2moe's shared expert) of block il on the normed input x [T, n_embd]."""
    hp = model.hparams
    layer = _Layer(model, il)
    n_tokens = x.shape[0]
    k = hp.n_expert_used

    router_logits = linear(x, layer.w("ffn_gate_inp"))  # [T, n_expert]
    if router_logits.shape[1] != hp.n_expert:
        raise ValueError(
            f"blk.{il}.ffn_gate_inp has {router_logits.shape[1]} experts, expected {hp.n_expert}"
        )
    # Descending by selection score; a stable sort on the negated values breaks exact ties toward the
    # lower expert id. (Exact ties do not happen with random float weights; near-ties do, and the
    # tests report them through router_margins() instead of relying on any tie-break rule.)
    probs, selected, choice = select_experts(model, il, router_logits)  # selected: [T, k]
    weights = np.take_along_axis(probs, selected, axis=1)  # [T, k]
    if hp.renormalise_topk:
        weights = weights / np.sum(weights, axis=1, keepdims=True)
    weights = weights * hp.expert_weights_scale
    record("ffn_moe_logits", router_logits)
    record("ffn_moe_probs", probs)
    record("ffn_moe_weights", weights)

    ungated = not layer.has("ffn_gate_exps")  # nemotron_h_moe: relu^2 experts
    gate_exps = None if ungated else layer.w("ffn_gate_exps")  # [n_expert, n_ff_exp, n_embd]
    up_exps = layer.w("ffn_up_exps")  # [n_expert, n_ff_exp, n_embd]
    down_exps = layer.w("ffn_down_exps")  # [n_expert, n_embd, n_ff_exp]
    # nemotron_h_moe's latent MoE (Nemotron 3 Super): the experts run on latent_down x, their sum
    # goes back through latent_up; the router and the shared expert read x.
    latent = layer.has("ffn_latent_down")
    x_exp = linear(x, layer.w("ffn_latent_down")) if latent else x
    out = np.zeros((n_tokens, x_exp.shape[1]))
    for t in range(n_tokens):
        for slot in range(k):
            e = selected[t, slot]
            if ungated:
                out[t] += weights[t, slot] * relu_sqr_ffn(x_exp[t : t + 1], up_exps[e], down_exps[e])[0]
            elif hp.weight_before_ffn:  # llama4: the weight scales the expert's input
                out[t] += swiglu_ffn(weights[t, slot] * x[t : t + 1], gate_exps[e], up_exps[e], down_exps[e])[0]
            else:
                expert_out = swiglu_ffn(x[t : t + 1], gate_exps[e], up_exps[e], down_exps[e])
                out[t] += weights[t, slot] * expert_out[0]
    record("ffn_moe_out", out)
    if latent:
        out = linear(out, layer.w("ffn_latent_up"))

    if layer.has("ffn_gate_inp_shexp"):
        # Shared expert: always on, scaled per token by a sigmoid gate. The gate weight is [n_embd]
        # after llama.cpp's quantizer and [1, n_embd] (ggml ne [n_embd, 1]) from the converter.
        gate_weight = layer.w("ffn_gate_inp_shexp").reshape(-1)
        if gate_weight.shape[0] != hp.n_embd:
            raise ValueError(
                f"blk.{il}.ffn_gate_inp_shexp has {gate_weight.shape[0]} values, expected {hp.n_embd}"
            )
        shared_gate = sigmoid(x @ gate_weight)[:, None]  # [T, 1]
        shared = swiglu_ffn(x, layer.w("ffn_gate_shexp"), layer.w("ffn_up_shexp"), layer.w("ffn_down_shexp"))
        record("ffn_shexp_out", shared * shared_gate)
        out = out + shared * shared_gate
    elif ungated and layer.has("ffn_up_shexp"):
        # nemotron_h_moe's shared expert: relu^2, always on, unscaled.
        out = out + relu_sqr_ffn(x, layer.w("ffn_up_shexp"), layer.w("ffn_down_shexp"))
    elif layer.has("ffn_gate_shexp"):
        # deepseek2's shared experts: always on, unscaled.
        out = out + swiglu_ffn(x, layer.w("ffn_gate_shexp"), layer.w("ffn_up_shexp"), layer.w("ffn_down_shexp"))

    # Margins are taken on the scores the choice was made on (= the logits' order for softmax).
    result.router_logits.append(router_logits if hp.arch not in DEEPSEEK_ROUTER_ARCHS else choice)
    result.selected_experts.append(selected)
    result.expert_weights.append(weights)
    return out


def ffn_norm_name(hp) -> str:
    """The norm before a block's FFN: post_attention_norm as the converter names it for the hybrid
    archs and glm4moe, ffn_norm elsewhere."""
    return "post_attention_norm" if hp.arch in HYBRID_ARCHS or hp.arch == "glm4moe" else "ffn_norm"


def forward(model: ReferenceModel, tokens) -> ForwardResult:
    """Logits for every position of `tokens` (causal, positions 0..n-1), with routing and named
    intermediate activations so that a mismatch can be traced to a layer and an operation."""
    hp = model.hparams
    tokens = np.asarray(tokens, dtype=np.int64)
    if tokens.ndim != 1 or tokens.size == 0:
        raise ValueError("tokens must be a non-empty 1-D sequence")
    if tokens.min() < 0 or tokens.max() >= hp.n_vocab:
        raise ValueError(f"token ids must lie in [0, {hp.n_vocab}), got [{tokens.min()}, {tokens.max()}]")
    positions = np.arange(tokens.size)
    result = ForwardResult(logits=np.empty(0))

    hidden = model.get("token_embd.weight")[tokens]  # [T, n_embd]
    for il in range(hp.n_layer):
        layer = _Layer(model, il)

        def record(name, value, il=il):
            result.intermediates[f"{name}-{il}"] = value

        if hp.block_kinds:
            # nemotron_h_moe: one mixer per block, x + mixer(rms_norm(x)).
            normed = rms_norm(hidden, layer.w("attn_norm"), hp.rms_eps)
            record("attn_norm", normed)
            kind = hp.block_kinds[il]
            if kind == "mamba":
                out = mamba2_block(model, il, normed, record)
            elif kind == "attention":
                out = attention_block(model, il, normed, positions, record)
            else:
                out = moe_block(model, il, normed, result, record)
            hidden = hidden + out
            record("l_out", hidden)
            continue

        normed = rms_norm(hidden, layer.w("attn_norm"), hp.rms_eps)
        record("attn_norm", normed)
        if hp.recurrent and hp.recurrent[il]:
            attn_out = deltanet_block(model, il, normed, record)
        else:
            block = {
                "deepseek2": mla_attention_block,
                "deepseek32": mla_attention_block,
                "llama4": llama4_attention_block,
            }.get(hp.arch, attention_block)
            attn_out = block(model, il, normed, positions, record)
        record("attn_out", attn_out)
        ffn_inp = hidden + attn_out
        record("ffn_inp", ffn_inp)

        ffn_norm = ffn_norm_name(hp)
        normed = rms_norm(ffn_inp, layer.w(ffn_norm), hp.rms_eps)
        record("ffn_norm", normed)
        if layer.has("ffn_gate_inp"):
            ffn_out = moe_block(model, il, normed, result, record)
        else:
            ffn_out = swiglu_ffn(
                normed,
                layer.w("ffn_gate"),
                layer.w("ffn_up"),
                layer.w("ffn_down"),
                layer.b("ffn_gate"),
                layer.b("ffn_up"),
                layer.b("ffn_down"),
            )
        record("ffn_out", ffn_out)
        hidden = ffn_inp + ffn_out
        record("l_out", hidden)

    normed = rms_norm(hidden, model.get("output_norm.weight"), hp.rms_eps)
    result.intermediates["result_norm"] = normed
    # Tied embeddings: files without output.weight reuse token_embd.weight as the LM head.
    lm_head = model.tensors.get("output.weight", model.get("token_embd.weight"))
    result.logits = normed @ lm_head.T
    result.intermediates["result_output"] = result.logits
    return result


def greedy_generate(model: ReferenceModel, prompt, n_new: int) -> list:
    """The n_new tokens greedy decoding appends to prompt (argmax, lowest id on an exact tie).
    Recomputes the whole sequence each step: slow, and free of any KV-cache logic to get wrong."""
    sequence = [int(t) for t in prompt]
    for _ in range(n_new):
        logits = forward(model, sequence).logits[-1]
        sequence.append(int(np.argmax(logits)))
    return sequence[len(prompt) :]


# ----------------------------------------------------------------------------------------------
# Helpers the tests use to compare and to explain mismatches.


def relative_error(actual, expected) -> float:
    """max over positions p of ||actual_p - expected_p||_inf / ||expected_p||_inf (rows = positions)."""
    actual = np.asarray(actual, dtype=np.float64).reshape(np.shape(expected)[0], -1)
    expected = np.asarray(expected, dtype=np.float64).reshape(actual.shape)
    per_row = np.max(np.abs(actual - expected), axis=1) / np.maximum(np.max(np.abs(expected), axis=1), 1e-30)
    return float(np.max(per_row))


def relative_error_per_position(actual, expected) -> np.ndarray:
    actual = np.asarray(actual, dtype=np.float64).reshape(np.shape(expected)[0], -1)
    expected = np.asarray(expected, dtype=np.float64).reshape(actual.shape)
    return np.max(np.abs(actual - expected), axis=1) / np.maximum(np.max(np.abs(expected), axis=1), 1e-30)


def router_margins(result: ForwardResult, n_expert_used: int) -> np.ndarray:
    """[n_layer_moe, n_tokens]: the gap, in router-logit units, between the k-th and (k+1)-th largest
    router logits. A small gap means f32 rounding may legitimately choose a different top-k."""
    margins = []
    for logits in result.router_logits:
        ordered = -np.sort(-logits, axis=1)
        if ordered.shape[1] == n_expert_used:  # every expert selected: no boundary to flip
            margins.append(np.full(ordered.shape[0], np.inf))
        else:
            margins.append(ordered[:, n_expert_used - 1] - ordered[:, n_expert_used])
    return np.array(margins)


def top2_logit_gap(logits: np.ndarray) -> np.ndarray:
    """Per position, the gap between the largest and the second largest output logit."""
    ordered = -np.sort(-np.asarray(logits, dtype=np.float64), axis=-1)
    return ordered[..., 0] - ordered[..., 1]


def mtp_forward(model: ReferenceModel, hidden: np.ndarray, next_tokens) -> tuple:
    """The file's first multi-token-prediction block (blk.<n_layer>, "nextn") on the pairs
    (hidden[i], next_tokens[i]), pair i at RoPE position i + 1 and causal over the pairs, as
    DeepSeek-V3's, Qwen3.5's and Nemotron 3 Super's MTP modules define it (llama.cpp's graph_mtp):

        z = eh_proj([enorm(embed(x)) | hnorm(h)]);  the arch's full-attention block on z;
        h' = shared_head_norm (else output_norm);  logits = h' @ head (nextn.shared_head_head, else
        the model's lm_head).

    hidden: [n, n_embd] (the trunk's hidden after output_norm, or an earlier h'). Returns (logits
    [n, n_vocab], h' [n, n_embd])."""
    hp = model.hparams
    il = hp.n_layer
    layer = _Layer(model, il)
    tokens = np.asarray(next_tokens, dtype=np.int64)
    embed = model.tensors.get(f"blk.{il}.nextn.embed_tokens.weight", model.get("token_embd.weight"))
    e = rms_norm(embed[tokens], layer.w("nextn.enorm"), hp.rms_eps)
    h = rms_norm(np.asarray(hidden, dtype=np.float64), layer.w("nextn.hnorm"), hp.rms_eps)
    x = linear(np.concatenate([e, h], axis=1), layer.w("nextn.eh_proj"))

    def record(name, value):
        pass

    positions = np.arange(1, tokens.size + 1)
    normed = rms_norm(x, layer.w("attn_norm"), hp.rms_eps)
    if hp.n_lora_kv:
        # DeepSeek's block: MLA, dense (llama.cpp's deepseek32 graph_mtp builds no indexer).
        attn_out = mla_attention_block(model, il, normed, positions, record, sparse=False)
    else:
        attn_out = attention_block(model, il, normed, positions, record)
    ffn_inp = x + attn_out
    # Nemotron-H's block (Nemotron 3 Super's mtp.layers.0 and .1, one GGUF block): its MoE sub-layer
    # norms with post_attention_norm, and the head norm is a LayerNorm without bias (llama.cpp's
    # nemotron_h_moe graph_mtp, f_norm_eps: the file's layer_norm_epsilon).
    nemotron = hp.arch == "nemotron_h_moe"
    ffn_norm = "post_attention_norm" if nemotron else ffn_norm_name(hp)
    normed = rms_norm(ffn_inp, layer.w(ffn_norm), hp.rms_eps)
    out = ffn_inp + moe_block(model, il, normed, ForwardResult(logits=np.empty(0)), record)
    head_norm = model.tensors.get(f"blk.{il}.nextn.shared_head_norm.weight", model.get("output_norm.weight"))
    if nemotron:
        eps = float(model.metadata[f"{hp.arch}.attention.layer_norm_epsilon"])
        h_out = layer_norm(out, head_norm, np.zeros_like(head_norm), eps)
    else:
        h_out = rms_norm(out, head_norm, hp.rms_eps)
    head = model.tensors.get(f"blk.{il}.nextn.shared_head_head.weight",
                             model.tensors.get("output.weight", model.get("token_embd.weight")))
    return h_out @ head.T, h_out
