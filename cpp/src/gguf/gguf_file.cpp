// GGUF v2/v3 reader. See gguf_file.h for ownership and thread-safety. One concept (parsing and
// validating one GGUF file: header, metadata, tensor table, mapping), hence over 600 lines.
//
// Layout (little-endian):
//   "GGUF" u32 version, u64 n_tensors, u64 n_kv
//   n_kv    x { string key, u32 value_type, value }
//   n_tensors x { string name, u32 n_dims, u64 ne[n_dims], u32 ggml_type, u64 offset }
//   padding to `general.alignment` (default 32), then the data section; tensor offsets are relative
//   to it and multiples of the alignment.
//   string = u64 length + bytes (no terminator); array = u32 element type, u64 count, elements.
// Version 1 used 32-bit counts and lengths; v2 widened them to 64 bits and v3 only added the
// (separately detected) big-endian variant, so v2 and v3 little-endian files parse identically.
//
// The header is read with pread through a small window buffer, never through the mapping, so that a
// corrupt header can only produce a typed error. Every length and count is checked, before anything
// is allocated for it, against the bytes left in the file AND against a fixed cap (below): the bytes
// left are not enough, since parsed metadata takes up to ~14x its encoded size (an empty nested
// array is 12 bytes in the file and a ~150-byte GgufValue here), so a hostile file of a few hundred
// MB could otherwise make the parser allocate gigabytes and die by the OOM killer.
#include "gguf/gguf_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstring>

#include "gguf/map_guard.h"
#include "sharpi/errors.h"

namespace sharpi {

namespace {

constexpr uint32_t kGgufMagic = 0x46554747;  // "GGUF" read as a little-endian u32
constexpr uint64_t kDefaultAlignment = 32;
constexpr int kMaxArrayDepth = 8;  // real files nest at most once; deeper is hostile
constexpr uint32_t kMaxDims = 4;   // GGML_MAX_DIMS

// Allocation caps, each far above any real file and low enough that a hostile header fails with a
// FormatError before the parser holds more than ~kMaxHeaderMemory. Real files: < 100 metadata
// keys; at most a few thousand tensors (experts are stacked, 3 tensors per layer); the largest
// arrays are vocabularies of ~262k tokens and ~500k merges; the longest strings are chat templates
// (tens of KiB) and the largest u8 array a tokenizer's precompiled charsmap (~1 MiB).
constexpr uint64_t kMaxKv = uint64_t{1} << 16;
constexpr uint64_t kMaxTensors = uint64_t{1} << 17;
constexpr uint64_t kMaxArrayElements = uint64_t{1} << 24;
constexpr uint64_t kMaxStringBytes = uint64_t{1} << 26;
// Memory the parsed header (metadata values, keys, tensor directory) may take in all: 256 MiB,
// ~10x that of the largest real vocabulary, and a quarter of the 1 GiB address space the hostile-
// file tests give a whole Python process.
constexpr uint64_t kMaxHeaderMemory = uint64_t{256} << 20;

// Smallest encoding of one metadata entry: empty key (8) + type (4) + a one-byte scalar.
constexpr uint64_t kMinKvBytes = 8 + 4 + 1;
// Smallest tensor directory entry: empty name (8) + n_dims (4) + type (4) + offset (8).
constexpr uint64_t kMinTensorInfoBytes = 8 + 4 + 4 + 8;

std::string hex(uint64_t v) {
    char buf[32];
    std::snprintf(buf, sizeof(buf), "0x%" PRIx64, v);
    return buf;
}

// Keys and tensor names come from the file and go into error messages, which must stay valid UTF-8
// text (Python turns them into str). Well-formed printable UTF-8 passes through; any other byte is
// written as \xNN; the result is capped at ~200 bytes.
std::string printable(const std::string& s) {
    std::string out;
    size_t i = 0;
    while (i < s.size() && out.size() < 200) {
        const auto c = static_cast<unsigned char>(s[i]);
        size_t len = 0;
        unsigned char lo = 0x80, hi = 0xBF;  // allowed range of the second byte
        if (c >= 0x20 && c < 0x7F) {
            len = 1;
        } else if (c >= 0xC2 && c <= 0xDF) {
            len = 2;
        } else if (c >= 0xE0 && c <= 0xEF) {
            len = 3;
            if (c == 0xE0) lo = 0xA0;  // no overlong forms
            if (c == 0xED) hi = 0x9F;  // no surrogates
        } else if (c >= 0xF0 && c <= 0xF4) {
            len = 4;
            if (c == 0xF0) lo = 0x90;
            if (c == 0xF4) hi = 0x8F;
        }
        bool ok = len > 0 && i + len <= s.size();
        for (size_t k = 1; ok && k < len; ++k) {
            const auto b = static_cast<unsigned char>(s[i + k]);
            ok = k == 1 ? (b >= lo && b <= hi) : (b >= 0x80 && b <= 0xBF);
        }
        if (ok) {
            out.append(s, i, len);
            i += len;
        } else {
            char buf[8];
            std::snprintf(buf, sizeof(buf), "\\x%02x", c);
            out += buf;
            i += 1;
        }
    }
    if (i < s.size()) out += "...";
    return out;
}

// Bytes one element of an array of `type` needs at least (strings: their u64 length; arrays: type + count).
uint64_t min_element_size(GgufValueType type) {
    switch (type) {
        case GgufValueType::UINT8:
        case GgufValueType::INT8:
        case GgufValueType::BOOL:
            return 1;
        case GgufValueType::UINT16:
        case GgufValueType::INT16:
            return 2;
        case GgufValueType::UINT32:
        case GgufValueType::INT32:
        case GgufValueType::FLOAT32:
            return 4;
        case GgufValueType::UINT64:
        case GgufValueType::INT64:
        case GgufValueType::FLOAT64:
        case GgufValueType::STRING:
            return 8;
        case GgufValueType::ARRAY:
            return 4 + 8;
    }
    return 0;
}

bool is_known_value_type(uint32_t t) {
    return t <= static_cast<uint32_t>(GgufValueType::FLOAT64);
}

// Sequential reader over the file header: pread into a window, bounds-checked against the file size.
// Owns nothing but its buffer; the fd belongs to GgufFile.
class HeaderReader {
  public:
    HeaderReader(int fd, uint64_t file_size, const std::string& path)
        : fd_(fd), file_size_(file_size), path_(path) {}

