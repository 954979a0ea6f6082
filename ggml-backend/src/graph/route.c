#include "graph/route.h"

#include <stdatomic.h>

#include "model/model_binding.h"

enum pi2_route pi2_route_region(const struct pi2_binding * b, int64_t n_tokens) {
    if (b == NULL) {
        return PI2_ROUTE_DENSE;
    }
    const bool batch = n_tokens > pi2_binding_setting(b, PI2_SET_SPARSE_BATCH);
    if (b->flash) { // the bundles are the weights' only copy: every mode runs the engine
        return batch ? PI2_ROUTE_SPARSE_BATCH : PI2_ROUTE_SPARSE_TOKENS;
    }
    return atomic_load(&b->mode) == PI2_MODE_DENSE || batch ? PI2_ROUTE_DENSE : PI2_ROUTE_SPARSE_TOKENS;
}

bool pi2_route_to_cpu(const struct pi2_settings * own, const struct pi2_settings * defaults, const struct pi2_stated_act * act,
                      bool gate_or_up, int64_t n_tokens) {
    if (pi2_act_overrides_glu(act) && !gate_or_up) {
        return false;
    }
    return pi2_setting(own, defaults, PI2_SET_PROMPT) != 0.0 && n_tokens > pi2_setting(own, defaults, PI2_SET_SPARSE_BATCH);
}
