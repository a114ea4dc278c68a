#include "model/model.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <sstream>

#include "cpu/quant/kernels.h"
#include "quant/fp16.h"
#include "sharpi/errors.h"

namespace sharpi {

namespace {

std::string shape_str(const std::vector<int64_t>& ne) {
    std::ostringstream s;
    s << "[";
    for (size_t i = 0; i < ne.size(); ++i) s << (i ? ", " : "") << ne[i];
    s << "]";
    return s.str();
}

}  // namespace

ExpertPart expert_part(const GgufTensor& t, uint32_t file, int64_t n_expert) {
    ExpertPart p;
    p.tensor = t.name;
    p.file = file;
    p.offset = t.file_offset;
    // nbytes is a whole number of rows and every expert has the same rows, so this division is exact.
    p.bytes = t.nbytes / static_cast<uint64_t>(n_expert);
    return p;
}

FileRange expert_range(const GgufTensor& t, int64_t expert) {
    if (t.ne.size() != 3) {
        throw InvalidArgument("[gguf] tensor " + t.name + " has " + std::to_string(t.ne.size()) +
                              " dimensions; expert-stacked tensors have 3");
    }
    if (expert < 0 || expert >= t.ne[2]) {
        throw InvalidArgument("[gguf] tensor " + t.name + ": expert " + std::to_string(expert) +
                              " out of range [0, " + std::to_string(t.ne[2]) + ")");
    }
    return expert_part(t, t.shard, t.ne[2]).range(expert);
}

bool is_expert_tensor(const std::string& name) {
    // gpt-oss's ffn_*_exps.bias are small and stay resident with the dense weights (moe_ffn.cpp).
    const std::string bias = ".bias";
    const bool is_bias =
        name.size() >= bias.size() && name.compare(name.size() - bias.size(), bias.size(), bias) == 0;
    return name.find("_exps.") != std::string::npos && !is_bias;
}

bool is_nextn_tensor(const std::string& name, int64_t n_layer) {
    if (name.compare(0, 4, "blk.") != 0) return false;
    int64_t il = 0;
    size_t i = 4;
    for (; i < name.size() && name[i] >= '0' && name[i] <= '9'; ++i) il = il * 10 + (name[i] - '0');
    return i > 4 && il >= n_layer;
}

namespace {

// Streaming mode: read every dense tensor into one owned buffer with pread (64-byte aligned each),
// so nothing the forward pass touches depends on the page cache or on the file staying intact.
void read_dense_tensors(Model& model) {
    const GgufFile& f = *model.file;
    uint64_t total = 0;
    const int64_t n_layer = model.hp.n_layer;
    auto skip = [&](const GgufTensor& t) {
        return is_expert_tensor(t.name) || is_nextn_tensor(t.name, n_layer);
    };
    for (const GgufTensor& t : f.tensors()) {
        if (!skip(t)) total += (t.nbytes + 63) & ~uint64_t{63};
    }
    model.dense_storage.reset(new uint8_t[total + 64]);
    uint8_t* base = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(model.dense_storage.get()) + 63) &
                                               ~uintptr_t{63});
    uint64_t at = 0;
    for (const GgufTensor& t : f.tensors()) {
        if (skip(t)) continue;
        uint8_t* dst = base + at;
        const GgufFile& shard = f.shard(t.shard);
        uint64_t done = 0;
        while (done < t.nbytes) {
            const ssize_t r =
                ::pread(shard.fd(), dst + done, t.nbytes - done, static_cast<off_t>(t.file_offset + done));
            if (r < 0 && errno == EINTR) continue;
            if (r <= 0) {
                throw IoError(
                    "[model] " + shard.path() + ": reading tensor " + t.name + " at offset " +
                    std::to_string(t.file_offset + done) + " failed: " +
                    (r == 0 ? std::string("unexpected end of file") : std::string(std::strerror(errno))));
            }
            done += static_cast<uint64_t>(r);
        }
        model.dense_data[&t] = dst;
        at += (t.nbytes + 63) & ~uint64_t{63};
    }
}

}  // namespace

