// Sparse decode of one FFN layer (the decode half of the engine): recognizes the layer's FFN in llama's
// graph, makes the layer's choices (which neurons fire, whose gates the predictor selects, where rows come
// from, how clusters go to threads) and its workspace, and hands the plan to the cluster scheduler (in
// RAM) or the flash pipeline. Counts what ran.
#pragma once

#include "graph/ffn_region.h"
#include "ggml.h"
#include "model/model_binding.h"
#include "core/pi2_context.h"

// A layer's FFN region (ffn_region.h) of a model with a sidecar: the weights are verified once and the layer
// runs sparse for decode batches in oracle/predicted mode (flash: always), else dense. A region sparse
// decode cannot run (no down product after it) runs dense in RAM (said once), and on flash, where the
// weights are nowhere else, the compute is refused (*st). model_layer: the model's layer (r->layer is the sidecar's).
// Returns the nodes consumed.
int pi2_sparse_ffn_compute(struct pi2_backend_ctx * ctx, struct pi2_binding * b, const struct pi2_ffn_region * r,
                           int model_layer, enum ggml_status * st);

// Computes the products (zero where a neuron was not computed), act(gate) * up (zero for inactive neurons)
// and down's output, in the binding's mode. io (may be NULL): what the neuron cache found (flash; else zeros).
enum ggml_status pi2_exec_sparse_ffn(struct pi2_backend_ctx * ctx, struct pi2_binding * b, const struct pi2_ffn_region * r,
                                     struct pi2_cache_token_stats * io);
// The same on ctx->n_threads threads with the sums of n_split (pi2_sparse_plan.n_split): the values are those of
// pi2_exec_sparse_ffn on n_split threads. ctx->n_threads 1 runs on the calling thread, also inside a parallel region.
enum ggml_status pi2_exec_sparse_ffn_split(struct pi2_backend_ctx * ctx, struct pi2_binding * b, const struct pi2_ffn_region * r,
                                           struct pi2_cache_token_stats * io, int n_split);
