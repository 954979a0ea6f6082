// State of the PI2 device (one per process) and of each backend stream (one per llama context).
// All mutable state of the plugin lives in these two structs.
#pragma once

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include "ggml-backend-impl.h"
#include "ggml-pi2.h"
#include "core/config.h"
#include "graph/activation.h"
#include "dense/glu.h"

struct pi2_binding;

#define PI2_MAX_BINDINGS 64

struct pi2_device_ctx {
    struct ggml_backend_buffer_type buft;
    struct ggml_backend_buffer_type flash_buft; // weights of models with a memory budget (not host memory)
    struct pi2_glu_tables           glu;
    struct pi2_counters             counters; // updated with atomic adds: several contexts may compute at once
    struct pi2_config               config;   // the environment at registration; config.error refuses every load

    // model loads (binding_registry.c): PI2 weight buffers allocated while `pending` is set bind to it
    // (guarded by lock)
    pthread_mutex_t      lock;
    struct pi2_binding * pending;
    struct pi2_stated_act pending_act; // the activation the model being loaded states (its weight buffers keep it)
    struct pi2_stated_act env_act;     // PI2_SIDECAR's, for loads outside pi2_load_begin/end
    int                  next_binding_id;
    struct pi2_binding * bindings[PI2_MAX_BINDINGS]; // addressable by id; each holds a reference until released
    struct pi2_binding * env_binding;                // PI2_SIDECAR: bound by every load outside pi2_load_begin/end
    bool                 frontend_load;              // between pi2_load_begin and pi2_load_end
    bool                 announced;                  // the first load outside them said that PI2 is active
};

// The one device context of the process (ggml-pi2.c).
struct pi2_device_ctx * pi2_device_ctx(void);
// Registry setup at registration: the binding PI2_SIDECAR names, if any (binding_registry.c).
void pi2_registry_init(struct pi2_device_ctx * d);

struct pi2_backend_ctx {
    struct pi2_device_ctx * dev;
    int                     n_threads;
    // scratch of the node being computed (converted activations, sparse decode's per-thread buffers);
    // nodes run one after another, so one arena serves them all. Grows, never shrinks.
    char *                  work;
    size_t                  work_size;
    // a decode's routed experts (sparse in RAM, or read whole under a budget) run one per thread (expert_ffn.c), each
    // thread with a context of its own
    // for its scratch: [n_sub], made on first use
    struct pi2_backend_ctx * sub;
    int                      n_sub;
    // per ggml type, whether the several-token dot kernel gives vec_dot's values (dense/dot_tokens.h: 0 not checked
    // yet, 1 it does, -1 it does not or there is none): checked once, not at every batch (~0.1 ms for Q4_K)
    int8_t                   dot_tokens_checked[GGML_TYPE_COUNT];
};

// ctx->work with at least size bytes (64-byte aligned), or NULL when memory runs out
static inline char * pi2_work_reserve(struct pi2_backend_ctx * ctx, size_t size) {
    if (ctx->work_size < size) {
        const size_t rounded = (size + 4095) & ~(size_t) 4095;
        void * p = NULL;
        if (posix_memalign(&p, 64, rounded) != 0) {
            return NULL;
        }
        free(ctx->work);
        ctx->work      = p;
        ctx->work_size = rounded;
    }
    return ctx->work;
}

static inline void pi2_count(uint64_t * counter, uint64_t v) {
    __atomic_fetch_add(counter, v, __ATOMIC_RELAXED);
}

static inline void pi2_count_layer_seen(struct pi2_counters * c, int layer) {
    uint32_t seen = __atomic_load_n(&c->n_layers, __ATOMIC_RELAXED);
    while ((uint32_t) (layer + 1) > seen &&
           !__atomic_compare_exchange_n(&c->n_layers, &seen, (uint32_t) (layer + 1), false, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
    }
}
