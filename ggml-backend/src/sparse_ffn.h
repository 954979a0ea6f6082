// Sparse decode of one FFN layer (the decode half of the polymorphic engine): predictor -> candidate
// neurons -> their gate rows -> activation with the layer threshold -> up rows of the neurons past it
// (method product: of those, the active ones are the neurons whose |act * up| passes a second threshold) ->
// down as a sum of the active neurons' down columns. Neurons are taken in bundle-slot order (hottest first) in
// clusters; clusters go round-robin to the threads llama gives the backend, so each thread walks its
// bundles front to back and a run is reproducible for a given thread count.
#pragma once

#include "ggml.h"
#include "model_binding.h"
#include "pi2_context.h"

// true when glu (a PI2 GLU of gate and up products) and down (the product of blk.N.ffn_down with the
// GLU output) form one layer's FFN that sparse decode can run
bool pi2_sparse_ffn_pattern(const struct ggml_tensor * glu, const struct ggml_tensor * down);

// Computes the GLU's sources (gate and up outputs, zero where a neuron was not computed), the GLU output
// (zero for inactive neurons) and down's output. mode is PI2_MODE_ORACLE or PI2_MODE_PREDICTED.
enum ggml_status pi2_exec_sparse_ffn(struct pi2_backend_ctx * ctx, struct pi2_binding * b, int layer,
                                     struct ggml_tensor * glu, struct ggml_tensor * down);
