/* LD_PRELOAD shim for the IO-fault tests (tests/test_io_faults.py): makes pread / pread64 / preadv /
 * preadv64 / preadv2 / preadv64v2 on one file fail or come back short at a chosen byte offset, at the
 * system-call boundary, so the readers' real error branches run (nothing in sharpi is told).
 *
 *   SHARPI_SHIM_PATH   the faulted file: a read is faulted only when /proc/self/fd/<fd> ends with it
 *   SHARPI_SHIM_FAULT  <what>@<offset>[x<count>|x*]: a read whose range covers <offset> fails with
 *                      errno <what> (EIO, EAGAIN, EINTR, ECANCELED) or, for `short`, returns only the
 *                      bytes before <offset> (half the request when it starts there); <count> reads
 *                      are faulted (default 1, `*` = all)
 *   SHARPI_SHIM_FROM   optional: reads that start before this offset are never faulted (the GGUF
 *                      header is read in 1 MiB windows from offset 0, which in a small file cover
 *                      the tensor data too)
 *   SHARPI_SHIM_LOG    optional: one line per injected fault is appended to this file
 *
 * Built by the test with `cc -shared -fPIC`; not part of sharpi. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>

static int shim_err; /* 0: short; else errno */
static pthread_once_t shim_once = PTHREAD_ONCE_INIT;
static uint64_t shim_offset;
static uint64_t shim_from;
static long shim_count; /* remaining; -1 = unlimited */
static const char* shim_path;

static void shim_parse(void) {
    const char* spec = getenv("SHARPI_SHIM_FAULT");
    shim_path = getenv("SHARPI_SHIM_PATH");
    const char* from = getenv("SHARPI_SHIM_FROM");
    if (from) shim_from = strtoull(from, NULL, 0);
    shim_count = 0;
    if (!spec || !shim_path) return;
    static const struct {
        const char* name;
        int err;
    } names[] = {{"short", 0}, {"EIO", EIO}, {"EAGAIN", EAGAIN}, {"EINTR", EINTR}, {"ECANCELED", ECANCELED}};
    const char* at = strchr(spec, '@');
    int known = 0;
    for (size_t i = 0; at && i < sizeof(names) / sizeof(names[0]); ++i) {
        if ((size_t)(at - spec) == strlen(names[i].name) && strncmp(spec, names[i].name, at - spec) == 0) {
            shim_err = names[i].err;
            known = 1;
        }
    }
    if (!known) {
        fprintf(stderr, "pread_shim: bad SHARPI_SHIM_FAULT '%s'\n", spec);
        abort();
    }
    char* end = NULL;
    shim_offset = strtoull(at + 1, &end, 0);
    shim_count = 1;
    if (*end == 'x') shim_count = end[1] == '*' ? -1 : strtol(end + 1, NULL, 10);
}

static int is_target(int fd) {
    char link[64], target[4096];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    const ssize_t n = readlink(link, target, sizeof target - 1);
    if (n <= 0) return 0;
    target[n] = '\0';
    const size_t lp = strlen(shim_path);
    return (size_t)n >= lp && strcmp(target + n - lp, shim_path) == 0;
}

static void shim_log(const char* what, uint64_t off, uint64_t len) {
    const char* log = getenv("SHARPI_SHIM_LOG");
    if (!log) return;
    const int fd = open(log, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0) return;
    char line[128];
    const int n = snprintf(line, sizeof line, "%s %llu %llu\n", what, (unsigned long long)off,
                           (unsigned long long)len);
    if (write(fd, line, (size_t)n) < 0) { /* best effort */
    }
    close(fd);
}

/* 0: read normally; -1: fail with errno set; > 0: read only this many bytes. */
static ssize_t shim_decide(int fd, uint64_t off, uint64_t len) {
    pthread_once(&shim_once, shim_parse);
    if (shim_count == 0 || len == 0 || off < shim_from || shim_offset < off || shim_offset >= off + len || !is_target(fd))
        return 0;
    const uint64_t before = shim_offset - off;
    long left = __atomic_load_n(&shim_count, __ATOMIC_SEQ_CST);
    for (;;) { /* take one fault, if any are left */
        if (left == 0) return 0;
        if (left < 0 || __atomic_compare_exchange_n(&shim_count, &left, left - 1, 0, __ATOMIC_SEQ_CST,
                                                    __ATOMIC_SEQ_CST))
            break;
    }
    shim_log(shim_err ? strerror(shim_err) : "short", off, len);
    if (shim_err) {
        errno = shim_err;
        return -1;
    }
    return before > 0 ? (ssize_t)before : (ssize_t)(len / 2 > 0 ? len / 2 : 1);
}

typedef ssize_t (*pread_fn)(int, void*, size_t, off_t);
typedef ssize_t (*preadv_fn)(int, const struct iovec*, int, off_t);
typedef ssize_t (*preadv2_fn)(int, const struct iovec*, int, off_t, int);

static ssize_t do_pread(const char* sym, int fd, void* buf, size_t count, off_t off) {
    static pread_fn real[2];
    const int which = sym[5] == '6';
    if (!real[which]) real[which] = (pread_fn)dlsym(RTLD_NEXT, sym);
    const ssize_t d = shim_decide(fd, (uint64_t)off, count);
    if (d < 0) return -1;
    return real[which](fd, buf, d > 0 ? (size_t)d : count, off);
}

ssize_t pread(int fd, void* buf, size_t count, off_t off) { return do_pread("pread", fd, buf, count, off); }
ssize_t pread64(int fd, void* buf, size_t count, off_t off) { return do_pread("pread64", fd, buf, count, off); }

/* The vector forms: the iovecs cut down to `d` bytes for a short read. */
static int cut_iov(const struct iovec* iov, int n, size_t d, struct iovec* out) {
    int k = 0;
    for (; k < n && k < 64 && d > 0; ++k) {
        out[k] = iov[k];
        if (out[k].iov_len > d) out[k].iov_len = d;
        d -= out[k].iov_len;
    }
    return k;
}

static size_t iov_total(const struct iovec* iov, int n) {
    size_t t = 0;
    for (int i = 0; i < n; ++i) t += iov[i].iov_len;
    return t;
}

static ssize_t do_preadv(const char* sym, int fd, const struct iovec* iov, int n, off_t off, int flags, int v2) {
    static void* real[4];
    const int which = (strstr(sym, "64") != NULL) + 2 * v2;
    if (!real[which]) real[which] = dlsym(RTLD_NEXT, sym);
    const ssize_t d = shim_decide(fd, (uint64_t)off, iov_total(iov, n));
    if (d < 0) return -1;
    struct iovec cut[64];
    if (d > 0) n = cut_iov(iov, n, (size_t)d, cut), iov = cut;
    return v2 ? ((preadv2_fn)real[which])(fd, iov, n, off, flags) : ((preadv_fn)real[which])(fd, iov, n, off);
}

ssize_t preadv(int fd, const struct iovec* iov, int n, off_t off) { return do_preadv("preadv", fd, iov, n, off, 0, 0); }
ssize_t preadv64(int fd, const struct iovec* iov, int n, off_t off) {
    return do_preadv("preadv64", fd, iov, n, off, 0, 0);
}
ssize_t preadv2(int fd, const struct iovec* iov, int n, off_t off, int flags) {
    return do_preadv("preadv2", fd, iov, n, off, flags, 1);
}
ssize_t preadv64v2(int fd, const struct iovec* iov, int n, off_t off, int flags) {
    return do_preadv("preadv64v2", fd, iov, n, off, flags, 1);
}
