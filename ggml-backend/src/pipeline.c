#include "pipeline.h"

#include <stdio.h>

#include "cluster_sched.h"
#include "memory_budget.h"
#include "pi2_clock.h"
#include "pi2_log.h"
#include "predictor.h"

static const uint8_t * pi2_cache_bundle_get(struct pi2_sparse_plan * p, int64_t s, uint64_t * wait_ns) {
    return pi2_cache_get(p->cache, p->layer, s, wait_ns);
}

// only a bundle already in memory: one still being read is prefetched by no one
static const uint8_t * pi2_cache_bundle_peek(const struct pi2_sparse_plan * p, int64_t s) {
    return pi2_cache_peek(p->cache, p->layer, s);
}

// which slots this token needs (thread ith's clusters), then one thread queues the reads
static void pi2_pipeline_request(struct pi2_sparse_plan * p, int ith, int nth, int64_t t) {
    const bool predicted = p->select != PI2_SELECT_ALL;
    for (int64_t c = ith; c < p->n_clusters; c += nth) {
        const int64_t s0 = c * PI2_CLUSTER;
        const int64_t s1 = s0 + PI2_CLUSTER < p->n_ff ? s0 + PI2_CLUSTER : p->n_ff;
        for (int64_t s = s0; s < s1; ++s) {
            const bool selected = !predicted || pi2_predictor_selects(p->z[s], p->L->cutoff, p->rule == PI2_RULE_RELU, p->op);
            p->want[s] = selected ? 1 : (p->select == PI2_SELECT_CHECKED ? 2 : 0);
        }
    }
    #pragma omp barrier
    if (ith == 0) {
        if (pi2_cache_request(p->cache, p->layer, p->want, &p->io, p->error, sizeof(p->error)) != 0) {
            atomic_store(&p->failed, 1);
        } else if (p->prefetch_layer >= 0 && t == p->n_tokens - 1) {
            // the next layer's first bundles queue behind this one's (the last token of a batch: the others
            // request this layer again)
            pi2_cache_prefetch(p->cache, p->prefetch_layer, false);
        }
    }
    #pragma omp barrier
}

enum ggml_status pi2_pipeline_run(struct pi2_binding * b, struct pi2_sparse_plan * p, int n_threads) {
    pthread_mutex_lock(&b->cache_lock);
    if (b->cache == NULL) {
        pthread_mutex_unlock(&b->cache_lock);
        if (b->env_budget == 0 ||
            pi2_binding_size_cache(b, b->env_budget, b->env_budget / 20, b->error, sizeof(b->error)) != 0) {
            if (b->env_budget == 0) {
                snprintf(b->error, sizeof(b->error), "sidecar %s: the model was loaded for a memory budget, but none was "
                         "set (pi2_gguf.Llama(memory_budget=) or PI2_MEMORY_BUDGET)", b->sc->path);
            }
            PI2_LOG_REFUSAL("pi2: %s\n", b->error);
            return GGML_STATUS_FAILED;
        }
        pthread_mutex_lock(&b->cache_lock);
    }
    p->source      = PI2_SOURCE_CACHE;
    p->cache       = b->cache;
    p->bundle_get  = pi2_cache_bundle_get;
    p->bundle_peek = pi2_cache_bundle_peek;
    p->request     = pi2_pipeline_request;
    // llama runs the layers in order, the last one followed by the first of the next token
    const int next = (p->layer + 1) % (int) b->sc->n_layer;
    const bool always = pi2_setting(&b->settings, b->defaults, PI2_SET_PREDICTOR) != 0.0;
    if (!pi2_predictor_runs(&b->layer[next].pred, atomic_load(&b->mode) == PI2_MODE_PREDICTED, always)) {
        p->prefetch_layer = next;
    }
    const uint64_t t0 = pi2_now_ns();
    pi2_sched_run(p, n_threads);
    // every read done (also after a failure, before entries are reused); the file unchanged meanwhile
    char err[sizeof(p->error)] = "";
    const int finished = pi2_cache_finish(p->cache, err, sizeof(err));
    const bool ok = !atomic_load(&p->failed) && finished == 0;
    if (!ok) { // the request's own error first, then a read error or a changed file
        snprintf(b->error, sizeof(b->error), "%s",
                 p->error[0] != '\0' ? p->error : err[0] != '\0' ? err : pi2_cache_error(p->cache));
    }
    if (ok && p->prefetch_layer >= 0) { // this layer's entries are free now: the rest of the next layer
        pi2_cache_prefetch(p->cache, p->prefetch_layer, true);
    }
    b->ffn_ns += pi2_now_ns() - t0;
    pthread_mutex_unlock(&b->cache_lock);
    if (!ok) {
        PI2_LOG_REFUSAL("pi2: %s\n", b->error);
        return GGML_STATUS_FAILED;
    }
    return GGML_STATUS_SUCCESS;
}