    uint64_t pos() const { return pos_; }
    uint64_t remaining() const { return file_size_ - pos_; }

    // Describes what is being read, for error messages: section ("metadata") and item ("key 3 of 12").
    void set_context(const char* section, std::string item) {
        section_ = section;
        item_ = std::move(item);
    }
    const std::string& item() const { return item_; }

    [[noreturn]] void fail(const std::string& what) const {
        throw FormatError("[gguf] " + path_ + ": " + what);
    }
    [[noreturn]] void fail_here(const std::string& what) const {
        std::string msg = std::string(section_) + " at offset " + hex(pos_);
        if (!item_.empty()) msg += " (" + item_ + ")";
        fail(msg + ": " + what);
    }

    void read(void* dst, uint64_t n) {
        if (n > remaining()) {
            fail("truncated " + std::string(section_) + " at offset " + hex(pos_) +
                 (item_.empty() ? std::string() : " (" + item_ + ")") + ": needs " + std::to_string(n) +
                 " bytes, file size " + std::to_string(file_size_));
        }
        uint8_t* out = static_cast<uint8_t*>(dst);
        while (n > 0) {
            if (pos_ < win_start_ || pos_ >= win_start_ + win_.size()) refill();
            const uint64_t off = pos_ - win_start_;
            const uint64_t take = std::min<uint64_t>(n, win_.size() - off);
            std::memcpy(out, win_.data() + off, take);
            out += take;
            pos_ += take;
            n -= take;
        }
    }

    // Accounts `bytes` of memory the parse is about to allocate; FormatError past kMaxHeaderMemory.
    // Called before each allocation whose size comes from the file, so nothing over the cap is
    // ever allocated.
    void charge(uint64_t bytes, const std::string& what) {
        if (bytes > kMaxHeaderMemory - charged_) {
            fail_here(what + " would take the header past " + std::to_string(kMaxHeaderMemory >> 20) +
                      " MiB of memory (no real GGUF comes close): corrupt or hostile file");
        }
        charged_ += bytes;
    }

    template <typename T>
    T read_scalar() {
        T v;
        read(&v, sizeof(T));
        return v;
    }

    std::string read_string(const char* what) {
        const uint64_t len = read_scalar<uint64_t>();
        if (len > remaining()) {
            fail_here(std::string(what) + " length " + std::to_string(len) + " exceeds the " +
                      std::to_string(remaining()) + " bytes left in the file");
        }
        if (len > kMaxStringBytes) {
            fail_here(std::string(what) + " length " + std::to_string(len) + " exceeds the cap of " +
                      std::to_string(kMaxStringBytes) + " bytes");
        }
        charge(len, what);
        std::string s(len, '\0');
        if (len) read(&s[0], len);
        return s;
    }

  private:
    void refill() {
        constexpr uint64_t kWindow = 1u << 20;
        const uint64_t want = std::min<uint64_t>(kWindow, file_size_ - pos_);
        win_.resize(want);
        uint64_t got = 0;
        while (got < want) {
            const ssize_t r = ::pread(fd_, win_.data() + got, want - got, static_cast<off_t>(pos_ + got));
            if (r < 0) {
                if (errno == EINTR) continue;
                throw IoError("[gguf] " + path_ + ": read at offset " + hex(pos_ + got) +
                              " failed: " + std::strerror(errno));
            }
            if (r == 0) {
                throw IoError("[gguf] " + path_ + ": unexpected end of file at offset " + hex(pos_ + got) +
                              " (file shrank while being read?)");
            }
            got += static_cast<uint64_t>(r);
        }
        win_start_ = pos_;
    }

