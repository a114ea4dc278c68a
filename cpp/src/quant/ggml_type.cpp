#include "quant/ggml_type.h"

#include "quant/blocks.h"

namespace sharpi {

const GgmlTypeTraits& ggml_type_traits(GgmlType type) {
    static const GgmlTypeTraits kUnknown{"unknown", 0, 0, false};
    static const GgmlTypeTraits kF32{"f32", 1, 4, true};
    static const GgmlTypeTraits kF16{"f16", 1, 2, true};
    static const GgmlTypeTraits kBF16{"bf16", 1, 2, true};
    static const GgmlTypeTraits kQ4_0{"q4_0", QK4_0, sizeof(block_q4_0), true};
    static const GgmlTypeTraits kQ4_1{"q4_1", QK4_1, sizeof(block_q4_1), true};
    static const GgmlTypeTraits kQ5_0{"q5_0", QK5_0, sizeof(block_q5_0), true};
    static const GgmlTypeTraits kQ5_1{"q5_1", QK5_1, sizeof(block_q5_1), true};
    static const GgmlTypeTraits kQ8_0{"q8_0", QK8_0, sizeof(block_q8_0), true};
    static const GgmlTypeTraits kQ2_K{"q2_K", QK_K, sizeof(block_q2_K), true};
    static const GgmlTypeTraits kQ3_K{"q3_K", QK_K, sizeof(block_q3_K), true};
    static const GgmlTypeTraits kQ4_K{"q4_K", QK_K, sizeof(block_q4_K), true};
    static const GgmlTypeTraits kQ5_K{"q5_K", QK_K, sizeof(block_q5_K), true};
    static const GgmlTypeTraits kQ6_K{"q6_K", QK_K, sizeof(block_q6_K), true};
    static const GgmlTypeTraits kMXFP4{"mxfp4", QK_MXFP4, sizeof(block_mxfp4), true};
    // Known to the format, not computed by sharpi (yet): sizes let `sharpi inspect` report them.
    static const GgmlTypeTraits kQ8_1{"q8_1", 32, 36, false};
    static const GgmlTypeTraits kQ8_K{"q8_K", QK_K, 292, false};
    static const GgmlTypeTraits kIQ2_XXS{"iq2_xxs", QK_K, sizeof(block_iq2_xxs), true};
    static const GgmlTypeTraits kIQ2_XS{"iq2_xs", QK_K, sizeof(block_iq2_xs), true};
    static const GgmlTypeTraits kIQ3_XXS{"iq3_xxs", QK_K, sizeof(block_iq3_xxs), true};
    static const GgmlTypeTraits kIQ1_S{"iq1_s", QK_K, sizeof(block_iq1_s), true};
    static const GgmlTypeTraits kIQ4_NL{"iq4_nl", QK4_NL, sizeof(block_iq4_nl), true};
    static const GgmlTypeTraits kIQ3_S{"iq3_s", QK_K, sizeof(block_iq3_s), true};
    static const GgmlTypeTraits kIQ2_S{"iq2_s", QK_K, sizeof(block_iq2_s), true};
    static const GgmlTypeTraits kIQ4_XS{"iq4_xs", QK_K, sizeof(block_iq4_xs), true};
    static const GgmlTypeTraits kI8{"i8", 1, 1, false};
    static const GgmlTypeTraits kI16{"i16", 1, 2, false};
    static const GgmlTypeTraits kI32{"i32", 1, 4, false};
    static const GgmlTypeTraits kI64{"i64", 1, 8, false};
    static const GgmlTypeTraits kF64{"f64", 1, 8, false};
    static const GgmlTypeTraits kIQ1_M{"iq1_m", QK_K, sizeof(block_iq1_m), true};
    static const GgmlTypeTraits kTQ1_0{"tq1_0", QK_K, 54, false};
    static const GgmlTypeTraits kTQ2_0{"tq2_0", QK_K, 66, false};
    switch (type) {
        case GgmlType::F32:
            return kF32;
        case GgmlType::F16:
            return kF16;
        case GgmlType::BF16:
            return kBF16;
        case GgmlType::Q4_0:
            return kQ4_0;
        case GgmlType::Q4_1:
            return kQ4_1;
        case GgmlType::Q5_0:
            return kQ5_0;
        case GgmlType::Q5_1:
            return kQ5_1;
        case GgmlType::Q8_0:
            return kQ8_0;
        case GgmlType::Q8_1:
            return kQ8_1;
        case GgmlType::Q2_K:
            return kQ2_K;
        case GgmlType::Q3_K:
            return kQ3_K;
        case GgmlType::Q4_K:
            return kQ4_K;
        case GgmlType::Q5_K:
            return kQ5_K;
        case GgmlType::Q6_K:
            return kQ6_K;
        case GgmlType::Q8_K:
            return kQ8_K;
        case GgmlType::IQ2_XXS:
            return kIQ2_XXS;
        case GgmlType::IQ2_XS:
            return kIQ2_XS;
        case GgmlType::IQ3_XXS:
            return kIQ3_XXS;
        case GgmlType::IQ1_S:
            return kIQ1_S;
        case GgmlType::IQ4_NL:
            return kIQ4_NL;
        case GgmlType::IQ3_S:
            return kIQ3_S;
        case GgmlType::IQ2_S:
            return kIQ2_S;
        case GgmlType::IQ4_XS:
            return kIQ4_XS;
        case GgmlType::I8:
            return kI8;
        case GgmlType::I16:
            return kI16;
        case GgmlType::I32:
            return kI32;
        case GgmlType::I64:
            return kI64;
        case GgmlType::F64:
            return kF64;
        case GgmlType::IQ1_M:
            return kIQ1_M;
        case GgmlType::TQ1_0:
            return kTQ1_0;
        case GgmlType::TQ2_0:
            return kTQ2_0;
        case GgmlType::MXFP4:
            return kMXFP4;
    }
    return kUnknown;
}

}  // namespace sharpi
