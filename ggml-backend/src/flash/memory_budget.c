// MAP_* and malloc_trim are outside C11/POSIX
#define _DEFAULT_SOURCE
#include "flash/memory_budget.h"

#include <stdio.h>
#if defined(__GLIBC__)
#include <malloc.h>
#endif
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/pi2_log.h"
#include "flash/bundle_io.h"
#include "flash/expert_file.h"
#include "ggml-pi2.h"
#include "flash/output_rows.h"
#include "flash/pipeline.h"
#include "graph/placement.h"
#include "sparse/predictor.h"

uint64_t pi2_cache_min_bytes(const struct pi2_sidecar * sc) {
    // with nothing hot, the cold segment must hold a whole layer (oracle and dense modes need every neuron)
    uint32_t n_bundles = 0;
    const uint32_t bsize = pi2_cache_entry_size(sc, &n_bundles);
    return (uint64_t) n_bundles * bsize;
}

uint64_t pi2_cache_ahead_bundles(const struct pi2_sidecar * sc, uint32_t ahead_pairs) {
    if (sc->n_expert == 0) {
        return 0;
    }
    uint32_t n_bundles = 0;
    pi2_cache_entry_size(sc, &n_bundles);
    return (uint64_t) ahead_pairs * n_bundles;
}

uint64_t pi2_cache_overhead_bytes(const struct pi2_sidecar * sc, uint32_t ahead_pairs) {
    uint32_t n_bundles = 0;
    pi2_cache_entry_size(sc, &n_bundles);
    uint64_t bundles = 0;
    for (uint32_t il = 0; il < sc->n_layer; ++il) {
        bundles += sc->layer[il].n_bundles;
    }
    // bundle maps, entry table (an entry per bundle at most), request buffers, frequency sort at planning
    // (request arrays: the request's, the two prefetch sets and the routed experts' two read-ahead sets)
    const uint64_t req_bundles = 3 * (uint64_t) n_bundles + 2 * pi2_cache_ahead_bundles(sc, ahead_pairs);
    return bundles * (sizeof(int32_t) + pi2_cache_entry_overhead() + 2 * sizeof(float)) +
           req_bundles * (sizeof(struct pi2_io_req) + sizeof(struct iovec) + sizeof(int32_t));
}

struct pi2_freq_item {
    float    f;
    uint32_t layer, bundle;
};

// by frequency, hottest first; ties (frequencies are counts over the profiled tokens) by layer and bundle,
// so that planning and creating the cache split the hot segment identically
static int pi2_freq_desc(const void * a, const void * b) {
    const struct pi2_freq_item * x = a, * y = b;
    if (x->f != y->f) {
        return (x->f < y->f) - (x->f > y->f);
    }
    if (x->layer != y->layer) {
        return (x->layer > y->layer) - (x->layer < y->layer);
    }
    return (x->bundle > y->bundle) - (x->bundle < y->bundle);
}

// whether layer il reads bundles (skip: pi2_cache_plan's)
static bool pi2_reads_bundles(const uint8_t * skip, uint32_t il) {
    return skip == NULL || skip[il] == 0;
}

// every bundle of the layers that read them as a pi2_freq_item, hottest first; NULL when out of memory. A bundle is
// as hot as its first slot (slots are in frequency order).
static struct pi2_freq_item * pi2_sorted_items(const struct pi2_sidecar * sc, const uint8_t * skip, size_t * n_items) {
    size_t n = 0;
    for (uint32_t il = 0; il < sc->n_layer; ++il) {
        n += pi2_reads_bundles(skip, il) ? sc->layer[il].n_bundles : 0;
    }
    struct pi2_freq_item * items = malloc((n > 0 ? n : 1) * sizeof(*items));
    if (items == NULL) {
        return NULL;
    }
    size_t k = 0;
    for (uint32_t il = 0; il < sc->n_layer; ++il) {
        const struct pi2_sidecar_layer * L = &sc->layer[il];
        for (uint32_t j = 0; pi2_reads_bundles(skip, il) && j < L->n_bundles; ++j) {
            items[k++] = (struct pi2_freq_item) { L->freq[L->order[(size_t) j * L->bundle_neurons]], il, j };
        }
    }
    qsort(items, n, sizeof(*items), pi2_freq_desc);
    *n_items = n;
    return items;
}

