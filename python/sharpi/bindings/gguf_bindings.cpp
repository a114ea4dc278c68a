// sharpi._core.GgufFile: the C++ GGUF reader (sharpi/gguf.h GgufReader) seen from Python. Type
// conversion only; all validation (and every error message) lives in cpp/src/gguf/gguf_file.cpp.
//
// Metadata values become Python ints / floats / bools / str; arrays of strings become list[str],
// arrays of numbers become 1-D numpy arrays of the file's element type (uint8 ... float64, bool),
// and arrays of arrays become lists of those. Strings that are not valid UTF-8 are decoded with
// U+FFFD replacement characters rather than raising.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <string>

#include "bindings.h"
#include "sharpi/gguf.h"

namespace py = pybind11;

namespace sharpi::py_bindings {

namespace {

py::str to_py_str(const std::string& s) {
    PyObject* o = PyUnicode_DecodeUTF8(s.data(), static_cast<Py_ssize_t>(s.size()), "replace");
    if (!o) throw py::error_already_set();
    return py::reinterpret_steal<py::str>(o);
}

template <typename T, typename Src>
py::array numbers_to_numpy(const std::vector<Src>& values) {
    py::array_t<T> out(static_cast<py::ssize_t>(values.size()));
    T* dst = out.mutable_data();
    for (size_t i = 0; i < values.size(); ++i) dst[i] = static_cast<T>(values[i]);
    return std::move(out);
}

py::object array_to_py(const GgufValue& v);

py::object value_to_py(const GgufValue& v) {
    switch (v.type) {
        case GgufValueType::UINT64:
            return py::int_(v.u());
        case GgufValueType::UINT8:
        case GgufValueType::INT8:
        case GgufValueType::UINT16:
        case GgufValueType::INT16:
        case GgufValueType::UINT32:
        case GgufValueType::INT32:
        case GgufValueType::INT64:
            return py::int_(v.i);
        case GgufValueType::BOOL:
            return py::bool_(v.i != 0);
        case GgufValueType::FLOAT32:
        case GgufValueType::FLOAT64:
            return py::float_(v.f);
        case GgufValueType::STRING:
            return to_py_str(v.str);
        case GgufValueType::ARRAY:
            return array_to_py(v);
    }
    return py::none();
}

py::object array_to_py(const GgufValue& v) {
    switch (v.array_type) {
        case GgufValueType::STRING: {
            py::list out(v.arr_str.size());
            for (size_t i = 0; i < v.arr_str.size(); ++i) out[i] = to_py_str(v.arr_str[i]);
            return std::move(out);
        }
        case GgufValueType::ARRAY: {
            py::list out(v.arr_nested.size());
            for (size_t i = 0; i < v.arr_nested.size(); ++i) out[i] = array_to_py(v.arr_nested[i]);
            return std::move(out);
        }
        case GgufValueType::UINT8:
            return numbers_to_numpy<uint8_t>(v.arr_int);
        case GgufValueType::INT8:
            return numbers_to_numpy<int8_t>(v.arr_int);
        case GgufValueType::UINT16:
            return numbers_to_numpy<uint16_t>(v.arr_int);
        case GgufValueType::INT16:
            return numbers_to_numpy<int16_t>(v.arr_int);
        case GgufValueType::UINT32:
            return numbers_to_numpy<uint32_t>(v.arr_int);
        case GgufValueType::INT32:
            return numbers_to_numpy<int32_t>(v.arr_int);
        case GgufValueType::UINT64:
            return numbers_to_numpy<uint64_t>(v.arr_int);  // bit-for-bit
        case GgufValueType::INT64:
            return numbers_to_numpy<int64_t>(v.arr_int);
        case GgufValueType::BOOL:
            return numbers_to_numpy<bool>(v.arr_int);
        case GgufValueType::FLOAT32:
            return numbers_to_numpy<float>(v.arr_float);
        case GgufValueType::FLOAT64:
            return numbers_to_numpy<double>(v.arr_float);
    }
    return py::none();
}

std::string type_description(const GgufValue& v) {
    if (v.type != GgufValueType::ARRAY) return gguf_value_type_name(v.type);
    return std::string("array[") + gguf_value_type_name(v.array_type) + "]";
}

py::dict tensor_to_py(const GgufTensorInfo& t) {
    py::dict d;
    d["name"] = to_py_str(t.name);
    d["type"] = t.type;
    d["type_name"] = t.type_name;
    py::list shape;
    for (int64_t ne : t.shape) shape.append(ne);
    d["shape"] = shape;
    d["n_elements"] = t.n_elements;
    d["offset"] = t.offset;
    d["file_offset"] = t.file_offset;
    d["nbytes"] = t.nbytes;
    d["shard"] = t.shard;
    return d;
}

}  // namespace

void bind_gguf(py::module_& m) {
    py::class_<GgufReader>(m, "GgufFile", R"doc(
A GGUF v2/v3 file: metadata, tensor directory and (by default) a read-only mapping of the data.
`path` may name any shard of a split model (NAME-0000i-of-0000K.gguf): all shards are opened and
checked; `shards` lists them and each tensor names its shard. path/file_size/data_offset/version are
the first shard's.

GgufFile(path, map_data=True). Raises FormatError (malformed / truncated / out of bounds),
UnsupportedError (GGUF v1, big-endian, unknown tensor type id) or IoError (cannot open / read).
)doc")
        .def(py::init([](const py::object& path, bool map_data) {
                 const std::string p = py::str(py::module_::import("os").attr("fspath")(path));
                 py::gil_scoped_release release;
                 return std::make_unique<GgufReader>(p, map_data);
             }),
             py::arg("path"), py::arg("map_data") = true)
        .def_property_readonly("path", &GgufReader::path)
        .def_property_readonly("version", &GgufReader::version)
        .def_property_readonly("alignment", &GgufReader::alignment)
        .def_property_readonly("data_offset", &GgufReader::data_offset)
        .def_property_readonly("file_size", &GgufReader::file_size)
        .def_property_readonly("is_mapped", &GgufReader::is_mapped)
        .def_property_readonly(
            "shards",
            [](const GgufReader& f) {
                py::list out;
                for (const GgufShardInfo& s : f.shards()) {
                    py::dict d;
                    d["path"] = s.path;
                    d["file_size"] = s.file_size;
                    d["data_offset"] = s.data_offset;
                    d["n_tensors"] = s.n_tensors;
                    out.append(d);
                }
                return out;
            },
            "The model's files in shard order (one for a one-file model): dicts {path, file_size, "
            "data_offset, n_tensors}")
        .def(
            "metadata",
            [](const GgufReader& f) {
                py::dict d;
                for (const auto& [key, value] : f.metadata()) d[to_py_str(key)] = value_to_py(value);
                return d;
            },
            "All metadata as a dict in file order (numeric arrays as numpy arrays, string arrays as lists)")
        .def(
            "metadata_types",
            [](const GgufReader& f) {
                py::dict d;
                for (const auto& [key, value] : f.metadata()) d[to_py_str(key)] = type_description(value);
                return d;
            },
            "GGUF value type of each key: 'uint32', 'string', 'array[string]', ...")
        .def(
            "tensors",
            [](const GgufReader& f) {
                py::list out;
                for (const GgufTensorInfo& t : f.tensors()) out.append(tensor_to_py(t));
                return out;
            },
            "Tensor directory in file order: dicts {name, type, type_name, shape (ggml order, ne[0] first), "
            "n_elements, offset (in the data section), file_offset (in its shard's file), nbytes, shard}")
        .def(
            "tensor",
            [](const GgufReader& f, const std::string& name) { return tensor_to_py(f.tensor(name)); },
            py::arg("name"), "One tensor's directory entry; MissingTensorError when absent")
        .def(
            "has_tensor",
            [](const GgufReader& f, const std::string& name) { return f.find_tensor(name) != nullptr; },
            py::arg("name"))
        .def(
            "tensor_bytes",
            [](const py::object& self, const std::string& name, bool copy) -> py::array {
                const GgufReader& f = self.cast<const GgufReader&>();
                const GgufTensorInfo& t = f.tensor(name);
                const auto n = static_cast<py::ssize_t>(t.nbytes);
                if (!copy && f.is_mapped()) {
                    // Read-only view into the mapping; the array keeps the GgufFile alive.
                    py::array_t<uint8_t> view({n}, {static_cast<py::ssize_t>(1)}, f.tensor_data(t), self);
                    view.attr("setflags")(py::arg("write") = false);
                    return std::move(view);
                }
                py::array_t<uint8_t> out(n);
                uint8_t* dst = out.mutable_data();
                py::gil_scoped_release release;
                f.read_tensor(t, dst);
                return std::move(out);
            },
            py::arg("name"), py::arg("copy") = true,
            "The tensor's raw bytes as a uint8 numpy array (copy=False: a read-only view of the mapping)")
        .def(
            "expert_range",
            [](const GgufReader& f, const std::string& name, int64_t expert) {
                const auto [offset, bytes] = f.expert_range(f.tensor(name), expert);
                return py::make_tuple(offset, bytes);
            },
            py::arg("name"), py::arg("expert"),
            "(file_offset, nbytes) of one expert's slice of an expert-stacked (3-D) tensor, in the file "
            "of the tensor's shard")
        .def("get_uint_per_layer", &GgufReader::get_uint_per_layer, py::arg("key"), py::arg("n_layer"),
             py::arg("default") = 0,
             "A scalar or per-layer integer key as n_layer values (llama.cpp get_key_or_arr)")
        .def("__repr__", [](const GgufReader& f) {
            const size_t n_shards = f.shards().size();
            return "<GgufFile '" + f.path() + "' v" + std::to_string(f.version()) + ", " +
                   std::to_string(f.metadata().size()) + " keys, " + std::to_string(f.tensors().size()) +
                   " tensors" + (n_shards > 1 ? ", " + std::to_string(n_shards) + " shards" : "") + ">";
        });
}

}  // namespace sharpi::py_bindings
