"""The tensors of a synthetic model and the ggml type each gets: what sharpi.make_model writes.

What it owns: the quant names `sharpi make-model --quant` accepts (QUANTS: llama.cpp's file type
and base type of each) and, per architecture, the tensor names and ggml shapes
convert_hf_to_gguf.py writes (plan_tensors), each with the type llama.cpp's converter or
llama-quantize would give it (choose_type, including the K_M mixes' extra bits on some layers).
Plain data and rules: no weights, no file I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import gguf
import numpy as np

from ._core import InvalidArgument
from .presets import HYBRID_ARCHES, MLA_ARCHES, HParams

QT = gguf.GGMLQuantizationType
FT = gguf.LlamaFileType


@dataclass(frozen=True)
class QuantRecipe:
    name: str
    ftype: FT  # general.file_type
    default: QT  # type of an ordinary weight matrix
    via_quantizer: bool  # True: llama-quantize's per-tensor rules; False: convert_hf_to_gguf --outtype
    # Dynamic mixes (the "UD-Q2_K_XL" kind): routed experts' gate/up and down types; everything
    # else follows `default` and the rules of choose_type.
    experts: tuple[QT, QT] | None = None


QUANTS: dict[str, QuantRecipe] = {
    r.name: r
    for r in [
        QuantRecipe("f32", FT.ALL_F32, QT.F32, False),
        QuantRecipe("f16", FT.MOSTLY_F16, QT.F16, False),
        QuantRecipe("bf16", FT.MOSTLY_BF16, QT.BF16, False),
        QuantRecipe("q8_0", FT.MOSTLY_Q8_0, QT.Q8_0, False),
        QuantRecipe("q4_0", FT.MOSTLY_Q4_0, QT.Q4_0, True),
        QuantRecipe("q4_1", FT.MOSTLY_Q4_1, QT.Q4_1, True),
        QuantRecipe("q5_0", FT.MOSTLY_Q5_0, QT.Q5_0, True),
        QuantRecipe("q5_1", FT.MOSTLY_Q5_1, QT.Q5_1, True),
        # The plain K names are llama-quantize's "_S" (small) mixes, its only mixes with those types.
        QuantRecipe("q2_k", FT.MOSTLY_Q2_K, QT.Q2_K, True),
        QuantRecipe("q3_k", FT.MOSTLY_Q3_K_S, QT.Q3_K, True),
        QuantRecipe("q4_k", FT.MOSTLY_Q4_K_S, QT.Q4_K, True),
        QuantRecipe("q5_k", FT.MOSTLY_Q5_K_S, QT.Q5_K, True),
        QuantRecipe("q6_k", FT.MOSTLY_Q6_K, QT.Q6_K, True),
        QuantRecipe("q4_k_m", FT.MOSTLY_Q4_K_M, QT.Q4_K, True),
        QuantRecipe("q5_k_m", FT.MOSTLY_Q5_K_M, QT.Q5_K, True),
        # llama-quantize's MXFP4_MOE: stacked expert tensors MXFP4, every other matrix Q8_0.
        QuantRecipe("mxfp4", FT.MOSTLY_MXFP4_MOE, QT.Q8_0, True),
        # The importance-matrix types, every weight matrix in that type (output.weight Q6_K).
        QuantRecipe("iq4_nl", FT.MOSTLY_IQ4_NL, QT.IQ4_NL, True),
        QuantRecipe("iq4_xs", FT.MOSTLY_IQ4_XS, QT.IQ4_XS, True),
        QuantRecipe("iq3_s", FT.MOSTLY_IQ3_S, QT.IQ3_S, True),
        QuantRecipe("iq3_xxs", FT.MOSTLY_IQ3_XXS, QT.IQ3_XXS, True),
        QuantRecipe("iq2_s", FT.MOSTLY_IQ2_S, QT.IQ2_S, True),
        QuantRecipe("iq2_xs", FT.MOSTLY_IQ2_XS, QT.IQ2_XS, True),
        QuantRecipe("iq2_xxs", FT.MOSTLY_IQ2_XXS, QT.IQ2_XXS, True),
        QuantRecipe("iq1_s", FT.MOSTLY_IQ1_S, QT.IQ1_S, True),
        QuantRecipe("iq1_m", FT.MOSTLY_IQ1_M, QT.IQ1_M, True),
        # A dynamic mix as big MoE files ship: IQ2_XXS expert gate/up, IQ3_S expert down, Q4_K dense
        # weights with Q6_K attn_v / output (unsloth's UD-IQ2_XXS layout, simplified).
        QuantRecipe("iq2_xxs_mix", FT.MOSTLY_IQ2_XXS, QT.Q4_K, True, experts=(QT.IQ2_XXS, QT.IQ3_S)),
    ]
}


@dataclass
class TensorSpec:
    """One tensor of the model. `ne` is ggml order (ne[0] = row length, innermost)."""

    name: str
    ne: tuple[int, ...]
    layer: int | None  # block index for blk.N.* tensors
    role: str  # embed | linear | out_linear | router | shexp_gate | norm | bias | lm_head | rope_freqs | table
    type: QT = QT.F32
    # Fixed values (float32, numpy shape) for a tensor that is computed, not drawn (rope_freqs).
    values: object = field(default=None, compare=False, repr=False)

    @property
    def numpy_shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.ne))

    @property
    def n_elements(self) -> int:
        return math.prod(self.ne)

    @property
    def nbytes(self) -> int:
        block, size = gguf.GGML_QUANT_SIZES[self.type]
        return self.n_elements // block * size

    def init_std(self) -> float:
        """Standard deviation of the synthetic weights: keeps activations O(1) through the network."""
        fan_in = self.ne[0]
        return {
            "embed": 1.0,  # the residual stream starts at unit scale
            "linear": 1.0 / math.sqrt(fan_in),
            "out_linear": 1.0 / math.sqrt(fan_in),  # residual branch outputs: O(1) but below the stream
            "router": 2.0 / math.sqrt(fan_in),  # logits ~N(0, 2): clear top-k margins
            "shexp_gate": 1.0 / math.sqrt(fan_in),
            "lm_head": 2.0 / math.sqrt(fan_in),
            "ssm_a": 0.5,  # -exp(N(0, 0.5^2)), see _float_weights: decays exp(g) in (0, 1)
            "norm": 0.05,  # around 1.0, see _float_weights
            "bias": 0.05,
            "rope_freqs": 0.0,  # computed, not drawn (synthetic_weights.tensor_data)
            "table": 0.0,  # deepseek4's i32 hash table, computed (tensor_plan._deepseek4_layer)
        }[self.role]


def _more_bits(i_layer: int, n_layer: int) -> bool:
    """llama.cpp's layer choice for the extra bits of the K_M mixes: the first and last eighth of the
    layers and every third layer in between."""
    return i_layer < n_layer // 8 or i_layer >= 7 * n_layer // 8 or (i_layer - n_layer // 8) % 3 == 2


_FALLBACK = {QT.Q2_K: QT.Q4_0, QT.Q3_K: QT.Q4_0, QT.Q4_K: QT.Q5_0, QT.Q5_K: QT.Q5_1, QT.Q6_K: QT.Q8_0}
# llama-quantize: the 256-element IQ types fall back to IQ4_NL (32-element blocks).
_FALLBACK.update(
    {t: QT.IQ4_NL for t in (QT.IQ4_XS, QT.IQ3_S, QT.IQ3_XXS, QT.IQ2_S, QT.IQ2_XS, QT.IQ2_XXS, QT.IQ1_S, QT.IQ1_M)}
)
_FALLBACK[QT.IQ4_NL] = QT.Q8_0


def _fits(qt: QT, row: int) -> bool:
    return row % gguf.GGML_QUANT_SIZES[qt][0] == 0


def choose_type(spec: TensorSpec, hp: HParams, recipe: QuantRecipe, pure: bool = False) -> QT:
    """The ggml type llama.cpp's tools give this tensor (rules of convert_hf_to_gguf.py and
    src/llama-quant.cpp, re-stated; `pure` = llama-quantize --pure: one type for every weight matrix)."""
    name, row = spec.name, spec.ne[0]
    if spec.role == "table":  # deepseek4's hash routing table: i32 token -> expert ids
        return QT.I32
    # deepseek4: the hyper-connection mixes and the compressors' position biases stay f32 (the
    # checkpoint's f32 tensors, which the converter keeps f32 whatever --outtype says).
    if ".hc_" in name or name.startswith("output_hc_") or "_ape." in name:
        return QT.F32
    # Never quantized: 1-D tensors, norms, biases, routers, the DeltaNet conv kernel (both converter
    # and quantizer agree).
    if (
        len(spec.ne) < 2
        or ".ssm_conv1d." in name
        or name.endswith("_norm.weight")
        or not name.endswith(".weight")
        or ".ffn_gate_inp" in name
    ):
        return QT.F32

    if not recipe.via_quantizer:
        # The converter's --outtype: everything else in that one type; q8_0 rows must be whole blocks.
        if recipe.default == QT.Q8_0 and not _fits(QT.Q8_0, row):
            return QT.F16
        return recipe.default

    ft, new = recipe.ftype, recipe.default
    # llama-quantize counts the layers by the tensors it sees: the MTP blocks' too.
    n_layer, il = hp.n_layer + hp.n_layer_nextn, spec.layer
    if ft == FT.MOSTLY_MXFP4_MOE:
        return QT.MXFP4 if len(spec.ne) == 3 and _fits(QT.MXFP4, row) else new if _fits(new, row) else QT.F16
    tied_embd = hp.tie_embeddings and name == "token_embd.weight"
    if recipe.experts is not None and not pure:
        if "_exps." in name:
            new = recipe.experts[1] if ".ffn_down_exps." in name else recipe.experts[0]
        elif ".attn_v." in name or name == "output.weight" or tied_embd:
            new = QT.Q6_K
    elif not pure:
        if name == "output.weight" or tied_embd:
            if not _fits(new, row):
                new = QT.Q8_0
            elif new != QT.Q8_0:
                new = QT.Q6_K
        elif name == "token_embd.weight":
            pass  # the file type's default
        elif ".attn_v." in name:
            if ft == FT.MOSTLY_Q2_K:
                new = QT.Q4_K if hp.n_head // hp.n_head_kv >= 4 else QT.Q3_K
            elif ft in (FT.MOSTLY_Q4_K_M, FT.MOSTLY_Q5_K_M) and _more_bits(il, n_layer):
                new = QT.Q6_K
            elif ft == FT.MOSTLY_Q4_K_S and il < 4:
                new = QT.Q5_K
            if hp.n_expert == 8:
                new = QT.Q8_0  # "trades just ~128MB" for 8-expert models
        elif ".attn_k." in name:
            if hp.n_expert == 8:
                new = QT.Q8_0
        elif ".ffn_down" in name:  # ffn_down, ffn_down_exps and ffn_down_shexp alike
            if ft == FT.MOSTLY_Q2_K:
                new = QT.Q3_K
            elif ft in (FT.MOSTLY_Q4_K_M, FT.MOSTLY_Q5_K_M) and _more_bits(il, n_layer):
                new = QT.Q6_K
            elif ft == FT.MOSTLY_Q4_K_S and il < n_layer // 8:
                new = QT.Q5_K
        elif ".attn_output." in name:
            if hp.n_expert == 8:
                if ft in (FT.MOSTLY_Q2_K, FT.MOSTLY_Q3_K_S, FT.MOSTLY_Q4_K_S, FT.MOSTLY_Q4_K_M):
                    new = QT.Q5_K
            elif ft == FT.MOSTLY_Q2_K:
                new = QT.Q3_K
    # Rows that are not whole blocks of the chosen type fall back as llama-quantize does
    # (e.g. Qwen1.5-MoE's 1408-wide ffn_down_exps: q4_K -> q5_0, q6_K -> q8_0).
    if not _fits(new, row):
        new = _FALLBACK.get(new, new)
        if not _fits(new, row):
            new = QT.F16
    return new


def plan_tensors(hp: HParams, quant: str = "f32", pure: bool = False) -> list[TensorSpec]:
    """Every tensor of the model in file order (token_embd, blocks in order, output_norm, output)."""
    recipe = quant_recipe(quant)
    E, V, Q, KV = hp.n_embd, hp.n_vocab, hp.q_width, hp.kv_width
    # The qwen2moe shared-expert gate is [n_embd, 1] from the converter; llama-quantize drops the
    # trailing 1 (it rewrites every shape with ggml_n_dims), so quantized files carry [n_embd].
    shexp_gate_ne = (E,) if recipe.via_quantizer else (E, 1)
    specs = [TensorSpec("token_embd.weight", (E, V), None, "embed")]
    if hp.arch == "llama4" and hp.rope_llama3_factor:
        # LlamaModel.generate_extra_tensors: the llama3 frequency factors, one per rotated pair.
        specs.insert(0, TensorSpec("rope_freqs.weight", (hp.head_dim // 2,), None, "rope_freqs",
                                   values=llama3_rope_factors(hp)))  # fmt: skip
    for il in range(hp.n_layer):
        b = f"blk.{il}."
        if hp.arch in HYBRID_ARCHES:
            specs += _hybrid_layer(hp, il, shexp_gate_ne)
            continue
        if hp.arch in MLA_ARCHES:
            specs += _deepseek2_layer(hp, il)
            continue
        if hp.arch == "gpt-oss":
            specs += _gpt_oss_layer(hp, il)
            continue
        if hp.arch == "glm4moe":
            specs += _glm4moe_layer(hp, il)
            continue
        if hp.arch == "llama4":
            specs += _llama4_layer(hp, il)
            continue
        if hp.arch == "deepseek4":
            specs += _deepseek4_layer(hp, il)
            continue
        if hp.arch == "nemotron_h_moe":
            specs += _nemotron_h_moe_layer(hp, il)
            continue
        t = [TensorSpec(b + "attn_norm.weight", (E,), il, "norm")]
        t += [
            TensorSpec(b + "attn_q.weight", (E, Q), il, "linear"),
            TensorSpec(b + "attn_k.weight", (E, KV), il, "linear"),
            TensorSpec(b + "attn_v.weight", (E, KV), il, "linear"),
        ]
        if hp.arch in ("qwen2", "qwen2moe"):
            t += [
                TensorSpec(b + "attn_q.bias", (Q,), il, "bias"),
                TensorSpec(b + "attn_k.bias", (KV,), il, "bias"),
                TensorSpec(b + "attn_v.bias", (KV,), il, "bias"),
            ]
        if hp.arch in ("qwen3", "qwen3moe"):  # per-head RMSNorm of q and k
            t += [
                TensorSpec(b + "attn_q_norm.weight", (hp.head_dim,), il, "norm"),
                TensorSpec(b + "attn_k_norm.weight", (hp.head_dim,), il, "norm"),
            ]
        if hp.arch in ("olmoe", "minimax-m2"):  # RMSNorm over the whole q / k projection
            t += [
                TensorSpec(b + "attn_q_norm.weight", (Q,), il, "norm"),
                TensorSpec(b + "attn_k_norm.weight", (KV,), il, "norm"),
            ]
        t += [
            TensorSpec(b + "attn_output.weight", (Q, E), il, "out_linear"),
            TensorSpec(b + "ffn_norm.weight", (E,), il, "norm"),
        ]
        if hp.is_moe:
            F, X = hp.n_ff_exp, hp.n_expert
            t += [
                TensorSpec(b + "ffn_gate_inp.weight", (E, X), il, "router"),
            ]
            if hp.arch == "minimax-m2":  # the router's selection bias (e_score_correction_bias)
                t.append(TensorSpec(b + "exp_probs_b.bias", (X,), il, "bias"))
            t += [
                TensorSpec(b + "ffn_gate_exps.weight", (E, F, X), il, "linear"),
                TensorSpec(b + "ffn_up_exps.weight", (E, F, X), il, "linear"),
                TensorSpec(b + "ffn_down_exps.weight", (F, E, X), il, "out_linear"),
            ]
            if hp.arch == "qwen2moe":
                S = hp.n_ff_shexp
                t += [
                    TensorSpec(b + "ffn_gate_inp_shexp.weight", shexp_gate_ne, il, "shexp_gate"),
                    TensorSpec(b + "ffn_gate_shexp.weight", (E, S), il, "linear"),
                    TensorSpec(b + "ffn_up_shexp.weight", (E, S), il, "linear"),
                    TensorSpec(b + "ffn_down_shexp.weight", (S, E), il, "out_linear"),
                ]
        else:
            t += [
                TensorSpec(b + "ffn_gate.weight", (E, hp.n_ff), il, "linear"),
                TensorSpec(b + "ffn_up.weight", (E, hp.n_ff), il, "linear"),
                TensorSpec(b + "ffn_down.weight", (hp.n_ff, E), il, "out_linear"),
            ]
        specs += t
    for i in range(hp.n_layer_nextn):
        il = hp.n_layer + i  # the MTP blocks, blk.<n_layer + i>, as the converter writes them
        if hp.arch == "glm4moe":
            specs += _glm4moe_layer(hp, il)
            continue
        if hp.arch == "nemotron_h_moe":
            specs += _nemotron_h_moe_layer(hp, il)
            continue
        if hp.arch == "deepseek4":
            # DeepSeek-V4's MTP block (mtp.0): a sliding-window, bias-routed layer of the trunk's kind
            # and the nextn tensors. Its own hc head is the root output_hc_* of a --mtp sidecar; in one
            # file llama.cpp's graph_mtp takes the trunk's, so none is written here.
            specs += _deepseek4_layer(hp, il) + _nextn_tensors(hp, il)
            continue
        if hp.arch == "deepseek32":
            # DeepSeek-V3.2's MTP block (model.layers.61): a MoE block of the trunk's kind (its own
            # indexer included), then the nextn tensors, which in DeepSeek's checkpoints include
            # the block's own copies of the embedding and the LM head.
            specs += _deepseek2_layer(hp, il) + _nextn_tensors(hp, il)
            specs += [
                TensorSpec(f"blk.{il}.nextn.embed_tokens.weight", (E, V), il, "embed"),
                TensorSpec(f"blk.{il}.nextn.shared_head_head.weight", (E, V), il, "lm_head"),
            ]
            continue
        # Qwen3.5 / Qwen3-Next (mtp.*): a full-attention block of the arch, then the nextn tensors.
        specs += _hybrid_layer(hp, il, shexp_gate_ne, attention=True) + _nextn_tensors(hp, il)
    specs.append(TensorSpec("output_norm.weight", (E,), None, "norm"))
    if hp.arch == "deepseek4":  # the hyper-connection head
        N = hp.hc_mult
        specs += [
            TensorSpec("output_hc_fn.weight", (N * E, N), None, "linear"),
            TensorSpec("output_hc_base.weight", (N,), None, "bias"),
            TensorSpec("output_hc_scale.weight", (1,), None, "norm"),
        ]
    if not hp.tie_embeddings:
        specs.append(TensorSpec("output.weight", (E, V), None, "lm_head"))
    for s in specs:
        s.type = choose_type(s, hp, recipe, pure)
    return specs


def _deepseek4_layer(hp: HParams, il: int) -> list[TensorSpec]:
    """One deepseek4 block as llama.cpp's converter writes it (DeepseekV4Model): the shared-KV
    attention with its q LoRA, sinks and grouped output; the two hyper-connections; the compressor
    (and on CSA layers the indexer); the router with its hash table (i32 token -> experts, valid
    expert ids) or its selection bias; the routed and shared experts."""
    b = f"blk.{il}."
    E, D, H, R, F, X = hp.n_embd, hp.head_dim, hp.n_head, hp.n_lora_q, hp.n_ff_exp, hp.n_expert
    N, G, Ro = hp.hc_mult, hp.o_groups, hp.o_lora_rank
    M = (2 + N) * N
    ratio = hp.compress_ratios[il] if il < hp.n_layer else 0  # the MTP block: sliding window only
    t = [
        TensorSpec(b + "attn_norm.weight", (E,), il, "norm"),
        TensorSpec(b + "attn_sinks.weight", (H,), il, "bias"),
        TensorSpec(b + "attn_q_a.weight", (E, R), il, "linear"),
        TensorSpec(b + "attn_q_a_norm.weight", (R,), il, "norm"),
        TensorSpec(b + "attn_q_b.weight", (R, H * D), il, "linear"),
        TensorSpec(b + "attn_kv.weight", (E, D), il, "linear"),
        TensorSpec(b + "attn_kv_a_norm.weight", (D,), il, "norm"),
        TensorSpec(b + "attn_output_a.weight", (H * D // G, G * Ro), il, "out_linear"),
        TensorSpec(b + "attn_output_b.weight", (G * Ro, E), il, "out_linear"),
    ]
    for hc in ("attn", "ffn"):
        t += [
            TensorSpec(b + f"hc_{hc}_fn.weight", (N * E, M), il, "linear"),
            TensorSpec(b + f"hc_{hc}_base.weight", (M,), il, "bias"),
            TensorSpec(b + f"hc_{hc}_scale.weight", (3,), il, "norm"),
        ]
    if ratio:
        cD = (2 if ratio == 4 else 1) * D
        t += [
            TensorSpec(b + "attn_compressor_kv.weight", (E, cD), il, "linear"),
            TensorSpec(b + "attn_compressor_gate.weight", (E, cD), il, "linear"),
            TensorSpec(b + "attn_compressor_ape.weight", (cD, ratio), il, "bias"),
            TensorSpec(b + "attn_compressor_norm.weight", (D,), il, "norm"),
        ]
    if ratio == 4:
        Hi, Di = hp.indexer_n_head, hp.indexer_head_dim
        t += [
            TensorSpec(b + "indexer.proj.weight", (E, Hi), il, "linear"),
            TensorSpec(b + "indexer.attn_q_b.weight", (R, Hi * Di), il, "linear"),
            TensorSpec(b + "indexer_compressor_kv.weight", (E, 2 * Di), il, "linear"),
            TensorSpec(b + "indexer_compressor_gate.weight", (E, 2 * Di), il, "linear"),
            TensorSpec(b + "indexer_compressor_ape.weight", (2 * Di, ratio), il, "bias"),
            TensorSpec(b + "indexer_compressor_norm.weight", (Di,), il, "norm"),
        ]
    t += [
        TensorSpec(b + "ffn_norm.weight", (E,), il, "norm"),
        TensorSpec(b + "ffn_gate_inp.weight", (E, X), il, "router"),
    ]
    if il < hp.n_hash_layers:
        k = hp.n_expert_used
        table = (np.arange(hp.n_vocab)[:, None] * k + np.arange(k)[None, :]) % X  # k distinct experts per token
        t.append(TensorSpec(b + "ffn_gate_tid2eid.weight", (k, hp.n_vocab), il, "table", values=table.astype(np.int32)))
    else:
        t.append(TensorSpec(b + "exp_probs_b.bias", (X,), il, "bias"))
    S = hp.n_ff_shexp
    t += [
        TensorSpec(b + "ffn_gate_exps.weight", (E, F, X), il, "linear"),
        TensorSpec(b + "ffn_up_exps.weight", (E, F, X), il, "linear"),
        TensorSpec(b + "ffn_down_exps.weight", (F, E, X), il, "out_linear"),
        TensorSpec(b + "ffn_gate_shexp.weight", (E, S), il, "linear"),
        TensorSpec(b + "ffn_up_shexp.weight", (E, S), il, "linear"),
        TensorSpec(b + "ffn_down_shexp.weight", (S, E), il, "out_linear"),
    ]
    return t


def _llama4_layer(hp: HParams, il: int) -> list[TensorSpec]:
    """One llama4 block as the converter writes it (Llama4Model): plain q/k/v/o (no q/k norm weights:
    the L2 norm has none), then either the MoE (router, stacked experts from the split gate_up_proj,
    the shared expert) on layers (il + 1) % moe_layer_step == 0, or the dense SwiGLU of n_ff."""
    b = f"blk.{il}."
    E, Q, KV, F, X = hp.n_embd, hp.q_width, hp.kv_width, hp.n_ff_exp, hp.n_expert
    t = [
        TensorSpec(b + "attn_norm.weight", (E,), il, "norm"),
        TensorSpec(b + "attn_q.weight", (E, Q), il, "linear"),
        TensorSpec(b + "attn_k.weight", (E, KV), il, "linear"),
        TensorSpec(b + "attn_v.weight", (E, KV), il, "linear"),
        TensorSpec(b + "attn_output.weight", (Q, E), il, "out_linear"),
        TensorSpec(b + "ffn_norm.weight", (E,), il, "norm"),
    ]
    if (il + 1) % hp.moe_layer_step == 0:
        t += [
            TensorSpec(b + "ffn_gate_inp.weight", (E, X), il, "router"),
            TensorSpec(b + "ffn_gate_exps.weight", (E, F, X), il, "linear"),
            TensorSpec(b + "ffn_up_exps.weight", (E, F, X), il, "linear"),
            TensorSpec(b + "ffn_down_exps.weight", (F, E, X), il, "out_linear"),
            TensorSpec(b + "ffn_gate_shexp.weight", (E, F), il, "linear"),
            TensorSpec(b + "ffn_up_shexp.weight", (E, F), il, "linear"),
            TensorSpec(b + "ffn_down_shexp.weight", (F, E), il, "out_linear"),
        ]
    else:
        t += [
            TensorSpec(b + "ffn_gate.weight", (E, hp.n_ff), il, "linear"),
            TensorSpec(b + "ffn_up.weight", (E, hp.n_ff), il, "linear"),
            TensorSpec(b + "ffn_down.weight", (hp.n_ff, E), il, "out_linear"),
        ]
    return t


def llama3_rope_factors(hp: HParams) -> np.ndarray:
    """The rope_freqs values convert_hf_to_gguf.py's LlamaModel writes for HF rope_type "llama3": per
    rotated pair, 1 for wavelengths below the original context / high_freq_factor, `factor` above
    context / low_freq_factor, a smooth interpolation between."""
    dim = hp.head_dim
    freqs = 1.0 / (hp.rope_freq_base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    n_ctx, low, high, factor = hp.rope_llama3_n_ctx_orig, hp.rope_llama3_low_freq, hp.rope_llama3_high_freq, hp.rope_llama3_factor
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / float(freq)
        if wavelen < n_ctx / high:
            out.append(1.0)
        elif wavelen > n_ctx / low:
            out.append(factor)
        else:
            smooth = (n_ctx / wavelen - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def _deepseek2_layer(hp: HParams, il: int) -> list[TensorSpec]:
    """One deepseek2 block as convert_hf_to_gguf.py writes it: MLA with kv_b split per head into
    attn_k_b (W_kb transposed, ne [qk_nope, kv_lora, n_head]) and attn_v_b (ne [kv_lora, v_head,
    n_head]), q through a LoRA when n_lora_q > 0, a dense FFN in the leading layers, else routed
    experts plus the shared experts (no shared-expert gate)."""
    E, H, R = hp.n_embd, hp.n_head, hp.n_rot
    b = f"blk.{il}."
    t = [TensorSpec(b + "attn_norm.weight", (E,), il, "norm")]
    if hp.n_lora_q > 0:
        t += [
            TensorSpec(b + "attn_q_a.weight", (E, hp.n_lora_q), il, "linear"),
            TensorSpec(b + "attn_q_a_norm.weight", (hp.n_lora_q,), il, "norm"),
            TensorSpec(b + "attn_q_b.weight", (hp.n_lora_q, hp.q_width), il, "linear"),
        ]
    else:
        t.append(TensorSpec(b + "attn_q.weight", (E, hp.q_width), il, "linear"))
    t += [
        TensorSpec(b + "attn_kv_a_mqa.weight", (E, hp.n_lora_kv + R), il, "linear"),
        TensorSpec(b + "attn_kv_a_norm.weight", (hp.n_lora_kv,), il, "norm"),
        TensorSpec(b + "attn_k_b.weight", (hp.head_dim - R, hp.n_lora_kv, H), il, "linear"),
        TensorSpec(b + "attn_v_b.weight", (hp.n_lora_kv, hp.head_dim_v, H), il, "linear"),
        TensorSpec(b + "attn_output.weight", (H * hp.head_dim_v, E), il, "out_linear"),
        TensorSpec(b + "ffn_norm.weight", (E,), il, "norm"),
    ]
    if hp.arch == "deepseek32":
        # DSA's lightning indexer (DeepseekV32Model: wq_b, wk, k_norm with its bias, weights_proj).
        NI, DI = hp.indexer_n_head, hp.indexer_head_dim
        t += [
            TensorSpec(b + "indexer.k_norm.bias", (DI,), il, "bias"),
            TensorSpec(b + "indexer.k_norm.weight", (DI,), il, "norm"),
            TensorSpec(b + "indexer.proj.weight", (E, NI), il, "linear"),
            TensorSpec(b + "indexer.attn_k.weight", (E, DI), il, "linear"),
            TensorSpec(b + "indexer.attn_q_b.weight", (hp.n_lora_q, NI * DI), il, "linear"),
        ]
    # DeepSeek-V3 and later (deepseek32) route with the selection bias; V2 / V2-Lite do not.
    return t + _lead_dense_or_moe_ffn(hp, il, selection_bias=hp.arch == "deepseek32")


def _lead_dense_or_moe_ffn(hp: HParams, il: int, selection_bias: bool) -> list[TensorSpec]:
    """The FFN of a deepseek2 / glm4moe block: dense in the leading n_layer_dense_lead layers, else
    the router (with its selection bias exp_probs_b when `selection_bias`), the routed experts and
    the ungated shared experts (when n_ff_shexp)."""
    E, b = hp.n_embd, f"blk.{il}."
    if il < hp.n_layer_dense_lead:
        return [
            TensorSpec(b + "ffn_gate.weight", (E, hp.n_ff), il, "linear"),
            TensorSpec(b + "ffn_up.weight", (E, hp.n_ff), il, "linear"),
            TensorSpec(b + "ffn_down.weight", (hp.n_ff, E), il, "out_linear"),
        ]
    F, X, S = hp.n_ff_exp, hp.n_expert, hp.n_ff_shexp
    t = [TensorSpec(b + "ffn_gate_inp.weight", (E, X), il, "router")]
    if selection_bias:
        t.append(TensorSpec(b + "exp_probs_b.bias", (X,), il, "bias"))
    t += [
        TensorSpec(b + "ffn_gate_exps.weight", (E, F, X), il, "linear"),
        TensorSpec(b + "ffn_up_exps.weight", (E, F, X), il, "linear"),
        TensorSpec(b + "ffn_down_exps.weight", (F, E, X), il, "out_linear"),
    ]
    if S:
        t += [
            TensorSpec(b + "ffn_gate_shexp.weight", (E, S), il, "linear"),
            TensorSpec(b + "ffn_up_shexp.weight", (E, S), il, "linear"),
            TensorSpec(b + "ffn_down_shexp.weight", (S, E), il, "out_linear"),
        ]
    return t


def _nextn_tensors(hp: HParams, il: int) -> list[TensorSpec]:
    """An MTP block's own tensors beside its decoder block (nextn.*, as the converter names them)."""
    E, b = hp.n_embd, f"blk.{il}."
    return [
        TensorSpec(b + "nextn.eh_proj.weight", (2 * E, E), il, "linear"),
        TensorSpec(b + "nextn.enorm.weight", (E,), il, "norm"),
        TensorSpec(b + "nextn.hnorm.weight", (E,), il, "norm"),
        TensorSpec(b + "nextn.shared_head_norm.weight", (E,), il, "norm"),
    ]


