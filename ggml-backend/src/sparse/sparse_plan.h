// One FFN layer's sparse decode of one batch, as the mechanisms share it: sparse_ffn.c builds it, the
// predictor (predictor.c) scores slots, the cluster scheduler (cluster_sched.c) runs the per-token phases
// across threads, the sparse kernels (sparse_kernels.c) compute a cluster's rows and the down columns
// through the bundle accessor, and on flash the pipeline (pipeline.c) fills that accessor from the neuron
// cache. Neurons are addressed by bundle slot (hottest first); PI2_CLUSTER slots make a cluster.
#pragma once

#include <math.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "ggml-cpu.h"
#include "ggml.h"
#include "dense/dot_tokens.h"
#include "model/model_binding.h"
#include "flash/neuron_cache.h"
#include "sparse/predictor.h"

#define PI2_CLUSTER 32 // neurons per cluster: one thread's unit of work

// Which neurons fire, from the gate (and up) values.
enum pi2_rule {
    PI2_RULE_ALL,       // dense mode on flash: every neuron, no threshold
    PI2_RULE_RELU,      // ReLU family: act_gate(gate) != 0, i.e. gate > 0 (FATReLU: gate > t); dReLU also needs up > 0
    PI2_RULE_THRESHOLD, // |act(gate)| > the layer threshold (CATS)
    PI2_RULE_PRODUCT,   // past the threshold, and |act(gate) * up| > the product threshold
};

// Which slots get their gate row computed.
enum pi2_select {
    PI2_SELECT_ALL,       // every slot (oracle and dense modes, layers whose predictor does not pay)
    PI2_SELECT_PREDICTED, // the slots the predictor selects
    PI2_SELECT_CHECKED,   // those, plus every other gate to count what the predictor missed (recall check)
};

// Where gate/up rows come from.
enum pi2_source {
    PI2_SOURCE_MAPPED,     // the sidecar's bundles, mapped in RAM
    PI2_SOURCE_MODEL_ROWS, // the model's own contiguous matrices, in row order (RAM, every gate computed)
    PI2_SOURCE_CACHE,      // bundles through the neuron cache (flash)
};

// How clusters go to threads.
enum pi2_assign {
    PI2_ASSIGN_INTERLEAVED, // every nth cluster in slot order: hot (pinned) ones first on each thread
    PI2_ASSIGN_BALANCED,    // contiguous runs of equal predicted work (RAM, ReLU models with a predictor)
};

// an active neuron in the down list: its bundle and act(gate) * up
struct pi2_active {
    const uint8_t * bundle;
    float           a;
};

struct pi2_thread_stats {
    int64_t  predicted; // candidates whose gate row was computed
    int64_t  admitted;  // of those, past the threshold: their up rows were computed
    int64_t  active;    // of those, active (rule product: past the product threshold too)
    int64_t  missed;    // past the threshold but not predicted (recall check only)
    uint64_t wait_ns;   // flash: time spent waiting for bundles
    char     pad[24];   // one cache line per thread
};

struct pi2_sparse_plan;
struct pi2_pipeline;

// flash: the pipeline's request of a token's bundles, in two steps the scheduler separates with its own barriers
// (cluster_sched.h): every thread marks the slots its clusters want (p->want; a prompt batch marks its own), then
// one thread queues their reads. Neither waits at a barrier.
typedef void (*pi2_mark_fn)(struct pi2_sparse_plan * p, int ith, int nth);
typedef void (*pi2_submit_fn)(struct pi2_sparse_plan * p, int64_t t);

struct pi2_sparse_plan {
    // the graph: FFN input, f32 [n_embd, n_tokens]; outputs [n_ff, n_tokens] and down's [n_embd, n_tokens]
    const struct ggml_tensor * x;
    struct ggml_tensor *       gate, * up, * glu, * down;
    const struct ggml_tensor * w_down;
    struct pi2_ffn_act         act;
    const float *              bias_gate, * bias_up; // [n_ff] model order, added to the products before act; or NULL
    int64_t                    n_embd, n_ff, rank, n_tokens, n_clusters;

    // the sidecar's layer and its prepared predictor
    const struct pi2_sidecar_layer * L;
    const struct pi2_binding_layer * B;
    int                              layer;

    // the choices (sparse_ffn.c makes them once per layer)
    enum pi2_rule   rule;
    enum pi2_select select;
    enum pi2_source source;
    enum pi2_assign assign;
    bool            batch;           // flash, a prompt: its neurons requested once, each for every token (batch_ffn.h)
    bool            recall_check;    // counted as checked tokens (the check was asked for in predicted mode)
    float           down_sparse_max; // down by columns when at most this fraction is active

    // flash: the request hooks (pipeline.c) and the cache the bundle accessor reads (pi2_plan_bundle)
    pi2_mark_fn                  mark;
    pi2_submit_fn                submit;
    struct pi2_pipeline *        pipe;
    struct pi2_neuron_cache *    cache;
    int                          prefetch_layer; // flash: the next layer, if it reads every bundle; else -1
    uint8_t *                    want;           // [n_ff] flash: 1 = predicted, 2 = recall check only
    // a batch whose tokens each compute only their own predicted neurons (PI2_BATCH_NEURONS=token, as decode computes
    // them): [n_tokens][n_ff] 1 where token t's predictor selects slot s; NULL: every token computes the union
    uint8_t *                    token_want;
    struct pi2_cache_token_stats io;
    atomic_int                   failed;
    // failed as the thread that requested a token's bundles read it, before the barrier after the request: what
    // every thread acts on there (failed itself may be set meanwhile by a thread already in its clusters)
    bool                         request_failed;
    char                         error[512];

