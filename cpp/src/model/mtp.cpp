#include "model/mtp.h"

#include <algorithm>

#include "model/kv_cache.h"
#include "sharpi/errors.h"

namespace sharpi {

bool MtpHead::supports(const std::string& arch) {
    // Blocks that are the architecture's own full-attention decoder layer (llama.cpp's graph_mtp
    // of each; qwen3moe: the shipped model's trained head, a sidecar): the layer builder runs them
    // unchanged.
    // deepseek32: its MLA decoder layer without DeepSeek Sparse Attention (block_hparams).
    // deepseek4: its hyper-connected layer on all streams (mtp.h).
    // nemotron_h_moe: attention then MoE in the one block (HParams::attention_then_moe), a
    // LayerNorm head norm.
    return arch == "qwen35moe" || arch == "qwen3next" || arch == "glm4moe" || arch == "qwen3moe" ||
           arch == "deepseek32" || arch == "deepseek4" || arch == "nemotron_h_moe";
}

HParams MtpHead::block_hparams(const HParams& file_hparams) {
    HParams h = file_hparams;
    h.n_layer = 1;  // the first nextn block (chained for longer drafts, as llama.cpp does)
    h.n_layer_nextn = 0;
    h.n_layer_dense_lead = 0;
    if (!h.recurrent_layers.empty()) h.recurrent_layers.assign(1, false);
    if (!h.ffn_only_layers.empty()) {  // nemotron_h_moe: the block folds attention and its MoE
        h.ffn_only_layers.assign(1, false);
        h.attention_then_moe = true;
    }
    // llama.cpp runs DeepSeek-V3.2's block as dense MLA (its graph_mtp builds no indexer, although
    // the file carries the block's indexer tensors): no indexer here, so none of its tensors is read
    // and its KV rows hold the latent only.
    h.indexer_n_head = h.indexer_head_dim = h.indexer_top_k = 0;
    if (file_hparams.n_layer_nextn > 0 && !file_hparams.compress_ratios.empty()) {
        // deepseek4: the per-block arrays' entries of the first nextn block (read_hparams requires
        // them), and no hash routing (llama.cpp's graph_mtp refuses a hash-routed block). Keeping
        // the trunk's indexer shape above would not matter: the block is sliding-window only.
        const size_t b = static_cast<size_t>(file_hparams.n_layer);
        h.compress_ratios = {file_hparams.compress_ratios[b]};
        h.swiglu_clamp_exp = {file_hparams.swiglu_clamp_exp[b]};
        h.swiglu_clamp_shexp = {file_hparams.swiglu_clamp_shexp[b]};
        h.n_hash_layers = 0;
    }
    return h;
}

namespace {

// The hyper-parameters of the file holding the block: the trunk's own, or a sidecar's (llama.cpp's
// `convert_hf_to_gguf.py --mtp` writes the block with the embeddings, norm and head only), which
// must describe the same model.
HParams block_file_hparams(const Model& trunk, const GgufFile& file, const std::string& sidecar) {
    const HParams& th = trunk.hp;
    if (sidecar.empty()) return th;
    const std::string arch = file.get_string_or("general.architecture", "");
    if (arch != th.arch) {
        throw InvalidArgument("[mtp] " + sidecar + " is a '" + arch + "' file; the model is '" + th.arch +
                              "'");
    }
    HParams h = read_hparams(file, *trunk.spec);
    if (h.n_embd != th.n_embd || h.n_vocab != th.n_vocab || h.n_head != th.n_head ||
        h.n_head_kv != th.n_head_kv || h.head_dim != th.head_dim || h.n_expert != th.n_expert ||
        h.n_ff_exp != th.n_ff_exp || h.n_ff_shexp != th.n_ff_shexp || h.hc_mult != th.hc_mult ||
        h.n_layer != th.n_layer) {
        throw InvalidArgument("[mtp] " + sidecar + " describes another model than " + trunk.file->path() +
                              " (its widths, heads, experts, expert widths or layer count differ)");
    }
    return h;
}

}  // namespace

MtpHead::MtpHead(const Model& trunk, const std::string& sidecar) {
    const std::string& path = sidecar.empty() ? trunk.file->path() : sidecar;
    model_.file = GgufFile::open(path, /*map_data=*/true);
    const HParams th = block_file_hparams(trunk, *model_.file, sidecar);
    if (th.n_layer_nextn == 0) {
        throw InvalidArgument("[mtp] " + path + " has no multi-token-prediction layers (" + th.arch +
                              ".nextn_predict_layers = 0)");
    }
    if (!supports(th.arch)) {
        throw UnsupportedError("[mtp] " + path + ": the " + th.arch +
                               " multi-token-prediction block is not supported (supported: qwen35moe, "
                               "qwen3next, glm4moe, qwen3moe, deepseek32, deepseek4, nemotron_h_moe)");
    }
    if (!th.compress_ratios.empty() && th.compress_ratios[static_cast<size_t>(th.n_layer)] != 0) {
        throw UnsupportedError("[mtp] " + path +
                               ": the deepseek4 multi-token-prediction block has compress ratio " +
                               std::to_string(th.compress_ratios[static_cast<size_t>(th.n_layer)]) +
                               "; only a sliding-window block (ratio 0) is supported");
    }
    model_.spec = trunk.spec;
    HParams& h = model_.hp;
    h = block_hparams(th);
    const int block = static_cast<int>(th.n_layer);
    ModelLoader ld(model_, block);
    model_.layers.resize(1);
    model_.experts.files.clear();
    for (size_t i = 0; i < model_.file->n_shards(); ++i)
        model_.experts.files.push_back(model_.file->shard(i).path());
    model_.experts.n_expert = h.n_expert;
    model_.experts.n_expert_used = h.n_expert_used;
    model_.experts.layers.resize(1);
    model_.spec->load_layer(ld, 0);
    eh_proj_ = ld.matrix(ld.blk(0, "nextn.eh_proj.weight"), 2 * h.n_embd, h.n_embd);
    enorm_ = ld.vector(ld.blk(0, "nextn.enorm.weight"), h.n_embd);
    hnorm_ = ld.vector(ld.blk(0, "nextn.hnorm.weight"), h.n_embd);
    // Without block-own copies the embedding table, head norm and lm_head are the trunk's (its
    // views: the trunk outlives the head), so nothing is held twice.
    head_norm_ = ld.optional_vector(ld.blk(0, "nextn.shared_head_norm.weight"), h.n_embd);
    if (h.attention_then_moe) {
        // nemotron_h_moe's head norm is a LayerNorm (no bias) with the file's layer_norm_epsilon, and
        // its own (llama.cpp's graph_mtp requires it).
        if (head_norm_.empty()) {
            throw MissingTensorError("[mtp] " + path + ": the nemotron_h_moe block has no " +
                                     ld.blk(0, "nextn.shared_head_norm.weight"));
        }
        head_layer_norm_eps_ = static_cast<float>(
            model_.file->get_float_or(th.arch + ".attention.layer_norm_epsilon", h.rms_eps));
    }
    if (head_norm_.empty()) head_norm_ = trunk.output_norm;
    embed_ = ld.optional_matrix(ld.blk(0, "nextn.embed_tokens.weight"), h.n_embd, h.n_vocab);
    if (!embed_.data) embed_ = trunk.token_embd;
    model_.token_embd = embed_;  // Forward::embed reads the model's table
    head_ = ld.optional_matrix(ld.blk(0, "nextn.shared_head_head.weight"), h.n_embd, h.n_vocab);
    if (!head_.data) head_ = trunk.output;
    if (h.hc_mult > 1) {
        // The head runs as the trunk's (Forward::output_head) on the block model: its hc head is the
        // block file's (llama.cpp's graph_mtp takes the draft model's), then head_norm and head.
        model_.hc_head_fn.w = ld.matrix("output_hc_fn.weight", h.n_embd_residual(), h.hc_mult);
        model_.hc_head_base = ld.vector("output_hc_base.weight", h.hc_mult);
        model_.hc_head_scale = ld.vector("output_hc_scale.weight", 1);
        model_.output_norm = head_norm_;
        model_.output = head_;
    }
    bytes_ = block_bytes(*model_.file, block);
    model_.file->check_mapping();
}

uint64_t MtpHead::block_bytes(const GgufFile& file, int64_t block) {
    uint64_t bytes = 0;
    for (const GgufTensor& t : file.tensors()) {
        if (is_nextn_tensor(t.name, block) && !is_nextn_tensor(t.name, block + 1)) bytes += t.nbytes;
    }
    return bytes;
}

uint64_t MtpHead::file_bytes(const Model& trunk, const std::string& sidecar) {
    if (sidecar.empty()) return block_bytes(*trunk.file, trunk.hp.n_layer);
    return block_bytes(*GgufFile::open(sidecar, /*map_data=*/false), trunk.hp.n_layer);
}

uint64_t MtpHead::sequence_bytes(const Model& trunk, const std::string& sidecar, int64_t n_ctx,
                                 GgmlType type_k, GgmlType type_v) {
    const HParams file_hp =
        sidecar.empty() ? trunk.hp
                        : block_file_hparams(trunk, *GgufFile::open(sidecar, /*map_data=*/false), sidecar);
    if (file_hp.n_layer_nextn == 0) return 0;  // no block: the head's constructor refuses the file
    const KvLayout one = kv_layout(block_hparams(file_hp), type_k, type_v);
    return KvCache::bytes(one, n_ctx) + static_cast<uint64_t>(n_ctx * hidden_width(trunk.hp)) * sizeof(float);
}

Act MtpHead::forward(Forward& f, const token_t* tokens, const float* h, int64_t n) const {
    const int64_t e = model_.hp.n_embd, n_hc = model_.hp.hc_mult;
    Backend& b = f.backend();
    // Forward::embed repeats the row over the streams (as for the trunk's input), so llama.cpp's
    // enorm row repeated over the streams is each stream's enorm.
    Act emb = f.alloc(n, n_hc * e);
    f.embed(tokens, emb);
    // [enorm(embed(x)) | hnorm(h)], 2 * n_embd per row (per stream: hc_mult rows of the
    // concatenation per pair), the order llama.cpp concatenates them in.
    Act cat = f.alloc(n * n_hc, 2 * e);
    for (int64_t s = 0; s < n_hc; ++s) {
        b.rms_norm(emb.data + s * e, emb.width, cat.row(s), n_hc * cat.width, n, e, enorm_.data(),
                   model_.hp.rms_eps);
        b.rms_norm(h + s * e, n_hc * e, cat.row(s) + e, n_hc * cat.width, n, e, hnorm_.data(),
                   model_.hp.rms_eps);
    }
    f.name(cat, "mtp_concat", 0);
    Act z = f.linear(cat, eh_proj_, {}, "mtp_eh_proj", 0);
    // Row s of pair i's projection is its stream s: [n, hc_mult * n_embd] is the same memory.
    z = Act{z.data, n, n_hc * e};
    Act out = model_.spec->build_layer(f, z, 0);
    if (n_hc > 1) return out;
    if (head_layer_norm_eps_ > 0.0f) {
        Act normed = f.alloc(n, e);
        b.layer_norm(out.data, out.width, normed.data, normed.width, n, e, head_norm_.data(), nullptr,
                     head_layer_norm_eps_);
        f.name(normed, "mtp_head_norm", 0);
        return normed;
    }
    return f.norm(out, head_norm_, "mtp_head_norm", 0);
}

void MtpHead::head(Forward& f, const Act& out, int64_t row, float* logits) const {
    const HParams& h = model_.hp;
    Backend& b = f.backend();
    if (h.hc_mult > 1) {
        f.output_head(Act{out.row(row), 1, out.width}, 0, logits);
        return;
    }
    // Elsewhere `out` is already head-normed.
    if (b.host_memory()) {
        b.matmul(head_, out.row(row), h.n_embd, 1, logits, h.n_vocab, f.exact());
        return;
    }
    Act dev_logits = f.alloc(1, h.n_vocab);
    b.matmul(head_, out.row(row), h.n_embd, 1, dev_logits.data, dev_logits.width, f.exact());
    b.read(dev_logits, logits);
}

}  // namespace sharpi