// cold entries the layer with the most non-hot bundles needs (oracle and dense modes read all of them)
static uint32_t pi2_cold_need(const struct pi2_sidecar * sc, const uint8_t * skip, const uint32_t * hot_k) {
    uint32_t need = 0;
    for (uint32_t il = 0; il < sc->n_layer; ++il) {
        const uint32_t rest = pi2_reads_bundles(skip, il) ? sc->layer[il].n_bundles - hot_k[il] : 0;
        need = rest > need ? rest : need;
    }
    return need;
}

bool pi2_cache_plan(const struct pi2_sidecar * sc, const uint8_t * skip, uint64_t bytes, uint64_t prefetch_bytes,
                    double cold_share, struct pi2_cache_plan * out) {
    memset(out, 0, sizeof(*out));
    uint32_t max_n_bundles = 0, most = 0; // the most bundles of any layer, and of any that reads them
    const uint32_t entry = pi2_cache_entry_size(sc, &max_n_bundles);
    for (uint32_t il = 0; il < sc->n_layer; ++il) {
        most = pi2_reads_bundles(skip, il) && sc->layer[il].n_bundles > most ? sc->layer[il].n_bundles : most;
    }
    if (bytes < (uint64_t) most * entry) {
        return false;
    }
    if (skip != NULL) {
        out->skip = malloc(sc->n_layer);
        if (out->skip == NULL) {
            return false;
        }
        memcpy(out->skip, skip, sc->n_layer);
    }
    if (entry == 0 || most == 0) { // no layer reads bundles (every FFN read whole from the model file): no neuron cache
        out->hot_k = calloc(sc->n_layer, sizeof(*out->hot_k));
        return out->hot_k != NULL;
    }
    // prefetch entries from at most a quarter of what the cache has beyond one whole layer, so a small
    // cache still pins its hottest neurons
    const uint64_t spare = (bytes / entry - most) / 4;
    const uint64_t n_pf  = prefetch_bytes / entry < spare ? prefetch_bytes / entry : spare;
    size_t n_items = 0;
    struct pi2_freq_item * items = pi2_sorted_items(sc, skip, &n_items);
    uint32_t * hot_k = calloc(sc->n_layer, sizeof(*hot_k));
    if (items == NULL || hot_k == NULL) {
        free(items);
        free(hot_k);
        pi2_cache_plan_free(out);
        return false;
    }
    // the longest prefix of the hottest bundles (up to 1 - the cold share of the cache) that leaves the
    // cold segment room for every non-hot bundle of any one layer. That room is not monotone in the
    // prefix (a layer still without hot neurons needs a whole layer of cold entries), so every prefix is
    // tried; no bisection.
    const uint64_t hot_cap = (uint64_t) ((1.0 - cold_share) * (double) bytes);
    uint64_t used = 0, best_used = 0;
    size_t best = 0;
    for (size_t k = 0; k < n_items; ++k) {
        used += sc->layer[items[k].layer].bundle_size;
        if (used > hot_cap) { // at most bytes: the cold share is 0 to 0.9
            break;
        }
        hot_k[items[k].layer]++;
        if ((bytes - used) / entry >= pi2_cold_need(sc, skip, hot_k) + n_pf) {
            best      = k + 1;
            best_used = used;
        }
    }
    out->hot_bytes   = best_used;
    out->hot_bundles = best;
    out->hot_neurons = 0;
    for (size_t k = 0; k < best; ++k) {
        const struct pi2_sidecar_layer * L = &sc->layer[items[k].layer];
        const uint64_t first = (uint64_t) items[k].bundle * L->bundle_neurons;
        out->hot_neurons += L->n_ff - first < L->bundle_neurons ? L->n_ff - first : L->bundle_neurons;
    }
    out->freq_cutoff = best > 0 ? items[best - 1].f : 1.0f;
    memset(hot_k, 0, sc->n_layer * sizeof(*hot_k));
    for (size_t k = 0; k < best; ++k) {
        hot_k[items[k].layer]++;
    }
    out->hot_k = hot_k;
    // no more cold entries than bundles besides the prefetch room: a budget far above the FFN (a model's
    // every bundle hot) once capped the cold segment below that room and the cache refused its own plan
    const uint64_t cold_entries = (bytes - best_used) / entry;
    const uint64_t cold_cap     = (uint64_t) n_items + n_pf;
    out->n_cold     = (uint32_t) (cold_entries < cold_cap ? cold_entries : cold_cap);
    out->n_prefetch = (uint32_t) n_pf;
    out->cold_bytes = (uint64_t) out->n_cold * entry;
    free(items);
    return true;
}

