// A minimal io_uring: one submission and one completion ring, through the raw system calls (no liburing:
// the plugin carries what it needs). Bundle reads go through it where the kernel allows (bundle_io.c): a
// pool of threads blocking in preadv costs two context switches and a futex a request. Where io_uring is
// missing (not Linux, an old kernel, a seccomp filter), pi2_ring_open fails and the thread pool reads.
// Not thread-safe: the caller serializes queueing and submitting; one thread may wait and take
// completions (pi2_ring_enter with submit false, pi2_ring_complete) while another submits.
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/uio.h>

struct pi2_ring;

// A ring of at least `entries` submissions; 0, or -1 with err (why io_uring is unavailable).
int  pi2_ring_open(struct pi2_ring ** out, unsigned entries, char * err, size_t errlen);
void pi2_ring_close(struct pi2_ring * ring);

// Queues a readv of n iovecs at off from fd, tagged `user`; false when the submission ring is full.
// The iovecs must stay valid until pi2_ring_enter has submitted it.
bool pi2_ring_readv(struct pi2_ring * ring, int fd, const struct iovec * iov, unsigned n, uint64_t off, uint64_t user);

// Submits what is queued (unless `submit` is false) and waits until at least min_complete completions are
// ready (0: does not wait), retrying interruptions and transient shortages; 0, or a negative errno, with
// nothing more submitted (the kernel fails a call only when it took no submission).
int  pi2_ring_enter(struct pi2_ring * ring, bool submit, unsigned min_complete);

// Takes one ready completion: true with its tag and result (bytes, or a negative errno).
bool pi2_ring_complete(struct pi2_ring * ring, uint64_t * user, int32_t * res);