std::string ModelLoader::where(const std::string& tensor) const {
    return "[model] " + model_.file->path() + ": tensor " + tensor;
}

const GgufTensor& ModelLoader::require(const std::string& name) {
    const GgufTensor* t = model_.file->find_tensor(name);
    if (!t) {
        throw MissingTensorError("[model] " + model_.file->path() + ": missing tensor " + name +
                                 " (required by arch " + model_.hp.arch + ")");
    }
    return *t;
}

WeightView ModelLoader::view(const GgufTensor& t, int64_t n_cols, int64_t n_rows, int64_t n_stack) {
    std::vector<int64_t> want{n_cols, n_rows};
    if (n_stack > 1) want.push_back(n_stack);
    std::vector<int64_t> got = t.ne;
    // Trailing ones do not change the layout: [n, 1] == [n] (writers differ, docs/design.md §8).
    while (got.size() > 1 && got.back() == 1) got.pop_back();
    while (want.size() > 1 && want.back() == 1) want.pop_back();
    if (got != want) {
        throw FormatError(where(t.name) + " has shape " + shape_str(t.ne) + ", expected " + shape_str(want));
    }
    const GgmlTypeTraits& traits = ggml_type_traits(t.type);
    if (!traits.supported) {
        throw UnsupportedError(where(t.name) + " has type " + traits.name + ", which sharpi cannot compute");
    }
    if (n_cols % traits.block_size != 0) {
        throw FormatError(where(t.name) + ": row width " + std::to_string(n_cols) +
                          " is not a multiple of the " + traits.name + " block size " +
                          std::to_string(traits.block_size));
    }
    WeightView w;
    w.type = t.type;
    if (model_.streaming) {
        auto it = model_.dense_data.find(&t);
        w.data = it == model_.dense_data.end() ? nullptr : it->second;  // experts: read by the cache
    } else {
        w.data = model_.file->tensor_data(t);
    }
    w.n_rows = n_rows * n_stack;
    w.n_cols = n_cols;
    w.row_bytes = ggml_row_size(t.type, n_cols);
    return w;
}

WeightView ModelLoader::matrix(const std::string& name, int64_t n_cols, int64_t n_rows) {
    return view(require(name), n_cols, n_rows);
}

WeightView ModelLoader::optional_matrix(const std::string& name, int64_t n_cols, int64_t n_rows) {
    const GgufTensor* t = model_.file->find_tensor(name);
    return t ? view(*t, n_cols, n_rows) : WeightView{};
}

WeightView ModelLoader::stacked_matrix(const std::string& name, int64_t n_cols, int64_t n_rows,
                                       int64_t n_stack) {
    return view(require(name), n_cols, n_rows, n_stack);
}

namespace {

// The n elements of a (small, contiguous) view as f32.
std::vector<float> vector_of(const WeightView& w, int64_t n) {
    std::vector<float> out(static_cast<size_t>(n));
    cpu::row_kernels(w.type, cpu::Isa::scalar).dequant_row(w.data, out.data(), n);
    return out;
}

}  // namespace

std::vector<float> ModelLoader::vector(const std::string& name, int64_t n) {
    return vector_of(view(require(name), n, 1), n);
}

std::vector<float> ModelLoader::optional_vector(const std::string& name, int64_t n) {
    return model_.file->find_tensor(name) ? vector(name, n) : std::vector<float>{};
}

std::vector<float> ModelLoader::stacked_vector(const std::string& name, int64_t n, int64_t n_stack) {
    return vector_of(view(require(name), n, n_stack), n * n_stack);
}

std::vector<int32_t> ModelLoader::int_table(const std::string& name, int64_t n, int64_t n_stack) {
    const GgufTensor& t = require(name);
    std::vector<int64_t> got = t.ne;
    while (got.size() > 1 && got.back() == 1) got.pop_back();
    if (got != std::vector<int64_t>{n, n_stack}) {
        throw FormatError(where(t.name) + " has shape " + shape_str(t.ne) + ", expected " +
                          shape_str({n, n_stack}));
    }
    if (t.type != GgmlType::I32)
        throw FormatError(where(t.name) + " has type " + ggml_type_traits(t.type).name + ", expected i32");
    const uint8_t* data = nullptr;
    if (model_.streaming) {
        auto it = model_.dense_data.find(&t);
        if (it != model_.dense_data.end()) data = it->second;
    } else {
        data = model_.file->tensor_data(t);
    }
    if (!data) throw FormatError(where(t.name) + ": no data");
    std::vector<int32_t> out(static_cast<size_t>(n * n_stack));
    std::memcpy(out.data(), data, out.size() * sizeof(int32_t));
    return out;
}

