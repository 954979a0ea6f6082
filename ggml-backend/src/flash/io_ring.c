// syscall() and MAP_POPULATE are outside C11
#define _GNU_SOURCE
#include "flash/io_ring.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if defined(__linux__) && defined(__has_include)
#    if __has_include(<linux/io_uring.h>)
#        define PI2_HAVE_IO_URING 1
#    endif
#endif

#if PI2_HAVE_IO_URING
#    include <linux/io_uring.h>
#    include <sys/mman.h>
#    include <sys/syscall.h>
#    include <time.h>
#    include <unistd.h>
#    if !defined(__NR_io_uring_setup) || !defined(__NR_io_uring_enter)
#        undef PI2_HAVE_IO_URING
#    endif
#endif

#if PI2_HAVE_IO_URING

struct pi2_ring {
    int                   fd;
    void *                sq_map, * cq_map;
    size_t                sq_map_len, cq_map_len;
    struct io_uring_sqe * sqes;
    size_t                sqes_len;
    unsigned *            sq_head, * sq_tail, * sq_array, sq_mask, sq_entries;
    unsigned *            cq_head, * cq_tail, cq_mask;
    struct io_uring_cqe * cqes;
    unsigned              sq_local; // the tail this thread has written up to
    unsigned              unsubmitted;
};

// the kernel reads the rings' other ends concurrently: tails are published with release, heads read with acquire
static unsigned pi2_load_acquire(const unsigned * p) {
    return __atomic_load_n(p, __ATOMIC_ACQUIRE);
}

static void pi2_store_release(unsigned * p, unsigned v) {
    __atomic_store_n(p, v, __ATOMIC_RELEASE);
}

// No IORING_SETUP_COOP_TASKRUN: a read's completion runs as task work on the thread that submitted it, often a
// compute thread; without an interruption it would wait until that thread next entered the kernel.
static int pi2_ring_setup(unsigned entries, struct io_uring_params * p) {
    memset(p, 0, sizeof(*p));
    return (int) syscall(__NR_io_uring_setup, entries, p);
}

// maps one of the ring's areas into *out (MAP_FAILED stays there on failure, with err naming `what`)
static bool pi2_ring_map(int fd, size_t len, off_t off, const char * what, void ** out, char * err, size_t errlen) {
    *out = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, off);
    if (*out == MAP_FAILED) {
        snprintf(err, errlen, "mapping the io_uring %s: %s", what, strerror(errno));
        return false;
    }
    return true;
}

int pi2_ring_open(struct pi2_ring ** out, unsigned entries, char * err, size_t errlen) {
    *out = NULL;
    struct pi2_ring * ring = calloc(1, sizeof(*ring));
    if (ring == NULL) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    ring->fd = -1;
    ring->sq_map = ring->cq_map = MAP_FAILED;
    ring->sqes = MAP_FAILED;
    struct io_uring_params p;
    ring->fd = pi2_ring_setup(entries, &p);
    if (ring->fd < 0) {
        snprintf(err, errlen, "io_uring_setup: %s", strerror(errno));
        pi2_ring_close(ring);
        return -1;
    }
    ring->sq_map_len = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    ring->cq_map_len = p.cq_off.cqes + p.cq_entries * sizeof(struct io_uring_cqe);
    const bool single = (p.features & IORING_FEAT_SINGLE_MMAP) != 0;
    if (single && ring->cq_map_len > ring->sq_map_len) {
        ring->sq_map_len = ring->cq_map_len;
    }
    ring->sqes_len = p.sq_entries * sizeof(struct io_uring_sqe);
    void * sqes = MAP_FAILED;
    const bool mapped =
        pi2_ring_map(ring->fd, ring->sq_map_len, IORING_OFF_SQ_RING, "submission ring", &ring->sq_map, err, errlen) &&
        (single || pi2_ring_map(ring->fd, ring->cq_map_len, IORING_OFF_CQ_RING, "completion ring", &ring->cq_map, err,
                                errlen)) &&
        pi2_ring_map(ring->fd, ring->sqes_len, IORING_OFF_SQES, "submissions", &sqes, err, errlen);
    ring->sqes = sqes;
    if (!mapped) {
        pi2_ring_close(ring);
        return -1;
    }
    if (single) {
        ring->cq_map = ring->sq_map;
    }
    char * sq = ring->sq_map;
    char * cq = ring->cq_map;
    ring->sq_head    = (unsigned *) (sq + p.sq_off.head);
    ring->sq_tail    = (unsigned *) (sq + p.sq_off.tail);
    ring->sq_array   = (unsigned *) (sq + p.sq_off.array);
    ring->sq_mask    = *(unsigned *) (sq + p.sq_off.ring_mask);
    ring->sq_entries = *(unsigned *) (sq + p.sq_off.ring_entries);
    ring->cq_head    = (unsigned *) (cq + p.cq_off.head);
    ring->cq_tail    = (unsigned *) (cq + p.cq_off.tail);
    ring->cq_mask    = *(unsigned *) (cq + p.cq_off.ring_mask);
    ring->cqes       = (struct io_uring_cqe *) (cq + p.cq_off.cqes);
    ring->sq_local   = *ring->sq_tail;
    *out = ring;
    return 0;
}

