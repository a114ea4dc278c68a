"""numpy quantizers: float32 weights to the bytes of a ggml quant type.

What it owns: the K-quant quantizers (q2_K ... q6_K), written here in numpy because the gguf package
quantizes only the 32-element types, and quantize(), which picks the right one (gguf.quants.quantize
for the rest). Block layouts are ggml's; gguf.quants.dequantize is the oracle in the tests. Each
K-quantizer takes float32 (..., n) with n % 256 == 0 and returns uint8 (..., n / 256 * type_size).
Scales are chosen per sub-block from its range (rounded up so no value clips), then quantized
against the block's f16 super-scale: simple and close to optimal for Gaussian weights. Pure
functions; sharpi.make_model uses them for its "float" weights.
"""

from __future__ import annotations

from typing import Callable

import gguf
import numpy as np

QT = gguf.GGMLQuantizationType


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