void ModelLoader::attention(int il) {
    const HParams& h = hp();
    LayerWeights& L = layer(il);
    L.attn_norm = vector(blk(il, "attn_norm.weight"), h.n_embd);
    L.wq.w = matrix(blk(il, "attn_q.weight"), h.n_embd, h.n_embd_q());
    L.wk.w = matrix(blk(il, "attn_k.weight"), h.n_embd, h.n_embd_kv());
    L.wv.w = matrix(blk(il, "attn_v.weight"), h.n_embd, h.n_embd_kv());
    L.wo.w = matrix(blk(il, "attn_output.weight"), h.n_embd_q(), h.n_embd);
    L.wq.bias = optional_vector(blk(il, "attn_q.bias"), h.n_embd_q());
    L.wk.bias = optional_vector(blk(il, "attn_k.bias"), h.n_embd_kv());
    L.wv.bias = optional_vector(blk(il, "attn_v.bias"), h.n_embd_kv());
    L.wo.bias = optional_vector(blk(il, "attn_output.bias"), h.n_embd);
}

void ModelLoader::qk_norm(int il, int64_t q_width, int64_t k_width) {
    LayerWeights& L = layer(il);
    L.attn_q_norm = vector(blk(il, "attn_q_norm.weight"), q_width);
    L.attn_k_norm = vector(blk(il, "attn_k_norm.weight"), k_width);
}

void ModelLoader::moe(int il, const char* norm, bool gated) {
    const HParams& h = hp();
    LayerWeights& L = layer(il);
    L.ffn_norm = vector(blk(il, norm), h.n_embd);
    L.ffn_gate_inp = matrix(blk(il, "ffn_gate_inp.weight"), h.n_embd, h.n_expert);
    // Pre-gated MoE (docs/predictors.md): layer il+1's router evaluated in layer il. Optional.
    L.ffn_pregate_inp = optional_matrix(blk(il, "ffn_pregate_inp.weight"), h.n_embd, h.n_expert);
    // ffn_{gate,up,down}_exps, expert-major: one ExpertPart per tensor (model/model.h); without a
    // gate, the up tensor stands in for the gate part's shape.
    const char* const names[kExpertParts] = {gated ? "ffn_gate_exps.weight" : "ffn_up_exps.weight",
                                             "ffn_up_exps.weight", "ffn_down_exps.weight"};
    const int64_t n_cols[kExpertParts] = {h.n_embd_exp(), h.n_embd_exp(), h.n_ff_exp};
    const int64_t n_rows[kExpertParts] = {h.n_ff_exp, h.n_ff_exp, h.n_embd_exp()};
    const GgufTensor* tensors[kExpertParts];
    for (int part = 0; part < kExpertParts; ++part) tensors[part] = &require(blk(il, names[part]));
    ExpertLayerLayout& x = model_.experts.layers[static_cast<size_t>(il)];
    for (int part = 0; part < kExpertParts; ++part) {
        const WeightView stacked = view(*tensors[part], n_cols[part], n_rows[part], h.n_expert);
        ExpertPart p = expert_part(*tensors[part], tensors[part]->shard, h.n_expert);
        p.view = stacked;  // data: expert 0 in the mapping, or nullptr when streaming
        p.view.n_rows = n_rows[part];
        x.parts[part] = std::move(p);
    }
    // Ungated experts: the gate part names the up tensor but holds no bytes (moe/expert_layout.h).
    if (!gated) x.parts[kExpertGate].bytes = 0;
}