void pi2_ring_close(struct pi2_ring * ring) {
    if (ring == NULL) {
        return;
    }
    if (ring->sqes != MAP_FAILED) {
        munmap(ring->sqes, ring->sqes_len);
    }
    if (ring->cq_map != MAP_FAILED && ring->cq_map != ring->sq_map) {
        munmap(ring->cq_map, ring->cq_map_len);
    }
    if (ring->sq_map != MAP_FAILED) {
        munmap(ring->sq_map, ring->sq_map_len);
    }
    if (ring->fd >= 0) {
        close(ring->fd);
    }
    free(ring);
}

bool pi2_ring_readv(struct pi2_ring * ring, int fd, const struct iovec * iov, unsigned n, uint64_t off, uint64_t user) {
    if (ring->sq_local - pi2_load_acquire(ring->sq_head) >= ring->sq_entries) {
        return false;
    }
    const unsigned idx = ring->sq_local & ring->sq_mask;
    struct io_uring_sqe * sqe = &ring->sqes[idx];
    memset(sqe, 0, sizeof(*sqe));
    sqe->opcode    = IORING_OP_READV;
    sqe->fd        = fd;
    sqe->off       = off;
    sqe->addr      = (uint64_t) (uintptr_t) iov;
    sqe->len       = n;
    sqe->user_data = user;
    ring->sq_array[idx] = idx;
    ring->sq_local++;
    pi2_store_release(ring->sq_tail, ring->sq_local);
    ring->unsubmitted++;
    return true;
}

int pi2_ring_enter(struct pi2_ring * ring, bool submit, unsigned min_complete) {
    for (;;) {
        const unsigned flags = min_complete > 0 ? IORING_ENTER_GETEVENTS : 0;
        const unsigned n = submit ? ring->unsubmitted : 0;
        const long r = syscall(__NR_io_uring_enter, ring->fd, n, min_complete, flags, NULL, 0);
        if (r >= 0) {
            if (n > 0) { // (a thread that only waits leaves the count to the submitters)
                ring->unsubmitted -= (unsigned) r < n ? (unsigned) r : n;
            }
            if (ring->unsubmitted == 0 || !submit || min_complete > 0) {
                return 0;
            }
            continue; // the kernel took part of the queue: submit the rest
        }
        if (errno == EINTR) {
            continue;
        }
        if (errno == EAGAIN || errno == EBUSY) { // short of memory or completion room for a moment
            const struct timespec ms = { 0, 1000000 };
            nanosleep(&ms, NULL);
            continue;
        }
        return -errno;
    }
}

bool pi2_ring_complete(struct pi2_ring * ring, uint64_t * user, int32_t * res) {
    const unsigned head = *ring->cq_head;
    if (head == pi2_load_acquire(ring->cq_tail)) {
        return false;
    }
    const struct io_uring_cqe * cqe = &ring->cqes[head & ring->cq_mask];
    *user = cqe->user_data;
    *res  = cqe->res;
    pi2_store_release(ring->cq_head, head + 1);
    return true;
}

#else // no io_uring here: the thread pool reads

struct pi2_ring {
    int unused;
};

int pi2_ring_open(struct pi2_ring ** out, unsigned entries, char * err, size_t errlen) {
    (void) entries;
    *out = NULL;
    snprintf(err, errlen, "io_uring is not available on this platform");
    return -1;
}

void pi2_ring_close(struct pi2_ring * ring) {
    (void) ring;
}

bool pi2_ring_readv(struct pi2_ring * ring, int fd, const struct iovec * iov, unsigned n, uint64_t off, uint64_t user) {
    (void) ring, (void) fd, (void) iov, (void) n, (void) off, (void) user;
    return false;
}

int pi2_ring_enter(struct pi2_ring * ring, bool submit, unsigned min_complete) {
    (void) ring, (void) submit, (void) min_complete;
    return -ENOSYS;
}

bool pi2_ring_complete(struct pi2_ring * ring, uint64_t * user, int32_t * res) {
    (void) ring, (void) user, (void) res;
    return false;
}

#endif
