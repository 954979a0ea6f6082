// O_DIRECT is a Linux open flag outside POSIX
#define _GNU_SOURCE
#include "flash/bundle_io.h"
#include "ggml-pi2.h"
#include "flash/io_ring.h"
#include "core/pi2_log.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sched.h>
#include <sys/stat.h>
#include <unistd.h>

#define PI2_IO_MAX_THREADS 64
// Queued batches: a layer's request and the next layer's two prefetches at most, but an MoE layer reads ahead a batch
// per routed expert and fills the queue; the submitter then spins in sched_yield until an I/O thread takes a batch
// (12% of the CPU of SmallThinker-shaped flash decode). That wait also holds read-ahead back so a pair's own misses
// do not queue behind it: 256 batches with a condition variable decoded 8-10% slower, 8 with a condition variable
// 7% (2026-11-26).
#define PI2_IO_MAX_BATCHES 8

struct pi2_io_batch {
    struct pi2_io_req * reqs;
    int                 n, next; // requests, and the first one no thread has taken
};

// a request the ring is reading: its merged iovecs live here until the kernel has taken them
struct pi2_ring_slot {
    const struct pi2_io_req * r;
    size_t                    bytes;
    int                       err;         // an injected fault (testing), or the ring's failure
    bool                      short_calls; // testing: read with short preadv calls instead
    char                      why[256];
    struct iovec              iov[PI2_IO_MAX_RUN];
};

struct pi2_bundle_file {
    char *          path;
    int             fd;        // O_DIRECT when `direct`, else buffered
    int             fd_plain;  // buffered, for reads O_DIRECT refuses (EINVAL)
    atomic_bool     direct;
    struct stat     st0;       // at open: size and mtime a changed file no longer has
    pi2_io_done_fn  done;
    void *          done_ctx;

    pthread_mutex_t     lock;
    pthread_cond_t      wake;
    struct pi2_io_batch queue[PI2_IO_MAX_BATCHES]; // FIFO: batches are read in the order submitted
    int                 head, n_batches;
    size_t              in_flight, in_flight_max; // bytes being read, and the most a thread starts more at
    bool                stop;
    pthread_t           threads[PI2_IO_MAX_THREADS];
    int                 n_threads;

    // with io_uring (all under `lock`): submitters move requests into the ring's `depth` slots themselves
    // (pi2_ring_pump); one thread (threads[0]) takes completions and refills it
    struct pi2_ring *      ring;
    bool                   ring_ok;        // false once io_uring_enter failed
    int                    depth;
    struct pi2_ring_slot * slots;
    int *                  free_slots, n_free;
    int *                  unsent;         // slots queued in the ring by one pump, until submitted
    int *                  sync, n_sync;   // slots the ring's thread finishes without the ring
    int *                  sync_k;         // the ring's thread's copies: of sync, and of the completions
    int *                  done_k;         // it takes (slot and result)
    int32_t *              done_res;
    int                    busy;           // slots the kernel is reading
    size_t                 ring_in_flight; // bytes of the slots taken from the queue and not finished

    atomic_int_fast64_t  fault_after;
    atomic_int           fault_err;
    atomic_int_fast64_t  short_left; // testing: requests still to be read by short preadv calls
};

static int pi2_stat_changed(const struct stat * a, const struct stat * b) {
    // (an fd keeps its inode: a sidecar replaced by rename is still read whole from the old file)
    return a->st_size != b->st_size || a->st_mtim.tv_sec != b->st_mtim.tv_sec || a->st_mtim.tv_nsec != b->st_mtim.tv_nsec;
}

int pi2_bundle_file_check(struct pi2_bundle_file * f, char * err, size_t errlen) {
    struct stat st;
    if (fstat(f->fd_plain, &st) != 0) {
        snprintf(err, errlen, "sidecar %s: fstat failed: %s", f->path, strerror(errno));
        return -1;
    }
    if (pi2_stat_changed(&st, &f->st0)) {
        snprintf(err, errlen, "sidecar %s changed on disk while the model was running (size %lld, was %lld); "
                 "reload the model", f->path, (long long) st.st_size, (long long) f->st0.st_size);
        return -1;
    }
    return 0;
}

