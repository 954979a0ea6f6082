// The segmented neuron cache of a model whose FFN lives on flash (PowerInfer-2 section 4.3):
//  - hot segment: per layer, the first hot_k bundles (the most frequently active neurons; bundles hold
//    the slots in rank order), read sequentially when the cache is made and pinned. hot_k comes from one global
//    frequency cutoff over all layers, so the bytes go where the profile says activations are.
//  - cold segment: fixed-size entries holding single bundles, replaced by CLOCK (second chance, an LRU
//    approximation that costs one bit per entry). Entries requested for the token being computed are
//    pinned until the next request.
// The predictors (the fixed segment) stay in the model binding.
//
// Use, per layer and token: one thread calls pi2_cache_request with the slots the predictor selected,
// which issues every missing bundle to the I/O threads at once; then any thread may pi2_cache_get a
// requested slot, which returns as soon as that bundle is in memory.
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "sidecar.h"

struct pi2_neuron_cache;

// How the memory budget splits the cache (memory_budget.c makes it).
struct pi2_cache_plan {
    uint64_t   hot_bytes, cold_bytes;
    uint32_t   n_cold;       // cold entries
    uint32_t   n_prefetch;   // of them, kept free of any one layer's need for the next layer's first bundles
    uint64_t   hot_bundles;  // summed over layers
    uint64_t   hot_neurons;  // in them
    float      freq_cutoff;  // neurons at least this frequently active are hot
    uint32_t * hot_k;        // [n_layer] hot bundles of each layer (its first ones); malloc'd, owned by the plan
};

// How the cache reads (the flash PI2_IO_* settings).
struct pi2_io_params {
    int      threads;      // I/O threads: the queue depth
    uint64_t inflight_max; // bytes being read at once (SIZE_MAX: no limit)
    uint64_t max_bytes;    // largest request
    uint64_t gap;          // bytes a request may bridge between two misses
};

// A cold entry's size (the largest bundle) and the most bundles of any layer
uint32_t pi2_cache_entry_size(const struct pi2_sidecar * sc, uint32_t * max_n_bundles);
// Bytes of bookkeeping per cold entry (for the budget's overhead)
size_t pi2_cache_entry_overhead(void);

// Makes the cache and reads the hot segments; NULL with err on failure.
struct pi2_neuron_cache * pi2_cache_create(const struct pi2_sidecar * sc, const struct pi2_cache_plan * plan,
                                           const struct pi2_io_params * io, char * err, size_t errlen);
void pi2_cache_free(struct pi2_neuron_cache * c);

struct pi2_cache_token_stats {
    uint64_t hot_hits, cold_hits, misses, bytes_read, requests;
    uint64_t prefetched; // of the misses, read by pi2_cache_prefetch
};

// Looks up the slots with want[slot] != 0 of one layer and queues reads for the bundles missing.
// 0, or -1 with err (the file changed, or the cache cannot hold them).
int pi2_cache_request(struct pi2_neuron_cache * c, int layer, const uint8_t * want, struct pi2_cache_token_stats * st,
                      char * err, size_t errlen);
// Queues reads of bundles of `layer` that are neither hot nor cached and returns without waiting; for a
// layer that will want every bundle (the engine knows which), the one after the current request's. Once
// the current request is queued (done false): at most the plan's prefetch entries, its first bundles,
// read after the current ones, so the disk reads on through this layer's last computations. Once the
// current request's computation has finished (done true; its entries are free then): the rest of the
// layer, read while the next attention (or the output layer and sampling, between tokens) runs. The
// request that uses the bundles takes them as they are (ready or still being read), counting them as
// misses and their bytes as read; pi2_cache_get reports a failed prefetch read.
void pi2_cache_prefetch(struct pi2_neuron_cache * c, int layer, bool done);
// The parts of a requested slot (its neuron within its bundle) once they are in memory; NULL if its read failed (pi2_cache_error says why).
// Adds the time spent waiting to *wait_ns.
const uint8_t * pi2_cache_get(struct pi2_neuron_cache * c, int layer, int64_t slot, uint64_t * wait_ns);
// the parts of slot if they are in memory now (hot, or a cold entry whose read is done), else NULL; never
// waits (for prefetching)
const uint8_t * pi2_cache_peek(const struct pi2_neuron_cache * c, int layer, int64_t slot);
// Waits for every queued read (after an error, before entries may be reused), then checks that the file
// did not change while they ran. 0, or -1 with err.
int pi2_cache_finish(struct pi2_neuron_cache * c, char * err, size_t errlen);
// The first read error since the last request, or "".
const char * pi2_cache_error(struct pi2_neuron_cache * c);

void pi2_cache_inject_fault(struct pi2_neuron_cache * c, int64_t after, int err);
bool pi2_cache_direct_io(const struct pi2_neuron_cache * c);
const struct pi2_cache_plan * pi2_cache_get_plan(const struct pi2_neuron_cache * c);
