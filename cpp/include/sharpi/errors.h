// Typed errors. Every failure the user can cause (bad file, bad option, overflow) is one of these,
// with a message that names the thing at fault: "[gguf] model.gguf: tensor blk.3.ffn_up_exps: ...".
// The Python bindings map each class to an exception of the same name under sharpi.
#pragma once

#include <stdexcept>
#include <string>

namespace sharpi {

class Error : public std::runtime_error {
  public:
    explicit Error(const std::string& what) : std::runtime_error(what) {}
};

// Malformed or truncated GGUF: bad magic, unsupported version, data out of bounds, bad metadata.
class FormatError : public Error {
    using Error::Error;
};

// Well-formed input that sharpi does not handle: unknown architecture, unsupported quant type.
class UnsupportedError : public Error {
    using Error::Error;
};

// A tensor or metadata key the architecture requires is absent or has the wrong shape.
class MissingTensorError : public FormatError {
    using FormatError::FormatError;
};

// Reading the file failed (open, mmap, EIO, short read that cannot be resumed).
class IoError : public Error {
    using Error::Error;
};

// Invalid option or argument: sampling values out of range, n_ctx <= 0, bad token id, impossible budget.
class InvalidArgument : public Error {
    using Error::Error;
};

// decode() would need more positions than the context holds.
class ContextOverflowError : public Error {
    using Error::Error;
};

// Session::cancel() stopped a decode() (between layers, prefill chunks or expert waves). Nothing
// of the cancelled call was appended: the session is usable at its old position.
class CancelledError : public Error {
    using Error::Error;
};

// The GPU failed or is absent where one was asked for: no CUDA device, device memory exhausted,
// a kernel launch or copy that returned an error. The message carries the CUDA error string.
class DeviceError : public Error {
    using Error::Error;
};

}  // namespace sharpi