def _norm_and_biased_qkv(hp: HParams, il: int) -> list[TensorSpec]:
    """attn_norm and q/k/v projections with biases (glm4moe, gpt-oss)."""
    E, Q, KV, b = hp.n_embd, hp.q_width, hp.kv_width, f"blk.{il}."
    return [
        TensorSpec(b + "attn_norm.weight", (E,), il, "norm"),
        TensorSpec(b + "attn_q.weight", (E, Q), il, "linear"),
        TensorSpec(b + "attn_q.bias", (Q,), il, "bias"),
        TensorSpec(b + "attn_k.weight", (E, KV), il, "linear"),
        TensorSpec(b + "attn_k.bias", (KV,), il, "bias"),
        TensorSpec(b + "attn_v.weight", (E, KV), il, "linear"),
        TensorSpec(b + "attn_v.bias", (KV,), il, "bias"),
    ]


def _glm4moe_layer(hp: HParams, il: int) -> list[TensorSpec]:
    """One glm4moe block as the converter writes it: q/k/v with biases, per-head q/k norms when
    use_qk_norm, post_attention_norm as the FFN norm; a dense FFN in the leading layers, else the
    router, its selection bias exp_probs_b, the routed experts and the ungated shared expert. Blocks
    il >= n_layer are MTP blocks: a MoE block plus nextn.eh_proj / enorm / hnorm / shared_head_norm."""
    E, Q, b = hp.n_embd, hp.q_width, f"blk.{il}."
    t = _norm_and_biased_qkv(hp, il)
    if hp.use_qk_norm:
        t += [
            TensorSpec(b + "attn_q_norm.weight", (hp.head_dim,), il, "norm"),
            TensorSpec(b + "attn_k_norm.weight", (hp.head_dim,), il, "norm"),
        ]
    t += [
        TensorSpec(b + "attn_output.weight", (Q, E), il, "out_linear"),
        TensorSpec(b + "post_attention_norm.weight", (E,), il, "norm"),
    ]
    t += _lead_dense_or_moe_ffn(hp, il, selection_bias=True)
    return t + (_nextn_tensors(hp, il) if il >= hp.n_layer else [])