    int fd_;
    uint64_t file_size_;
    const std::string& path_;
    uint64_t pos_ = 0;
    std::vector<uint8_t> win_;
    uint64_t win_start_ = 0;
    const char* section_ = "header";
    std::string item_;
    uint64_t charged_ = 0;  // memory accounted by charge()
};

struct Number {
    int64_t i = 0;
    double f = 0.0;
};

// Decodes one little-endian scalar of a numeric or BOOL type from `p` (min_element_size(type) bytes).
Number decode_number(GgufValueType type, const uint8_t* p) {
    Number n;
    switch (type) {
        case GgufValueType::UINT8:
            n.i = p[0];
            break;
        case GgufValueType::INT8:
            n.i = static_cast<int8_t>(p[0]);
            break;
        // Any non-zero byte is true, as in ggml: files llama.cpp accepts must open here too.
        case GgufValueType::BOOL:
            n.i = p[0] != 0;
            break;
        case GgufValueType::UINT16: {
            uint16_t v;
            std::memcpy(&v, p, 2);
            n.i = v;
            break;
        }
        case GgufValueType::INT16: {
            int16_t v;
            std::memcpy(&v, p, 2);
            n.i = v;
            break;
        }
        case GgufValueType::UINT32: {
            uint32_t v;
            std::memcpy(&v, p, 4);
            n.i = v;
            break;
        }
        case GgufValueType::INT32: {
            int32_t v;
            std::memcpy(&v, p, 4);
            n.i = v;
            break;
        }
        case GgufValueType::UINT64: {
            uint64_t v;
            std::memcpy(&v, p, 8);
            n.i = static_cast<int64_t>(v);
            break;
        }
        case GgufValueType::INT64: {
            int64_t v;
            std::memcpy(&v, p, 8);
            n.i = v;
            break;
        }
        case GgufValueType::FLOAT32: {
            float v;
            std::memcpy(&v, p, 4);
            n.f = v;
            break;
        }
        case GgufValueType::FLOAT64: {
            double v;
            std::memcpy(&v, p, 8);
            n.f = v;
            break;
        }
        case GgufValueType::STRING:
        case GgufValueType::ARRAY:
            break;
    }
    return n;
}

void read_array(HeaderReader& r, GgufValue& out, int depth) {
    if (depth >= kMaxArrayDepth) r.fail_here("arrays nested deeper than " + std::to_string(kMaxArrayDepth));
    const uint32_t elem_raw = r.read_scalar<uint32_t>();
    if (!is_known_value_type(elem_raw)) r.fail_here("unknown array element type " + std::to_string(elem_raw));
    const auto elem = static_cast<GgufValueType>(elem_raw);
    const uint64_t n = r.read_scalar<uint64_t>();
    // A count whose smallest encoding does not fit in what is left is a lie: reject before allocating.
    const uint64_t min_size = min_element_size(elem);
    if (n > r.remaining() / min_size) {
        r.fail_here("array of " + std::to_string(n) + " " + gguf_value_type_name(elem) +
                    " elements cannot fit in the " + std::to_string(r.remaining()) +
                    " bytes left in the file");
    }
    if (n > kMaxArrayElements) {
        r.fail_here("array of " + std::to_string(n) + " elements exceeds the cap of " +
                    std::to_string(kMaxArrayElements));
    }
    // What the elements take here (not in the file): strings and nested values are far larger in
    // memory than their smallest encoding; numbers are widened to 8 bytes (plus the raw copy).
    const uint64_t elem_memory = elem == GgufValueType::STRING  ? sizeof(std::string)
                                 : elem == GgufValueType::ARRAY ? sizeof(GgufValue)
                                                                : 8 + min_size;
    r.charge(n * elem_memory, "array of " + std::to_string(n) + " " + gguf_value_type_name(elem));
    out.array_type = elem;
    switch (elem) {
        case GgufValueType::STRING:
            out.arr_str.reserve(n);
            for (uint64_t i = 0; i < n; ++i) out.arr_str.push_back(r.read_string("array string"));
            break;
        case GgufValueType::ARRAY:
            out.arr_nested.resize(n);
            for (uint64_t i = 0; i < n; ++i) {
                out.arr_nested[i].type = GgufValueType::ARRAY;
                read_array(r, out.arr_nested[i], depth + 1);
            }
            break;
        default: {
            // Numbers: one bulk read, then widen each element to the int64/double storage.
            std::vector<uint8_t> raw(n * min_size);
            if (!raw.empty()) r.read(raw.data(), raw.size());
            const uint8_t* p = raw.data();
            if (elem == GgufValueType::FLOAT32 || elem == GgufValueType::FLOAT64) {
                out.arr_float.resize(n);
                for (uint64_t i = 0; i < n; ++i) out.arr_float[i] = decode_number(elem, p + i * min_size).f;
            } else {
                out.arr_int.resize(n);
                for (uint64_t i = 0; i < n; ++i) out.arr_int[i] = decode_number(elem, p + i * min_size).i;
            }
            break;
        }
    }
}

// Reads one value of `type` (already read) into `out`. `depth` counts enclosing arrays.
void read_value(HeaderReader& r, GgufValueType type, GgufValue& out, int depth) {
    out.type = type;
    switch (type) {
        case GgufValueType::STRING:
            out.str = r.read_string("string value");
            break;
        case GgufValueType::ARRAY:
            read_array(r, out, depth);
            break;
        default: {
            uint8_t raw[8];
            r.read(raw, min_element_size(type));
            const Number n = decode_number(type, raw);
            out.i = n.i;
            out.f = n.f;
            break;
        }
    }
}

bool is_power_of_two(uint64_t v) {
    return v != 0 && (v & (v - 1)) == 0;
}

}  // namespace

const char* gguf_value_type_name(GgufValueType type) {
    switch (type) {
        case GgufValueType::UINT8:
            return "uint8";
        case GgufValueType::INT8:
            return "int8";
        case GgufValueType::UINT16:
            return "uint16";
        case GgufValueType::INT16:
            return "int16";
        case GgufValueType::UINT32:
            return "uint32";
        case GgufValueType::INT32:
            return "int32";
        case GgufValueType::FLOAT32:
            return "float32";
        case GgufValueType::BOOL:
            return "bool";
        case GgufValueType::STRING:
            return "string";
        case GgufValueType::ARRAY:
            return "array";
        case GgufValueType::UINT64:
            return "uint64";
        case GgufValueType::INT64:
            return "int64";
        case GgufValueType::FLOAT64:
            return "float64";
    }
    return "unknown";
}

bool GgufValue::is_integer() const {
    switch (type) {
        case GgufValueType::UINT8:
        case GgufValueType::INT8:
        case GgufValueType::UINT16:
        case GgufValueType::INT16:
        case GgufValueType::UINT32:
        case GgufValueType::INT32:
        case GgufValueType::UINT64:
        case GgufValueType::INT64:
        case GgufValueType::BOOL:
            return true;
        default:
            return false;
    }
}

bool GgufValue::is_float() const {
    return type == GgufValueType::FLOAT32 || type == GgufValueType::FLOAT64;
}

size_t GgufValue::array_size() const {
    if (type != GgufValueType::ARRAY) return 0;
    switch (array_type) {
        case GgufValueType::STRING:
            return arr_str.size();
        case GgufValueType::ARRAY:
            return arr_nested.size();
        case GgufValueType::FLOAT32:
        case GgufValueType::FLOAT64:
            return arr_float.size();
        default:
            return arr_int.size();
    }
}

std::unique_ptr<GgufFile> GgufFile::open(const std::string& path, bool map_data) {
    std::unique_ptr<GgufFile> file = open_one(path, map_data);
    if (file->get_uint_or(kGgufSplitCount, 0) > 1) return open_split(std::move(file), map_data);
    return file;
}

namespace {

// NAME-0000i-of-0000K.gguf, as llama.cpp writes shard names (llama_split_path: "%s-%05d-of-%05d.gguf",
// gguf-py's SHARD_NAME_FORMAT). Wider numbers are accepted; i and K are 1-based.
struct SplitName {
    std::string prefix;  // everything before "-0000i-of-0000K.gguf", directory included
    uint64_t no = 0;
    uint64_t count = 0;
};

bool parse_split_name(const std::string& path, SplitName* out) {
    static const std::string kSuffix = ".gguf";
    if (path.size() < kSuffix.size() ||
        path.compare(path.size() - kSuffix.size(), kSuffix.size(), kSuffix) != 0)
        return false;
    const std::string stem = path.substr(0, path.size() - kSuffix.size());
    // Walk back over "-DIGITS-of-DIGITS".
    auto digits_before = [&](size_t end, size_t* begin) {
        size_t b = end;
        while (b > 0 && stem[b - 1] >= '0' && stem[b - 1] <= '9') --b;
        *begin = b;
        return end - b >= 5 && end - b <= 18;
    };
    size_t count_begin = 0, no_begin = 0;
    if (!digits_before(stem.size(), &count_begin)) return false;
    if (count_begin < 4 || stem.compare(count_begin - 4, 4, "-of-") != 0) return false;
    if (!digits_before(count_begin - 4, &no_begin)) return false;
    if (no_begin < 2 || stem[no_begin - 1] != '-') return false;
    out->prefix = stem.substr(0, no_begin - 1);
    out->no = std::stoull(stem.substr(no_begin, count_begin - 4 - no_begin));
    out->count = std::stoull(stem.substr(count_begin));
    return out->no >= 1 && out->no <= out->count;
}

[[noreturn]] void split_fail(const std::string& file, const std::string& what) {
    throw FormatError("[gguf] " + file + ": " + what);
}

std::string split_path(const std::string& prefix, uint64_t no, uint64_t count) {
    char buf[64];
    std::snprintf(buf, sizeof(buf), "-%05" PRIu64 "-of-%05" PRIu64 ".gguf", no, count);
    return prefix + buf;
}

}  // namespace

std::unique_ptr<GgufFile> GgufFile::open_split(std::unique_ptr<GgufFile> opened, bool map_data) {
    const std::string& path = opened->path();
    const uint64_t count = opened->get_uint(kGgufSplitCount);
    SplitName name;
    if (!parse_split_name(path, &name)) {
        split_fail(path, "split.count = " + std::to_string(count) +
                             " (one shard of a split model), but the file name does not follow "
                             "NAME-0000i-of-0000K.gguf, so the other shards cannot be found");
    }
    if (name.count != count) {
        split_fail(path, "the file name says " + std::to_string(name.count) + " shards, split.count says " +
                             std::to_string(count));
    }
    if (count > 9999)
        split_fail(path, "split.count = " + std::to_string(count) + " is not a plausible shard count");

    std::vector<std::unique_ptr<GgufFile>> shards(count);
    const uint64_t opened_no = name.no - 1;
    shards[opened_no] = std::move(opened);
    for (uint64_t i = 0; i < count; ++i) {
        if (shards[i]) continue;
        const std::string shard_path = split_path(name.prefix, i + 1, count);
        struct stat st;
        if (::stat(shard_path.c_str(), &st) != 0) {
            split_fail(shard_path, "missing shard " + std::to_string(i + 1) + " of " + std::to_string(count) +
                                       " of the split model " + split_path(name.prefix, 1, count) + " (" +
                                       std::strerror(errno) + ")");
        }
        shards[i] = open_one(shard_path, map_data);
    }

    // Every shard must say it is shard i of this split and count the same tensors as the first.
    const uint64_t n_total = shards[0]->get_uint_or(kGgufSplitTensorsCount, 0);
    const std::string arch = shards[0]->get_string_or("general.architecture", "");
    for (uint64_t i = 0; i < count; ++i) {
        const GgufFile& s = *shards[i];
        const std::string which = "shard " + std::to_string(i + 1) + " of " + std::to_string(count);
        if (!s.has(kGgufSplitCount) || !s.has(kGgufSplitNo)) {
            split_fail(s.path(),
                       which + " has no split.count / split.no keys: not a shard of this split model");
        }
        if (s.get_uint(kGgufSplitCount) != count) {
            split_fail(s.path(), which +
                                     " says split.count = " + std::to_string(s.get_uint(kGgufSplitCount)) +
                                     ": a shard of another split");
        }
        if (s.get_uint(kGgufSplitNo) != i) {
            split_fail(s.path(), which + " says split.no = " + std::to_string(s.get_uint(kGgufSplitNo)) +
                                     " (shard " + std::to_string(s.get_uint(kGgufSplitNo) + 1) + ")");
        }
        if (s.get_uint_or(kGgufSplitTensorsCount, 0) != n_total) {
            split_fail(s.path(), which + " says split.tensors.count = " +
                                     std::to_string(s.get_uint_or(kGgufSplitTensorsCount, 0)) +
                                     ", shard 1 says " + std::to_string(n_total) +
                                     ": a shard of another model or split");
        }
        const std::string shard_arch = s.get_string_or("general.architecture", arch);
        if (shard_arch != arch) {
            split_fail(s.path(), which + " is a '" + shard_arch + "' model, shard 1 a '" + arch +
                                     "' model: a shard of another model");
        }
    }

    // Merge the tensor directories into the first shard's, each tensor keeping its shard.
    std::unique_ptr<GgufFile> first = std::move(shards[0]);
    for (uint64_t i = 1; i < count; ++i) {
        for (const GgufTensor& t : shards[i]->tensors_) {
            auto it = first->tensor_index_.find(t.name);
            if (it != first->tensor_index_.end()) {
                split_fail(shards[i]->path(), "tensor " + printable(t.name) + " is also in shard " +
                                                  std::to_string(first->tensors_[it->second].shard + 1) +
                                                  ": a shard of another model or split");
            }
            GgufTensor merged = t;
            merged.shard = static_cast<uint32_t>(i);
            first->tensor_index_.emplace(t.name, first->tensors_.size());
            first->tensors_.push_back(std::move(merged));
        }
        first->others_.push_back(std::move(shards[i]));
    }
    if (first->tensors_.size() != n_total) {
        split_fail(first->path(), "the " + std::to_string(count) + " shards hold " +
                                      std::to_string(first->tensors_.size()) +
                                      " tensors, split.tensors.count says " + std::to_string(n_total));
    }
    return first;
}

std::unique_ptr<GgufFile> GgufFile::open_one(const std::string& path, bool map_data) {
    std::unique_ptr<GgufFile> file(new GgufFile());
    file->path_ = path;
    file->fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (file->fd_ < 0) throw IoError("[gguf] " + path + ": cannot open: " + std::strerror(errno));
    struct stat st;
    if (::fstat(file->fd_, &st) != 0)
        throw IoError("[gguf] " + path + ": cannot stat: " + std::strerror(errno));
    if (!S_ISREG(st.st_mode)) throw IoError("[gguf] " + path + ": not a regular file");
    file->file_size_ = static_cast<uint64_t>(st.st_size);

    file->parse();

    if (map_data && file->file_size_ > 0) {
        void* m = ::mmap(nullptr, file->file_size_, PROT_READ, MAP_SHARED, file->fd_, 0);
        if (m == MAP_FAILED) {
            throw IoError("[gguf] " + path + ": mmap of " + std::to_string(file->file_size_) +
                          " bytes failed: " + std::strerror(errno));
        }
        file->mapping_ = static_cast<const uint8_t*>(m);
        file->guard_id_ = map_guard::guard(m, file->file_size_);
    }
    return file;
}

void GgufFile::check_mapping() const {
    for (size_t i = 0; i < n_shards(); ++i) {
        const GgufFile& f = shard(i);
        const uint64_t at = map_guard::fault_offset(f.guard_id_);
        if (at == map_guard::kNoFault) continue;
        throw IoError("[gguf] " + f.path_ + ": the mapped file could not be read at offset " + hex(at) +
                      " (mapped size " + std::to_string(f.file_size_) +
                      "): it was truncated or changed after it was opened, or the device failed; "
                      "reopen the model");
    }
}

GgufFile::~GgufFile() {
    map_guard::unguard(guard_id_);
    if (mapping_) ::munmap(const_cast<uint8_t*>(mapping_), file_size_);
    if (fd_ >= 0) ::close(fd_);
}

void GgufFile::parse() {
    HeaderReader r(fd_, file_size_, path_);

    const uint32_t magic = r.read_scalar<uint32_t>();
    if (magic != kGgufMagic) {
        r.fail("bad magic " + hex(magic) + " (expected " + hex(kGgufMagic) + ", \"GGUF\"): not a GGUF file");
    }
    version_ = r.read_scalar<uint32_t>();
    if (version_ == 1) {
        throw UnsupportedError("[gguf] " + path_ +
                               ": GGUF version 1 is not supported (only versions 2 and 3); "
                               "re-convert the model with a current converter");
    }
    if (version_ != 2 && version_ != 3) {
        // A big-endian file has its version byte-swapped; say so rather than "version 50331648".
        const uint32_t swapped = __builtin_bswap32(version_);
        if (swapped >= 1 && swapped <= 3) {
            throw UnsupportedError("[gguf] " + path_ + ": big-endian GGUF (version " +
                                   std::to_string(swapped) + ") is not supported");
        }
        throw UnsupportedError("[gguf] " + path_ + ": unknown GGUF version " + std::to_string(version_) +
                               " (supported: 2, 3)");
    }
    const uint64_t n_tensors = r.read_scalar<uint64_t>();
    const uint64_t n_kv = r.read_scalar<uint64_t>();
    if (n_kv > r.remaining() / kMinKvBytes) {
        r.fail("metadata count " + std::to_string(n_kv) + " cannot fit in the " +
               std::to_string(r.remaining()) + " bytes left after the header (each entry needs at least " +
               std::to_string(kMinKvBytes) + ")");
    }

    if (n_kv > kMaxKv) {
        r.fail("metadata count " + std::to_string(n_kv) + " exceeds the cap of " + std::to_string(kMaxKv) +
               " (real files hold fewer than 100 keys)");
    }
    r.charge(n_kv * (sizeof(kv_[0]) + 64), "the metadata table");  // + 64: the index entry
    kv_.reserve(n_kv);
    for (uint64_t i = 0; i < n_kv; ++i) {
        const std::string nth = std::to_string(i) + " of " + std::to_string(n_kv);
        r.set_context("metadata", "key " + nth);
        std::string key = r.read_string("key");
        r.set_context("metadata", "key " + nth + ", '" + printable(key) + "'");
        const uint32_t type_raw = r.read_scalar<uint32_t>();
        if (!is_known_value_type(type_raw)) r.fail_here("unknown value type " + std::to_string(type_raw));
        GgufValue value;
        read_value(r, static_cast<GgufValueType>(type_raw), value, 0);
        if (kv_index_.count(key)) r.fail("duplicate metadata key '" + printable(key) + "'");
        kv_index_.emplace(key, kv_.size());
        kv_.emplace_back(std::move(key), std::move(value));
    }

    if (const GgufValue* a = find("general.alignment")) {
        if (!a->is_integer() || a->type == GgufValueType::BOOL) {
            r.fail(std::string("general.alignment has type ") + gguf_value_type_name(a->type) +
                   ", expected an unsigned integer");
        }
        if (a->i <= 0 || !is_power_of_two(a->u())) {
            r.fail("general.alignment = " + std::to_string(a->i) + " is not a power of two");
        }
        alignment_ = a->u();
    } else {
        alignment_ = kDefaultAlignment;
    }

    r.set_context("tensor directory", "");
    if (n_tensors > r.remaining() / kMinTensorInfoBytes) {
        r.fail("tensor count " + std::to_string(n_tensors) + " cannot fit in the " +
               std::to_string(r.remaining()) + " bytes left after the metadata (each entry needs at least " +
               std::to_string(kMinTensorInfoBytes) + ")");
    }
    if (n_tensors > kMaxTensors) {
        r.fail("tensor count " + std::to_string(n_tensors) + " exceeds the cap of " +
               std::to_string(kMaxTensors));
    }
    r.charge(n_tensors * (sizeof(GgufTensor) + kMaxDims * sizeof(int64_t) + 64), "the tensor directory");
    tensors_.reserve(n_tensors);
    for (uint64_t i = 0; i < n_tensors; ++i) {
        const std::string nth = std::to_string(i) + " of " + std::to_string(n_tensors);
        r.set_context("tensor directory", "tensor " + nth);
        GgufTensor t;
        t.name = r.read_string("tensor name");
        if (t.name.empty()) r.fail_here("empty tensor name");
        r.set_context("tensor directory", "tensor " + nth + ", " + printable(t.name));
        const std::string who = "tensor " + printable(t.name);

        const uint32_t n_dims = r.read_scalar<uint32_t>();
        if (n_dims == 0 || n_dims > kMaxDims) {
            r.fail(who + ": n_dims = " + std::to_string(n_dims) + " (must be 1.." + std::to_string(kMaxDims) +
                   ")");
        }
        t.ne.resize(n_dims);
        int64_t n_elements = 1;
        for (uint32_t d = 0; d < n_dims; ++d) {
            const uint64_t ne = r.read_scalar<uint64_t>();
            if (ne == 0 || ne > static_cast<uint64_t>(INT64_MAX)) {
                r.fail(who + ": dimension " + std::to_string(d) + " = " + std::to_string(ne) +
                       " is not positive");
            }
            t.ne[d] = static_cast<int64_t>(ne);
            if (__builtin_mul_overflow(n_elements, t.ne[d], &n_elements)) {
                r.fail(who + ": element count overflows 64 bits");
            }
        }
        t.n_elements = n_elements;

        const uint32_t type_raw = r.read_scalar<uint32_t>();
        const GgmlTypeTraits& traits = ggml_type_traits(type_raw);
        if (traits.block_size == 0) {
            throw UnsupportedError("[gguf] " + path_ + ": " + who + " has unknown type id " +
                                   std::to_string(type_raw));
        }
        t.type = static_cast<GgmlType>(type_raw);
        if (t.ne[0] % traits.block_size != 0) {
            r.fail(who + ": row length " + std::to_string(t.ne[0]) + " is not a multiple of the " +
                   traits.name + " block size " + std::to_string(traits.block_size));
        }
        uint64_t nbytes = static_cast<uint64_t>(t.ne[0] / traits.block_size) * traits.type_size;
        for (uint32_t d = 1; d < n_dims; ++d) {
            if (__builtin_mul_overflow(nbytes, static_cast<uint64_t>(t.ne[d]), &nbytes)) {
                r.fail(who + ": byte size overflows 64 bits");
            }
        }
        t.nbytes = nbytes;
        t.offset = r.read_scalar<uint64_t>();
        if (t.offset % alignment_ != 0) {
            r.fail(who + ": data offset " + hex(t.offset) + " is not a multiple of the alignment " +
                   std::to_string(alignment_));
        }
        if (tensor_index_.count(t.name)) r.fail("duplicate tensor name '" + printable(t.name) + "'");
        tensor_index_.emplace(t.name, tensors_.size());
        tensors_.push_back(std::move(t));
    }

    // The data section starts at the next multiple of the alignment after the directory.
    const uint64_t end_of_header = r.pos();
    if (end_of_header > UINT64_MAX - (alignment_ - 1)) r.fail("data offset overflows 64 bits");
    data_offset_ = (end_of_header + alignment_ - 1) / alignment_ * alignment_;

    for (GgufTensor& t : tensors_) {
        uint64_t begin = 0, end = 0;
        if (__builtin_add_overflow(data_offset_, t.offset, &begin) ||
            __builtin_add_overflow(begin, t.nbytes, &end) || end > file_size_) {
            r.fail("tensor " + printable(t.name) + ": data [" + hex(data_offset_ + t.offset) + ", " +
                   hex(data_offset_ + t.offset + t.nbytes) + ") beyond end of file (size " +
                   std::to_string(file_size_) + ")");
        }
        t.file_offset = begin;
    }

    // Two tensors sharing bytes would silently alias each other's weights.
    std::vector<const GgufTensor*> by_offset;
    by_offset.reserve(tensors_.size());
    for (const GgufTensor& t : tensors_) by_offset.push_back(&t);
    std::sort(by_offset.begin(), by_offset.end(),
              [](const GgufTensor* a, const GgufTensor* b) { return a->offset < b->offset; });
    for (size_t i = 1; i < by_offset.size(); ++i) {
        const GgufTensor* prev = by_offset[i - 1];
        if (prev->offset + prev->nbytes > by_offset[i]->offset) {
            r.fail("tensor " + printable(by_offset[i]->name) + ": data at " + hex(by_offset[i]->file_offset) +
                   " overlaps tensor " + printable(prev->name) + " [" + hex(prev->file_offset) + ", " +
                   hex(prev->file_offset + prev->nbytes) + ")");
        }
    }
}

const GgufValue* GgufFile::find(const std::string& key) const {
    auto it = kv_index_.find(key);
    return it == kv_index_.end() ? nullptr : &kv_[it->second].second;
}

const GgufTensor* GgufFile::find_tensor(const std::string& name) const {
    auto it = tensor_index_.find(name);
    return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

namespace {

[[noreturn]] void wrong_type(const std::string& path, const std::string& key, const GgufValue& v,
                             const char* want) {
    throw FormatError("[gguf] " + path + ": metadata key '" + key + "' has type " +
                      gguf_value_type_name(v.type) + ", expected " + want);
}

}  // namespace

uint64_t GgufFile::get_uint(const std::string& key) const {
    if (!has(key)) throw MissingTensorError("[gguf] " + path_ + ": missing metadata key '" + key + "'");
    return get_uint_or(key, 0);
}

uint64_t GgufFile::get_uint_or(const std::string& key, uint64_t def) const {
    const GgufValue* v = find(key);
    if (!v) return def;
    if (!v->is_integer() || v->type == GgufValueType::BOOL) wrong_type(path_, key, *v, "an unsigned integer");
    const bool is_signed = v->type == GgufValueType::INT8 || v->type == GgufValueType::INT16 ||
                           v->type == GgufValueType::INT32 || v->type == GgufValueType::INT64;
    if (is_signed && v->i < 0) {
        throw FormatError("[gguf] " + path_ + ": metadata key '" + key + "' = " + std::to_string(v->i) +
                          " is negative, expected an unsigned integer");
    }
    return v->u();
}

double GgufFile::get_float_or(const std::string& key, double def) const {
    const GgufValue* v = find(key);
    if (!v) return def;
    if (v->is_float()) return v->f;
    if (v->is_integer() && v->type != GgufValueType::BOOL) {
        return v->type == GgufValueType::UINT64 ? static_cast<double>(v->u()) : static_cast<double>(v->i);
    }
    wrong_type(path_, key, *v, "a number");
}

bool GgufFile::get_bool_or(const std::string& key, bool def) const {
    const GgufValue* v = find(key);
    if (!v) return def;
    if (v->type != GgufValueType::BOOL) wrong_type(path_, key, *v, "bool");
    return v->i != 0;
}

std::string GgufFile::get_string(const std::string& key) const {
    if (!has(key)) throw MissingTensorError("[gguf] " + path_ + ": missing metadata key '" + key + "'");
    return get_string_or(key, "");
}

std::string GgufFile::get_string_or(const std::string& key, const std::string& def) const {
    const GgufValue* v = find(key);
    if (!v) return def;
    if (v->type != GgufValueType::STRING) wrong_type(path_, key, *v, "string");
    return v->str;
}

std::vector<uint64_t> GgufFile::get_uint_per_layer(const std::string& key, size_t n_layer,
                                                   uint64_t def) const {
    const GgufValue* v = find(key);
    if (!v) return std::vector<uint64_t>(n_layer, def);
    if (v->type != GgufValueType::ARRAY) return std::vector<uint64_t>(n_layer, get_uint_or(key, def));
    const bool integer_elems =
        v->array_type != GgufValueType::STRING && v->array_type != GgufValueType::ARRAY &&
        v->array_type != GgufValueType::FLOAT32 && v->array_type != GgufValueType::FLOAT64 &&
        v->array_type != GgufValueType::BOOL;
    if (!integer_elems) {
        throw FormatError("[gguf] " + path_ + ": metadata key '" + key + "' is an array of " +
                          gguf_value_type_name(v->array_type) + ", expected integers");
    }
    if (v->arr_int.size() != n_layer) {
        throw FormatError("[gguf] " + path_ + ": metadata key '" + key + "' has " +
                          std::to_string(v->arr_int.size()) + " values, expected one per layer (" +
                          std::to_string(n_layer) + ")");
    }
    std::vector<uint64_t> out;
    out.reserve(n_layer);
    for (int64_t x : v->arr_int) {
        if (x < 0 && v->array_type != GgufValueType::UINT64) {
            throw FormatError("[gguf] " + path_ + ": metadata key '" + key + "' holds a negative value");
        }
        out.push_back(static_cast<uint64_t>(x));
    }
    return out;
}

}  // namespace sharpi
