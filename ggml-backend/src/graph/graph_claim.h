// What PI2 takes from llama's graph: which nodes it claims (supports_op: the FFN products of weights in its
// buffers, their GLU, a patched graph's elementwise spelling of a stated ReLU-family activation, the routed
// experts, the tables a memory budget leaves in the model file), llama's weight-placement probe (placement.h),
// and the check of each scheduled graph that refuses, at load, an FFN a memory budget could not run.
#pragma once

#include <stdbool.h>

#include "ggml-backend-impl.h"

bool pi2_claim_op(ggml_backend_dev_t dev, const struct ggml_tensor * op);
// every FFN of a bound model in graph g is one PI2 can run, else its binding records why (graph_optimize)
void pi2_claim_check_graph(struct ggml_cgraph * g);
