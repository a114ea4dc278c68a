// MapGuard: a SIGBUS on a guarded read-only file mapping becomes a typed IoError, not a dead process.
//
// Resident mode maps the GGUF file MAP_SHARED and computes straight from the mapping. When the file
// shrinks after it was opened (a download rewritten in place, `truncate`), or the device fails to
// read a page, the kernel answers the access with SIGBUS, whose default action kills the process.
// Reading the weights into memory instead would avoid that, at the price of a second copy of the
// model next to the page cache and of the lazy paging that lets a resident model larger than RAM
// run at all (the benchmarks' resident baseline of a 17 GiB model); so the mapping stays and the
// signal is handled:
//
// - guard() registers a mapping in a fixed table (kMaxGuarded entries, lock-free for the handler)
//   and installs a process-wide SIGBUS handler, chained to the handler it replaces (Python's
//   faulthandler under pytest, a sanitizer's): signals for any other address go there unchanged.
// - For an address inside a guarded mapping, the handler maps anonymous zero pages over the rest
//   of it from the faulting page on (MAP_FIXED; mmap is a plain system call, async-signal-safe),
//   records the file offset of the fault, and returns: the access is retried and reads zeros.
//   Zero weights are harmless to the arithmetic (quantized blocks with zero scales decode to zeros;
//   no index or length is read from weight bytes), so the computation finishes on garbage.
// - The caller checks fault_offset() after every forward pass (GgufFile::check_mapping()) and
//   throws IoError instead of returning what it computed: no wrong token reaches the user. The
//   mapping stays poisoned, so every later decode of that model raises the same error.
//
// Thread safety: guard() and unguard() take a mutex; the handler only reads the table's atomics and
// may run on any thread (compute threads touch the mapping). unguard() must only be called once no
// thread can access the mapping any more (the owner is being destroyed), then the owner unmaps it.
// Must never: allocate, lock or throw in the handler.
#pragma once

#include <cstdint>

namespace sharpi::map_guard {

constexpr int kMaxGuarded = 256;  // mappings guarded at once; more are left unguarded (see guard())
constexpr uint64_t kNoFault = ~uint64_t{0};

// Registers [base, base + bytes) (page-aligned base, as mmap returns). Returns the entry's id, or -1
// when the table is full or the handler cannot be installed (the mapping then works unguarded).
int guard(const void* base, uint64_t bytes);
// Forgets entry `id` (a no-op for -1).
void unguard(int id);
// Offset (from base) of the first page that faulted in entry `id`; kNoFault when none did.
uint64_t fault_offset(int id);

}  // namespace sharpi::map_guard