def _gpt_oss_layer(hp: HParams, il: int) -> list[TensorSpec]:
    """One gpt-oss block as the converter writes it: q/k/v/o with biases, one sink logit per head,
    post_attention_norm as the FFN norm, a router with a bias, experts with gate/up/down biases."""
    E, Q, F, X, b = hp.n_embd, hp.q_width, hp.n_ff_exp, hp.n_expert, f"blk.{il}."
    return _norm_and_biased_qkv(hp, il) + [
        TensorSpec(b + "attn_output.weight", (Q, E), il, "out_linear"),
        TensorSpec(b + "attn_output.bias", (E,), il, "bias"),
        TensorSpec(b + "attn_sinks.weight", (hp.n_head,), il, "bias"),
        TensorSpec(b + "post_attention_norm.weight", (E,), il, "norm"),
        TensorSpec(b + "ffn_gate_inp.weight", (E, X), il, "router"),
        TensorSpec(b + "ffn_gate_inp.bias", (X,), il, "bias"),
        TensorSpec(b + "ffn_gate_exps.weight", (E, F, X), il, "linear"),
        TensorSpec(b + "ffn_gate_exps.bias", (F, X), il, "bias"),
        TensorSpec(b + "ffn_up_exps.weight", (E, F, X), il, "linear"),
        TensorSpec(b + "ffn_up_exps.bias", (F, X), il, "bias"),
        TensorSpec(b + "ffn_down_exps.weight", (F, E, X), il, "out_linear"),
        TensorSpec(b + "ffn_down_exps.bias", (E, X), il, "bias"),
    ]


