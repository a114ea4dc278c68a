// sharpi::GgufReader: the public face of GgufFile (pimpl keeps the public headers free of the
// private tensor and quant types). Every check and message is GgufFile's; this file only converts
// its directory to the public GgufTensorInfo and reads tensor bytes.
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "gguf/gguf_file.h"
#include "model/model.h"  // expert_range
#include "sharpi/errors.h"
#include "sharpi/gguf.h"

namespace sharpi {

namespace {

// Reads [offset, offset + n) of shard `f` with pread (the file was opened without a mapping).
void pread_exact(const GgufFile& f, uint8_t* dst, uint64_t offset, uint64_t n) {
    uint64_t got = 0;
    while (got < n) {
        const ssize_t r = ::pread(f.fd(), dst + got, n - got, static_cast<off_t>(offset + got));
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) {
            throw IoError("[gguf] " + f.path() + ": read of " + std::to_string(n) + " bytes at offset " +
                          std::to_string(offset + got) +
                          " failed: " + (r < 0 ? std::strerror(errno) : "end of file"));
        }
        got += static_cast<uint64_t>(r);
    }
}

// The private directory entry of `t`, which must be one of tensors() (same order as file_'s).
const GgufTensor& private_entry(const GgufFile& file, const std::vector<GgufTensorInfo>& infos,
                                const GgufTensorInfo& t) {
    if (infos.empty() || &t < infos.data() || &t >= infos.data() + infos.size()) {
        throw InvalidArgument("[gguf] " + file.path() + ": tensor " + t.name +
                              " is not from this file's directory");
    }
    return file.tensors()[static_cast<size_t>(&t - infos.data())];
}

}  // namespace

GgufReader::GgufReader(const std::string& path, bool map_data) : file_(GgufFile::open(path, map_data)) {
    const std::vector<GgufTensor>& tensors = file_->tensors();
    tensors_.reserve(tensors.size());
    for (const GgufTensor& t : tensors) {
        GgufTensorInfo info;
        info.name = t.name;
        info.type = static_cast<uint32_t>(t.type);
        info.type_name = ggml_type_traits(t.type).name;
        info.shape = t.ne;
        info.n_elements = t.n_elements;
        info.offset = t.offset;
        info.file_offset = t.file_offset;
        info.nbytes = t.nbytes;
        info.shard = t.shard;
        index_.emplace(info.name, tensors_.size());
        tensors_.push_back(std::move(info));
    }
    for (size_t i = 0; i < file_->n_shards(); ++i) {
        const GgufFile& s = file_->shard(i);
        GgufShardInfo shard;
        shard.path = s.path();
        shard.file_size = s.file_size();
        shard.data_offset = s.data_offset();
        for (const GgufTensor& t : tensors) shard.n_tensors += t.shard == i;
        shards_.push_back(std::move(shard));
    }
}

GgufReader::~GgufReader() = default;

const std::string& GgufReader::path() const {
    return file_->path();
}
uint32_t GgufReader::version() const {
    return file_->version();
}
uint64_t GgufReader::alignment() const {
    return file_->alignment();
}
uint64_t GgufReader::data_offset() const {
    return file_->data_offset();
}
uint64_t GgufReader::file_size() const {
    return file_->file_size();
}
bool GgufReader::is_mapped() const {
    return file_->is_mapped();
}

const std::vector<std::pair<std::string, GgufValue>>& GgufReader::metadata() const {
    return file_->metadata();
}

const GgufTensorInfo* GgufReader::find_tensor(const std::string& name) const {
    const auto it = index_.find(name);
    return it == index_.end() ? nullptr : &tensors_[it->second];
}

const GgufTensorInfo& GgufReader::tensor(const std::string& name) const {
    const GgufTensorInfo* t = find_tensor(name);
    if (t == nullptr)
        throw MissingTensorError("[gguf] " + file_->path() + ": no tensor named '" + name + "'");
    return *t;
}

const uint8_t* GgufReader::tensor_data(const GgufTensorInfo& t) const {
    return file_->tensor_data(private_entry(*file_, tensors_, t));
}

void GgufReader::read_tensor(const GgufTensorInfo& t, uint8_t* dst) const {
    const GgufTensor& entry = private_entry(*file_, tensors_, t);
    if (file_->is_mapped()) {
        std::memcpy(dst, file_->tensor_data(entry), entry.nbytes);
        file_->check_mapping();  // IoError, not zeros, when the file shrank under the mapping
    } else {
        pread_exact(file_->shard(entry.shard), dst, entry.file_offset, entry.nbytes);
    }
}

void GgufReader::check_mapping() const {
    file_->check_mapping();
}

std::pair<uint64_t, uint64_t> GgufReader::expert_range(const GgufTensorInfo& t, int64_t expert) const {
    const FileRange r = sharpi::expert_range(private_entry(*file_, tensors_, t), expert);
    return {r.offset, r.bytes};
}

std::vector<uint64_t> GgufReader::get_uint_per_layer(const std::string& key, size_t n_layer,
                                                     uint64_t def) const {
    return file_->get_uint_per_layer(key, n_layer, def);
}

}  // namespace sharpi
