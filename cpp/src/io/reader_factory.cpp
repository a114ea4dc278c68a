// make_expert_reader: picks the reader for a file. "auto" tries io_uring + O_DIRECT first and falls
// back to pread when either is unavailable here (the pread reader's describe() then says why);
// "uring" (or "io_uring") turns that unavailability into UnsupportedError; "pread" never tries
// io_uring. "cufile" is an UnsupportedError saying why: the probe's reason (io/cufile_probe.h) without a
// device or libcufile, otherwise that cuFile fills VRAM slots and these are host-memory ones.
#include "io/cufile_probe.h"
#include "io/expert_reader.h"
#include "io/reader_common.h"
#include "sharpi/errors.h"

namespace sharpi {

ReaderKind parse_reader_kind(const std::string& name) {
    if (name == "auto") return ReaderKind::automatic;
    if (name == "io_uring" || name == "uring") return ReaderKind::io_uring;
    if (name == "pread") return ReaderKind::pread;
    if (name == "cufile") return ReaderKind::cufile;
    throw InvalidArgument("[io] unknown reader kind '" + name +
                          "' (expected 'auto', 'cufile', 'io_uring' (or 'uring') or 'pread')");
}

std::unique_ptr<ExpertReader> make_expert_reader(const std::string& kind,
                                                 const std::vector<std::string>& paths, uint8_t* arena,
                                                 uint64_t arena_bytes, const ReaderOptions& options) {
    const ReaderKind parsed = parse_reader_kind(kind);
    if (paths.empty()) throw InvalidArgument("[io] a reader needs at least one file");
    if (parsed == ReaderKind::pread) return io::open_pread_reader(paths, options, "");
    if (parsed == ReaderKind::cufile) {
        // cuFile reads into device memory; this factory serves the RAM tier, whose slots are host memory.
        const CufileProbe probe = probe_cufile();
        if (!probe.usable)
            throw UnsupportedError("[io] " + paths[0] + ": cuFile reader unavailable: " + probe.why);
        throw UnsupportedError(
            "[io] " + paths[0] + ": cuFile (" + probe.library +
            ") reads into VRAM slots; the reader of host-memory expert slots is io_uring or "
            "pread (--reader auto)");
    }
    std::string why;
    std::unique_ptr<ExpertReader> reader = io::open_uring_reader(paths, arena, arena_bytes, options, &why);
    if (reader) return reader;
    if (parsed == ReaderKind::io_uring)
        throw UnsupportedError("[io] " + paths[0] + ": io_uring reader unavailable: " + why);
    return io::open_pread_reader(paths, options, "io_uring unavailable: " + why);
}

std::unique_ptr<ExpertReader> make_expert_reader(const std::string& kind, const std::string& path,
                                                 uint8_t* arena, uint64_t arena_bytes,
                                                 const ReaderOptions& options) {
    return make_expert_reader(kind, std::vector<std::string>{path}, arena, arena_bytes, options);
}

std::unique_ptr<ExpertReader> make_expert_reader(const std::string& kind, const std::string& path,
                                                 uint8_t* arena, uint64_t arena_bytes) {
    return make_expert_reader(kind, path, arena, arena_bytes, ReaderOptions{});
}

bool uring_compiled() {
#if SHARPI_WITH_URING
    return true;
#else
    return false;
#endif
}

}  // namespace sharpi