// preadv until every iovec is full (retrying EINTR and short reads): 0, an errno, or PI2_READ_EOF when
// the file ends first; *got counts the bytes read either way. max_call > 0 (testing) asks each preadv for
// at most that many bytes of one iovec, so every call returns short as a network file system's may.
static int pi2_preadv_full(int fd, struct iovec * iov, int n, uint64_t off, size_t * got, size_t max_call) {
    *got = 0;
    int k = 0;
    while (k < n && iov[k].iov_len == 0) { // nothing to read there: not an end of file
        k++;
    }
    while (k < n) {
        struct iovec one = iov[k];
        if (max_call > 0 && one.iov_len > max_call) {
            one.iov_len = max_call;
        }
        const ssize_t r = max_call > 0 ? preadv(fd, &one, 1, (off_t) (off + *got))
                                       : preadv(fd, iov + k, n - k, (off_t) (off + *got));
        if (r < 0) {
            if (errno == EINTR) {
                continue;
            }
            return errno;
        }
        if (r == 0) {
            return PI2_READ_EOF;
        }
        *got += (size_t) r;
        size_t left = (size_t) r;
        while (k < n && left >= iov[k].iov_len) { // a partial read: resume inside the iovec it stopped in
            left -= iov[k].iov_len;
            k++;
        }
        if (left > 0) {
            iov[k].iov_base = (char *) iov[k].iov_base + left;
            iov[k].iov_len -= left;
        }
    }
    return 0;
}

int pi2_read_exact(int fd, void * dst, size_t n, uint64_t off) {
    struct iovec iov = { .iov_base = dst, .iov_len = n };
    size_t got;
    return pi2_preadv_full(fd, &iov, 1, off, &got, 0);
}

// the request's iovecs into iov, those that continue the previous one in memory merged into it: entries
// of consecutive slots are mostly neighbours in the cache (its clock hands them out in order), and the
// kernel pins each iovec's pages separately (that pinning was the largest CPU cost of a read). Returns
// the count.
static int pi2_merged_iov(const struct pi2_io_req * r, struct iovec * iov) {
    int m = 0;
    for (int k = 0; k < r->n; ++k) {
        const struct iovec v = r->iov[k];
        if (m > 0 && (char *) iov[m - 1].iov_base + iov[m - 1].iov_len == (char *) v.iov_base) {
            iov[m - 1].iov_len += v.iov_len;
        } else {
            iov[m++] = v;
        }
    }
    return m;
}

// testing: the errno this request is to fail with (0: none), with why
static int pi2_injected_fault(struct pi2_bundle_file * f, const struct pi2_io_req * r, size_t total, char * why, size_t whylen) {
    const int64_t left = atomic_fetch_sub(&f->fault_after, 1);
    const int inject = atomic_load(&f->fault_err);
    if (inject != 0 && left == 0) {
        atomic_store(&f->fault_err, 0);
        snprintf(why, whylen, "sidecar %s: read of %zu bytes at offset %llu failed: %s (injected)", f->path, total,
                 (unsigned long long) r->offset, strerror(inject));
        return inject;
    }
    return 0;
}

// testing: whether this request is read by short preadv calls (of 512 bytes: a sector, so O_DIRECT takes each)
static bool pi2_short_reads(struct pi2_bundle_file * f) {
    return atomic_load(&f->short_left) > 0 && atomic_fetch_sub(&f->short_left, 1) > 0;
}

