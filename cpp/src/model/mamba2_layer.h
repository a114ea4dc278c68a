// The Mamba-2 token mixer of nemotron_h_moe (NVIDIA Nemotron-H / Nemotron 3): the counterpart of
// the Gated DeltaNet in model/hybrid_layer.h, with the same per-sequence RecurrentState (a conv
// state [d_conv - 1, conv_channels] and an SSM state [n_head, head_dim, d_state] per Mamba-2 layer;
// hparams' ssm_conv_channels() and ssm_dt_rank * ssm_d_state * ssm_head_v_dim() are exactly these
// sizes with llama.cpp's key names: time_step_rank = n_head, inner_size = n_head * head_dim,
// group_count = n_group, state_size = d_state).
//
// Tensors as llama.cpp's converter writes them: ssm_in [n_embd -> d_inner (z) + conv_channels (x B
// C) + n_head (dt)], ssm_conv1d.weight [conv_channels, d_conv] and .bias, ssm_dt.bias, ssm_a
// (= -exp(A_log)), ssm_d, ssm_norm [d_inner] (the grouped norm's weight, written [d_inner /
// n_group, n_group]) and ssm_out.
//
// The scan runs token by token in prefill as in decode (cpu/ops/ssm_scan.h), so on nemotron_h_moe
// prefill, token-by-token decoding, batching and rewindable steps are bit-identical.
#pragma once

namespace sharpi {

class ModelLoader;

void load_mamba2_layer(ModelLoader& ld, int il);

}  // namespace sharpi
