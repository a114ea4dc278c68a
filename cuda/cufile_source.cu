// cuFile (GPUDirect Storage) as the VRAM tier's fill source (fill_source.cuh, docs/design.md §5, §10): each
// fill is one cuFileReadAsync of the expert's aligned span from the file straight into its VRAM slot,
// queued on the copy stream, so the StreamFiller's event after it orders compute exactly as a copy's
// does. With the nvidia-fs driver the bytes go NVMe -> VRAM by DMA; without it cuFile runs in its
// compatibility mode (POSIX reads through its own pinned bounce buffers), same bytes, slower.
//
// libcufile is never linked: it is dlopen'ed (the library io/cufile_probe.h found) the first time a
// source opens, with the signatures checked against cufile.h at build time (CMake finds the header in
// the CUDA toolkit or the nvidia-cufile wheel; a build without it refuses --reader cufile, saying so).
// The driver is opened once per process and left open (cuFile keeps it per process, not per file).
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "fill_source.cuh"
#include "io/cufile_probe.h"
#include "sharpi/errors.h"

#if defined(SHARPI_HAVE_CUFILE_H)
#include <cufile.h>
#include <dlfcn.h>

#include <mutex>
#endif

namespace sharpi::cuda {
namespace {

// GPUDirect Storage proper needs the nvidia-fs kernel driver, which publishes this directory.
bool nvidia_fs_loaded() {
    return ::access("/proc/driver/nvidia-fs", F_OK) == 0;
}

}  // namespace

CufileChoice choose_cufile_for_auto() {
    CufileChoice c;
    const CufileProbe probe = probe_cufile();
    if (!probe.usable) {
        c.why = "cuFile not used: " + probe.why + "; the VRAM tier copies from the pinned mapping";
        return c;
    }
#if !defined(SHARPI_HAVE_CUFILE_H)
    c.why = "cuFile not used: this build has no cufile.h; the VRAM tier copies from the pinned mapping";
#else
    if (!nvidia_fs_loaded()) {
        c.why = "cuFile (" + probe.library +
                ") not used: the nvidia-fs driver is not loaded, so it would run in compatibility mode "
                "(POSIX reads through bounce buffers); the VRAM tier copies from the pinned mapping "
                "(--reader cufile uses cuFile anyway)";
        return c;
    }
    c.use = true;
    c.why = "cuFile (" + probe.library + ") with GPUDirect Storage (nvidia-fs loaded)";
#endif
    return c;
}

#if !defined(SHARPI_HAVE_CUFILE_H)

std::unique_ptr<FillSource> cufile_source(const std::vector<std::string>& files) {
    const CufileProbe probe = probe_cufile();
    const std::string path = files.empty() ? std::string("(no file)") : files[0];
    if (!probe.usable)
        throw UnsupportedError("[cufile] " + path + ": cuFile reader unavailable: " + probe.why);
    throw UnsupportedError(
        "[cufile] " + path +
        ": this build of sharpi has no cufile.h (pip install nvidia-cufile, then rebuild)");
}

#else

namespace {

std::string cufile_error(CUfileError_t e) {
    std::string s = cufileop_status_error(e.err);
    if (e.err == CU_FILE_CUDA_DRIVER_ERROR) s += " (CUDA driver error " + std::to_string(e.cu_err) + ")";
    return s;
}

// The entry points this source calls, resolved once from the library the probe found.
struct CufileApi {
    std::string library;
    decltype(&cuFileDriverOpen) driver_open = nullptr;
    decltype(&cuFileHandleRegister) handle_register = nullptr;
    decltype(&cuFileHandleDeregister) handle_deregister = nullptr;
    decltype(&cuFileReadAsync) read_async = nullptr;
    bool vanilla_posix = false;  // cuFile's POSIX path with its GPUDirect file checks skipped (no nvidia-fs)
    std::string
        error;  // why the library cannot be used; empty when every entry resolved and the driver opened
};

// CUFILE_PARAM_PROPERTIES_POSIX_IO_MODE of cufile.h since GDS 1.16 (the enum only grows). By value:
// older headers (CUDA 13.0's toolkit) lack the name; a library that does not know it refuses the set.
constexpr auto kPosixIoMode = static_cast<CUFileBoolConfigParameter_t>(12);

template <typename Fn>
bool resolve(void* lib, const char* name, Fn* out, std::string* error) {
    *out = reinterpret_cast<Fn>(::dlsym(lib, name));
    if (*out == nullptr && error->empty()) *error = std::string("it does not export ") + name;
    return *out != nullptr;
}

// The first caller's library is loaded for the process's life (cufile_source refuses another).
const CufileApi& cufile_api(const std::string& library) {
    static std::once_flag once;
    static CufileApi api;
    std::call_once(once, [&library] {
        api.library = library;
        void* lib = ::dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL);  // kept for the process's life
        if (lib == nullptr) {
            const char* e = ::dlerror();
            api.error = e != nullptr ? e : "dlopen failed";
            return;
        }
        resolve(lib, "cuFileDriverOpen", &api.driver_open, &api.error);
        resolve(lib, "cuFileHandleRegister", &api.handle_register, &api.error);
        resolve(lib, "cuFileHandleDeregister", &api.handle_deregister, &api.error);
        resolve(lib, "cuFileReadAsync", &api.read_async, &api.error);
        if (!api.error.empty()) return;
        // Without nvidia-fs there is no GPUDirect path, only cuFile's POSIX one; its default
        // compatibility mode still runs the GDS file checks at registration, which read the block
        // device's udev properties and refuse every file where there is no udev database (VMs and
        // containers: "unable to get volume attributes"). Vanilla POSIX mode skips those checks.
        // A parameter set before the driver opens; libraries older than cuFileSetParameterBool
        // keep their default.
        if (!nvidia_fs_loaded()) {
            decltype(&cuFileSetParameterBool) set_bool = nullptr;
            std::string unused;
            if (resolve(lib, "cuFileSetParameterBool", &set_bool, &unused) &&
                set_bool(kPosixIoMode, true).err == CU_FILE_SUCCESS) {
                api.vanilla_posix = true;
            }
        }
        const CUfileError_t e = api.driver_open();
        if (e.err != CU_FILE_SUCCESS) api.error = "cuFileDriverOpen: " + cufile_error(e);
    });
    return api;
}

// One fill's arguments: cuFileReadAsync reads them through pointers when the stream reaches the read
// and writes bytes_read back, so they live until the fill's event completed.
struct CufileRead final : FillState {
    size_t size = 0;
    off_t file_offset = 0;
    off_t buffer_offset = 0;
    ssize_t bytes_read = 0;
    uint64_t wanted = 0;  // bytes up to the end of the requested range
};

struct CufileFile {
    std::string path;
    int fd = -1;
    CUfileHandle_t handle = nullptr;
    uint64_t size = 0;
    bool direct = false;
};

class CufileSource final : public FillSource {
  public:
    CufileSource(const CufileApi& api, const std::vector<std::string>& paths) : api_(api) {
        try {
            for (const std::string& path : paths) open_file(path);
        } catch (...) {
            close_files();
            throw;
        }
    }
    ~CufileSource() override { close_files(); }

