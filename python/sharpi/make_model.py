"""`sharpi make-model`: synthetic GGUF models with real shapes, real metadata and a working tokenizer.

What it writes: one GGUF v3 file laid out exactly as llama.cpp's convert_hf_to_gguf.py (float / q8_0
outputs) or llama-quantize (every other quant) would write that architecture: the same tensor names,
ggml shapes, metadata keys and value types, and the same per-tensor type choices for the K_M mixes.
Weights are synthetic:
  - "float" weights (default for models under ~64 MiB, e.g. every "tiny"): normal draws with scales
    chosen so hidden states stay O(1) (linear layers 1/sqrt(fan_in), unit-scale embeddings,
    norms 1 + N(0, 0.05), routers wide enough that top-k is not a coin toss), then quantized properly
    (gguf.quants.quantize for the 32-element types, the numpy K-quant quantizers below otherwise);
  - "random" weights (default above ~64 MiB): random quantized blocks whose f16 scale fields are
    overwritten with scales calibrated so the dequantized values have the same standard deviation as
    the float weights would. Generated and streamed to disk chunk by chunk (never the whole model in
    RAM) through an O_DIRECT double-buffered writer: the Qwen3-30B-A3B Q4_K_M file (17.3 GiB) takes
    ~18 s of CPU and ~40 s of wall time on the shared 2-core machine, RSS ~240 MB;
  - "sparse": no data at all (a hole; every weight reads as 0): full-size directories in no time.
Weights are drawn directly in llama.cpp's layout: for arch "llama" that is the converter's permuted
q/k row order (normal RoPE); there is no Hugging Face original to permute from.
Owns only the output file (written to `<path>.tmp`, renamed when complete) and a tokenizer cache
(~/.cache/sharpi/tokenizers or $SHARPI_CACHE_DIR); it never reads or modifies anything else.

Tokenizer: a byte-level BPE ("gpt2" model; pre-tokenizer "gpt-2", llama.cpp's name for the regex
the `tokenizers` ByteLevel pre-tokenizer implements) trained on Python standard-library sources, at most 8192 learned
tokens, then the special tokens <|endoftext|> (bos, padding), <|im_start|>, <|im_end|> (eos), then
"[PAD<id>]" tokens of type UNUSED up to the preset's vocabulary size (as convert_hf_to_gguf.py pads).
ChatML chat template. Trained once per size and cached.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import sys
import sysconfig
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import gguf
import numpy as np

from . import presets
from ._core import InvalidArgument
from .presets import HParams

QT = gguf.GGMLQuantizationType
FT = gguf.LlamaFileType

# ==================================================================================================
# Quantization recipes: which ggml type each tensor gets
# ==================================================================================================


@dataclass(frozen=True)
class QuantRecipe:
    name: str
    ftype: FT  # general.file_type
    default: QT  # type of an ordinary weight matrix
    via_quantizer: bool  # True: llama-quantize's per-tensor rules; False: convert_hf_to_gguf --outtype


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
    ]
}


@dataclass
class TensorSpec:
    """One tensor of the model. `ne` is ggml order (ne[0] = row length, innermost)."""

    name: str
    ne: tuple[int, ...]
    layer: int | None  # block index for blk.N.* tensors
    role: str  # embed | linear | out_linear | router | shexp_gate | norm | bias | lm_head
    type: QT = QT.F32

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
            "norm": 0.05,  # around 1.0, see _float_weights
            "bias": 0.05,
        }[self.role]


def _more_bits(i_layer: int, n_layer: int) -> bool:
    """llama.cpp's layer choice for the extra bits of the K_M mixes: the first and last eighth of the
    layers and every third layer in between."""
    return i_layer < n_layer // 8 or i_layer >= 7 * n_layer // 8 or (i_layer - n_layer // 8) % 3 == 2


_FALLBACK = {QT.Q2_K: QT.Q4_0, QT.Q3_K: QT.Q4_0, QT.Q4_K: QT.Q5_0, QT.Q5_K: QT.Q5_1, QT.Q6_K: QT.Q8_0}


def _fits(qt: QT, row: int) -> bool:
    return row % gguf.GGML_QUANT_SIZES[qt][0] == 0


def choose_type(spec: TensorSpec, hp: HParams, recipe: QuantRecipe, pure: bool = False) -> QT:
    """The ggml type llama.cpp's tools give this tensor (rules of convert_hf_to_gguf.py and
    src/llama-quant.cpp, re-stated; `pure` = llama-quantize --pure: one type for every weight matrix)."""
    name, row = spec.name, spec.ne[0]
    # Never quantized: 1-D tensors, norms, biases, routers (both converter and quantizer agree).
    if (
        len(spec.ne) < 2
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
    n_layer, il = hp.n_layer, spec.layer
    tied_embd = hp.tie_embeddings and name == "token_embd.weight"
    if not pure:
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


# ==================================================================================================
# Tensor plan: names and ggml shapes per architecture, as convert_hf_to_gguf.py writes them
# ==================================================================================================


def plan_tensors(hp: HParams, quant: str = "f32", pure: bool = False) -> list[TensorSpec]:
    """Every tensor of the model in file order (token_embd, blocks in order, output_norm, output)."""
    recipe = _recipe(quant)
    E, V, Q, KV = hp.n_embd, hp.n_vocab, hp.q_width, hp.kv_width
    # The qwen2moe shared-expert gate is [n_embd, 1] from the converter; llama-quantize drops the
    # trailing 1 (it rewrites every shape with ggml_n_dims), so quantized files carry [n_embd].
    shexp_gate_ne = (E,) if recipe.via_quantizer else (E, 1)
    specs = [TensorSpec("token_embd.weight", (E, V), None, "embed")]
    for il in range(hp.n_layer):
        b = f"blk.{il}."
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
        if hp.arch == "olmoe":  # RMSNorm over the whole q / k projection
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
    specs.append(TensorSpec("output_norm.weight", (E,), None, "norm"))
    if not hp.tie_embeddings:
        specs.append(TensorSpec("output.weight", (E, V), None, "lm_head"))
    for s in specs:
        s.type = choose_type(s, hp, recipe, pure)
    return specs


def _recipe(quant: str) -> QuantRecipe:
    if quant not in QUANTS:
        raise InvalidArgument(f"unknown quant '{quant}' (known: {', '.join(QUANTS)})")
    return QUANTS[quant]


# ==================================================================================================
# K-quant quantizers (numpy). Block layouts are ggml's; gguf.quants.dequantize is the oracle in tests.
# Each takes float32 (..., n) with n % 256 == 0 and returns uint8 (..., n / 256 * type_size).
# Scales are chosen per sub-block from its range (rounded up so no value clips), then quantized
# against the block's f16 super-scale; simple and close to optimal for Gaussian weights.
# ==================================================================================================


def _f16_bytes(v: np.ndarray) -> np.ndarray:
    return v.astype(np.float16).view(np.uint8).reshape(v.shape[0], 2)


def _safe_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.where(b > 0, a / np.where(b > 0, b, 1), 0)


def _scale_and_min(blocks: np.ndarray, levels: int, scale_bits: int):
    """Asymmetric sub-block quantization (q2_K, q4_K, q5_K): blocks (nb, n_sub, sub) -> q codes,
    sub-scale codes, sub-min codes, f16 d, f16 dmin."""
    top = (1 << scale_bits) - 1
    mn = np.minimum(blocks.min(-1), 0.0)
    mx = np.maximum(blocks.max(-1), 0.0)
    scale = (mx - mn) / levels
    minv = -mn
    d = (scale.max(-1) / top).astype(np.float16)
    dmin = (minv.max(-1) / top).astype(np.float16)
    df, dmf = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.clip(np.ceil(_safe_div(scale, df) - 1e-4), 0, top)
    mq = np.clip(np.rint(_safe_div(minv, dmf)), 0, top)
    eff_scale, eff_min = (df * sc)[..., None], (dmf * mq)[..., None]
    q = np.clip(np.rint(_safe_div(blocks + eff_min, eff_scale)), 0, levels).astype(np.uint8)
    return q, sc.astype(np.uint8), mq.astype(np.uint8), d, dmin


def _pack_scale_min_k4(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins -> the 12-byte q4_K / q5_K scale field."""
    out = np.empty((sc.shape[0], 12), np.uint8)
    out[:, 0:4] = (sc[:, 0:4] & 0x3F) | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = (mn[:, 0:4] & 0x3F) | ((mn[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 0x0F) | ((mn[:, 4:8] & 0x0F) << 4)
    return out


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    blocks = np.asarray(x, np.float32).reshape(-1, 8, 32)
    nb = blocks.shape[0]
    q, sc, mn, d, dmin = _scale_and_min(blocks, 15, 6)
    out = np.empty((nb, 144), np.uint8)
    out[:, 0:2], out[:, 2:4] = _f16_bytes(d), _f16_bytes(dmin)
    out[:, 4:16] = _pack_scale_min_k4(sc, mn)
    q = q.reshape(nb, 4, 2, 32)  # 32 bytes hold sub-block 2g (low nibbles) and 2g+1 (high nibbles)
    out[:, 16:] = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(nb, 128)
    return out.reshape(*x.shape[:-1], -1)


def quantize_q5_k(x: np.ndarray) -> np.ndarray:
    blocks = np.asarray(x, np.float32).reshape(-1, 8, 32)
    nb = blocks.shape[0]
    q, sc, mn, d, dmin = _scale_and_min(blocks, 31, 6)
    out = np.empty((nb, 176), np.uint8)
    out[:, 0:2], out[:, 2:4] = _f16_bytes(d), _f16_bytes(dmin)
    out[:, 4:16] = _pack_scale_min_k4(sc, mn)
    high = (q >> 4) & 1  # bit 4 of element l of sub-block j is bit j of qh[l]
    out[:, 16:48] = (high << np.arange(8, dtype=np.uint8)[None, :, None]).sum(1, dtype=np.uint8)
    low = (q & 0x0F).reshape(nb, 4, 2, 32)
    out[:, 48:] = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(nb, 128)
    return out.reshape(*x.shape[:-1], -1)


def quantize_q2_k(x: np.ndarray) -> np.ndarray:
    blocks = np.asarray(x, np.float32).reshape(-1, 16, 16)
    nb = blocks.shape[0]
    q, sc, mn, d, dmin = _scale_and_min(blocks, 3, 4)
    out = np.empty((nb, 84), np.uint8)
    out[:, 0:16] = sc | (mn << 4)
    # element h*128 + k*32 + b is bits 2k..2k+1 of qs[h*32 + b]
    q = q.reshape(nb, 2, 4, 32)
    out[:, 16:80] = (
        (q << (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]).sum(2, dtype=np.uint8).reshape(nb, 64)
    )
    out[:, 80:82], out[:, 82:84] = _f16_bytes(d), _f16_bytes(dmin)
    return out.reshape(*x.shape[:-1], -1)


def _symmetric(blocks: np.ndarray, qmax: float, scale_top: int):
    """Symmetric sub-block quantization (q3_K, q6_K): scale = max|x| / qmax per sub-block."""
    scale = np.abs(blocks).max(-1) / qmax
    d = (scale.max(-1) / scale_top).astype(np.float16)
    df = d.astype(np.float32)[:, None]
    sc = np.clip(np.ceil(_safe_div(scale, df) - 1e-4), 0, scale_top)
    eff = (df * sc)[..., None]
    return _safe_div(blocks, eff), sc, d


def quantize_q3_k(x: np.ndarray) -> np.ndarray:
    blocks = np.asarray(x, np.float32).reshape(-1, 16, 16)
    nb = blocks.shape[0]
    ratio, sc, d = _symmetric(blocks, 3.0, 31)
    q = np.clip(np.rint(ratio), -4, 3).astype(np.int8).reshape(nb, 256)
    v = (sc.astype(np.int16) + 32).astype(np.uint8)  # stored as 6-bit scale + 32
    out = np.empty((nb, 110), np.uint8)
    hbit = (q >= 0).astype(np.uint8)  # set: q = low bits; clear: q = low bits - 4
    out[:, 0:32] = (hbit.reshape(nb, 8, 32) << np.arange(8, dtype=np.uint8)[None, :, None]).sum(
        1, dtype=np.uint8
    )
    low = (q + 4 * (1 - hbit.astype(np.int8))).astype(np.uint8).reshape(nb, 2, 4, 32)
    out[:, 32:96] = (
        (low << (2 * np.arange(4, dtype=np.uint8))[None, None, :, None])
        .sum(2, dtype=np.uint8)
        .reshape(nb, 64)
    )
    out[:, 96:104] = (v[:, 0:8] & 0x0F) | ((v[:, 8:16] & 0x0F) << 4)
    hi = ((v >> 4) & 0x03).reshape(nb, 4, 4)  # scale 4k+i: bits 2k..2k+1 of byte 8+i
    out[:, 104:108] = (hi << (2 * np.arange(4, dtype=np.uint8))[None, :, None]).sum(1, dtype=np.uint8)
    out[:, 108:110] = _f16_bytes(d)
    return out.reshape(*x.shape[:-1], -1)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    blocks = np.asarray(x, np.float32).reshape(-1, 16, 16)
    nb = blocks.shape[0]
    ratio, sc, d = _symmetric(blocks, 31.0, 127)
    q = (np.clip(np.rint(ratio), -32, 31) + 32).astype(np.uint8).reshape(nb, 256)
    out = np.empty((nb, 210), np.uint8)
    ql = (q & 0x0F).reshape(nb, 2, 2, 64)  # element h*128 + s*64 + b: nibble s of ql[h*64 + b]
    out[:, 0:128] = (ql[:, :, 0] | (ql[:, :, 1] << 4)).reshape(nb, 128)
    qh = (q >> 4).reshape(nb, 2, 4, 32)  # element h*128 + k*32 + b: bits 2k.. of qh[h*32 + b]
    out[:, 128:192] = (
        (qh << (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]).sum(2, dtype=np.uint8).reshape(nb, 64)
    )
    out[:, 192:208] = sc.astype(np.int8).view(np.uint8)
    out[:, 208:210] = _f16_bytes(d)
    return out.reshape(*x.shape[:-1], -1)


_K_QUANTIZERS: dict[QT, Callable[[np.ndarray], np.ndarray]] = {
    QT.Q2_K: quantize_q2_k,
    QT.Q3_K: quantize_q3_k,
    QT.Q4_K: quantize_q4_k,
    QT.Q5_K: quantize_q5_k,
    QT.Q6_K: quantize_q6_k,
}


def quantize(x: np.ndarray, qtype: QT) -> np.ndarray:
    """float32 (..., n) -> the bytes of `qtype` (uint8, or float32/float16 for those types)."""
    x = np.asarray(x, np.float32)
    if qtype == QT.F32:
        return x
    if qtype == QT.F16:
        return x.astype(np.float16)
    if qtype in _K_QUANTIZERS:
        return _K_QUANTIZERS[qtype](x)
    return gguf.quants.quantize(x, qtype)


# ==================================================================================================
# Synthetic weights
# ==================================================================================================


def _tensor_rng(seed: int, name: str, fast: bool = False) -> np.random.Generator:
    """Independent stream per (seed, tensor): a tensor's values do not depend on the others."""
    ss = np.random.SeedSequence([seed, zlib.crc32(name.encode())])
    return np.random.Generator(np.random.SFC64(ss) if fast else np.random.PCG64(ss))


def _float_weights(spec: TensorSpec, rng: np.random.Generator) -> np.ndarray:
    x = rng.standard_normal(spec.numpy_shape, dtype=np.float32) * np.float32(spec.init_std())
    if spec.role == "norm":
        x += 1.0
    return x


# Scale fields of each block type: (offset of the f16 super-scale d, [(offset, ratio)] of f16 fields
# set to ratio * d). The ratios centre the dequantized values: e.g. q4_K is d*sc*q - dmin*m with
# sc, m uniform on 0..63 and q on 0..15, whose mean is zero when dmin = 7.5 d.
_SCALE_FIELDS: dict[QT, tuple[int, list[tuple[int, float]]]] = {
    QT.Q4_0: (0, []),
    QT.Q4_1: (0, [(2, -7.5)]),  # m = -7.5 d: x = d*q + m, q on 0..15
    QT.Q5_0: (0, []),
    QT.Q5_1: (0, [(2, -15.5)]),
    QT.Q8_0: (0, []),
    QT.Q2_K: (80, [(82, 1.5)]),
    QT.Q3_K: (108, []),
    QT.Q4_K: (0, [(2, 7.5)]),
    QT.Q5_K: (0, [(2, 15.5)]),
    QT.Q6_K: (208, []),
}
_JITTER = (0.75 + np.arange(256) / 512.0).astype(np.float32)  # per-block scale spread, mean ~1
_UNIT_STD: dict[QT, float] = {}


def _fix_scales(blocks: np.ndarray, qtype: QT, d0: float) -> None:
    """Overwrites the scale fields of random blocks (uint8, (nb, type_size)) in place: d = d0 * jitter,
    jitter drawn from the random low byte already in the d field."""
    d_off, extra = _SCALE_FIELDS[qtype]
    jitter_idx = blocks[:, d_off]
    d_table = (np.float32(d0) * _JITTER).astype(np.float16).view(np.uint16)
    d_bits = d_table[jitter_idx]
    if not extra:
        # Symmetric codes are not quite centred (q4_0: q - 8 on -8..7); a random sign on d (the f16
        # sign bit, from the random high byte) makes the distribution symmetric.
        d_bits |= (blocks[:, d_off + 1] & 0x80).astype(np.uint16) << 8
    blocks[:, d_off : d_off + 2].view(np.uint16)[:, 0] = d_bits
    for off, ratio in extra:
        table = (np.float32(d0 * ratio) * _JITTER).astype(np.float16).view(np.uint16)
        blocks[:, off : off + 2].view(np.uint16)[:, 0] = table[jitter_idx]


def _unit_std(qtype: QT) -> float:
    """Std of dequantized random blocks with d0 = 1 (measured once with gguf's dequantizer)."""
    if qtype not in _UNIT_STD:
        size = gguf.GGML_QUANT_SIZES[qtype][1]
        rng = np.random.Generator(np.random.SFC64(12345))
        blocks = rng.integers(0, 256, size=(8192, size), dtype=np.uint8)
        _fix_scales(blocks, qtype, 1.0)
        _UNIT_STD[qtype] = float(gguf.quants.dequantize(blocks, qtype).std())
    return _UNIT_STD[qtype]


def _random_chunks(spec: TensorSpec, rng: np.random.Generator, chunk_bytes: int) -> Iterator[np.ndarray]:
    """Random data for a big tensor in chunks of whole blocks, values with std = init_std()."""
    qtype, std, total = spec.type, spec.init_std(), spec.nbytes
    size = gguf.GGML_QUANT_SIZES[qtype][1]
    step = max(8 * size, chunk_bytes // (8 * size) * (8 * size))  # whole blocks, whole u64 words
    done = 0
    while done < total:
        n = min(step, total - done)
        words = rng.integers(0, np.iinfo(np.uint64).max, size=(n + 7) // 8, dtype=np.uint64, endpoint=True)
        raw = words.view(np.uint8)[:n]
        if qtype in _SCALE_FIELDS:
            _fix_scales(raw.reshape(-1, size), qtype, std / _unit_std(qtype))
            yield raw
        else:  # F16 / BF16: uniform values with the right std, from the random bits (cheap)
            u = raw.view(np.uint16).astype(np.float32)
            vals = (u - np.float32(32767.5)) * np.float32(std * math.sqrt(3.0) / 32768.0)
            if spec.role == "norm":
                vals += 1.0
            if qtype == QT.F16:
                yield vals.astype(np.float16)
            else:  # BF16: the top 16 bits of the float32
                yield (vals.view(np.uint32) >> 16).astype(np.uint16)
        done += n


def _random_float32(spec: TensorSpec, rng: np.random.Generator, chunk_bytes: int) -> Iterator[np.ndarray]:
    """F32 data for big tensors: two random u16 per value would waste bits; draw floats directly."""
    total = spec.n_elements
    step = max(1, chunk_bytes // 4)
    done = 0
    while done < total:
        n = min(step, total - done)
        u = rng.random(n, dtype=np.float32)
        vals = (u - np.float32(0.5)) * np.float32(spec.init_std() * math.sqrt(12.0))
        if spec.role == "norm":
            vals += 1.0
        yield vals
        done += n


# ==================================================================================================
# Tokenizer
# ==================================================================================================

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MAX_TRAINED_VOCAB = 8192
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_UNUSED = 1, 3, 5  # gguf.TokenType


def _corpus() -> list[str]:
    """~3 MB of real text available offline: the Python standard library's own sources."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts, total = [], 0
    for f in sorted(stdlib.glob("*.py")):
        texts.append(f.read_text(encoding="utf-8", errors="replace"))
        total += len(texts[-1])
        if total > 3_000_000:
            break
    if total < 100_000:
        raise RuntimeError(f"cannot find Python standard-library sources under {stdlib} to train a tokenizer")
    return texts


def _cache_dir() -> Path:
    base = os.environ.get("SHARPI_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "sharpi")
    return Path(base) / "tokenizers"


def trained_tokenizer(n_trained: int):
    """A byte-level BPE `tokenizers.Tokenizer` with n_trained tokens (256 bytes + merges), no specials.
    Cached on disk keyed by size and corpus hash, written atomically (safe under parallel tests)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts = _corpus()
    digest = hashlib.sha1("".join(texts).encode("utf-8", errors="replace")).hexdigest()[:12]
    path = _cache_dir() / f"bpe-{n_trained}-{digest}.json"
    if path.exists():
        return Tokenizer.from_file(str(path))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=n_trained, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(texts, trainer)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tok.save(str(tmp))
        os.replace(tmp, path)
    except OSError:
        pass  # read-only home: no cache, training is only a second or two
    return tok


def tokenizer_metadata(n_vocab: int) -> dict:
    """tokens, token types, merges and special ids for a vocabulary of exactly n_vocab entries."""
    n_trained = min(n_vocab - len(SPECIAL_TOKENS), MAX_TRAINED_VOCAB)
    tok = trained_tokenizer(n_trained)
    model = json.loads(tok.to_str())["model"]
    by_id = sorted(model["vocab"].items(), key=lambda kv: kv[1])
    assert [i for _, i in by_id] == list(range(len(by_id))), "trained vocabulary ids are not dense"
    tokens = [t for t, _ in by_id]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    types = [TOKEN_NORMAL] * len(tokens)
    first_special = len(tokens)
    tokens += SPECIAL_TOKENS
    types += [TOKEN_CONTROL] * len(SPECIAL_TOKENS)
    tokens += [f"[PAD{i}]" for i in range(len(tokens), n_vocab)]
    types += [TOKEN_UNUSED] * (n_vocab - len(types))
    return {
        "tokens": tokens,
        "token_type": types,
        "merges": merges,
        "n_trained": len(by_id),
        "bos_token_id": first_special,
        "padding_token_id": first_special,
        "eos_token_id": first_special + 2,
        "chat_template": CHAT_TEMPLATE,
    }


# ==================================================================================================
# Metadata
# ==================================================================================================


def _write_metadata(
    w: gguf.GGUFWriter, hp: HParams, recipe: QuantRecipe, tok: dict, preset: str, seed: int, weights: str
) -> None:
    """Keys and value types as convert_hf_to_gguf.py writes them for hp.arch."""
    w.add_type("model")
    w.add_name(f"sharpi synthetic {preset} {hp.arch}")
    w.add_block_count(hp.n_layer)
    w.add_context_length(hp.n_ctx_train)
    w.add_embedding_length(hp.n_embd)
    # feed_forward_length is the HF "intermediate_size": the expert width for Mixtral and OLMoE, the
    # dense width (unused by the MoE layers) for the Qwen MoE models.
    dense_ff_key = hp.arch in ("qwen2moe", "qwen3moe") or not hp.is_moe
    w.add_feed_forward_length(hp.n_ff if dense_ff_key else hp.n_ff_exp)
    w.add_head_count(hp.n_head)
    w.add_head_count_kv(hp.n_head_kv)
    w.add_rope_freq_base(hp.rope_freq_base)
    w.add_layer_norm_rms_eps(hp.rms_eps)
    if hp.is_moe:
        w.add_expert_count(hp.n_expert)
        w.add_expert_used_count(hp.n_expert_used)
    # key_length / value_length exist when the HF config has head_dim: Qwen3 always, Llama when set.
    if hp.arch in ("qwen3", "qwen3moe") or (hp.arch == "llama" and hp.q_width != hp.n_embd):
        w.add_key_length(hp.head_dim)
        w.add_value_length(hp.head_dim)
    w.add_file_type(int(recipe.ftype))
    if hp.arch in ("qwen2moe", "qwen3moe"):
        w.add_expert_feed_forward_length(hp.n_ff_exp)
    if hp.arch == "qwen2moe":
        w.add_expert_shared_feed_forward_length(hp.n_ff_shexp)
    if hp.arch == "llama":
        w.add_vocab_size(hp.n_vocab)
        w.add_rope_dimension_count(hp.head_dim)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tok["tokens"])
    w.add_token_types(tok["token_type"])
    w.add_token_merges(tok["merges"])
    w.add_bos_token_id(tok["bos_token_id"])
    w.add_eos_token_id(tok["eos_token_id"])
    w.add_pad_token_id(tok["padding_token_id"])
    w.add_add_bos_token(False)
    w.add_chat_template(tok["chat_template"])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    # sharpi's own provenance keys (ignored by other readers).
    w.add_bool("sharpi.synthetic", True)
    w.add_string("sharpi.preset", preset)
    w.add_uint32("sharpi.seed", seed)
    w.add_string("sharpi.weights", weights)


# ==================================================================================================
# Writing
# ==================================================================================================

FLOAT_WEIGHTS_LIMIT = 64 << 20  # models below this get real float weights by default
CHUNK_BYTES = 32 << 20  # generation chunk of the random path
SINK_BUFFER = 32 << 20  # O_DIRECT write unit (a multiple of 4 KiB)


class _DirectSink:
    """Sequential file writer for multi-GB outputs: O_DIRECT writes of page-aligned 32 MiB buffers from
    a background thread, double-buffered so generation (main thread) overlaps the disk.

    Owns the fd and two anonymous-mmap (page-aligned) buffers. Why O_DIRECT: on the project machines
    buffered writes of a 17 GB file run at 0.2-0.4 GB/s under dirty-page throttling, O_DIRECT at the
    disk's ~1 GB/s, and it leaves the page cache (other people's working sets) alone. The last partial
    buffer is zero-padded to 4 KiB and the file truncated back to its exact length. Falls back to
    buffered writes where O_DIRECT is refused (tmpfs). Never reads the file; single producer thread.
    """

    def __init__(self, path: Path):
        import mmap
        import queue
        import threading

        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
        try:
            self._fd = os.open(path, flags | getattr(os, "O_DIRECT", 0), 0o644)
        except OSError:
            self._fd = os.open(path, flags, 0o644)
        self._bufs = [mmap.mmap(-1, SINK_BUFFER) for _ in range(2)]
        self._free: queue.Queue = queue.Queue()
        self._full: queue.Queue = queue.Queue()
        for i in range(len(self._bufs)):
            self._free.put(i)
        self._error: BaseException | None = None
        self._cur = self._free.get()
        self._fill = 0
        self._size = 0
        self._thread = threading.Thread(target=self._drain, name="make-model-writer", daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        while True:
            item = self._full.get()
            if item is None:
                return
            i, n = item
            try:
                if self._error is None:
                    view, done = memoryview(self._bufs[i]), 0
                    while done < n:
                        done += os.write(self._fd, view[done:n])
            except BaseException as e:  # noqa: BLE001 -- re-raised in the producer on its next call
                self._error = e
            self._free.put(i)

    def _check(self) -> None:
        if self._error is not None:
            raise self._error

    def tell(self) -> int:
        return self._size

    def write(self, data) -> None:
        mv = memoryview(data).cast("B")
        while len(mv):
            self._check()
            take = min(len(mv), SINK_BUFFER - self._fill)
            self._bufs[self._cur][self._fill : self._fill + take] = mv[:take]
            self._fill += take
            self._size += take
            mv = mv[take:]
            if self._fill == SINK_BUFFER:
                self._full.put((self._cur, SINK_BUFFER))
                self._cur, self._fill = self._free.get(), 0

    def close(self) -> None:
        try:
            if self._fill:
                padded = -(-self._fill // 4096) * 4096
                self._bufs[self._cur][self._fill : padded] = bytes(padded - self._fill)
                self._full.put((self._cur, padded))
            self._full.put(None)
            self._thread.join()
            self._check()
            os.ftruncate(self._fd, self._size)
        finally:
            os.close(self._fd)
            for b in self._bufs:
                b.close()


def write_model(
    path,
    arch: str | None = None,
    preset: str = "tiny",
    quant: str = "f32",
    seed: int = 0,
    vocab_size: int | None = None,
    *,
    weights: str = "auto",
    pure: bool = False,
    progress: Callable[[str], None] | None = None,
    **overrides,
) -> dict:
    """Writes a synthetic model and returns a summary dict.

    arch: one of presets.ARCHES, or None for the preset's own (qwen3moe for "tiny"); a preset that
    fixes its arch (every one but "tiny") rejects a different one. quant: a key of QUANTS.
    vocab_size: overrides the preset's vocabulary size. weights: "float" (normal draws, quantized),
    "random" (random blocks with calibrated scales, streamed), "auto" (float below 64 MiB, else random)
    or "sparse" (no data written: the file is extended with a hole, every weight reads as zero; full
    size shapes in no time and no disk, for tests of readers, planners and inspect).
    pure: every weight matrix in the quant's base type (llama-quantize --pure). overrides: any
    presets.HParams field (n_layer=4, n_expert=16, ...). Raises InvalidArgument on bad arguments.
    """
    t0 = time.perf_counter()
    if vocab_size is not None:
        overrides["n_vocab"] = vocab_size
    hp = presets.resolve(arch, preset, **overrides)
    recipe = _recipe(quant)
    if weights not in ("auto", "float", "random", "sparse"):
        raise InvalidArgument(f"weights must be 'auto', 'float', 'random' or 'sparse', not '{weights}'")
    specs = plan_tensors(hp, quant, pure)
    total = sum(s.nbytes for s in specs)
    if weights == "auto":
        weights = "float" if total < FLOAT_WEIGHTS_LIMIT else "random"

    tok = tokenizer_metadata(hp.n_vocab)
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    w = gguf.GGUFWriter(str(tmp), hp.arch)
    _write_metadata(w, hp, recipe, tok, preset, seed, weights)
    for s in specs:
        dtype = np.float16 if s.type == QT.F16 else np.float32
        w.add_tensor_info(
            s.name,
            s.numpy_shape,
            np.dtype(dtype),
            s.nbytes,
            raw_dtype=None if s.type in (QT.F32, QT.F16) else s.type,
        )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()

    t_data = time.perf_counter()
    alignment = w.data_alignment
    try:
        header = tmp.read_bytes()
        data_start = -(-len(header) // alignment) * alignment
        if weights == "sparse":
            end = data_start + sum(-(-s.nbytes // alignment) * alignment for s in specs)
            os.truncate(tmp, end)
        else:
            sink = _DirectSink(tmp)
            try:
                sink.write(header)
                sink.write(bytes(data_start - len(header)))
                for i, s in enumerate(specs):
                    start = sink.tell()
                    for chunk in _tensor_data(s, seed, weights):
                        sink.write(np.ascontiguousarray(chunk))
                    if sink.tell() - start != s.nbytes:
                        raise AssertionError(
                            f"{s.name}: wrote {sink.tell() - start} bytes, expected {s.nbytes}"
                        )
                    sink.write(bytes(-s.nbytes % alignment))
                    if progress and (s.nbytes > 64 << 20 or i == len(specs) - 1):
                        progress(
                            f"{s.name} {s.type.name.lower()} {s.nbytes / 2**20:.0f} MiB "
                            f"({sink.tell() / 2**30:.2f} GiB written)"
                        )
            finally:
                sink.close()
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    t_end = time.perf_counter()

    size = path.stat().st_size
    by_type: dict[str, int] = {}
    for s in specs:
        by_type[s.type.name.lower()] = by_type.get(s.type.name.lower(), 0) + s.nbytes
    return {
        "path": str(path),
        "arch": hp.arch,
        "preset": preset,
        "quant": quant,
        "file_type": int(recipe.ftype),
        "hparams": dataclasses.asdict(hp),
        "weights": weights,
        "seed": seed,
        "n_tensors": len(specs),
        "file_size": size,
        "tensor_bytes": total,
        "bytes_by_type": by_type,
        "seconds": t_end - t0,
        "data_seconds": t_end - t_data,
        "write_gbps": total / max(t_end - t_data, 1e-9) / 1e9,
        "tokenizer": {
            "n_vocab": hp.n_vocab,
            "n_trained": tok["n_trained"],
            "bos_token_id": tok["bos_token_id"],
            "eos_token_id": tok["eos_token_id"],
            "padding_token_id": tok["padding_token_id"],
            "special_tokens": list(SPECIAL_TOKENS),
        },
    }


def _tensor_data(spec: TensorSpec, seed: int, weights: str) -> Iterator[np.ndarray]:
    """The tensor's bytes, as one or more arrays in order."""
    small = spec.role in ("norm", "bias", "router", "shexp_gate")  # tiny, f32: always real draws
    if weights == "float" or small:
        x = _float_weights(spec, _tensor_rng(seed, spec.name))
        yield quantize(x, spec.type)
    elif spec.type == QT.F32:
        yield from _random_float32(spec, _tensor_rng(seed, spec.name, fast=True), CHUNK_BYTES)
    else:
        yield from _random_chunks(spec, _tensor_rng(seed, spec.name, fast=True), CHUNK_BYTES)


# ==================================================================================================
# Command line (the `sharpi make-model` subcommand reuses add_arguments / run)
# ==================================================================================================


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("output", help="path of the .gguf file to write")
    p.add_argument(
        "--arch",
        choices=presets.ARCHES,
        default=None,
        help="architecture (default: the preset's; qwen3moe for tiny)",
    )
    p.add_argument("--preset", choices=list(presets.PRESETS), default="tiny")
    p.add_argument("--quant", choices=list(QUANTS), default="f32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab-size", type=int, default=None)
    p.add_argument("--weights", choices=["auto", "float", "random", "sparse"], default="auto")
    p.add_argument("--pure", action="store_true", help="every weight matrix in the quant's base type")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help=f"override a hyper-parameter ({', '.join(presets.FIELDS)}); repeatable",
    )
    p.add_argument("--json", action="store_true", help="print the summary as JSON")


def _parse_overrides(items: list[str]) -> dict:
    types = {f.name: f.type for f in dataclasses.fields(HParams)}
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or key not in types or key == "arch":
            raise InvalidArgument(
                f"--set expects FIELD=VALUE with FIELD one of {', '.join(presets.FIELDS)}: '{item}'"
            )
        kind = types[key]
        out[key] = (
            float(value)
            if kind == "float"
            else value.lower() in ("1", "true", "yes")
            if kind == "bool"
            else int(value)
        )
    return out


def run(args: argparse.Namespace) -> dict:
    info = write_model(
        args.output,
        arch=args.arch,
        preset=args.preset,
        quant=args.quant,
        seed=args.seed,
        vocab_size=args.vocab_size,
        weights=args.weights,
        pure=args.pure,
        progress=None if args.json else lambda msg: print("  " + msg, file=sys.stderr),
        **_parse_overrides(args.set),
    )
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        print(
            f"wrote {info['path']}: {info['arch']} {info['preset']} {info['quant']}, {info['n_tensors']} tensors, "
            f"{info['file_size'] / 2**30:.2f} GiB in {info['seconds']:.1f} s "
            f"(data {info['write_gbps']:.2f} GB/s, {info['weights']} weights)"
        )
    return info


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="sharpi make-model", description=__doc__.split("\n")[0])
    add_arguments(p)
    run(p.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
