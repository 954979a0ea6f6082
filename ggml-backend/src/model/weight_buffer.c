#include "model/weight_buffer.h"

#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>

#include "core/build_info.h"
#include "core/pi2_context.h"
#include "core/pi2_log.h"
#include "flash/memory_budget.h"
#include "model/model_binding.h"

// Once per process, at the first load outside pi2_load_begin/end (llama.cpp's tools; pi2_gguf says it
// itself): that PI2 is active and what PI2_* made of it. On stderr: the tools show ggml's INFO only with -v.
static void pi2_announce(const struct pi2_config * c) {
    static const char * const modes[] = { "dense", "oracle", "predicted" };
    if (c->sidecar[0] == '\0') {
        fprintf(stderr, "pi2: PI2 backend %s active: FFN dense, in RAM (no PI2_SIDECAR)%s\n", PI2_VERSION,
                pi2_setting(NULL, &c->defaults, PI2_SET_LAYERS) != 0.0
                    ? "" : "; left to ggml-cpu unless the model states a ReLU-family activation (PI2_LAYERS=auto)");
    } else if (c->memory_budget > 0) {
        fprintf(stderr, "pi2: PI2 backend %s active: mode %s, sidecar %s, FFN on flash within a memory budget of %.0f MB\n",
                PI2_VERSION, modes[c->mode], c->sidecar, (double) c->memory_budget / 1e6);
    } else {
        fprintf(stderr, "pi2: PI2 backend %s active: mode %s, sidecar %s, FFN in RAM\n", PI2_VERSION, modes[c->mode], c->sidecar);
    }
}

// the announcement, at the first load outside pi2_load_begin/end (d->lock held)
void pi2_announce_once(struct pi2_device_ctx * d) {
    if (!d->frontend_load && !d->announced) {
        pi2_announce(&d->config);
        d->announced = true;
    }
}

// the buffer context of a new buffer, bound to the pending model binding; NULL (logged) on failure
struct pi2_buffer_ctx * pi2_buffer_ctx_new(void * data, bool owned) {
    struct pi2_device_ctx * dctx = pi2_device_ctx();
    pthread_mutex_lock(&dctx->lock);
    if (dctx->config.error[0] != '\0') {
        PI2_LOG_REFUSAL("pi2: %s\n", dctx->config.error);
        pthread_mutex_unlock(&dctx->lock);
        return NULL;
    }
    pi2_announce_once(dctx);
    // the first buffer of a load: the frontend has set this model's settings by now
    if (dctx->pending != NULL && pi2_binding_prepare(dctx->pending) != 0) {
        PI2_LOG_REFUSAL("pi2: %s\n", dctx->pending->error);
        pthread_mutex_unlock(&dctx->lock);
        return NULL;
    }
    // PI2_MEMORY_BUDGET's model: a buffer after the weights were uploaded is a context's compute buffer, and
    // model and KV cache are resident by then, so the cache is sized now and a budget that cannot work is
    // refused while the tool is loading (the context fails), not at its first request
    struct pi2_binding * eb = dctx->env_binding;
    if (dctx->pending != NULL && dctx->pending == eb && eb->flash && eb->env_budget > 0 && atomic_load(&eb->uploading) &&
        !pi2_binding_has_cache(eb) &&
        pi2_binding_size_env_cache(eb) != 0) {
        PI2_LOG_REFUSAL("pi2: PI2_MEMORY_BUDGET: %s\n", eb->error);
        pthread_mutex_unlock(&dctx->lock);
        return NULL;
    }
    struct pi2_buffer_ctx * bc = calloc(1, sizeof(*bc));
    if (bc != NULL) {
        bc->data    = data;
        bc->owned   = owned;
        bc->binding = dctx->pending;
        bc->act     = dctx->pending_act;
        if (bc->binding != NULL) {
            pi2_binding_ref(bc->binding);
        }
    }
    pthread_mutex_unlock(&dctx->lock);
    return bc;
}

void pi2_buffer_ctx_free(struct pi2_buffer_ctx * bc) {
    pi2_binding_unref(bc->binding);
    free(bc);
}

bool pi2_pending_load_flash(bool before_upload) {
    struct pi2_device_ctx * d = pi2_device_ctx();
    pthread_mutex_lock(&d->lock);
    const bool flash = d->pending != NULL && d->pending->flash && !(before_upload && atomic_load(&d->pending->uploading));
    pthread_mutex_unlock(&d->lock);
    return flash;
}

bool pi2_is_pi2_buft(ggml_backend_buffer_type_t buft) {
    const struct pi2_device_ctx * d = pi2_device_ctx();
    return buft == &d->buft || buft == &d->flash_buft;
}

struct pi2_binding * pi2_weight_binding(const struct ggml_tensor * w) {
    if (w == NULL || w->buffer == NULL || !pi2_is_pi2_buft(w->buffer->buft)) {
        return NULL;
    }
    // the buffers of a model loaded without memory (no_alloc: llama's parameter fitting) have no context
    const struct pi2_buffer_ctx * bc = w->buffer->context;
    return bc != NULL ? bc->binding : NULL;
}

// the FFN activation the model of weight w states; llama's placement probe asks with a zero-size buffer,
// which has no context: the pending load's
struct pi2_stated_act pi2_weight_act(const struct ggml_tensor * w) {
    struct pi2_device_ctx * d = pi2_device_ctx();
    if (w == NULL || w->buffer == NULL || !pi2_is_pi2_buft(w->buffer->buft)) {
        return (struct pi2_stated_act) { 0 };
    }
    const struct pi2_buffer_ctx * bc = w->buffer->context;
    if (bc != NULL) {
        return bc->act;
    }
    pthread_mutex_lock(&d->lock);
    const struct pi2_stated_act a = d->pending_act;
    pthread_mutex_unlock(&d->lock);
    return a;
}