    const char* name() const override { return "cufile"; }
    std::string describe() const override {
        const bool direct =
            std::all_of(files_.begin(), files_.end(), [](const CufileFile& f) { return f.direct; });
        const std::string mode =
            nvidia_fs_loaded() ? std::string("GPUDirect Storage (nvidia-fs loaded)")
            : api_.vanilla_posix
                ? std::string(
                      "vanilla POSIX mode (nvidia-fs not loaded: POSIX reads through cuFile's bounce "
                      "buffers, GDS file checks skipped)")
                : std::string(
                      "compatibility mode (nvidia-fs not loaded: POSIX reads through cuFile's bounce "
                      "buffers)");
        return "cufile (" + api_.library + "): cuFileReadAsync into VRAM slots on the copy stream, " + mode +
               ", files opened " + (direct ? "O_DIRECT" : "through the page cache");
    }
    std::unique_ptr<FillState> enqueue(const ReadRequest& r, cudaStream_t stream) override {
        if (r.file >= files_.size() || r.offset + r.length > files_[r.file].size) {
            throw InvalidArgument("[cufile] read request [" + std::to_string(r.offset) + ", +" +
                                  std::to_string(r.length) + ") of file " + std::to_string(r.file) +
                                  " is outside the files");
        }
        const CufileFile& f = files_[r.file];
        // The aligned span (the reader contract: the wanted bytes land at buffer + offset % kAlignment),
        // cut at the end of the file.
        auto st = std::make_unique<CufileRead>();
        const uint64_t head = r.offset % ExpertReader::kAlignment;
        const uint64_t start = r.offset - head;
        st->file_offset = static_cast<off_t>(start);
        st->size =
            static_cast<size_t>(std::min(ExpertReader::aligned_span(r.offset, r.length), f.size - start));
        st->wanted = head + r.length;
        const CUfileError_t e = api_.read_async(f.handle, r.buffer, &st->size, &st->file_offset,
                                                &st->buffer_offset, &st->bytes_read, stream);
        if (e.err != CU_FILE_SUCCESS) {
            throw DeviceError("[cufile] " + f.path + ": cuFileReadAsync of [" + std::to_string(start) +
                              ", +" + std::to_string(st->size) + "): " + cufile_error(e));
        }
        return st;
    }
    std::string check(const ReadRequest& r, const FillState* state) const override {
        const auto* st = static_cast<const CufileRead*>(state);
        const std::string where =
            files_[r.file].path + " [" + std::to_string(r.offset) + ", +" + std::to_string(r.length) + ")";
        if (st->bytes_read < 0) {
            const std::string why =
                st->bytes_read == -1
                    ? std::string("a file system error")
                    : std::string(cufileop_status_error(static_cast<CUfileOpError>(-st->bytes_read)));
            return "[cufile] read of " + where + " failed: " + why;
        }
        if (static_cast<uint64_t>(st->bytes_read) < st->wanted) {
            return "[cufile] short read of " + where + ": " + std::to_string(st->bytes_read) + " of " +
                   std::to_string(st->wanted) + " bytes";
        }
        return "";
    }

