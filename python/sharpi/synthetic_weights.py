"""The synthetic weights of sharpi.make_model: the bytes of one tensor, drawn from a seed.

What it owns: an independent random stream per (seed, tensor name), and two ways to fill a tensor:
  - "float": normal draws with the tensor's init_std() (tensor_plan.TensorSpec), then quantized
    properly (sharpi.quantize);
  - "random": random quantized blocks whose f16 scale fields are overwritten with scales calibrated
    so the dequantized values have the standard deviation the float weights would have, generated
    chunk by chunk (a multi-GB tensor never sits in RAM at once).
Pure generation: it writes nothing; sharpi.make_model streams the chunks to the file.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterator

import gguf
import numpy as np

from .quantize import quantize
from .tensor_plan import TensorSpec

QT = gguf.GGMLQuantizationType
CHUNK_BYTES = 32 << 20  # generation chunk of the random path


def _tensor_rng(seed: int, name: str, fast: bool = False) -> np.random.Generator:
    """Independent stream per (seed, tensor): a tensor's values do not depend on the others."""
    ss = np.random.SeedSequence([seed, zlib.crc32(name.encode())])
    return np.random.Generator(np.random.SFC64(ss) if fast else np.random.PCG64(ss))

def _float_weights(spec: TensorSpec, rng: np.random.Generator) -> np.ndarray:
    x = rng.standard_normal(spec.numpy_shape, dtype=np.float32) * np.float32(spec.init_std())
    if spec.role == "norm":
        x += 1.0
    if spec.role == "ssm_a":
        x = -np.exp(x)  # DeltaNet's A = -exp(A_log) < 0, so every decay exp(g) lies in (0, 1)
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
    # The IQ types: d first (IQ1_M's is spread over nibbles, see _fix_scales), symmetric values.
    QT.IQ4_NL: (0, []),
    QT.IQ4_XS: (0, []),
    QT.IQ3_S: (0, []),
    QT.IQ3_XXS: (0, []),
    QT.IQ2_S: (0, []),
    QT.IQ2_XS: (0, []),
    QT.IQ2_XXS: (0, []),
    QT.IQ1_S: (0, []),
    QT.IQ1_M: (48, []),
}
# No numpy quantizer (gguf quantizes none of them): tensors of these types are random blocks even
# with weights="float".
RANDOM_ONLY = frozenset(t for t in _SCALE_FIELDS if t.name.startswith("IQ"))

_JITTER = (0.75 + np.arange(256) / 512.0).astype(np.float32)  # per-block scale spread, mean ~1

_UNIT_STD: dict[QT, float] = {}


def _fix_scales(blocks: np.ndarray, qtype: QT, d0: float) -> None:
    """Overwrites the scale fields of random blocks (uint8, (nb, type_size)) in place: d = d0 * jitter,
    jitter drawn from the random low byte already in the d field."""
    if qtype == QT.MXFP4:
        # One E8M0 exponent byte: scale 2^(e - 128) (ggml's halved form), a power of two near d0,
        # jittered by one octave from the random low bit.
        e0 = 128 + round(math.log2(d0))
        blocks[:, 0] = np.clip(e0 + (blocks[:, 0] & 1).astype(np.int64), 1, 254).astype(np.uint8)
        return
    d_off, extra = _SCALE_FIELDS[qtype]
    jitter_idx = blocks[:, d_off]
    d_table = (np.float32(d0) * _JITTER).astype(np.float16).view(np.uint16)
    d_bits = d_table[jitter_idx]
    if not extra:
        # Symmetric codes are not quite centred (q4_0: q - 8 on -8..7); a random sign on d (the f16
        # sign bit, from the random high byte) makes the distribution symmetric.
        d_bits |= (blocks[:, d_off + 1] & 0x80).astype(np.uint16) << 8
    if qtype == QT.IQ1_M:
        # d's 16 bits are the top nibbles of the four uint16 scale words (bytes 48..55), low first.
        words = blocks[:, 48:56].view(np.uint16)
        for i in range(4):
            words[:, i] = (words[:, i] & 0x0FFF) | (((d_bits >> (4 * i)) & 0xF) << 12)
        return
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
        if qtype in _SCALE_FIELDS or qtype == QT.MXFP4:
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


def tensor_data(spec: TensorSpec, seed: int, weights: str) -> Iterator[np.ndarray]:
    """The tensor's bytes, as one or more arrays in order."""
    small = spec.role in ("norm", "bias", "router", "shexp_gate", "ssm_a")  # tiny, f32: always real draws
    if spec.type == QT.I32:  # deepseek4's hash table: the values themselves
        yield np.asarray(spec.values, dtype=np.int32).reshape(spec.numpy_shape)
    elif spec.values is not None:  # computed from the hyper-parameters (rope_freqs)
        yield quantize(spec.values.reshape(spec.numpy_shape), spec.type)
    elif (weights == "float" and spec.type not in RANDOM_ONLY) or small:
        x = _float_weights(spec, _tensor_rng(seed, spec.name))
        yield quantize(x, spec.type)
    elif spec.type == QT.F32:
        yield from _random_float32(spec, _tensor_rng(seed, spec.name, fast=True), CHUNK_BYTES)
    else:
        yield from _random_chunks(spec, _tensor_rng(seed, spec.name, fast=True), CHUNK_BYTES)
