// State of the PI2 device (one per process) and of each backend stream (one per llama context).
// All mutable state of the plugin lives in these two structs.
#pragma once

#include <stddef.h>
#include <stdint.h>

#include "ggml-backend-impl.h"
#include "ggml-pi2.h"
#include "glu.h"

struct pi2_device_ctx {
    struct ggml_backend_buffer_type buft;
    struct pi2_glu_tables           glu;
    struct pi2_counters             counters; // updated with atomic adds: several contexts may compute at once
};

struct pi2_backend_ctx {
    struct pi2_device_ctx * dev;
    int                     n_threads;
    char *                  work;      // activations converted to vec_dot_type; grows, never shrinks
    size_t                  work_size;
};

static inline void pi2_count(uint64_t * counter, uint64_t v) {
    __atomic_fetch_add(counter, v, __ATOMIC_RELAXED);
}

static inline void pi2_count_layer_seen(struct pi2_counters * c, int layer) {
    uint32_t seen = __atomic_load_n(&c->n_layers, __ATOMIC_RELAXED);
    while ((uint32_t) (layer + 1) > seen &&
           !__atomic_compare_exchange_n(&c->n_layers, &seen, (uint32_t) (layer + 1), false, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
    }
}