// one request of `total` bytes (its iovecs' lengths) into its iovecs on this thread: O_DIRECT, falling back
// to buffered where the filesystem refuses
static int pi2_read_sync(struct pi2_bundle_file * f, const struct pi2_io_req * r, size_t total, bool short_calls,
                         char * why, size_t whylen) {
    struct iovec iov[PI2_IO_MAX_RUN];
    const int m = pi2_merged_iov(r, iov);
    const size_t max_call = short_calls ? 512 : 0;
    size_t got = 0;
    const bool direct = atomic_load(&f->direct);
    int e = pi2_preadv_full(direct ? f->fd : f->fd_plain, iov, m, r->offset, &got, max_call);
    if (e == EINVAL && direct) {
        if (atomic_exchange(&f->direct, false)) { // said once, by the thread that turned it off
            // e.g. a sidecar of 512-byte bundles on a device of 4 KiB blocks (pi2.bundle.align, docs/FORMAT.md)
            PI2_LOG_WARN("pi2: sidecar %s: O_DIRECT refused a read of %zu bytes at offset %llu; reading through the "
                         "page cache from now on\n", f->path, total, (unsigned long long) r->offset);
        }
        pi2_merged_iov(r, iov); // the failed attempt may have moved them
        e = pi2_preadv_full(f->fd_plain, iov, m, r->offset, &got, max_call);
    }
    if (e == PI2_READ_EOF) { // the bundle lies past the end: the file was cut since it was checked
        e = EIO;
    }
    if (e != 0) {
        snprintf(why, whylen, "sidecar %s: read of %zu bytes at offset %llu failed after %zu bytes: %s%s", f->path, total,
                 (unsigned long long) r->offset, got, strerror(e), e == EIO && got < total ? " (was the file truncated?)" : "");
        return e;
    }
    return 0;
}

static int pi2_read_req(struct pi2_bundle_file * f, const struct pi2_io_req * r, size_t total, char * why, size_t whylen) {
    const int e = pi2_injected_fault(f, r, total, why, whylen);
    return e != 0 ? e : pi2_read_sync(f, r, total, pi2_short_reads(f), why, whylen);
}

static size_t pi2_req_bytes(const struct pi2_io_req * r) {
    size_t n = 0;
    for (int k = 0; k < r->n; ++k) {
        n += r->iov[k].iov_len;
    }
    return n;
}

// the oldest request no thread has taken (f->lock held, a batch queued)
static const struct pi2_io_req * pi2_take_req(struct pi2_bundle_file * f) {
    struct pi2_io_batch * q = &f->queue[f->head];
    const struct pi2_io_req * r = &q->reqs[q->next++];
    if (q->next >= q->n) { // every request of the batch taken
        f->head = (f->head + 1) % PI2_IO_MAX_BATCHES;
        f->n_batches--;
    }
    return r;
}

// Threads take requests in submission order while fewer than in_flight_max bytes are being read. Large
// requests (a layer read whole, 1 MiB each) then arrive one after another, so compute follows the reads
// and the next layer's prefetch is read after them; all at once, they shared the disk and finished
// together, and the disk idled while the layer's compute caught up. Small scattered requests (sparse
// layers) still fill every thread.
static void * pi2_io_thread(void * arg) {
    struct pi2_bundle_file * f = arg;
    char why[512];
    for (;;) {
        pthread_mutex_lock(&f->lock);
        while (!f->stop && (f->n_batches == 0 || (f->in_flight >= f->in_flight_max && f->in_flight > 0))) {
            pthread_cond_wait(&f->wake, &f->lock);
        }
        if (f->stop) {
            pthread_mutex_unlock(&f->lock);
            return NULL;
        }
        const struct pi2_io_req * r = pi2_take_req(f);
        const size_t bytes = pi2_req_bytes(r);
        f->in_flight += bytes;
        pthread_mutex_unlock(&f->lock);
        why[0] = '\0';
        const int e = pi2_read_req(f, r, bytes, why, sizeof(why));
        f->done(f->done_ctx, r, e, why);
        // no wake-up: this thread takes the next request itself (a waiting one would find no more room)
        pthread_mutex_lock(&f->lock);
        f->in_flight -= bytes;
        pthread_mutex_unlock(&f->lock);
    }
}

