// See map_guard.h.
#include "gguf/map_guard.h"

#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <mutex>

namespace sharpi::map_guard {

namespace {

struct Entry {
    std::atomic<uintptr_t> begin{0};  // 0: free
    std::atomic<uintptr_t> end{0};
    std::atomic<uint64_t> fault{kNoFault};
};

Entry g_entries[kMaxGuarded];
std::mutex g_mutex;           // guard() / unguard()
struct sigaction g_previous;  // the handler ours replaced; written under g_mutex before install
uintptr_t g_page = 4096;      // the page size, read once before the handler is installed

std::atomic<int> g_chaining{0};  // a chained handler is running (it may raise the signal again)

void chain(int sig, siginfo_t* info, void* context) {
    // A handler that re-raises the signal after restoring its own predecessor (Python's faulthandler
    // does, and that predecessor can be us again) must not bounce back and forth: die by default.
    if (g_chaining.exchange(1) != 0) {
        signal(sig, SIG_DFL);
        return;
    }
    struct Reset {
        ~Reset() { g_chaining.store(0); }
    } reset;
    if (g_previous.sa_flags & SA_SIGINFO) {
        if (g_previous.sa_sigaction != nullptr) {
            g_previous.sa_sigaction(sig, info, context);
            return;
        }
    } else if (g_previous.sa_handler != SIG_DFL && g_previous.sa_handler != SIG_IGN) {
        g_previous.sa_handler(sig);
        return;
    }
    // Default action: restore it; returning re-executes the access, which then kills as it would have.
    signal(sig, SIG_DFL);
}

void on_sigbus(int sig, siginfo_t* info, void* context) {
    // Only faults raised by the kernel for an access carry a meaningful si_addr (si_code > 0).
    const uintptr_t addr =
        info != nullptr && info->si_code > 0 ? reinterpret_cast<uintptr_t>(info->si_addr) : 0;
    for (Entry& e : g_entries) {
        const uintptr_t begin = e.begin.load(std::memory_order_acquire);
        const uintptr_t end = e.end.load(std::memory_order_acquire);
        if (addr == 0 || begin == 0 || addr < begin || addr >= end) continue;
        const uintptr_t from = addr & ~(g_page - 1);
        void* p = mmap(reinterpret_cast<void*>(from), end - from, PROT_READ,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
        if (p == MAP_FAILED) break;  // cannot repair: let the previous handler (or death) have it
        uint64_t expected = kNoFault;
        e.fault.compare_exchange_strong(expected, from - begin);
        return;
    }
    chain(sig, info, context);
}

// Under g_mutex: makes on_sigbus the SIGBUS handler unless it already is (something installed later,
// e.g. faulthandler.enable(), may have replaced it: it is then chained behind ours).
bool install() {
    struct sigaction current;
    if (sigaction(SIGBUS, nullptr, &current) != 0) return false;
    if ((current.sa_flags & SA_SIGINFO) && current.sa_sigaction == on_sigbus) return true;
    g_page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));  // sysconf is not async-signal-safe
    struct sigaction ours = {};
    ours.sa_sigaction = on_sigbus;
    ours.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
    sigemptyset(&ours.sa_mask);
    g_previous = current;
    if (sigaction(SIGBUS, &ours, nullptr) != 0) return false;
    return true;
}

}  // namespace

int guard(const void* base, uint64_t bytes) {
    std::lock_guard<std::mutex> lock(g_mutex);
    if (!install()) return -1;
    for (int i = 0; i < kMaxGuarded; ++i) {
        Entry& e = g_entries[i];
        if (e.begin.load() != 0) continue;
        e.fault.store(kNoFault);
        e.end.store(reinterpret_cast<uintptr_t>(base) + bytes, std::memory_order_release);
        e.begin.store(reinterpret_cast<uintptr_t>(base), std::memory_order_release);
        return i;
    }
    return -1;
}

void unguard(int id) {
    if (id < 0) return;
    std::lock_guard<std::mutex> lock(g_mutex);
    g_entries[id].begin.store(0, std::memory_order_release);
    g_entries[id].end.store(0, std::memory_order_release);
}

uint64_t fault_offset(int id) {
    return id < 0 ? kNoFault : g_entries[id].fault.load(std::memory_order_acquire);
}

}  // namespace sharpi::map_guard
