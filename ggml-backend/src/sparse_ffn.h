// Sparse decode of one FFN layer (the decode half of the engine): recognizes the layer's FFN in llama's
// graph, makes the layer's choices (which neurons fire, whose gates the predictor selects, where rows come
// from, how clusters go to threads) and its workspace, and hands the plan to the cluster scheduler (in
// RAM) or the flash pipeline. Counts what ran.
#pragma once

#include "ggml.h"
#include "model_binding.h"
#include "pi2_context.h"

// 4 when nodes i..i+3 of g are one layer's gate and up products (either order), their GLU and the down
// product that sparse decode can run; else 0 with *why saying what differs (for the log and refusals).
int pi2_sparse_ffn_match(struct ggml_cgraph * g, int i, const char ** why);

// Computes the GLU's sources (gate and up outputs, zero where a neuron was not computed), the GLU output
// (zero for inactive neurons) and down's output, in the binding's mode.
enum ggml_status pi2_exec_sparse_ffn(struct pi2_backend_ctx * ctx, struct pi2_binding * b, int layer,
                                     struct ggml_tensor * glu, struct ggml_tensor * down);