void pi2_cache_plan_free(struct pi2_cache_plan * plan) {
    free(plan->hot_k);
    free(plan->skip);
    plan->hot_k = NULL;
    plan->skip  = NULL;
}

uint64_t pi2_resident_bytes(void) {
#if defined(__GLIBC__)
    // freed heap (the predictors a flash binding dropped, loading's temporaries) stays resident until
    // trimmed: without this the cache got 61 or 95 MB of the same 600 MB budget from one load to the next
    malloc_trim(0);
#endif
    FILE * f = fopen("/proc/self/statm", "r");
    if (f == NULL) {
        return 0;
    }
    unsigned long long size = 0, resident = 0;
    const int n = fscanf(f, "%llu %llu", &size, &resident);
    fclose(f);
    const long page = sysconf(_SC_PAGESIZE);
    return n == 2 && page > 0 ? (uint64_t) resident * (uint64_t) page : 0;
}

static double pi2_mb(uint64_t v) {
    return (double) v / 1e6;
}

// Cold room for prefetching the next layer's first bundles while a layer finishes (PI2_PREFETCH_BYTES,
// default 8 MiB: ~3 ms of this disk, the time a Qwen2.5-1.5B layer's tail and attention leave it idle),
// where some layer reads every bundle in predicted mode; sparse layers do not know their bundles early.
static uint64_t pi2_prefetch_bytes(const struct pi2_binding * b) {
    const uint64_t bytes = (uint64_t) pi2_binding_setting(b, PI2_SET_PREFETCH_BYTES);
    if (b->sc->n_expert > 0) { // the room a batch's routed experts are read ahead into
        return pi2_binding_setting(b, PI2_SET_EXPERT_AHEAD) > 0 ? bytes : 0;
    }
    for (uint32_t il = 0; il < b->sc->n_layer; ++il) {
        if (!b->layer[il].read_whole && !pi2_predictor_runs(&b->layer[il].pred, true, false)) {
            return bytes;
        }
    }
    return 0;
}

