// The segmented neuron cache of a model whose FFN lives on flash (PowerInfer-2 section 4.3): its
// memory, its replacement policy and its lookup; the pipeline (pipeline.c) does the reading.
//  - hot segment: per layer, the first hot_k bundles (the most frequently active neurons; bundles hold
//    the slots in rank order), read when the cache is made and pinned. hot_k comes from one global
//    frequency cutoff over all layers (memory_budget.c), so the bytes go where the profile says
//    activations are.
//  - cold segment: fixed-size entries holding single bundles, replaced by CLOCK (second chance, an LRU
//    approximation that costs one bit per entry). Entries found or claimed for the request being
//    computed (an epoch) are pinned until the next request; entries read ahead for a later request (the
//    next layer's first bundles, or the bundles of a layer's routed experts) until that one.
// The predictors (the fixed segment) stay in the model binding.
#pragma once

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "model/sidecar.h"

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
    uint8_t *  skip;         // [n_layer] 1: the layer reads no bundles (read whole from the model file); NULL: none.
                             // malloc'd, owned by the plan
};

// A cold entry's size (the largest bundle) and the most bundles of any layer
uint32_t pi2_cache_entry_size(const struct pi2_sidecar * sc, uint32_t * max_n_bundles);
// Bytes of bookkeeping per cold entry (for the budget's overhead)
size_t pi2_cache_entry_overhead(void);

// Makes the segments and tables (nothing is read yet: the pipeline fills the hot segments), with a scratch
// area of scratch_entries entries; NULL with err on failure.
struct pi2_neuron_cache * pi2_cache_create(const struct pi2_sidecar * sc, const struct pi2_cache_plan * plan,
                                           uint32_t scratch_entries, char * err, size_t errlen);
void pi2_cache_free(struct pi2_neuron_cache * c);
const struct pi2_cache_plan * pi2_cache_get_plan(const struct pi2_neuron_cache * c);

// A layer's hot segment (its first hot_k bundles, hot_slots slots) and the scratch area
uint8_t * pi2_cache_hot_segment(struct pi2_neuron_cache * c, int layer, uint32_t * hot_k, uint32_t * hot_slots);
uint8_t * pi2_cache_scratch(struct pi2_neuron_cache * c);

// Cold entries that may be pinned for requests after the next one, whatever they hold: at any request the
// rest must be free for one whole layer's bundles (the plan's room beyond that need).
uint32_t pi2_cache_ahead_room(const struct pi2_neuron_cache * c);

// A new request (its epoch; the entries of the one before are no longer pinned by it), and the current one.
uint32_t pi2_cache_begin_request(struct pi2_neuron_cache * c);
// After a failed computation: the requests entries were pinned for (read ahead for the next layer, a routed expert
// further on) will not come in that order (the next prompt starts from the first layer), so no entry stays pinned
// and a request for a whole layer finds its room. Reads still in flight keep their entries until they end.
void pi2_cache_unpin(struct pi2_neuron_cache * c);
uint32_t pi2_cache_epoch(const struct pi2_neuron_cache * c);

enum pi2_found {
    PI2_FOUND_HOT,        // in the hot segment
    PI2_FOUND_CACHED,     // in a cold entry, read: pinned for the current request
    PI2_FOUND_PREFETCHED, // read ahead for the current request (maybe still being read): pinned, adopted
    PI2_FOUND_MISSING,    // to be read
};
// Where bundle k of a layer is for the current request (pinning what it finds).
enum pi2_found pi2_cache_find(struct pi2_neuron_cache * c, int layer, uint32_t k);
// A prefetch for the request of epoch `key` should read bundle k: it is neither cached nor being read (a
// failed read already made for that request is left for it to report).
bool pi2_cache_should_prefetch(const struct pi2_neuron_cache * c, int layer, uint32_t k, uint32_t key);
// Bundle k, cached and read, is kept for the request of epoch `pin` too (a later one than it is pinned for):
// true if it was pinned so.
bool pi2_cache_pin_ahead(struct pi2_neuron_cache * c, int layer, uint32_t k, uint32_t pin);
// A cold entry for bundle k (CLOCK picks one unless the bundle has one), pinned for the request of epoch
// `pin` and pending until pi2_cache_entry_done; `done`: the current request's computation has finished
// (its entries may go too); `prefetched`: read ahead of its request. *dst: where its bytes go. -1 if no
// entry is free.
int64_t pi2_cache_claim(struct pi2_neuron_cache * c, int layer, uint32_t k, uint32_t pin, bool done, bool prefetched,
                        uint8_t ** dst);
// An entry's read finished (ok or not); then pi2_cache_signal, once per finished read request, wakes the
// threads waiting in pi2_cache_get or pi2_cache_wait_zero.
void pi2_cache_entry_done(struct pi2_neuron_cache * c, int64_t e, bool ok);
void pi2_cache_signal(struct pi2_neuron_cache * c);
// Waits until *n is 0 (a count the signalling side decrements before pi2_cache_signal).
void pi2_cache_wait_zero(struct pi2_neuron_cache * c, atomic_int * n);
// When pi2_cache_claim found no entry: waits for a read to finish if some entry is free but for its read
// still in flight (a prefetch no request wanted, read ahead by an earlier batch), and returns true (claim
// again); false if no read in flight would free one.
bool pi2_cache_wait_reading(struct pi2_neuron_cache * c, bool done);

// What one request found, counted in neurons (a bundle is read when any of its neurons is wanted)
struct pi2_cache_token_stats {
    uint64_t hot_hits, cold_hits, misses, bytes_read, requests;
    uint64_t prefetched; // of the misses, read ahead of the request
};

// The parts of a slot (its neuron within its bundle) once they are in memory: hot, or a cold entry whose
// read is done; NULL if its read failed or it has no entry. Adds the time spent waiting to *wait_ns.
const uint8_t * pi2_cache_get(struct pi2_neuron_cache * c, int layer, int64_t slot, uint64_t * wait_ns);
// The same if they are in memory now, else NULL; never waits (for prefetching)
const uint8_t * pi2_cache_peek(const struct pi2_neuron_cache * c, int layer, int64_t slot);