// The io_uring engine (f->lock held): moves queued requests into free slots of the ring, in submission order
// and under the same in-flight limit as the threads, and submits them, on the calling thread: the thread
// that submits a batch issues its reads itself, without waking another first (on two cores that wake-up
// cost a dependent read more than the thread pool's: 2026-11-26). Requests the ring must not read (testing:
// an injected fault, short reads; or a ring that failed) go to the sync list for the ring's thread.
static void pi2_ring_pump(struct pi2_bundle_file * f) {
    int n_new = 0;
    while (f->n_batches > 0 && f->n_free > 0 && (f->ring_in_flight < f->in_flight_max || f->ring_in_flight == 0)) {
        const int k = f->free_slots[--f->n_free];
        struct pi2_ring_slot * sl = &f->slots[k];
        sl->r     = pi2_take_req(f);
        sl->bytes = pi2_req_bytes(sl->r);
        sl->err   = pi2_injected_fault(f, sl->r, sl->bytes, sl->why, sizeof(sl->why));
        sl->short_calls = sl->err == 0 && pi2_short_reads(f);
        f->ring_in_flight += sl->bytes;
        bool queued = false;
        if (sl->err == 0 && !sl->short_calls && f->ring_ok) {
            const int m  = pi2_merged_iov(sl->r, sl->iov);
            const int fd = atomic_load(&f->direct) ? f->fd : f->fd_plain;
            queued = pi2_ring_readv(f->ring, fd, sl->iov, (unsigned) m, sl->r->offset, (uint64_t) k);
        }
        if (queued) {
            f->unsent[n_new++] = k;
        } else {
            f->sync[f->n_sync++] = k;
        }
    }
    if (n_new > 0) {
        const int e = pi2_ring_enter(f->ring, true, 0);
        if (e < 0) { // not transient (a bug, or the ring torn down): the kernel took none of these
            PI2_LOG_ERROR("pi2: sidecar %s: io_uring_enter failed: %s; bundle reads fail from now on\n", f->path, strerror(-e));
            f->ring_ok = false;
            for (int u = 0; u < n_new; ++u) {
                struct pi2_ring_slot * sl = &f->slots[f->unsent[u]];
                sl->err = -e;
                snprintf(sl->why, sizeof(sl->why), "sidecar %s: read of %zu bytes at offset %llu failed: io_uring_enter: %s",
                         f->path, sl->bytes, (unsigned long long) sl->r->offset, strerror(-e));
                f->sync[f->n_sync++] = f->unsent[u];
            }
            n_new = 0;
        }
        f->busy += n_new;
    }
    if (f->n_sync > 0 || (n_new > 0 && f->busy == n_new)) {
        pthread_cond_signal(&f->wake); // the ring's thread may be waiting for work to finish
    }
}

// a finished slot back to the free list (f->lock held)
static void pi2_ring_release(struct pi2_bundle_file * f, int k) {
    f->ring_in_flight -= f->slots[k].bytes;
    f->free_slots[f->n_free++] = k;
}

// The io_uring engine's thread: waits in io_uring_enter for completions (or on f->wake while nothing is in
// the ring), finishes each request (a result other than a whole read is read again with preadv here, which
// reports errors as the threads do), and refills the ring from the queue.
static void * pi2_ring_thread(void * arg) {
    struct pi2_bundle_file * f = arg;
    int * done_k = f->done_k, * sync_k = f->sync_k;
    int32_t * done_res = f->done_res;
    for (;;) {
        pthread_mutex_lock(&f->lock);
        while (!f->stop && f->busy == 0 && f->n_sync == 0) {
            pthread_cond_wait(&f->wake, &f->lock);
        }
        if (f->stop && f->busy == 0) {
            pthread_mutex_unlock(&f->lock);
            break;
        }
        const int n_sync = f->n_sync;
        memcpy(sync_k, f->sync, (size_t) n_sync * sizeof(int));
        f->n_sync = 0;
        const bool wait = f->busy > 0;
        pthread_mutex_unlock(&f->lock);
        for (int u = 0; u < n_sync; ++u) {
            struct pi2_ring_slot * sl = &f->slots[sync_k[u]];
            if (sl->err == 0) {
                sl->err = pi2_read_sync(f, sl->r, sl->bytes, sl->short_calls, sl->why, sizeof(sl->why));
            }
            f->done(f->done_ctx, sl->r, sl->err, sl->err != 0 ? sl->why : "");
        }
        int n_done = 0;
        if (wait) {
            // (only this thread takes completions; submitters enter the ring too, which the kernel allows)
            const int e = pi2_ring_enter(f->ring, false, 1);
            if (e < 0) {
                PI2_LOG_ERROR("pi2: sidecar %s: waiting in io_uring_enter failed: %s\n", f->path, strerror(-e));
            }
            uint64_t user;
            int32_t res;
            while (n_done < f->depth && pi2_ring_complete(f->ring, &user, &res)) {
                done_k[n_done]   = (int) user;
                done_res[n_done] = res;
                n_done++;
            }
        }
        for (int u = 0; u < n_done; ++u) {
            struct pi2_ring_slot * sl = &f->slots[done_k[u]];
            char why[512] = "";
            int err = 0;
            if (done_res[u] < 0 || (size_t) done_res[u] != sl->bytes) {
                err = pi2_read_sync(f, sl->r, sl->bytes, false, why, sizeof(why));
            }
            f->done(f->done_ctx, sl->r, err, why);
        }
        pthread_mutex_lock(&f->lock);
        for (int u = 0; u < n_sync; ++u) {
            pi2_ring_release(f, sync_k[u]);
        }
        for (int u = 0; u < n_done; ++u) {
            pi2_ring_release(f, done_k[u]);
        }
        f->busy -= n_done;
        if (!f->stop) {
            pi2_ring_pump(f);
        }
        pthread_mutex_unlock(&f->lock);
    }
    return NULL;
}