// The dense layers this budget reads whole (PI2_DENSE_READS=auto), in pick[n_layer], and the bytes of their cache;
// 0 where none. A layer may be read so where its sparse decode is not expected to beat ggml-cpu's dense kernels (in RAM
// the placement rule leaves it to ggml-cpu: SiLU models at the product criterion's ~0.9 density, placement.h): a cached
// token then computes it from the model's own rows with the dense kernels, as in RAM, instead of a float axpy per down
// weight over the bundles' columns (MEASUREMENTS.md, 2026-11-29); not where its bundles hold other gate or up types
// than the model (convert --bundle-type: in RAM too it computes from the bundles), nor in oracle mode (it measures the
// bundles). As many of those (the smallest first, each an entry of the largest's size) as fit in `bytes` with every
// other layer's bundles in the hot segment: a token then reads nothing. Where none fits so, none is read whole: a
// token reads some bundles anyway, and they read fewer bytes than whole layers would (down columns re-quantized;
// MEASUREMENTS.md, 2026-11-28).
// The rule itself, over the sidecar, the model file and each layer's placement cost (cost[il] >= 1: not expected to
// beat ggml-cpu's dense kernels): the binding's pick below and the planner's (pi2_dense_whole_layers) both call it.
static uint64_t pi2_dense_whole_rule(const struct pi2_sidecar * sc, const char * model_path, const double * cost,
                                     uint64_t bytes, uint8_t * pick) {
    memset(pick, 0, sc->n_layer);
    if (sc->n_expert > 0 || sc->dense_whole || model_path == NULL) {
        return 0;
    }
    bool any = false; // the model file is read only where some layer may be read whole (ReLU-family models: none)
    for (uint32_t il = 0; il < sc->n_layer; ++il) {
        pick[il] = !sc->layer[il].whole && cost[il] >= 1.0;
        any = any || pick[il];
    }
    struct pi2_expert_file_layer * f = any ? calloc(sc->n_layer, sizeof(*f)) : NULL;
    uint32_t * order = any ? malloc(sizeof(uint32_t) * sc->n_layer) : NULL;
    char why[512];
    uint32_t n = 0;
    uint64_t bundles = 0; // every layer's bundles
    if (f != NULL && order != NULL && pi2_expert_file_layers(model_path, true, f, (int) sc->n_layer, why, sizeof(why)) == (int) sc->n_layer) {
        for (uint32_t il = 0; il < sc->n_layer; ++il) {
            const struct pi2_sidecar_layer * L = &sc->layer[il];
            bundles += (uint64_t) L->n_bundles * L->bundle_size;
            if (pick[il] && f[il].present && f[il].type[0] == L->gate_type && f[il].type[1] == L->up_type) {
                uint32_t k = n++; // insertion by entry size, smallest first
                for (; k > 0 && f[order[k - 1]].bytes > f[il].bytes; --k) {
                    order[k] = order[k - 1];
                }
                order[k] = il;
            }
        }
    }
    memset(pick, 0, sc->n_layer);
    uint32_t best = 0;
    uint64_t rest = bundles, best_bytes = 0;
    for (uint32_t k = 0; k < n; ++k) {
        const struct pi2_sidecar_layer * L = &sc->layer[order[k]];
        rest -= (uint64_t) L->n_bundles * L->bundle_size;
        const uint64_t whole = (uint64_t) (k + 1) * f[order[k]].bytes;
        if (whole + rest <= bytes) {
            best = k + 1;
            best_bytes = whole;
        }
    }
    for (uint32_t k = 0; k < best; ++k) {
        pick[order[k]] = 1;
    }
    free(f);
    free(order);
    return best_bytes;
}

static uint64_t pi2_dense_whole_pick(struct pi2_binding * b, uint64_t bytes, uint8_t * pick) {
    const struct pi2_sidecar * sc = b->sc;
    memset(pick, 0, sc->n_layer);
    if (pi2_binding_setting(b, PI2_SET_DENSE_READS) != 0.0 || atomic_load(&b->mode) == PI2_MODE_ORACLE) {
        return 0;
    }
    double * cost = malloc(sizeof(double) * (sc->n_layer > 0 ? sc->n_layer : 1));
    if (cost == NULL) {
        return 0; // nothing read whole: the bundles, as before this rule
    }
    for (uint32_t il = 0; il < sc->n_layer; ++il) {
        cost[il] = pi2_placement_layer_cost(b, b->defaults, il);
    }
    const uint64_t got = pi2_dense_whole_rule(sc, b->model_path, cost, bytes, pick);
    free(cost);
    return got;
}

int pi2_dense_whole_layers(const char * model_path, const char * sidecar_path, uint64_t cache_bytes, uint8_t * pick, int cap,
                           uint64_t * whole_bytes, char * err, size_t errlen) {
    *whole_bytes = 0;
    struct pi2_sidecar * sc = NULL;
    if (pi2_sidecar_open(sidecar_path, &sc, err, errlen) != 0) {
        return -1;
    }
    const int n = (int) sc->n_layer;
    double * cost = malloc(sizeof(double) * (size_t) (n > 0 ? n : 1));
    uint8_t * got = malloc((size_t) (n > 0 ? n : 1));
    if (cost == NULL || got == NULL) {
        snprintf(err, errlen, "sidecar %s: out of memory", sidecar_path);
        free(cost);
        free(got);
        pi2_sidecar_free(sc);
        return -1;
    }
    pi2_sidecar_default_costs(sc, cost, n);
    *whole_bytes = pi2_dense_whole_rule(sc, model_path, cost, cache_bytes, got);
    for (int il = 0; il < n && il < cap; ++il) {
        pick[il] = got[il];
    }
    free(cost);
    free(got);
    pi2_sidecar_free(sc);
    return n;
}

