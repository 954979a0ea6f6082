// The one routing decision of a compute: how an FFN region (a layer's dense FFN, or its routed experts) of a
// batch of n tokens runs, given the model's binding (sidecar, mode, RAM or flash) and its settings. Every other
// place asks here instead of testing modes or PI2_SPARSE_BATCH / PI2_PROMPT itself. Which layers PI2 holds at
// all is the load's decision (placement.h); what a held region then computes is this one.
#pragma once

#include <stdbool.h>
#include <stdint.h>

#include "core/config.h"
#include "graph/activation.h"

struct pi2_binding;

enum pi2_route {
    PI2_ROUTE_DENSE,         // PI2's dense kernels (dense/): no sidecar, dense mode in RAM, an in-RAM prompt batch
    PI2_ROUTE_SPARSE_TOKENS, // the sparse engine token by token (sparse/cluster_sched.c; routed pairs in experts/)
    PI2_ROUTE_SPARSE_BATCH,  // flash, a prompt batch: its bundles requested once, each cluster for every token
};

// The route of a region PI2 computes: b NULL for a model without a sidecar.
enum pi2_route pi2_route_region(const struct pi2_binding * b, int64_t n_tokens);

// Whether a node of a prompt batch of n_tokens over weights PI2 holds in RAM (a product, or their GLU) goes to
// ggml-cpu instead (PI2_PROMPT=cpu): past PI2_SPARSE_BATCH, and never the GLU, down or routed-expert nodes of a
// model whose ReLU-family activation ggml-cpu would compute as the graph's SwiGLU. own: the model's settings
// (NULL: the defaults'); gate_or_up: the node is the product of a dense FFN's gate or up weight.
bool pi2_route_to_cpu(const struct pi2_settings * own, const struct pi2_settings * defaults, const struct pi2_stated_act * act,
                      bool gate_or_up, int64_t n_tokens);