def _hybrid_layer(hp: HParams, il: int, shexp_gate_ne: tuple, attention: bool = False) -> list[TensorSpec]:
    """One qwen3next / qwen35moe block as the converter writes it: Gated DeltaNet on layers other
    than every full_attention_interval-th, gated attention there (and on an MTP block:
    `attention`); routed experts plus the gated shared expert; the FFN norm is post_attention_norm."""
    E, Q, KV, b = hp.n_embd, hp.q_width, hp.kv_width, f"blk.{il}."
    t = [TensorSpec(b + "attn_norm.weight", (E,), il, "norm")]
    if not attention and (il + 1) % hp.full_attention_interval != 0:
        C, V, H = 2 * hp.ssm_n_group * hp.ssm_d_state + hp.ssm_d_inner, hp.ssm_d_inner, hp.ssm_dt_rank
        t += [
            TensorSpec(b + "attn_qkv.weight", (E, C), il, "linear"),
            TensorSpec(b + "attn_gate.weight", (E, V), il, "linear"),
            TensorSpec(b + "ssm_conv1d.weight", (hp.ssm_d_conv, C), il, "linear"),
            TensorSpec(b + "ssm_dt.bias", (H,), il, "bias"),
            TensorSpec(b + "ssm_a", (H,), il, "ssm_a"),
        ]
        if hp.arch == "qwen3next":
            t.append(TensorSpec(b + "ssm_ba.weight", (E, 2 * H), il, "linear"))
        else:
            t += [
                TensorSpec(b + "ssm_beta.weight", (E, H), il, "linear"),
                TensorSpec(b + "ssm_alpha.weight", (E, H), il, "linear"),
            ]
        t += [
            TensorSpec(b + "ssm_norm.weight", (V // H,), il, "norm"),
            TensorSpec(b + "ssm_out.weight", (V, E), il, "out_linear"),
        ]
    else:
        t += [
            TensorSpec(b + "attn_q.weight", (E, 2 * Q), il, "linear"),  # [query | gate] per head
            TensorSpec(b + "attn_k.weight", (E, KV), il, "linear"),
            TensorSpec(b + "attn_v.weight", (E, KV), il, "linear"),
            TensorSpec(b + "attn_q_norm.weight", (hp.head_dim,), il, "norm"),
            TensorSpec(b + "attn_k_norm.weight", (hp.head_dim,), il, "norm"),
            TensorSpec(b + "attn_output.weight", (Q, E), il, "out_linear"),
        ]
    F, X, S = hp.n_ff_exp, hp.n_expert, hp.n_ff_shexp
    t += [
        TensorSpec(b + "post_attention_norm.weight", (E,), il, "norm"),
        TensorSpec(b + "ffn_gate_inp.weight", (E, X), il, "router"),
        TensorSpec(b + "ffn_gate_exps.weight", (E, F, X), il, "linear"),
        TensorSpec(b + "ffn_up_exps.weight", (E, F, X), il, "linear"),
        TensorSpec(b + "ffn_down_exps.weight", (F, E, X), il, "out_linear"),
        TensorSpec(b + "ffn_gate_inp_shexp.weight", shexp_gate_ne, il, "shexp_gate"),
        TensorSpec(b + "ffn_gate_shexp.weight", (E, S), il, "linear"),
        TensorSpec(b + "ffn_up_shexp.weight", (E, S), il, "linear"),
        TensorSpec(b + "ffn_down_shexp.weight", (S, E), il, "out_linear"),
    ]
    return t

def _nemotron_h_moe_layer(hp: HParams, il: int) -> list[TensorSpec]:
    """One nemotron_h_moe block as the converter writes it (NemotronHModel): the block's norm, then
    its one mixer: Mamba-2 ("M"), ungated relu^2 experts with the selection bias and a shared expert
    ("E"), or plain GQA attention ("*"). An MTP block (il >= n_layer, Nemotron 3 Super's mtp.layers.0
    and .1 folded into one) holds the attention, post_attention_norm, the experts and the nextn
    tensors."""
    E, Q, KV, b = hp.n_embd, hp.q_width, hp.kv_width, f"blk.{il}."
    kind = hp.layer_pattern[il] if il < hp.n_layer else "B"
    t = []
    if kind == "M":
        H, V, G = hp.ssm_dt_rank, hp.ssm_d_inner, hp.ssm_n_group
        C = V + 2 * G * hp.ssm_d_state
        t += [
            TensorSpec(b + "ssm_a", (1, H), il, "ssm_a"),
            TensorSpec(b + "ssm_d", (1, H), il, "norm"),
            TensorSpec(b + "ssm_conv1d.bias", (C,), il, "bias"),
            TensorSpec(b + "ssm_conv1d.weight", (hp.ssm_d_conv, C), il, "linear"),
            TensorSpec(b + "ssm_dt.bias", (H,), il, "bias"),
            TensorSpec(b + "ssm_in.weight", (E, V + C + H), il, "linear"),
            TensorSpec(b + "ssm_norm.weight", (V // G, G), il, "norm"),
            TensorSpec(b + "ssm_out.weight", (V, E), il, "out_linear"),
        ]
    if kind in "*B":
        t += [
            TensorSpec(b + "attn_k.weight", (E, KV), il, "linear"),
            TensorSpec(b + "attn_output.weight", (Q, E), il, "out_linear"),
            TensorSpec(b + "attn_q.weight", (E, Q), il, "linear"),
            TensorSpec(b + "attn_v.weight", (E, KV), il, "linear"),
        ]
    if kind == "B":
        t.append(TensorSpec(b + "post_attention_norm.weight", (E,), il, "norm"))
    if kind in "EB":
        F, X, S = hp.n_ff_exp, hp.n_expert, hp.n_ff_shexp
        t += [
            TensorSpec(b + "ffn_down_exps.weight", (F, E, X), il, "out_linear"),
            TensorSpec(b + "ffn_up_exps.weight", (E, F, X), il, "linear"),
            TensorSpec(b + "exp_probs_b.bias", (X,), il, "bias"),
            TensorSpec(b + "ffn_gate_inp.weight", (E, X), il, "router"),
            TensorSpec(b + "ffn_down_shexp.weight", (S, E), il, "out_linear"),
            TensorSpec(b + "ffn_up_shexp.weight", (E, S), il, "linear"),
        ]
    t.append(TensorSpec(b + "attn_norm.weight", (E,), il, "norm"))
    return t + (_nextn_tensors(hp, il) if kind == "B" else [])


def quant_recipe(quant: str) -> QuantRecipe:
    if quant not in QUANTS:
        raise InvalidArgument(f"unknown quant '{quant}' (known: {', '.join(QUANTS)})")
    return QUANTS[quant]