bool pi2_binding_has_cache(struct pi2_binding * b) {
    pthread_mutex_lock(&b->cache_lock);
    const bool has = b->pipe != NULL;
    pthread_mutex_unlock(&b->cache_lock);
    return has;
}

int pi2_binding_size_cache(struct pi2_binding * b, uint64_t budget, uint64_t reserved, char * err, size_t errlen) {
    if (!b->flash) {
        snprintf(err, errlen, "sidecar %s: the model was loaded without a memory budget", b->sc->path);
        return -1;
    }
    // the output matrix's copy stored in the sidecar is in RAM before the resident memory is measured
    if (b->output != NULL && pi2_output_finish(b->output) != 0) {
        snprintf(err, errlen, "%s", b->output->error);
        return -1;
    }
    pthread_mutex_lock(&b->cache_lock);
    if (b->pipe != NULL) { // a new budget replaces the cache (its hot segment is read again)
        pi2_pipeline_free(b->pipe);
        b->pipe = NULL;
    }
    pi2_expert_file_free(b->experts);
    b->experts = NULL;
    for (uint32_t il = 0; il < b->sc->n_layer; ++il) {
        b->layer[il].read_whole = false;
    }
    // PI2_EXPERT_READS=model: routed experts come whole from the model file into an expert cache of their own; so do
    // a dense model's FFN layers where the sidecar says so (pi2.dense_reads = model), each layer one expert
    const bool dense = b->sc->dense_whole;
    const bool whole = dense || (b->sc->n_expert > 0 && (b->sc->experts_whole || pi2_binding_setting(b, PI2_SET_EXPERT_READS) != 0.0));
    if (whole && b->model_path == NULL) {
        snprintf(err, errlen, "sidecar %s: %s read whole from the model file, whose path the load did not give "
                 "(pi2_gguf.Llama gives it)", b->sc->path, dense ? "the FFN layers are" : "PI2_EXPERT_READS=model: routed experts are");
        pthread_mutex_unlock(&b->cache_lock);
        return -1;
    }
    const uint64_t expert_entry = whole ? pi2_expert_file_entry_bytes(b->model_path, dense, err, errlen) : 0;
    if (whole && expert_entry == 0) {
        pthread_mutex_unlock(&b->cache_lock);
        return -1;
    }
    // the routers for guessing the next layer's experts, read before the resident memory counts them
    if (b->sc->n_expert > 0 && b->model_path != NULL && pi2_binding_setting(b, PI2_SET_EXPERT_GUESS) != 0.0 &&
        pi2_binding_setting(b, PI2_SET_EXPERT_AHEAD) > 0 &&
        pi2_expert_guess_open(&b->guess, b->model_path, b->sc->n_model_layer, b->sc->routed, b->sc->n_expert, b->sc->n_embd,
                              err, errlen) < 0) {
        pthread_mutex_unlock(&b->cache_lock);
        return -1;
    }
    const uint64_t resident = pi2_resident_bytes();
    const uint32_t ahead_pairs = (uint32_t) pi2_binding_setting(b, PI2_SET_EXPERT_AHEAD);
    const uint64_t overhead = pi2_cache_overhead_bytes(b->sc, ahead_pairs) + PI2_BUDGET_MARGIN;
    // with whole experts, the neuron cache keeps what the sidecar's other layers need (dense FFNs, shared experts),
    // and the expert cache at least one expert
    const uint64_t min_cache = pi2_cache_min_bytes(b->sc) + expert_entry;
    const uint64_t fixed = resident + reserved + overhead;
    if (resident == 0 || budget < fixed + min_cache) {
        snprintf(err, errlen, "memory budget %.0f MB is too small for this model: it needs at least %.0f MB "
                 "(resident now %.0f MB: llama.cpp's weights and KV cache, the predictors %.0f MB, the runtime; "
                 "compute buffers %.0f MB; neuron cache at least %.0f MB, one layer's bundles (and one routed expert or "
                 "dense FFN layer read whole); tables and margin %.0f MB)%s",
                 pi2_mb(budget), pi2_mb(fixed + min_cache), pi2_mb(resident), pi2_mb(b->fixed_bytes), pi2_mb(reserved),
                 pi2_mb(min_cache), pi2_mb(overhead),
                 // the KV cache is llama's, sized by the context: the tools default to the model's training context
                 // (Qwen2.5's 32,768 tokens: 940 MB) where pi2_gguf asks for what the app gives
                 resident > budget ? "; a smaller context (n_ctx, the tools' -c) shrinks llama.cpp's KV cache" : "");
        pthread_mutex_unlock(&b->cache_lock);
        return -1;
    }
    uint64_t cache_bytes = budget - fixed, cache_bytes_experts = 0;
    // PI2_CACHE_MAX caps the cache below what the budget allows: a smaller device's cache on this one
    const uint64_t cap = (uint64_t) pi2_binding_setting(b, PI2_SET_CACHE_MAX);
    if (cap > 0) {
        cache_bytes = cap < min_cache ? min_cache : (cap < cache_bytes ? cap : cache_bytes);
    }
    if (whole) {
        // the neuron cache: one layer's bundles, and every bundle of the layers that are not routed experts if half
        // the cache holds them (they are few: dense first layers, shared experts); the expert cache the rest
        uint64_t other = 0;
        for (uint32_t il = 0; il < b->sc->n_layer; ++il) {
            other += pi2_sidecar_layer_routed(b->sc, il) ? 0 : (uint64_t) b->sc->layer[il].n_bundles * b->sc->layer[il].bundle_size;
        }
        const uint64_t neuron_min = pi2_cache_min_bytes(b->sc);
        uint64_t neuron = neuron_min + (other < cache_bytes / 2 ? other : cache_bytes / 2);
        neuron = neuron + expert_entry > cache_bytes ? cache_bytes - expert_entry : neuron; // at least one expert
        b->experts = pi2_expert_file_open(b->model_path, dense, cache_bytes - neuron, (uint64_t) pi2_binding_setting(b, PI2_SET_IO_MAX_BYTES),
                                           err, errlen);
        if (b->experts == NULL) {
            pthread_mutex_unlock(&b->cache_lock);
            return -1;
        }
        cache_bytes_experts = cache_bytes - neuron;
        cache_bytes = neuron;
    }
    // a dense model's layers read whole where they fit with every other layer's bundles (PI2_DENSE_READS=auto)
    uint8_t * pick = whole ? NULL : calloc(b->sc->n_layer, 1);
    const uint64_t whole_bytes = pick != NULL ? pi2_dense_whole_pick(b, cache_bytes, pick) : 0;
    if (whole_bytes > 0) {
        b->experts = pi2_expert_file_open_layers(b->model_path, pick, (int) b->sc->n_layer, whole_bytes,
                                                 (uint64_t) pi2_binding_setting(b, PI2_SET_IO_MAX_BYTES), err, errlen);
        if (b->experts == NULL) {
            free(pick);
            pthread_mutex_unlock(&b->cache_lock);
            return -1;
        }
        for (uint32_t il = 0; il < b->sc->n_layer; ++il) {
            b->layer[il].read_whole = pick[il] != 0;
        }
        cache_bytes_experts = pi2_expert_file_bytes(b->experts);
        cache_bytes -= cache_bytes_experts;
    }
    struct pi2_cache_plan plan;
    // beside layers read whole every other layer's bundles are hot: nothing to prefetch, no room kept for it
    const bool planned = pi2_cache_plan(b->sc, whole_bytes > 0 ? pick : NULL, cache_bytes, whole_bytes > 0 ? 0 : pi2_prefetch_bytes(b),
                                        pi2_binding_setting(b, PI2_SET_COLD_SHARE), &plan);
    free(pick);
    if (!planned) {
        snprintf(err, errlen, "sidecar %s: cannot plan a neuron cache of %.0f MB", b->sc->path, pi2_mb(cache_bytes));
        pthread_mutex_unlock(&b->cache_lock);
        return -1;
    }
    const uint64_t inflight = (uint64_t) pi2_binding_setting(b, PI2_SET_IO_INFLIGHT_BYTES);
    const struct pi2_io_params io = {
        .threads      = (int) pi2_binding_setting(b, PI2_SET_IO_THREADS),
        .ring         = pi2_binding_setting(b, PI2_SET_IO_ENGINE) != 0.0,
        .inflight_max = inflight > 0 ? inflight : UINT64_MAX,
        .max_bytes    = (uint64_t) pi2_binding_setting(b, PI2_SET_IO_MAX_BYTES),
        .gap          = (uint64_t) pi2_binding_setting(b, PI2_SET_IO_GAP),
        .ahead_pairs  = ahead_pairs,
    };
    b->pipe = pi2_pipeline_create(b->sc, &plan, &io, err, errlen);
    if (b->pipe != NULL) { // where the budget went, for hosts that cannot ask (llama.cpp's tools: pi2_gguf prints its own)
        PI2_LOG_INFO("pi2: memory budget %.0f MB: resident at sizing %.0f MB (llama.cpp's weights and KV cache, the "
                     "predictors, the runtime), compute buffers %.0f MB, tables and margin %.0f MB; neuron cache hot %.0f "
                     "+ cold %.0f MB, expert cache %.0f MB\n", pi2_mb(budget), pi2_mb(resident), pi2_mb(reserved),
                     pi2_mb(overhead), pi2_mb(plan.hot_bytes), pi2_mb(plan.cold_bytes),
                     pi2_mb(b->experts != NULL ? cache_bytes_experts : 0));
    }
    pi2_cache_plan_free(&plan);
    b->ffn_ns = 0;
    b->budget_use = (struct pi2_budget_use) {
        .budget = budget, .resident = resident, .reserved = reserved, .tables = overhead - PI2_BUDGET_MARGIN,
        .margin = PI2_BUDGET_MARGIN,
    };
    pthread_mutex_unlock(&b->cache_lock);
    return b->pipe != NULL ? 0 : -1;
}

