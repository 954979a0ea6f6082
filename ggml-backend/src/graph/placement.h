// Which FFN layers PI2 holds in RAM. llama.cpp offers every CPU-side weight to PI2's buffer type first
// (an ACCEL device); a layer PI2 declines lands in ggml-cpu's buffers instead, repacked where ggml-cpu
// repacks its type (Q4_0, Q4_K, Q8_0, IQ4_NL, ... on AVX2 or NEON), and runs in ggml-cpu's kernels: stock
// llama.cpp's own speed. So PI2 holds a layer only where it is expected to be faster than that or is
// needed for correctness:
//   - a memory budget (flash: the weights exist nowhere else), oracle mode (a measurement of every layer),
//     `PI2_LAYERS=all`;
//   - a model that states a ReLU-family activation (ggml-cpu would run the SwiGLU an unpatched llama.cpp's
//     graph holds);
//   - predicted mode, where the layer's estimated sparse time (pi2_sparse_cost_ratio) is below stock's.
// Dense mode and models without a sidecar leave every other layer to ggml-cpu.
#pragma once

#include <stdbool.h>
#include <stdint.h>

#include "graph/activation.h"
#include "core/config.h"
#include "model/sidecar.h"

struct pi2_binding;

// The layer's estimated in-RAM sparse decode time over ggml-cpu's dense time for the same layer, from what
// profiling measured (active density, predictor density) and the costs per byte of each kind of read
// (placement.c). Below 1: sparse decode is expected to pay.
double pi2_sparse_cost_ratio(const struct pi2_sidecar_layer * L, uint32_t n_embd, enum pi2_sparsity_method method,
                             double down_sparse_max, bool predictor_always);

// pi2_sparse_cost_ratio of sidecar layer `layer` with b's settings (defaults: the device's): the estimate
// pi2_placement_holds compares with 1 in predicted mode
double pi2_placement_layer_cost(const struct pi2_binding * b, const struct pi2_settings * defaults, uint32_t layer);
// pi2_sparse_cost_ratio of the sidecar's first `cap` layers with the settings table's defaults (no binding)
void pi2_sidecar_default_costs(const struct pi2_sidecar * sc, double * out, int cap);

// true: PI2 holds blk.<layer>.ffn_* of the model being loaded; false: ggml-cpu does. b: that load's binding
// (NULL: no sidecar), act: the activation the model states, defaults: the device's settings.
bool pi2_placement_holds(const struct pi2_binding * b, struct pi2_stated_act act, const struct pi2_settings * defaults,
                         int layer);

// The same for the routed experts (blk.<layer>.ffn_*_exps) of an MoE model in RAM, by the same rule: in predicted
// mode the estimate is the mean over the layer's experts (each a sidecar layer). A ReLU-family activation holds them
// because an unmodified llama.cpp's MoE graph computes SwiGLU; a sidecar without experts counts as none.
bool pi2_placement_holds_experts(const struct pi2_binding * b, struct pi2_stated_act act, const struct pi2_settings * defaults,
                                 int layer);
