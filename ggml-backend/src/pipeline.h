// The flash pipeline of one FFN layer (a model loaded for a memory budget): once the predictor has
// scored a token's slots, the bundles they need are requested from the neuron cache, which queues the
// misses to the I/O threads at once, and the clusters compute as their bundles arrive (the accessor
// waits per bundle, not per layer). The next layer's first bundles are prefetched behind this layer's
// reads, and the rest of it once this layer's compute is done, so the disk stays busy through the
// attention between FFNs. The cache is made here at the first compute when its budget came from
// PI2_MEMORY_BUDGET (frontends other than pi2_gguf).
#pragma once

#include "ggml-backend.h"
#include "model_binding.h"
#include "sparse_plan.h"

// Runs the plan's layer through the neuron cache of b (p is built as for RAM, source set to the cache
// here). GGML_STATUS_FAILED with b->error set on a read error, a changed sidecar or a budget too small.
enum ggml_status pi2_pipeline_run(struct pi2_binding * b, struct pi2_sparse_plan * p, int n_threads);