int pi2_binding_size_env_cache(struct pi2_binding * b) {
    if (b->env_budget == 0) {
        snprintf(b->error, sizeof(b->error), "sidecar %s: the model was loaded for a memory budget, but none was set "
                 "(pi2_gguf.Llama(memory_budget=) or PI2_MEMORY_BUDGET)", b->sc->path);
        return -1;
    }
    return pi2_binding_size_cache(b, b->env_budget, b->env_budget / 20, b->error, sizeof(b->error));
}

int pi2_budget_floor(const char * model_path, const char * sidecar_path, int64_t output_rows, struct pi2_budget_floor * out,
                     char * err, size_t errlen) {
    memset(out, 0, sizeof(*out));
    out->resident = pi2_resident_bytes(); // before the files below are read
    struct pi2_model_summary m;
    if (pi2_model_summary(model_path, &m, err, errlen) != 0) {
        return -1;
    }
    struct pi2_sidecar * sc = NULL;
    if (pi2_sidecar_open(sidecar_path, &sc, err, errlen) != 0) {
        return -1;
    }
    if (output_rows < 0) {
        output_rows = sc->output_rows > 0 ? sc->output_rows : 0;
    }
    for (uint32_t il = 0; il < sc->n_layer; ++il) {
        const uint64_t bytes = (uint64_t) sc->layer[il].n_bundles * sc->layer[il].bundle_size;
        out->one_layer = bytes > out->one_layer ? bytes : out->one_layer;
    }
    // layers read whole from the model file: the cache holds at least one of them (a dense layer, or a routed expert)
    const bool dense = sc->dense_whole, whole = dense || (sc->n_expert > 0 && sc->experts_whole);
    pi2_sidecar_free(sc);
    if (whole) {
        const uint64_t entry = pi2_expert_file_entry_bytes(model_path, dense, err, errlen);
        if (entry == 0) {
            return -1;
        }
        out->one_layer += entry;
    }
    const uint64_t outside = m.ffn_bytes + m.embedding_bytes +
                             (output_rows > 0 && m.output_copy_bytes > 0 ? m.output_bytes - m.output_copy_bytes : 0);
    out->non_ffn = m.file_size > outside ? m.file_size - outside : 0;
    out->margin  = PI2_BUDGET_MARGIN;
    out->need    = out->resident + out->non_ffn + out->one_layer + out->margin;
    return 0;
}