// The io_uring engine's ring and slots for n_threads requests; false (the thread pool reads) where io_uring
// is unavailable, said at the info level.
static bool pi2_ring_start(struct pi2_bundle_file * f, int n_threads) {
    char why[256];
    if (pi2_ring_open(&f->ring, (unsigned) n_threads, why, sizeof(why)) != 0) {
        PI2_LOG_INFO("pi2: %s; bundle reads use %d I/O threads\n", why, n_threads);
        return false;
    }
    f->slots      = calloc((size_t) n_threads, sizeof(*f->slots));
    f->free_slots = calloc((size_t) n_threads, sizeof(int));
    f->unsent     = calloc((size_t) n_threads, sizeof(int));
    f->sync       = calloc((size_t) n_threads, sizeof(int));
    f->sync_k     = calloc((size_t) n_threads, sizeof(int));
    f->done_k     = calloc((size_t) n_threads, sizeof(int));
    f->done_res   = calloc((size_t) n_threads, sizeof(int32_t));
    if (f->slots == NULL || f->free_slots == NULL || f->unsent == NULL || f->sync == NULL || f->sync_k == NULL ||
        f->done_k == NULL || f->done_res == NULL) { // (freed when the file closes)
        PI2_LOG_INFO("pi2: no memory for the read ring; bundle reads use %d I/O threads\n", n_threads);
        pi2_ring_close(f->ring);
        f->ring = NULL;
        return false;
    }
    f->depth   = n_threads;
    f->ring_ok = true;
    for (int k = 0; k < n_threads; ++k) {
        f->free_slots[f->n_free++] = n_threads - 1 - k;
    }
    return true;
}

int pi2_bundle_file_open(struct pi2_bundle_file ** out, const char * path, int n_threads, bool ring, uint64_t inflight_max,
                         pi2_io_done_fn done, void * done_ctx, char * err, size_t errlen) {
    *out = NULL;
    struct pi2_bundle_file * f = calloc(1, sizeof(*f));
    if (f == NULL || (f->path = strdup(path)) == NULL) {
        free(f);
        snprintf(err, errlen, "sidecar %s: out of memory", path);
        return -1;
    }
    f->fd = f->fd_plain = -1;
    f->done     = done;
    f->done_ctx = done_ctx;
    f->fd_plain = open(path, O_RDONLY | O_CLOEXEC);
    if (f->fd_plain < 0) {
        snprintf(err, errlen, "sidecar %s: cannot open: %s", path, strerror(errno));
        pi2_bundle_file_close(f);
        return -1;
    }
    if (fstat(f->fd_plain, &f->st0) != 0) {
        snprintf(err, errlen, "sidecar %s: fstat failed: %s", path, strerror(errno));
        pi2_bundle_file_close(f);
        return -1;
    }
    // O_DIRECT keeps bundle reads out of the page cache, which a memory cgroup would charge to us
    f->fd = open(path, O_RDONLY | O_CLOEXEC | O_DIRECT);
    atomic_init(&f->direct, f->fd >= 0);
    if (f->fd < 0) {
        f->fd = f->fd_plain; // tmpfs and some others refuse O_DIRECT
    }
    atomic_init(&f->fault_after, -1);
    atomic_init(&f->fault_err, 0);
    atomic_init(&f->short_left, 0);
    pthread_mutex_init(&f->lock, NULL);
    pthread_cond_init(&f->wake, NULL);
    f->in_flight_max = inflight_max > 0 && inflight_max < SIZE_MAX ? (size_t) inflight_max : SIZE_MAX;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, 64 * 1024); // a few frames and a message buffer
    if (n_threads < 1) {
        n_threads = 1;
    }
    if (n_threads > PI2_IO_MAX_THREADS) {
        n_threads = PI2_IO_MAX_THREADS;
    }
    const bool use_ring = ring && pi2_ring_start(f, n_threads);
    for (int k = 0; k < (use_ring ? 1 : n_threads); ++k) {
        const int e = pthread_create(&f->threads[k], &attr, use_ring ? pi2_ring_thread : pi2_io_thread, f);
        if (e != 0) {
            pthread_attr_destroy(&attr);
            snprintf(err, errlen, "sidecar %s: cannot start I/O thread: %s", path, strerror(e));
            pi2_bundle_file_close(f);
            return -1;
        }
        f->n_threads++;
    }
    pthread_attr_destroy(&attr);
    *out = f;
    return 0;
}

