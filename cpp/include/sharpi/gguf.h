// Reading a GGUF model file from a host, without loading the model: metadata, the tensor directory
// and tensor bytes (sharpi.GgufFile in Python, tools that inspect or convert models).
//
// GgufReader is the public, read-only face of the engine's own reader (the private GgufFile): the
// same parser, the same validation and the same typed errors. It owns the file descriptors and the
// read-only mappings of every shard of the model; pointers it returns stay valid while it lives. It
// never writes to the file. Immutable after construction, so concurrent reads from any thread are
// safe.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace sharpi {

// GGUF metadata value types, numbered as in the file format.
enum class GgufValueType : uint32_t {
    UINT8 = 0,
    INT8 = 1,
    UINT16 = 2,
    INT16 = 3,
    UINT32 = 4,
    INT32 = 5,
    FLOAT32 = 6,
    BOOL = 7,
    STRING = 8,
    ARRAY = 9,
    UINT64 = 10,
    INT64 = 11,
    FLOAT64 = 12,
};

// "uint32", "string", "array", ...
const char* gguf_value_type_name(GgufValueType type);

// One metadata value. Scalars: integer kinds in `i` (u64 stored bit-for-bit; use `u()`), floats in
// `f`, BOOL in `i` (0/1), STRING in `str`. ARRAY: `array_type` and one of `arr_int`, `arr_float`,
// `arr_str` (by element kind), or `arr_nested` for arrays of arrays.
struct GgufValue {
    GgufValueType type = GgufValueType::UINT8;
    int64_t i = 0;
    double f = 0.0;
    std::string str;
    GgufValueType array_type = GgufValueType::UINT8;
    std::vector<int64_t> arr_int;
    std::vector<double> arr_float;
    std::vector<std::string> arr_str;
    std::vector<GgufValue> arr_nested;

    uint64_t u() const { return static_cast<uint64_t>(i); }
    bool is_integer() const;  // any of the integer scalar kinds or BOOL
    bool is_float() const;    // FLOAT32 / FLOAT64
    size_t array_size() const;
};

// One entry of the tensor directory.
struct GgufTensorInfo {
    std::string name;
    uint32_t type = 0;           // ggml type id, as stored
    std::string type_name;       // ggml's name of it: "f32", "q4_K", ...
    std::vector<int64_t> shape;  // ggml order: shape[0] is the contiguous (innermost) dimension
    int64_t n_elements = 0;
    uint64_t offset = 0;       // relative to the start of the data section, as stored
    uint64_t file_offset = 0;  // absolute byte offset in the file of its shard
    uint64_t nbytes = 0;
    uint32_t shard = 0;  // index into GgufReader::shards(); 0 for a one-file model
};

// One file of the model (a split model, NAME-0000i-of-0000K.gguf, has K).
struct GgufShardInfo {
    std::string path;
    uint64_t file_size = 0;
    uint64_t data_offset = 0;
    uint64_t n_tensors = 0;  // tensors stored in this file
};

class GgufFile;  // the engine's reader (private)

class GgufReader {
  public:
    // `path` may name any shard of a split model: all shards are opened and checked.
    // map_data = false maps nothing (tensor_data() is then nullptr; read_tensor() reads with pread).
    // Throws FormatError (malformed, truncated, out of bounds), UnsupportedError (GGUF v1,
    // big-endian, unknown tensor type id) or IoError (cannot open / map).
    explicit GgufReader(const std::string& path, bool map_data = true);
    ~GgufReader();
    GgufReader(const GgufReader&) = delete;
    GgufReader& operator=(const GgufReader&) = delete;

    // Of the first shard.
    const std::string& path() const;
    uint32_t version() const;
    uint64_t alignment() const;
    uint64_t data_offset() const;
    uint64_t file_size() const;
    bool is_mapped() const;

    const std::vector<GgufShardInfo>& shards() const { return shards_; }
    // Metadata in file order (the first shard's; keys are unique).
    const std::vector<std::pair<std::string, GgufValue>>& metadata() const;
    // The directory of every shard, in file order.
    const std::vector<GgufTensorInfo>& tensors() const { return tensors_; }
    const GgufTensorInfo* find_tensor(const std::string& name) const;  // nullptr when absent
    const GgufTensorInfo& tensor(const std::string& name) const;       // MissingTensorError when absent

    // The tensor's bytes in the read-only mapping of its shard (valid while this reader lives), or
    // nullptr when not mapped. Reading them may fault in pages of a file that shrank: call
    // check_mapping() after copying.
    const uint8_t* tensor_data(const GgufTensorInfo& t) const;
    // Copies the tensor's nbytes bytes to dst: from the mapping (then check_mapping()), else with
    // pread. IoError when the file cannot be read (shrank, device error).
    void read_tensor(const GgufTensorInfo& t, uint8_t* dst) const;
    // IoError when a page of any shard's mapping could not be read since the file was opened.
    void check_mapping() const;

    // (file offset, bytes) of one expert's slice of an expert-stacked (3-D) tensor, in the file of
    // its shard. InvalidArgument for a tensor that is not 3-D or an expert out of range.
    std::pair<uint64_t, uint64_t> expert_range(const GgufTensorInfo& t, int64_t expert) const;
    // A scalar or per-layer integer key as n_layer values (llama.cpp's get_key_or_arr); absent:
    // n_layer copies of def. FormatError for a wrong type or array length.
    std::vector<uint64_t> get_uint_per_layer(const std::string& key, size_t n_layer, uint64_t def) const;

  private:
    std::unique_ptr<GgufFile> file_;
    std::vector<GgufTensorInfo> tensors_;
    std::vector<GgufShardInfo> shards_;
    std::map<std::string, size_t> index_;  // name -> position in tensors_
};

}  // namespace sharpi