  private:
    void open_file(const std::string& path) {
        // O_DIRECT first (GPUDirect Storage needs it); where the file system refuses O_DIRECT or
        // cuFile refuses the descriptor, the file opened through the page cache (compatibility mode).
        std::string refused;
        for (const bool direct : {true, false}) {
            CufileFile f;
            f.path = path;
            f.direct = direct;
            f.fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | (direct ? O_DIRECT : 0));
            if (f.fd < 0) {
                if (direct && errno == EINVAL) continue;  // no O_DIRECT here (tmpfs)
                throw IoError("[cufile] " + path + ": " + std::strerror(errno));
            }
            struct stat st{};
            if (::fstat(f.fd, &st) != 0) {
                const int err = errno;
                ::close(f.fd);
                throw IoError("[cufile] " + path + ": " + std::strerror(err));
            }
            f.size = static_cast<uint64_t>(st.st_size);
            CUfileDescr_t descr{};
            descr.type = CU_FILE_HANDLE_TYPE_OPAQUE_FD;
            descr.handle.fd = f.fd;
            const CUfileError_t e = api_.handle_register(&f.handle, &descr);
            if (e.err == CU_FILE_SUCCESS) {
                files_.push_back(std::move(f));
                return;
            }
            ::close(f.fd);
            refused += std::string(refused.empty() ? "" : "; ") + (direct ? "O_DIRECT: " : "buffered: ") +
                       cufile_error(e);
        }
        std::string hint;
        if (!nvidia_fs_loaded() && !api_.vanilla_posix) {
            // Seen on a VM (session 33): compatibility mode's registration runs GPUDirect file checks
            // that read the block device's udev properties, and refuses every file where they are missing.
            hint =
                "; without nvidia-fs, cuFile's registration checks need the block device's udev "
                "properties (missing in VMs and containers), and this libcufile did not accept vanilla "
                "POSIX mode, which skips them (nvidia-cufile 1.20 has it)";
        }
        throw DeviceError("[cufile] " + path + ": cuFileHandleRegister refused the file (" + refused + ")" +
                          hint);
    }
    void close_files() {
        for (CufileFile& f : files_) {
            api_.handle_deregister(f.handle);
            ::close(f.fd);
        }
        files_.clear();
    }

    const CufileApi& api_;
    std::vector<CufileFile> files_;
};

}  // namespace

std::unique_ptr<FillSource> cufile_source(const std::vector<std::string>& files) {
    const CufileProbe probe = probe_cufile();
    const std::string path = files.empty() ? std::string("(no file)") : files[0];
    if (!probe.usable)
        throw UnsupportedError("[cufile] " + path + ": cuFile reader unavailable: " + probe.why);
    const CufileApi& api = cufile_api(probe.library);
    // One libcufile per process: its driver is opened once and never closed, so a later change of
    // SHARPI_CUFILE_LIB cannot take effect here; say so rather than read through the other library.
    if (api.library != probe.library) {
        throw UnsupportedError("[cufile] " + path + ": this process already loaded " + api.library +
                               "; the library " + probe.library + " takes effect in a new process");
    }
    if (!api.error.empty()) throw DeviceError("[cufile] " + path + ": " + api.library + ": " + api.error);
    return std::make_unique<CufileSource>(api, files);
}

#endif

}  // namespace sharpi::cuda
