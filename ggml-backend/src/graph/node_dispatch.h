// Runs the nodes of a graph llama gave PI2: an FFN region (a layer's gate, up, GLU and down; or its routed
// experts) as one, through the route route.h picks (sparse for a model with a sidecar, else dense), and every
// other claimed node alone (a product, a GLU, an embedding's rows, the output matrix).
#pragma once

#include "core/pi2_context.h"

// Node i of g (flagged for compute): the number of nodes it consumed (>= 1), *st failed where it could not run
// (an op PI2 does not run, a refusal the binding records); nodes computed are counted.
int pi2_dispatch_node(struct pi2_backend_ctx * ctx, struct ggml_cgraph * g, int i, enum ggml_status * st);
