// The flash pipeline of a model loaded for a memory budget: the bundle reads behind its neuron cache.
// Once the predictor has scored a token's slots, the bundles they need are looked up in the cache and
// the misses queued to the I/O threads at once, neighbours merged into one request (bridging small gaps),
// and the clusters compute as their bundles arrive (the accessor waits per bundle, not per layer). The next layer's first bundles are prefetched behind this layer's
// reads, and the rest of it once this layer's compute is done, so the disk stays busy through the
// attention between FFNs. The cache is made here at the first compute when its budget came from
// PI2_MEMORY_BUDGET (frontends other than pi2_gguf).
#pragma once

#include "flash/bundle_io.h"
#include "ggml-backend.h"
#include "model/model_binding.h"
#include "sparse/sparse_plan.h"

struct pi2_pipeline;

// Makes the neuron cache of this plan (memory_budget.c decides it) and the reads behind it, and reads the
// hot segments; NULL with err on failure.
struct pi2_pipeline * pi2_pipeline_create(const struct pi2_sidecar * sc, const struct pi2_cache_plan * plan,
                                          const struct pi2_io_params * io, char * err, size_t errlen);
void pi2_pipeline_free(struct pi2_pipeline * pp);
struct pi2_neuron_cache * pi2_pipeline_cache(const struct pi2_pipeline * pp);
bool pi2_pipeline_direct_io(const struct pi2_pipeline * pp); // reads bypass the page cache (O_DIRECT)
bool pi2_pipeline_io_ring(const struct pi2_pipeline * pp);   // reads go through io_uring
// Testing: the read request after `after` more fails with errno err (0 disarms)
void pi2_pipeline_inject_fault(struct pi2_pipeline * pp, int64_t after, int err);

// A batch's routed experts (MoE) are read before the first of them computes: between requests, the bundles
// of sidecar layer `layer` that want[] marks are read ahead for the request `later` requests from now
// (1: the next), pinning at most max_pin cold entries (those cached already are pinned for it too); `first`
// starts a batch's read-ahead. Returns the entries pinned; 0 where the cache is not made yet (the first
// compute makes it) or the sidecar has no experts.
uint32_t pi2_pipeline_read_ahead(struct pi2_binding * b, int layer, const uint8_t * want, uint32_t later, uint32_t max_pin,
                                 bool first);
// Cold entries that may be pinned for requests after the next one (pi2_cache_ahead_room); 0 without read-ahead.
uint32_t pi2_pipeline_ahead_room(struct pi2_binding * b);

// Runs the plan's layer through the neuron cache of b (p is built as for RAM, source set to the cache
// here). GGML_STATUS_FAILED with b->error set on a read error, a changed sidecar or a budget too small.
enum ggml_status pi2_pipeline_run(struct pi2_binding * b, struct pi2_sparse_plan * p, int n_threads);
