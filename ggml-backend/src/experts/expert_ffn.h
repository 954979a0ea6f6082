// Routed experts of an MoE layer: MUL_MAT_ID of blk.N.ffn_{gate,up,down}_exps.weight (one matrix per expert,
// stacked along ne[2]) by the router's choice of experts for each token (ids: [n_expert_used, n_tokens]).
// Only the experts a batch routes to are computed, each once for all the tokens routed to it, so its rows are
// read once a batch. llama's graph holds gate, up, act(gate, up) and down in that order (build_moe_ffn); when the
// first three arrive together and the activation is ReLU-family, gate runs first and up computes only the rows
// of neurons whose gate fired: the others' act(gate) is exactly 0, so the result equals the dense one.
#pragma once

#include <stdbool.h>

#include "graph/activation.h"
#include "ggml.h"
#include "core/pi2_context.h"

struct pi2_binding;

struct pi2_expert_region {
    int                  layer;
    int                  n_nodes;    // graph nodes from the first product through glu: 3, 4 (fused, below) or 5 (biased)
    struct ggml_tensor * up, * gate; // the MUL_MAT_ID products, f32 [n_ff, n_expert_used, n_tokens]
    // gpt-oss: ADD_ID(product, the experts' bias [n_ff, n_expert], ids) of gate and of up, the GLU's inputs; else NULL
    struct ggml_tensor * gate_biased, * up_biased;
    struct ggml_tensor * glu;        // act(gate, up), the node down reads
    struct ggml_tensor * down;       // down's product of glu when it follows directly, else NULL
    struct pi2_ffn_act   act;        // what PI2 computes into glu
    // ffn_gate_up_exps (each expert's gate rows, then its up rows) and its product, split into the gate and up
    // halves gate and up point at; the graph holds the product, its two views and the GLU of them. A region
    // holding them is used where it was found, never copied.
    struct ggml_tensor   fused_w[2], fused_p[2];
};

// true when node i of g (a MUL_MAT_ID of ffn_gate_exps) is followed by the same layer's up product of the same
// input and ids and their GLU (gpt-oss: each product with its bias added by an ADD_ID first), or (ffn_gate_up_exps)
// by the two halves' views and their GLU; the activation is the one the model states, else the GLU op's
bool pi2_expert_region_find(struct ggml_cgraph * g, int i, const struct pi2_stated_act * stated, struct pi2_expert_region * r);

// the region's three nodes: gate, then up (rows of fired neurons only, for a ReLU-family activation), then act
enum ggml_status pi2_exec_expert_region(struct pi2_backend_ctx * ctx, const struct pi2_expert_region * r);

// With a binding whose sidecar describes the model's experts (FORMAT.md, "MoE sidecars") in oracle/predicted mode and
// a decode batch: each (token, routed expert) runs the sparse engine on the sidecar layer of that (layer, expert),
// down included (4 nodes consumed); returns 0 where that does not apply (the dense path then runs)
int pi2_exec_expert_region_sparse(struct pi2_backend_ctx * ctx, struct pi2_binding * b, const struct pi2_expert_region * r,
                                  enum ggml_status * st);

// one MUL_MAT_ID of an expert weight alone (down, or products whose region did not match)
enum ggml_status pi2_exec_mul_mat_id(struct pi2_backend_ctx * ctx, struct ggml_tensor * node);

// ADD_ID: out[:, s, t] = a[:, s, t] + b[:, ids[s, t]] (an expert's bias added to its product, as ggml-cpu adds it)
enum ggml_status pi2_exec_add_id(struct pi2_backend_ctx * ctx, struct ggml_tensor * node);

// shapes PI2 computes for ADD_ID: f32 a [n, n_used, n_tokens] (contiguous rows), f32 b [n, n_expert], i32 ids
bool pi2_add_id_shapes(const struct ggml_tensor * op);

// shapes PI2 computes: an own expert weight [k, rows, n_expert] by f32 columns [k, n_b, n_tokens] with i32 ids
// [n_used, n_tokens] into f32 [rows, n_used, n_tokens]
bool pi2_expert_mul_mat_id_shapes(const struct ggml_tensor * op);
