// Which nodes of llama's graph are one layer's FFN, and what activation PI2 computes for it. llama builds
// gate and up products of the FFN input, then act(gate) * up (one GLU node; a patched llama.cpp spells a
// ReLU-family activation with a few elementwise ops instead), then the down product. PI2 takes the region
// whole: it writes the gate and up products, act(gate) * up into the node down reads, and down's output;
// the elementwise nodes in between are not computed (nothing else reads them).
#pragma once

#include <stdbool.h>

#include "graph/activation.h"
#include "ggml.h"

#define PI2_FFN_REGION_MAX 16 // nodes a region may span, down included

struct pi2_ffn_region {
    int                  n_nodes;  // graph nodes from the first product through `out`, or through down
    int                  layer;
    struct ggml_tensor * gate, * up; // the products, f32 [n_ff, n_tokens]: graph nodes, or the halves below
    struct ggml_tensor * out;        // the node down reads: act(gate) * up
    struct ggml_tensor * down;       // down's product of `out`, or NULL when it does not follow directly
    struct pi2_ffn_act   act;        // what PI2 computes into `out`
    bool                 batch;      // a routed expert's tokens of a prompt: computed as a batch on flash (batch_ffn.h)
    // per neuron (model order), added to the gate and up products before the activation (gpt-oss's experts'
    // biases, which llama adds with ADD_ID), or NULL
    const float *        bias_gate, * bias_up;
    // a fused gate+up weight (phi3's ffn_up: gate rows, then up rows) and its product, split into their gate and up
    // halves, which gate and up point at: a region holding them is used where it was found, never copied
    struct ggml_tensor   fused_w[2], fused_p[2];
};

// true when node i of g starts a layer's FFN PI2 can compute, given what the model states (the gate weight's
// buffer keeps it); else false with *why saying what differs
bool pi2_ffn_region_find(struct ggml_cgraph * g, int i, const struct pi2_stated_act * stated, struct pi2_ffn_region * r,
                         const char ** why);

// half k (0: gate, 1: up) of a fused gate+up product t (phi3's ffn_up, or ffn_gate_up_exps'): the weight's rows
// [k n_ff, (k + 1) n_ff) (of each expert's matrix, for stacked experts) into hw, the same columns of t into hp,
// whose weight is hw
void pi2_fused_half(struct ggml_tensor * hw, struct ggml_tensor * hp, const struct ggml_tensor * t, int k);

// a GLU of one fused gate+up product (phi3's ffn_up: gate rows, then up rows): act(first half) * second half
bool pi2_ffn_fused_glu(const struct ggml_tensor * glu);

// an elementwise op a patched llama.cpp uses to spell a ReLU-family activation (relu, step, scale, mul)
bool pi2_ffn_region_elementwise(const struct ggml_tensor * t);

// The FFN weight (gate, up or down, by name) whose product t derives from through at most `depth` of those
// elementwise ops or GLUs, or NULL. With through_add also through an ADD: the bias or LoRA term build_ffn adds
// to a product before the GLU, which keeps the GLU's inputs the model's gate and up, so the activation the
// model states still applies to them (an unpatched llama.cpp spells every GLU SwiGLU).
const struct ggml_tensor * pi2_ffn_product_weight(const struct ggml_tensor * t, int depth, bool through_add);

// how far a GLU's input may be from its product (a bias ADD, a scale MUL, a patched graph's relu): the claim
// that takes the GLU and the dispatch that finds its stated activation walk the same way
#define PI2_GLU_INPUT_DEPTH 3
