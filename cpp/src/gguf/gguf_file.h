// GGUF reader: parses the header, every metadata key/value (all value types, nested arrays) and the
// tensor directory of a version 2 or 3 file, validates it against the file size, and maps the
// tensor data read-only with mmap for the resident case.
//
// Owns the file descriptor (O_RDONLY, kept open for the streaming readers' pread / io_uring) and the
// read-only mapping; tensor data pointers stay valid while the GgufFile lives. The header is read
// with pread, never through the mapping, and never trusts a count or a length from the file: every
// read is bounds-checked and a violation is a FormatError naming the file, the byte offset and what
// was being read ("[gguf] m.gguf: truncated tensor directory at offset 0x1a0 (tensor 3 of 12,
// blk.0.attn_q.weight): needs 8 bytes, file size 420"). It never writes to the file and never touches
// tensor bytes itself. Immutable after open(), so concurrent reads from any thread are safe.
//
// Split models. llama.cpp's gguf-split and convert_hf_to_gguf.py --split-max-tensors/--split-max-size
// write one model as NAME-00001-of-0000K.gguf ... NAME-0000K-of-0000K.gguf; every shard carries
// split.no (0-based), split.count (K) and split.tensors.count (tensors in all shards), and only the
// first shard carries the model's other metadata. open() on any shard opens all K, validates them
// (a missing shard, a shard whose split.* keys disagree with its name or with the first shard, a
// tensor present in two shards, a tensor total that differs from split.tensors.count, a truncated
// shard: FormatError naming the file and what is wrong) and returns the first shard, which owns the
// others: metadata() is the first shard's, tensors() lists the tensors of every shard, each with the
// index of its shard (GgufTensor::shard) and its offset in that shard's file.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "quant/ggml_type.h"
#include "sharpi/gguf.h"  // GgufValueType, GgufValue (the public side of the reader)

namespace sharpi {

struct GgufTensor {
    std::string name;
    GgmlType type = GgmlType::F32;
    std::vector<int64_t> ne;  // ggml order: ne[0] is the contiguous (innermost) dimension
    int64_t n_elements = 0;
    uint64_t offset = 0;       // relative to the start of the data section, as stored
    uint64_t file_offset = 0;  // absolute byte offset in the file of its shard
    uint64_t nbytes = 0;
    uint32_t shard = 0;  // index of the file holding it (GgufFile::shard()); 0 for a one-file model
};

// The split.* keys of one shard; count == 0 when the file carries none (a one-file model).
constexpr const char* kGgufSplitNo = "split.no";
constexpr const char* kGgufSplitCount = "split.count";
constexpr const char* kGgufSplitTensorsCount = "split.tensors.count";

class GgufFile {
  public:
    // Throws IoError (cannot open/map), FormatError (malformed, truncated, out of bounds),
    // UnsupportedError (version 1, big-endian, tensor of unknown type id).
    // map_data = false skips the mmap (a streaming host that reads experts with pread / O_DIRECT and
    // wants no mapping at all); tensor_data() then returns nullptr.
    // `path` may name any shard of a split model: all shards are opened (see the header comment).
    static std::unique_ptr<GgufFile> open(const std::string& path, bool map_data = true);
    ~GgufFile();
    GgufFile(const GgufFile&) = delete;
    GgufFile& operator=(const GgufFile&) = delete;

    // path, size, fd, data offset: of this file (the first shard of a split model).
    const std::string& path() const { return path_; }
    uint32_t version() const { return version_; }
    uint64_t file_size() const { return file_size_; }
    uint64_t alignment() const { return alignment_; }
    uint64_t data_offset() const { return data_offset_; }
    int fd() const { return fd_; }

    // The files of the model: shard(0) is this object; a one-file model has n_shards() == 1. A
    // shard other than the first is a one-file GgufFile of its own (its tensors() are its own, with
    // shard index 0 and offsets in its file; its metadata holds only the split.* keys).
    size_t n_shards() const { return 1 + others_.size(); }
    const GgufFile& shard(size_t i) const { return i == 0 ? *this : *others_[i - 1]; }

    // Metadata in file order (keys are unique; a duplicate key is a FormatError).
    const std::vector<std::pair<std::string, GgufValue>>& metadata() const { return kv_; }
    const GgufValue* find(const std::string& key) const;  // nullptr when absent
    bool has(const std::string& key) const { return find(key) != nullptr; }

    // Typed getters. The *_or forms return the default when the key is absent; all throw FormatError
    // naming the key when it is present with an incompatible type. The plain forms throw
    // MissingTensorError ("missing metadata key ...") when absent.
    uint64_t get_uint(const std::string& key) const;
    uint64_t get_uint_or(const std::string& key, uint64_t def) const;
    double get_float_or(const std::string& key, double def) const;
    bool get_bool_or(const std::string& key, bool def) const;
    std::string get_string(const std::string& key) const;
    // A per-layer value that files store either as one scalar or as an array of n_layer integers
    // (llama.cpp's get_key_or_arr, e.g. {arch}.expert_feed_forward_length): always n_layer values.
    // Absent key: n_layer copies of def. Wrong type or array length: FormatError naming the key.
    std::vector<uint64_t> get_uint_per_layer(const std::string& key, size_t n_layer, uint64_t def) const;
    std::string get_string_or(const std::string& key, const std::string& def) const;

    const std::vector<GgufTensor>& tensors() const { return tensors_; }
    const GgufTensor* find_tensor(const std::string& name) const;  // nullptr when absent

    // Pointer to a tensor's bytes in the read-only mapping of its shard (valid while this object
    // lives); nullptr when opened with map_data = false.
    const uint8_t* tensor_data(const GgufTensor& t) const {
        const GgufFile& f = shard(t.shard);
        return f.mapping_ ? f.mapping_ + t.file_offset : nullptr;
    }
    bool is_mapped() const { return mapping_ != nullptr; }
    // Throws IoError when a page of the mapping of any shard could not be read since it was opened
    // (file truncated or changed, device error: SIGBUS caught by map_guard.h, the page read as zeros).
    // Whoever computed from tensor_data() calls this before using the result.
    void check_mapping() const;

  private:
    GgufFile() = default;
    static std::unique_ptr<GgufFile> open_one(const std::string& path, bool map_data);
    // `opened` is one shard of a split model (split.count > 1): opens, checks and merges the others.
    static std::unique_ptr<GgufFile> open_split(std::unique_ptr<GgufFile> opened, bool map_data);
    int guard_id_ = -1;  // map_guard entry of mapping_ (-1: none)
    void parse();        // reads and validates the header and directory; fills every member but mapping_

    std::string path_;
    uint32_t version_ = 0;
    uint64_t file_size_ = 0;
    uint64_t alignment_ = 32;
    uint64_t data_offset_ = 0;
    int fd_ = -1;
    const uint8_t* mapping_ = nullptr;
    std::vector<std::pair<std::string, GgufValue>> kv_;
    std::map<std::string, size_t> kv_index_;
    std::vector<GgufTensor> tensors_;
    std::map<std::string, size_t> tensor_index_;
    std::vector<std::unique_ptr<GgufFile>> others_;  // shards 2..K of a split model
};

}  // namespace sharpi