void ModelLoader::dense_ffn(int il, const char* norm) {
    const HParams& h = hp();
    LayerWeights& L = layer(il);
    if (h.n_ff <= 0)
        throw MissingTensorError("[model] " + model_.file->path() + ": feed_forward_length is missing");
    L.ffn_norm = vector(blk(il, norm), h.n_embd);
    L.ffn_gate.w = matrix(blk(il, "ffn_gate.weight"), h.n_embd, h.n_ff);
    L.ffn_up.w = matrix(blk(il, "ffn_up.weight"), h.n_embd, h.n_ff);
    L.ffn_down.w = matrix(blk(il, "ffn_down.weight"), h.n_ff, h.n_embd);
}

void ModelLoader::shared_expert(int il, bool gated) {
    const HParams& h = hp();
    LayerWeights& L = layer(il);
    if (h.n_ff_shexp <= 0) return;  // qwen2moe without a shared expert
    if (gated) L.ffn_gate.w = matrix(blk(il, "ffn_gate_shexp.weight"), h.n_embd, h.n_ff_shexp);
    L.ffn_up.w = matrix(blk(il, "ffn_up_shexp.weight"), h.n_embd, h.n_ff_shexp);
    L.ffn_down.w = matrix(blk(il, "ffn_down_shexp.weight"), h.n_ff_shexp, h.n_embd);
    // [n_embd] after llama.cpp's quantizer, [n_embd, 1] from the converter: both are one row.
    L.ffn_gate_inp_shexp = optional_matrix(blk(il, "ffn_gate_inp_shexp.weight"), h.n_embd, 1);
}

std::unique_ptr<Model> load_model(const std::string& path, bool streaming) {
    auto model = std::make_unique<Model>();
    model->streaming = streaming;
    model->file = GgufFile::open(path, /*map_data=*/!streaming);
    const GgufFile& f = *model->file;

    const std::string arch = f.get_string_or("general.architecture", "");
    if (arch.empty())
        throw MissingTensorError("[model] " + path + ": missing metadata key general.architecture");
    model->spec = find_arch(arch);
    if (!model->spec) {
        std::string known;
        for (const auto& n : arch_names()) known += (known.empty() ? "" : ", ") + n;
        throw UnsupportedError("[model] " + path + ": unknown architecture '" + arch +
                               "' (supported: " + known + ")");
    }
    model->hp = read_hparams(f, *model->spec);
    const HParams& h = model->hp;

    if (streaming) read_dense_tensors(*model);

    ModelLoader loader(*model);
    if (h.n_vocab <= 0) throw MissingTensorError("[model] " + path + ": missing tensor token_embd.weight");
    model->token_embd = loader.matrix("token_embd.weight", h.n_embd, h.n_vocab);
    model->output_norm = loader.vector("output_norm.weight", h.n_embd);
    model->output = loader.optional_matrix("output.weight", h.n_embd, h.n_vocab);
    if (!model->output.data) model->output = model->token_embd;  // tied embeddings

    if (h.hc_mult > 1) {
        model->hc_head_fn.w = loader.matrix("output_hc_fn.weight", h.n_embd_residual(), h.hc_mult);
        model->hc_head_base = loader.vector("output_hc_base.weight", h.hc_mult);
        model->hc_head_scale = loader.vector("output_hc_scale.weight", 1);
    }
    model->layers.resize(static_cast<size_t>(h.n_layer));
    model->experts.files.clear();  // one per shard: ExpertPart::file is the tensor's shard
    for (size_t i = 0; i < f.n_shards(); ++i) model->experts.files.push_back(f.shard(i).path());
    model->experts.n_expert = h.n_expert;
    model->experts.n_expert_used = h.n_expert_used;
    model->experts.layers.resize(static_cast<size_t>(h.n_layer));
    for (int il = 0; il < h.n_layer; ++il) model->spec->load_layer(loader, il);

    for (const GgufTensor& t : f.tensors()) {
        if (is_nextn_tensor(t.name, h.n_layer)) continue;
        (is_expert_tensor(t.name) ? model->bytes_experts : model->bytes_dense) += t.nbytes;
    }
    f.check_mapping();  // norms and biases were copied out of the mapping above
    return model;
}

}  // namespace sharpi