    // kernels: ggml-cpu's dot products and activation converters per type
    ggml_vec_dot_t    gate_dot, up_dot, pred_dot, down_dot;
    pi2_dot_tokens_t  gate_dot_tokens, up_dot_tokens; // a batch's rows against several tokens a call, or NULL
    ggml_from_float_t to_gate_vdt, to_up_vdt, to_down_vdt, to_pred_vdt;

    // workspace (one arena, sparse_ffn.c)
    char *                    xq, * xq_up; // [n_tokens] rows in gate's / up's vec_dot type (the same when they agree)
    size_t                    xq_stride, xq_up_stride;
    char *                    xp;          // x in the predictor's vec_dot type
    float *                   h;           // [rank] predictor hidden layer
    float *                   z;           // [n_ff] predictor scores, slot order
    float *                   y;           // [n_split][n_embd] partial down sums (batch: [nth][n_tokens][n_embd])
    float *                   acts;        // batch: [nth][n_tokens][PI2_CLUSTER] a cluster's GLU values
    float *                   colf;        // batch: [nth][PI2_CLUSTER][n_embd] a cluster's down columns as floats
    int32_t *                 tok;         // batch: [nth][2][n_tokens] the tokens a neuron's gate, then up, is dotted with
    float *                   tok_vals;    // batch: [nth][2][n_tokens] those dot products
    float *                   tmp;         // [max(nth, n_split)][tmp_stride] dequantization scratch
    int64_t                   tmp_stride;
    // the down list in cluster order, whichever thread computed a cluster: cluster c's active neurons are
    // list[c * PI2_CLUSTER ..] (n_act[c] of them). The down pass splits it evenly between threads, so its
    // sums depend only on the list and the thread count, not on who computed what.
    struct pi2_active *       list;        // [n_ff]
    int32_t *                 n_act;       // [n_clusters]
    int32_t *                 weight;      // [n_clusters] balanced assignment: 1 + neurons predicted in cluster c
    int32_t *                 cand;        // [nth][n_ff] each thread's candidate slots
    struct pi2_thread_stats * stats;       // [nth]
    char *                    gluq;        // glu row in down's vec_dot type (dense down)
    int                       nth;
    // the down list is summed in n_split partial rows, then those in order: the thread count the sums follow,
    // whatever number of threads runs them (a routed expert in RAM runs on one thread of several)
    int                       n_split;
    int64_t                   n_down_sparse; // tokens whose down ran by columns
};

// the predictor selects slot s (p->z holds the token's scores)
static inline bool pi2_plan_selects(const struct pi2_sparse_plan * p, int64_t s) {
    return pi2_predictor_selects(p->z[s], p->L->cutoff, &p->act);
}

// a neuron's gate and up values: its products plus the region's biases (gpt-oss's experts), as llama adds them
static inline float pi2_plan_gate(const struct pi2_sparse_plan * p, float dot, int64_t neuron) {
    return p->bias_gate != NULL ? dot + p->bias_gate[neuron] : dot;
}

static inline float pi2_plan_up(const struct pi2_sparse_plan * p, float dot, int64_t neuron) {
    return p->bias_up != NULL ? dot + p->bias_up[neuron] : dot;
}

// a neuron's gate fires: every one under rule all, g past the activation's cut (0, or FATReLU's t) under
// relu, else |act| above the threshold
static inline bool pi2_fires(const struct pi2_sparse_plan * p, float g, float act) {
    switch (p->rule) {
        case PI2_RULE_ALL:  return true;
        case PI2_RULE_RELU: return g > p->act.threshold;
        default:            return fabsf(act) > p->L->threshold;
    }
}

// a neuron whose gate fired is active, given a = act(g) * up and its up value u: past the product threshold
// (rule product), up positive (dReLU)
static inline bool pi2_active(const struct pi2_sparse_plan * p, float a, float u) {
    return !((p->rule == PI2_RULE_PRODUCT && !(fabsf(a) > p->L->product_threshold)) ||
             (p->rule == PI2_RULE_RELU && p->act.kind == PI2_ACT_DRELU && !(u > 0.0f)));
}

// The one accessor of bundle bytes; kernels reach bundles through nothing else. In RAM: the sidecar's mapping. On
// flash: the neuron cache's entry, waiting while its read is in flight (the request queued it). NULL, with the
// plan marked failed, if its read failed.
static inline const uint8_t * pi2_plan_bundle(struct pi2_sparse_plan * p, int64_t s, struct pi2_thread_stats * st) {
    if (p->source != PI2_SOURCE_CACHE) {
        return p->B->bundles + pi2_slot_offset(p->L, s);
    }
    const uint8_t * b = pi2_cache_get(p->cache, p->layer, s, &st->wait_ns);
    if (b == NULL) {
        atomic_store(&p->failed, 1);
    }
    return b;
}

// slot s's bundle if it is in memory already, else NULL (never waits: for prefetching into the CPU's caches)
static inline const uint8_t * pi2_plan_bundle_peek(const struct pi2_sparse_plan * p, int64_t s) {
    return p->source != PI2_SOURCE_CACHE ? p->B->bundles + pi2_slot_offset(p->L, s) : pi2_cache_peek(p->cache, p->layer, s);
}
