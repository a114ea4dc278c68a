#include "model/mamba2_layer.h"

#include <string>

#include "model/forward.h"
#include "model/model.h"
#include "model/recurrent_state.h"
#include "sharpi/errors.h"

namespace sharpi {

void load_mamba2_layer(ModelLoader& ld, int il) {
    const HParams& h = ld.hp();
    LayerWeights& L = ld.layer(il);
    auto blk = [&ld, il](const char* name) { return ld.blk(il, name); };
    if (h.ssm_d_conv < 1 || h.ssm_d_inner % h.ssm_n_group != 0) {
        throw FormatError("[model] " + ld.model().file->path() + ": layer " + std::to_string(il) +
                          " is Mamba-2 but the ssm.* hyper-parameters are missing or inner_size " +
                          std::to_string(h.ssm_d_inner) + " is not a multiple of group_count " +
                          std::to_string(h.ssm_n_group));
    }
    const int64_t channels = h.ssm_conv_channels(), n_head = h.ssm_dt_rank;
    L.attn_norm = ld.vector(blk("attn_norm.weight"), h.n_embd);
    L.ssm_in.w = ld.matrix(blk("ssm_in.weight"), h.n_embd, h.ssm_d_inner + channels + n_head);
    // [channels, d_conv] f32, channel-major, as cpu/ops/gated_delta_net.h's conv reads it.
    L.ssm_conv1d = ld.stacked_vector(blk("ssm_conv1d.weight"), h.ssm_d_conv, channels);
    L.ssm_conv1d_b = ld.optional_vector(blk("ssm_conv1d.bias"), channels);
    L.ssm_dt_bias = ld.vector(blk("ssm_dt.bias"), n_head);
    L.ssm_a = ld.stacked_vector(blk("ssm_a"), 1, n_head);
    L.ssm_d = ld.stacked_vector(blk("ssm_d"), 1, n_head);
    L.ssm_norm = ld.stacked_vector(blk("ssm_norm.weight"), h.ssm_d_inner / h.ssm_n_group, h.ssm_n_group);
    L.ssm_out.w = ld.matrix(blk("ssm_out.weight"), h.ssm_d_inner, h.n_embd);
}

Act Forward::mamba2(const Act& cur, int il) {
    const HParams& h = hp();
    const LayerWeights& L = layer(il);
    for (const SeqSpan& s : spans_) {
        if (!s.recurrent)
            throw InvalidArgument("[forward] layer " + std::to_string(il) + " needs a recurrent state");
    }
    const int64_t T = cur.n_tokens, d_inner = h.ssm_d_inner, channels = h.ssm_conv_channels();
    const int64_t n_head = h.ssm_dt_rank, n_group = h.ssm_n_group, d_state = h.ssm_d_state;
    // zxbcdt rows: [z (d_inner) | x B C (channels) | dt (n_head)].
    Act zxbcdt = linear(cur, L.ssm_in, "ssm_in", il);
    const float* z = zxbcdt.data;
    const float* xbc = zxbcdt.data + d_inner;
    const float* dt = zxbcdt.data + d_inner + channels;

    // The conv and the scan carry state along a sequence: span by span, each with its own. A
    // rewindable span runs token by token (what one-token decodes compute) keeping each state.
    Act conv = alloc(T, channels);
    const float* conv_b = L.ssm_conv1d_b.empty() ? nullptr : L.ssm_conv1d_b.data();
    for (const SeqSpan& s : spans_) {
        const int64_t steps = s.rewindable ? s.n_tokens : 1, per = s.rewindable ? 1 : s.n_tokens;
        for (int64_t t = 0; t < steps; ++t) {
            const int64_t r = s.row0 + t;
            backend_.conv1d_silu(s.recurrent->conv(il), xbc + r * zxbcdt.width, zxbcdt.width, per, channels,
                                 h.ssm_d_conv, L.ssm_conv1d.data(), conv_b, conv.row(r), conv.width);
            if (s.rewindable) s.recurrent->save_conv_point(il, s.pos0 + t + 1);
        }
    }
    name(conv, "conv_output_silu", il);

    const SsmShape shape{n_head, d_inner / n_head, n_group, d_state};
    Act y = alloc(T, d_inner);
    for (const SeqSpan& s : spans_) {
        const int64_t steps = s.rewindable ? s.n_tokens : 1, per = s.rewindable ? 1 : s.n_tokens;
        for (int64_t t = 0; t < steps; ++t) {
            const int64_t r = s.row0 + t;
            const float* c = conv.row(r);
            const SsmInputs in{c,
                               channels,
                               c + d_inner,
                               channels,
                               c + d_inner + n_group * d_state,
                               channels,
                               dt + r * zxbcdt.width,
                               zxbcdt.width,
                               L.ssm_a.data(),
                               L.ssm_d.data(),
                               L.ssm_dt_bias.data()};
            backend_.ssm_scan(in, per, shape, s.recurrent->ssm(il), y.row(r), y.width);
            if (s.rewindable) s.recurrent->save_ssm_point(il, s.pos0 + t + 1);
        }
    }
    name(y, "mamba2_y_add_d", il);
    // y * silu(z), then RMSNorm over each group of d_inner / n_group channels with its slice of
    // ssm_norm (transformers' NemotronHRMSNormGated: gate before norm).
    Act zc = alloc(T, d_inner);
    backend_.copy_rows(z, zxbcdt.width, zc.data, zc.width, T, d_inner);
    backend_.mul_silu(y.data, zc.data, T * d_inner);
    const int64_t group = d_inner / n_group;
    for (int64_t g = 0; g < n_group; ++g) {
        backend_.rms_norm(y.data + g * group, y.width, y.data + g * group, y.width, T, group,
                          L.ssm_norm.data() + g * group, h.rms_eps);
    }
    name(y, "ssm_norm", il);
    return linear(y, L.ssm_out, "ssm_out", il);
}

}  // namespace sharpi
