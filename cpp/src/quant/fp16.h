// Scalar IEEE half <-> float and bfloat16 -> float conversions (exact, portable, usable on any CPU
// and, through SHARPI_HD, in CUDA device code: memcpy is a device function there too).
#pragma once

#include <stdint.h>
#include <string.h>

#include "quant/host_device.h"

namespace sharpi {

SHARPI_HD inline float fp32_from_bits(uint32_t w) {
    float f;
    memcpy(&f, &w, 4);
    return f;
}

SHARPI_HD inline uint32_t fp32_to_bits(float f) {
    uint32_t w;
    memcpy(&w, &f, 4);
    return w;
}

// Exact for every half value including subnormals, inf and NaN.
SHARPI_HD inline float fp16_to_fp32(uint16_t h) {
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
    const uint32_t exp = (h >> 10) & 0x1Fu;
    const uint32_t mant = h & 0x3FFu;
    if (exp == 0) {
        if (mant == 0) return fp32_from_bits(sign);
        // subnormal: mant * 2^-24
        float v = static_cast<float>(mant) * (1.0f / 16777216.0f);
        return sign ? -v : v;
    }
    if (exp == 31) return fp32_from_bits(sign | 0x7F800000u | (mant << 13));
    return fp32_from_bits(sign | ((exp + 112) << 23) | (mant << 13));
}

// Round to nearest even.
SHARPI_HD inline uint16_t fp32_to_fp16(float f) {
    uint32_t x = fp32_to_bits(f);
    const uint32_t sign = (x >> 16) & 0x8000u;
    x &= 0x7FFFFFFFu;
    if (x >= 0x7F800000u) return static_cast<uint16_t>(sign | 0x7C00u | (x > 0x7F800000u ? 0x200u : 0u));
    if (x >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // overflow to inf
    if (x < 0x38800000u) {                                               // subnormal or zero
        const float v = fp32_from_bits(x) * 16777216.0f;                 // in units of 2^-24
        uint32_t m = static_cast<uint32_t>(v);
        const float rem = v - static_cast<float>(m);
        if (rem > 0.5f || (rem == 0.5f && (m & 1u))) ++m;
        return static_cast<uint16_t>(sign | m);
    }
    uint32_t mant = x & 0x7FFFFFu;
    uint32_t exp = (x >> 23) - 112;
    uint32_t h = (exp << 10) | (mant >> 13);
    const uint32_t rest = mant & 0x1FFFu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;
    return static_cast<uint16_t>(sign | h);
}

SHARPI_HD inline float bf16_to_fp32(uint16_t h) {
    return fp32_from_bits(static_cast<uint32_t>(h) << 16);
}

}  // namespace sharpi
