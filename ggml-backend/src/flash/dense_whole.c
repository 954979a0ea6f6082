#include "flash/dense_whole.h"

#include <pthread.h>
#include <stdio.h>

#include "core/pi2_log.h"
#include "dense/ffn_exec.h"
#include "flash/expert_file.h"

enum ggml_status pi2_dense_whole_run(struct pi2_backend_ctx * ctx, struct pi2_binding * b, const struct pi2_ffn_region * r,
                                     int layer) {
    if (b->experts == NULL) {
        snprintf(b->error, sizeof(b->error), "sidecar %s: layer %d is read whole from the model file, but no memory budget "
                 "sized its cache", b->sc->path, layer);
        PI2_LOG_ERROR("pi2: %s\n", b->error);
        return GGML_STATUS_FAILED;
    }
    const struct ggml_tensor * const w[3] = { r->gate->src[0], r->up->src[0], r->down->src[0] };
    struct pi2_expert_read_stats io = { 0 };
    pthread_mutex_lock(&b->cache_lock); // the entry stays while the layer computes: one FFN at a time per model
    const int32_t e = 0;
    uint8_t cached = 0;
    pi2_expert_file_want(b->experts, layer, &e, 1, &cached, &io);
    pi2_expert_file_ahead(b->experts, layer, &io); // the next streaming layer reads while this one computes
    struct pi2_expert_matrices em;
    enum ggml_status st = GGML_STATUS_SUCCESS;
    if (pi2_expert_file_get(b->experts, layer, e, &em, &io, b->error, sizeof(b->error)) != 0) {
        st = GGML_STATUS_FAILED;
    }
    if (st == GGML_STATUS_SUCCESS && !pi2_expert_matrices_match(&em, w, b->model_path, layer, false, b->error, sizeof(b->error))) {
        st = GGML_STATUS_FAILED;
    }
    if (st == GGML_STATUS_SUCCESS) {
        // the region's products, their weights now where the cache entry holds them (outputs where llama put them)
        struct ggml_tensor wg = *w[0], wu = *w[1], wd = *w[2];
        wg.data = (void *) em.data[0];
        wu.data = (void *) em.data[1];
        wd.data = (void *) em.data[2];
        struct ggml_tensor gate = *r->gate, up = *r->up, down = *r->down;
        gate.src[0] = &wg;
        up.src[0]   = &wu;
        down.src[0] = &wd;
        struct pi2_ffn_region rr = *r;
        rr.gate = &gate;
        rr.up   = &up;
        rr.down = &down;
        st = pi2_exec_gate_up_act(ctx, &rr);
        if (st == GGML_STATUS_SUCCESS) {
            st = pi2_exec_mul_mat(ctx, &down);
        }
    } else {
        PI2_LOG_ERROR("pi2: %s\n", b->error);
    }
    pi2_expert_file_done(b->experts, layer, e);
    pthread_mutex_unlock(&b->cache_lock);
    pi2_expert_read_count(&ctx->dev->counters, r->layer, &io);
    return st;
}