void pi2_bundle_file_close(struct pi2_bundle_file * f) {
    if (f == NULL) {
        return;
    }
    if (f->n_threads > 0) {
        pthread_mutex_lock(&f->lock);
        f->stop = true;
        pthread_cond_broadcast(&f->wake);
        pthread_mutex_unlock(&f->lock);
        for (int k = 0; k < f->n_threads; ++k) {
            pthread_join(f->threads[k], NULL);
        }
        pthread_mutex_destroy(&f->lock);
        pthread_cond_destroy(&f->wake);
    }
    pi2_ring_close(f->ring); // after its thread: nothing of ours is in flight
    free(f->slots);
    free(f->free_slots);
    free(f->unsent);
    free(f->sync);
    free(f->sync_k);
    free(f->done_k);
    free(f->done_res);
    if (f->fd >= 0 && f->fd != f->fd_plain) {
        close(f->fd);
    }
    if (f->fd_plain >= 0) {
        close(f->fd_plain);
    }
    free(f->path);
    free(f);
}

void pi2_bundle_file_submit(struct pi2_bundle_file * f, struct pi2_io_req * reqs, int n) {
    if (n <= 0) {
        return;
    }
    pthread_mutex_lock(&f->lock);
    while (f->n_batches >= PI2_IO_MAX_BATCHES && !f->stop) {
        pthread_mutex_unlock(&f->lock);
        sched_yield();
        pthread_mutex_lock(&f->lock);
    }
    f->queue[(f->head + f->n_batches) % PI2_IO_MAX_BATCHES] = (struct pi2_io_batch) { .reqs = reqs, .n = n, .next = 0 };
    f->n_batches++;
    if (f->ring != NULL) {
        pi2_ring_pump(f);
    } else if (n == 1) {
        pthread_cond_signal(&f->wake);
    } else {
        pthread_cond_broadcast(&f->wake);
    }
    pthread_mutex_unlock(&f->lock);
}

int pi2_bundle_file_read(struct pi2_bundle_file * f, void * dst, size_t n, uint64_t off, char * err, size_t errlen) {
    struct iovec      iov = { .iov_base = dst, .iov_len = n };
    int32_t           tag = -1;
    struct pi2_io_req r   = { .offset = off, .n = 1, .iov = &iov, .tag = &tag };
    return pi2_read_req(f, &r, n, err, errlen) == 0 ? 0 : -1;
}

bool pi2_bundle_file_ring(const struct pi2_bundle_file * f) {
    return f->ring != NULL;
}

bool pi2_bundle_file_direct(const struct pi2_bundle_file * f) {
    return atomic_load(&f->direct);
}

void pi2_bundle_file_inject_fault(struct pi2_bundle_file * f, int64_t after, int err) {
    if (err == PI2_INJECT_SHORT_READS) {
        atomic_store(&f->short_left, after);
        return;
    }
    atomic_store(&f->fault_after, after);
    atomic_store(&f->fault_err, err);
}
