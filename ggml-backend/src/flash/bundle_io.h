// Reads neuron bundles from the sidecar file: O_DIRECT where the filesystem allows it (buffered reads
// otherwise), on a small pool of I/O threads, so that one token's misses are in flight together (this
// virtual disk here served 4 KiB O_DIRECT reads at ~10k/s one at a time and 50-80k/s at queue depth 16-32).
// The file is checked for changes (size, mtime) around every batch: a sidecar truncated or rewritten
// while a model runs must end the generation with an error, not feed garbage into the FFN.
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/uio.h>

#define PI2_IO_MAX_RUN 256 // most bundles of consecutive slots one request (one preadv) reads; <= IOV_MAX

// the iovecs and tags live in the submitter's arrays (one slot's bundle per iovec, so a layer's requests
// need at most n_ff of them in all)
struct pi2_io_req {
    uint64_t       offset;
    int            n;   // iovecs, each a whole bundle: 4 KiB aligned address and length
    struct iovec * iov;
    int32_t *      tag; // the submitter's (cache entry of each iovec)
};

// called on an I/O thread for each finished request; err 0 on success, else why (errno-style text in why)
typedef void (*pi2_io_done_fn)(void * ctx, const struct pi2_io_req * r, int err, const char * why);

struct pi2_bundle_file;

// How the pipeline reads (the flash PI2_IO_* settings).
struct pi2_io_params {
    int      threads;      // I/O threads: the queue depth
    bool     ring;         // through io_uring where the kernel allows (PI2_IO_ENGINE)
    uint64_t inflight_max; // bytes being read at once (SIZE_MAX: no limit)
    uint64_t max_bytes;    // largest request
    uint64_t gap;          // bytes a request may bridge between two misses
    uint32_t ahead_pairs;  // MoE: routed (token, expert) pairs read ahead of their compute (PI2_EXPERT_AHEAD)
};


// Opens path for bundle reads, n_threads at a time: with `ring`, through io_uring where the kernel
// allows (one thread, io_ring.h), else on n_threads I/O threads; at most inflight_max bytes being read at
// once (SIZE_MAX or 0: no limit); 0 on success, -1 with err.
int  pi2_bundle_file_open(struct pi2_bundle_file ** out, const char * path, int n_threads, bool ring, uint64_t inflight_max,
                          pi2_io_done_fn done, void * done_ctx, char * err, size_t errlen);
// Whether reads go through io_uring.
bool pi2_bundle_file_ring(const struct pi2_bundle_file * f);
void pi2_bundle_file_close(struct pi2_bundle_file * f);

// Queues n requests behind the batches queued before (the arrays of a batch must stay valid until its
// requests are done). Threads take requests in order, while less than the in-flight limit is being read.
void pi2_bundle_file_submit(struct pi2_bundle_file * f, struct pi2_io_req * reqs, int n);
// Reads n bytes at off into dst (4 KiB aligned) on the calling thread; 0, or -1 with err.
int  pi2_bundle_file_read(struct pi2_bundle_file * f, void * dst, size_t n, uint64_t off, char * err, size_t errlen);
// 0 while the file is the one opened (same size and modification time); -1 with err once it changed.
int  pi2_bundle_file_check(struct pi2_bundle_file * f, char * err, size_t errlen);

bool     pi2_bundle_file_direct(const struct pi2_bundle_file * f); // O_DIRECT in use

// Reads exactly n bytes at off from fd (any file, retrying short reads and EINTR): 0; an errno value on
// a read error; PI2_READ_EOF when the file ends first.
#define PI2_READ_EOF (-1)
int  pi2_read_exact(int fd, void * dst, size_t n, uint64_t off);

// Testing: the request after `after` more requests fails with errno err (0 disarms); with err
// PI2_INJECT_SHORT_READS (ggml-pi2.h), the next `after` requests are read by short preadv calls instead.
void pi2_bundle_file_inject_fault(struct pi2_bundle_file * f, int64_t after, int err);
