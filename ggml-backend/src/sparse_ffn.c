#include "sparse_ffn.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <omp.h>

#include "column_axpy.h"
#include "dense_matmul.h"
#include "ffn_names.h"
#include "ggml-cpu.h"
#include "pi2_clock.h"
#include "pi2_log.h"

#define PI2_CLUSTER 32 // neurons per cluster: one thread's unit of work
// down columns are prefetched this many columns before they are added: a neuron's column is needed only
// after every cluster's gates and ups, by when a layer's worth of rows has pushed it out of L2, so it
// is not fetched together with its up row
#define PI2_DOWN_AHEAD 4
// in RAM, gate rows are prefetched this many candidates ahead, and up rows this many fired neurons
// ahead. Measured on the ReLU 1.5B model at rank 128 (2 threads): 8/8 took its gate/up pass from
// ~200 to ~175 us per layer; prefetching a whole cluster's gates at once (the previous scheme) or
// 16 ahead was slower, and so was prefetching up rows with the gates (30% of candidates do not fire)
#define PI2_GATE_AHEAD 8
#define PI2_UP_AHEAD   8

struct pi2_active {
    const uint8_t * bundle;
    float           a; // act(gate) * up
};

struct pi2_thread_stats {
    int64_t predicted; // candidates whose gate row was computed
    int64_t admitted;  // of those, past the threshold: their up rows were computed
    int64_t active;    // of those, active (method product: past the product threshold too)
    int64_t missed;    // past the threshold but not predicted (recall check only)
    uint64_t wait_ns;  // flash: time spent waiting for bundles
    char    pad[24];   // one cache line per thread
};

static size_t pi2_align64(size_t n) {
    return (n + 63) & ~(size_t) 63;
}

static float pi2_act(enum ggml_glu_op op, float g) {
    switch (op) {
        case GGML_GLU_OP_REGLU:     return g > 0.0f ? g : 0.0f;
        case GGML_GLU_OP_SWIGLU:    return g / (1.0f + expf(-g));
        case GGML_GLU_OP_GEGLU:     return 0.5f * g * (1.0f + tanhf(0.7978845608f * (g + 0.044715f * g * g * g)));
        case GGML_GLU_OP_GEGLU_ERF: return 0.5f * g * (1.0f + erff(g * 0.70710678f));
        default:                    return 0.0f;
    }
}

// the graph's GLU must be the activation the sidecar's thresholds were measured with
static enum ggml_glu_op pi2_glu_for(enum pi2_activation a) {
    switch (a) {
        case PI2_ACT_SILU:     return GGML_GLU_OP_SWIGLU;
        case PI2_ACT_GELU:     return GGML_GLU_OP_GEGLU;
        case PI2_ACT_GELU_ERF: return GGML_GLU_OP_GEGLU_ERF;
        case PI2_ACT_RELU:     return GGML_GLU_OP_REGLU;
        default:               return GGML_GLU_OP_COUNT;
    }
}

bool pi2_sparse_ffn_pattern(const struct ggml_tensor * glu, const struct ggml_tensor * down) {
    if (glu->op != GGML_OP_GLU || down->op != GGML_OP_MUL_MAT || down->src[1] != glu || glu->src[1] == NULL) {
        return false;
    }
    const enum ggml_glu_op op = ggml_get_glu_op(glu);
    if (op != GGML_GLU_OP_REGLU && op != GGML_GLU_OP_SWIGLU && op != GGML_GLU_OP_GEGLU && op != GGML_GLU_OP_GEGLU_ERF) {
        return false;
    }
    if (((const int32_t *) glu->op_params)[1] != 0) { // swapped: op_params[1] (ggml_glu_impl)
        return false;
    }
    int lg = -1, lu = -1, ld = -1;
    enum pi2_matrix mg, mu, md;
    const struct ggml_tensor * gate = glu->src[0];
    const struct ggml_tensor * up   = glu->src[1];
    return gate->op == GGML_OP_MUL_MAT && up->op == GGML_OP_MUL_MAT && gate->src[1] == up->src[1] &&
           pi2_ffn_weight_parse(gate->src[0]->name, &lg, &mg) && mg == PI2_MATRIX_GATE &&
           pi2_ffn_weight_parse(up->src[0]->name, &lu, &mu) && mu == PI2_MATRIX_UP &&
           pi2_ffn_weight_parse(down->src[0]->name, &ld, &md) && md == PI2_MATRIX_DOWN &&
           lg == lu && lu == ld && ggml_is_contiguous_1(glu) && ggml_is_contiguous_1(gate) && ggml_is_contiguous_1(up);
}

struct pi2_sparse_plan {
    // model side
    const struct ggml_tensor * x;     // FFN input, f32 [n_embd, n_tokens]
    struct ggml_tensor *       gate;  // outputs [n_ff, n_tokens]
    struct ggml_tensor *       up;
    struct ggml_tensor *       glu;
    struct ggml_tensor *       down;  // output [n_embd, n_tokens]
    const struct ggml_tensor * w_down;
    enum ggml_glu_op           op;
    // sidecar side
    const struct pi2_sidecar_layer * L;
    const struct pi2_binding_layer * B;
    bool                             relu;
    bool                             product; // method product: |act * up| decides among the admitted
    bool                             predicted;
    bool                             check;
    bool                             all_active; // dense mode on flash: every neuron, no threshold
    // in RAM, predicted mode without a predictor (it would cost more than it saves): every gate row is
    // computed anyway, so gate and up rows stream from the model's own contiguous matrices in row order
    // instead of from the 4 KiB-strided bundles
    bool                             model_rows;
    // flash: bundles come through the neuron cache; want[slot] 1 = predicted, 2 = recall check only
    struct pi2_neuron_cache *        cache;
    int                              layer;
    int                              prefetch_layer; // flash: the next layer, if it reads every bundle; else -1
    uint8_t *                        want;
    struct pi2_cache_token_stats     io;
    atomic_int                       failed;
    char                             error[512];
    int64_t                          n_embd, n_ff, rank, n_tokens;
    int64_t                          n_clusters; // of PI2_CLUSTER slots (model-rows path: chunks of rows)
    // kernels
    ggml_vec_dot_t     gate_dot, up_dot, pred_dot, down_dot;
    ggml_from_float_t  to_gate_vdt, to_up_vdt, to_down_vdt, to_pred_vdt;
    enum ggml_type     gate_vdt, up_vdt, down_vdt;
    float              down_sparse_max;
    // workspace
    char *                    xq;     // [n_tokens] rows of gate_vdt
    char *                    xq_up;  // [n_tokens] rows of up_vdt (== xq when the types agree)
    size_t                    xq_stride, xq_up_stride;
    char *                    xp;     // x in the predictor's vec_dot type
    float *                   h;      // [rank]
    float *                   z;      // [n_ff] predictor scores, slot order
    float *                   y;      // [nth][n_embd] partial down sums
    float *                   tmp;    // [nth][tmp_stride] dequantization scratch
    int64_t                   tmp_stride;
    // the down list in cluster order, whichever thread computed a cluster: cluster c's active neurons
    // are list[c * PI2_CLUSTER ..] (n_act[c] of them). The down pass splits it evenly between threads,
    // so its sums depend only on the list and the thread count, not on who computed what.
    struct pi2_active *       list;   // [n_ff]
    int32_t *                 n_act;  // [n_clusters]
    // in RAM on ReLU models with a predictor, threads take contiguous runs of clusters of equal
    // predicted work (weight[c]: 1 + neurons predicted in cluster c) instead of every nth cluster
    bool                      balance;
    int32_t *                 weight; // [n_clusters]
    int32_t *                 cand;   // [nth][n_ff] each thread's candidate slots
    struct pi2_thread_stats * stats;  // [nth]
    char *                    gluq;   // glu row in down_vdt (dense down)
    int                       nth;
    int64_t                   n_down_sparse; // tokens whose down ran by columns
};

static inline void pi2_prefetch(const void * p, size_t n) {
    for (size_t off = 0; off < n; off += 64) {
        __builtin_prefetch((const char *) p + off, 0, 3);
    }
}

// bundle of slot s: in the mapping, or (flash) from the cache once read; NULL if its read failed
static inline const uint8_t * pi2_bundle_at(struct pi2_sparse_plan * p, int64_t s, struct pi2_thread_stats * st) {
    if (p->cache == NULL) {
        return p->B->bundles + pi2_slot_offset(p->L, s);
    }
    const uint8_t * b = pi2_cache_get(p->cache, p->layer, s, &st->wait_ns);
    if (b == NULL) {
        atomic_store(&p->failed, 1);
    }
    return b;
}

// the predictor's score of slot s is above the layer's cutoff (p->z holds the token's scores)
static inline bool pi2_predict_slot(const struct pi2_sparse_plan * p, int64_t s) {
    const float z     = p->z[s];
    const float score = p->relu ? z : fabsf(pi2_act(p->op, z));
    return score > p->L->cutoff;
}

// the predictor's output layer for thread ith's share of slots: z = b2 + W2 h, as the W2 columns of the
// hidden units that fired added four at a time (a fixed order: z does not depend on the thread count)
static void pi2_predictor_scores(struct pi2_sparse_plan * p, int ith, int nth) {
    const struct pi2_binding_layer * B = p->B;
    const int64_t blk = ggml_blck_size(B->w2_type);
    const int64_t nb  = p->n_ff / blk;
    const int64_t z0 = nb * ith / nth * blk, z1 = nb * (ith + 1) / nth * blk;
    if (z1 == z0) {
        return;
    }
    const size_t off = ggml_row_size(B->w2_type, z0);
    float * z   = p->z + z0;
    float * tmp = p->tmp + (size_t) ith * p->tmp_stride;
    memcpy(z, B->b2_slot + z0, (size_t) (z1 - z0) * sizeof(float));
    struct pi2_column_sum sum = { .type = B->w2_type, .n = z1 - z0, .y = z, .tmp = tmp };
    for (int64_t k = 0; k < p->rank; ++k) {
        if (p->h[k] > 0.0f) {
            pi2_column_sum_add(&sum, p->h[k], B->w2 + (size_t) k * B->w2_stride + off);
        }
    }
    pi2_column_sum_finish(&sum);
    if (p->balance) { // z0 and z1 fall on cluster bounds (W2's blocks are clusters)
        for (int64_t c = z0 / PI2_CLUSTER; c < z1 / PI2_CLUSTER; ++c) {
            int32_t w = 1;
            for (int64_t s = c * PI2_CLUSTER; s < (c + 1) * PI2_CLUSTER; ++s) {
                w += pi2_predict_slot(p, s);
            }
            p->weight[c] = w;
        }
    }
}

static bool pi2_needs_convert(enum ggml_type t) {
    return t != GGML_TYPE_F32;
}

static void pi2_convert_row(ggml_from_float_t f, const float * src, void * dst, int64_t n) {
    if (f == NULL) {
        memcpy(dst, src, (size_t) n * sizeof(float));
    } else {
        f(src, dst, n);
    }
}

// What thread ith reads and writes for token t: the converted activations and the token's gate/up/GLU
// output rows
struct pi2_token_rows {
    const char *              xq, * xqu;
    float *                   gate_out, * up_out, * glu_out;
    struct pi2_thread_stats * st;
};

static struct pi2_token_rows pi2_token_rows(struct pi2_sparse_plan * p, int ith, int64_t t) {
    return (struct pi2_token_rows) {
        .xq       = p->xq + (size_t) t * p->xq_stride,
        .xqu      = p->xq_up + (size_t) t * p->xq_up_stride,
        .gate_out = (float *) ((char *) p->gate->data + t * p->gate->nb[1]),
        .up_out   = (float *) ((char *) p->up->data + t * p->up->nb[1]),
        .glu_out  = (float *) ((char *) p->glu->data + t * p->glu->nb[1]),
        .st       = &p->stats[ith],
    };
}

// a neuron fires: every one in dense mode (flash), g > 0 on ReLU models, else |act| above the threshold
static inline bool pi2_fires(const struct pi2_sparse_plan * p, float g, float act) {
    return p->all_active || (p->relu ? g > 0.0f : fabsf(act) > p->L->threshold);
}

// an admitted neuron's up row (at up_row) -> its up and GLU outputs and, if it is active, its entry e of
// the down list; returns whether it is
static inline bool pi2_emit_admitted(const struct pi2_sparse_plan * p, struct pi2_token_rows * r, int32_t neuron,
                                     const void * up_row, const uint8_t * bundle, float act, struct pi2_active * e) {
    float u = 0.0f;
    p->up_dot((int) p->n_embd, &u, 0, up_row, 0, r->xqu, 0, 1);
    r->up_out[neuron] = u;
    const float a = act * u;
    if (p->product && !(fabsf(a) > p->L->product_threshold)) {
        return false; // its GLU output stays 0, as the down pass sees it
    }
    r->glu_out[neuron] = a;
    e->bundle = bundle;
    e->a      = a;
    return true;
}

// balanced split: thread ith's run [*c0, *c1) of clusters, cut where the running weight crosses
// ith/nth of the total (the same cut on every thread: the weights were written before a barrier)
static void pi2_balanced_range(const struct pi2_sparse_plan * p, int ith, int nth, int64_t * c0, int64_t * c1) {
    const int64_t n_clusters = p->n_clusters;
    int64_t total = 0;
    for (int64_t c = 0; c < n_clusters; ++c) {
        total += p->weight[c];
    }
    const int64_t lo = total * ith, hi = total * (ith + 1);
    int64_t run = 0, c = 0;
    for (; c < n_clusters && run * nth < lo; ++c) {
        run += p->weight[c];
    }
    *c0 = c;
    for (; c < n_clusters && run * nth < hi; ++c) {
        run += p->weight[c];
    }
    *c1 = ith == nth - 1 ? n_clusters : c;
}

// the slots of thread ith's clusters whose gate row is computed, in cluster order: s for a predicted
// slot, -1 - s for one computed only for the recall check. Returns their count.
static int64_t pi2_thread_candidates(const struct pi2_sparse_plan * p, int64_t c0, int64_t c1, int64_t step,
                                     int32_t * cand) {
    int64_t n = 0;
    for (int64_t c = c0; c < c1; c += step) {
        const int64_t s1 = (c + 1) * PI2_CLUSTER < p->n_ff ? (c + 1) * PI2_CLUSTER : p->n_ff;
        for (int64_t s = c * PI2_CLUSTER; s < s1; ++s) {
            bool pred = true;
            if (p->cache != NULL) {
                if (p->want[s] == 0) {
                    continue;
                }
                pred = p->want[s] == 1;
            } else if (p->predicted) {
                pred = pi2_predict_slot(p, s);
                if (!pred && !p->check) {
                    continue;
                }
            }
            cand[n++] = pred ? (int32_t) s : -1 - (int32_t) s;
        }
    }
    return n;
}

// a neuron that fired, waiting for its up row
struct pi2_fired {
    const uint8_t * bundle;
    const void *    up;     // its up row: in the bundle, or (model-rows path) the model's row
    int32_t         neuron; // the model's index
    int32_t         c;      // its cluster
    float           act;
};

// the fired neuron's up row -> its up/GLU outputs and, if active, its entry in its cluster's down list
static void pi2_fired_up(struct pi2_sparse_plan * p, struct pi2_token_rows * r, const struct pi2_fired * f) {
    struct pi2_active * list = p->list + (size_t) f->c * PI2_CLUSTER;
    const int32_t n = p->n_act[f->c];
    const bool active = pi2_emit_admitted(p, r, f->neuron, f->up, f->bundle, f->act, &list[n]);
    p->n_act[f->c] = n + active;
    r->st->admitted++;
    r->st->active += active;
}

// gate/up/GLU of the clusters assigned to thread ith, for token t, one row at a time. Random rows are
// latency-bound, so the gate row of the candidate PI2_GATE_AHEAD places ahead is prefetched (flash: if in memory),
// and a neuron that fires waits in a ring until PI2_UP_AHEAD more have fired before its prefetched up
// row is read. Each cluster's down list keeps slot order, whichever thread computed it.
static void pi2_sparse_clusters(struct pi2_sparse_plan * p, int ith, int64_t t) {
    struct pi2_token_rows r = pi2_token_rows(p, ith, t);
    // flash: every nth cluster in slot order, hot (pinned) ones first, so compute overlaps the reads of
    // the rest
    int64_t c0 = ith, c1 = p->n_clusters, step = p->nth;
    if (p->balance) {
        pi2_balanced_range(p, ith, p->nth, &c0, &c1);
        step = 1;
    }
    int32_t * cand = p->cand + (size_t) ith * p->n_ff;
    const int64_t n = pi2_thread_candidates(p, c0, c1, step, cand);
    const struct pi2_sidecar_layer * L = p->L;
    const size_t up_bytes = L->down_offset - L->up_offset;
    struct pi2_fired ring[PI2_UP_AHEAD];
    int head = 0, queued = 0;
    for (int64_t i = 0; i < n && !atomic_load_explicit(&p->failed, memory_order_relaxed); ++i) {
        if (i + PI2_GATE_AHEAD < n) {
            const int32_t a = cand[i + PI2_GATE_AHEAD];
            const int64_t sa = a >= 0 ? a : -1 - a;
            // flash: only a bundle already in memory; one still being read is prefetched by no one
            const uint8_t * ahead = p->cache == NULL ? p->B->bundles + pi2_slot_offset(L, sa)
                                                     : pi2_cache_peek(p->cache, p->layer, sa);
            if (ahead != NULL) {
                pi2_prefetch(ahead, L->up_offset);
            }
        }
        const bool    pred = cand[i] >= 0;
        const int32_t s    = pred ? cand[i] : -1 - cand[i];
        const uint8_t * bundle = pi2_bundle_at(p, s, r.st);
        if (bundle == NULL) {
            return;
        }
        float g = 0.0f;
        p->gate_dot((int) p->n_embd, &g, 0, bundle, 0, r.xq, 0, 1);
        const float act    = pi2_act(p->op, g);
        const bool  active = pi2_fires(p, g, act);
        if (!pred) { // recall check: the gate was computed only to count what the predictor missed
            r.st->missed += active;
            continue;
        }
        r.st->predicted++;
        const int32_t neuron = L->order[s];
        r.gate_out[neuron] = g;
        if (!active) {
            continue;
        }
        pi2_prefetch(bundle + L->up_offset, up_bytes);
        if (queued == PI2_UP_AHEAD) {
            pi2_fired_up(p, &r, &ring[head]);
            head = (head + 1) % PI2_UP_AHEAD;
            --queued;
        }
        ring[(head + queued) % PI2_UP_AHEAD] = (struct pi2_fired) { bundle, bundle + L->up_offset, neuron, s / PI2_CLUSTER, act };
        ++queued;
    }
    for (; queued > 0 && !atomic_load_explicit(&p->failed, memory_order_relaxed); --queued) {
        pi2_fired_up(p, &r, &ring[head]);
        head = (head + 1) % PI2_UP_AHEAD;
    }
}

// gate/up/GLU of every neuron in thread ith's contiguous share of rows, from the model's matrices. Gate
// rows stream in order; the up rows of the neurons that fire are scattered, so they
// are prefetched while the next PI2_CLUSTER gate rows compute and used after (list order unchanged).
static void pi2_sparse_model_rows(struct pi2_sparse_plan * p, int ith, int nth, int64_t t) {
    const struct ggml_tensor * wg = p->gate->src[0];
    const struct ggml_tensor * wu = p->up->src[0];
    const struct pi2_sidecar_layer * L = p->L;
    struct pi2_token_rows r = pi2_token_rows(p, ith, t);
    // whole chunks per thread: chunk c's active neurons are the down list's cluster c
    const int64_t f0 = p->n_clusters * ith / nth * PI2_CLUSTER;
    const int64_t f1 = ith == nth - 1 ? p->n_ff : p->n_clusters * (ith + 1) / nth * PI2_CLUSTER;
    const size_t up_bytes = (size_t) wu->nb[1];
    // chunk i's gates fill k[i % 2] while chunk i-1's ups drain k[(i + 1) % 2]
    struct pi2_fired k[2][PI2_CLUSTER];
    int na[2] = { 0, 0 };
    int i = 0;
    for (int64_t c0 = f0; c0 < f1 + PI2_CLUSTER; c0 += PI2_CLUSTER, ++i) {
        struct pi2_fired * fill = k[i % 2];
        na[i % 2] = 0;
        const int64_t c1 = c0 + PI2_CLUSTER < f1 ? c0 + PI2_CLUSTER : f1;
        for (int64_t n = c0; n < c1; ++n) {
            float g = 0.0f;
            p->gate_dot((int) p->n_embd, &g, 0, (const char *) wg->data + n * wg->nb[1], 0, r.xq, 0, 1);
            r.gate_out[n] = g;
            const float act = pi2_act(p->op, g);
            if (pi2_fires(p, g, act)) {
                const char * up_row = (const char *) wu->data + n * wu->nb[1];
                pi2_prefetch(up_row, up_bytes);
                fill[na[i % 2]++] = (struct pi2_fired) {
                    .bundle = p->B->bundles + pi2_slot_offset(L, p->B->slot_of[n]), .up = up_row,
                    .neuron = (int32_t) n, .c = (int32_t) (c0 / PI2_CLUSTER), .act = act,
                };
            }
        }
        for (int j = 0; i > 0 && j < na[(i + 1) % 2]; ++j) {
            pi2_fired_up(p, &r, &k[(i + 1) % 2][j]);
        }
    }
    r.st->predicted += f1 - f0;
}

// flash: which slots this token needs (thread ith's clusters), then one thread queues the reads
static void pi2_sparse_request(struct pi2_sparse_plan * p, int ith, int nth, int64_t t) {
    const int64_t n_clusters = p->n_clusters;
    for (int64_t c = ith; c < n_clusters; c += nth) {
        const int64_t s0 = c * PI2_CLUSTER;
        const int64_t s1 = s0 + PI2_CLUSTER < p->n_ff ? s0 + PI2_CLUSTER : p->n_ff;
        for (int64_t s = s0; s < s1; ++s) {
            p->want[s] = !p->predicted || pi2_predict_slot(p, s) ? 1 : (p->check ? 2 : 0);
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

// a position in the down list: entry j of cluster c
struct pi2_list_cursor {
    int64_t c;
    int32_t j;
};

// the cursor at entry e of the list (counted over the clusters in order); e must be below the total
static struct pi2_list_cursor pi2_list_seek(const struct pi2_sparse_plan * p, int64_t e) {
    int64_t c = 0;
    while (e >= p->n_act[c]) {
        e -= p->n_act[c];
        ++c;
    }
    return (struct pi2_list_cursor) { .c = c, .j = (int32_t) e };
}

// the entry at the cursor, which then moves to the next one
static inline const struct pi2_active * pi2_list_next(const struct pi2_sparse_plan * p, struct pi2_list_cursor * at) {
    while (at->j >= p->n_act[at->c]) {
        ++at->c;
        at->j = 0;
    }
    return &p->list[at->c * PI2_CLUSTER + at->j++];
}

static void pi2_sparse_token(struct pi2_sparse_plan * p, int ith, int nth, int64_t t) {
    // the flag is only set after the barrier below, so every thread takes the same branch here
    if (atomic_load(&p->failed)) {
        return;
    }
    const int64_t n_ff   = p->n_ff;
    const int64_t n_embd = p->n_embd;
    const float * xt     = (const float *) ((const char *) p->x->data + t * p->x->nb[1]);

    // phase 0: outputs cleared, activations converted once for every dot product of this token
    const int64_t f0 = n_ff * ith / nth, f1 = n_ff * (ith + 1) / nth;
    memset((char *) p->gate->data + t * p->gate->nb[1] + f0 * sizeof(float), 0, (size_t) (f1 - f0) * sizeof(float));
    memset((char *) p->up->data + t * p->up->nb[1] + f0 * sizeof(float), 0, (size_t) (f1 - f0) * sizeof(float));
    memset((char *) p->glu->data + t * p->glu->nb[1] + f0 * sizeof(float), 0, (size_t) (f1 - f0) * sizeof(float));
    const int64_t n_clusters = p->n_clusters;
    const int64_t k0 = n_clusters * ith / nth, k1 = n_clusters * (ith + 1) / nth;
    memset(p->n_act + k0, 0, (size_t) (k1 - k0) * sizeof(int32_t)); // clusters a failed read skipped stay empty
    if (ith == 0) {
        pi2_convert_row(p->to_gate_vdt, xt, p->xq + (size_t) t * p->xq_stride, n_embd);
        if (p->xq_up != p->xq) {
            pi2_convert_row(p->to_up_vdt, xt, p->xq_up + (size_t) t * p->xq_up_stride, n_embd);
        }
    }
    if (p->predicted && ith == nth - 1) {
        pi2_convert_row(p->to_pred_vdt, xt, p->xp, n_embd);
    }
    #pragma omp barrier

    // phase 1: predictor hidden layer h = relu(W1 x + b1), then the scores z = b2 + W2 h
    if (p->predicted) {
        const int64_t r0 = p->rank * ith / nth, r1 = p->rank * (ith + 1) / nth;
        for (int64_t j = r0; j < r1; ++j) {
            float v = 0.0f;
            p->pred_dot((int) n_embd, &v, 0, p->B->w1 + (size_t) j * p->B->w1_stride, 0, p->xp, 0, 1);
            v += p->L->pred_b1[j];
            p->h[j] = v > 0.0f ? v : 0.0f;
        }
        #pragma omp barrier
        pi2_predictor_scores(p, ith, nth);
        #pragma omp barrier
    }

    // phase 2: the clusters, through score, gate, threshold, up
    if (p->model_rows) {
        pi2_sparse_model_rows(p, ith, nth, t);
    } else {
        if (p->cache != NULL) {
            pi2_sparse_request(p, ith, nth, t);
        }
        pi2_sparse_clusters(p, ith, t);
    }
    #pragma omp barrier

    // phase 3: down. Every thread sums the same counts, so all take the same branch.
    if (atomic_load(&p->failed)) { // set before the barrier above, so seen alike
        return;
    }
    int64_t n_active = 0;
    for (int64_t c = 0; c < n_clusters; ++c) {
        n_active += p->n_act[c];
    }
    float * out = (float *) ((char *) p->down->data + t * p->down->nb[1]);
    // flash has no down rows in memory: always by columns
    const bool sparse_down = p->cache != NULL || (float) n_active <= p->down_sparse_max * (float) n_ff;
    if (ith == 0) {
        p->n_down_sparse += sparse_down;
    }
    if (sparse_down) {
        float * y   = p->y + (size_t) ith * n_embd;
        float * tmp = p->tmp + (size_t) ith * p->tmp_stride;
        memset(y, 0, (size_t) n_embd * sizeof(float));
        struct pi2_column_sum sum = { .type = p->L->down_type, .n = n_embd, .y = y, .tmp = tmp };
        const size_t  off  = p->L->down_offset;
        const size_t  size = p->L->data_end - p->L->down_offset;
        // an even share of the list: entries [e0, e1), and a second cursor PI2_DOWN_AHEAD entries ahead
        const int64_t e0 = n_active * ith / nth, e1 = n_active * (ith + 1) / nth;
        struct pi2_list_cursor at = e0 < e1 ? pi2_list_seek(p, e0) : (struct pi2_list_cursor) { 0, 0 }, ahead = at;
        int64_t e_ahead = e0;
        for (; e_ahead < e1 && e_ahead < e0 + PI2_DOWN_AHEAD; ++e_ahead) {
            pi2_prefetch(pi2_list_next(p, &ahead)->bundle + off, size);
        }
        for (int64_t e = e0; e < e1; ++e) {
            if (e_ahead < e1) {
                pi2_prefetch(pi2_list_next(p, &ahead)->bundle + off, size);
                ++e_ahead;
            }
            const struct pi2_active * a = pi2_list_next(p, &at);
            pi2_column_sum_add(&sum, a->a, a->bundle + off);
        }
        pi2_column_sum_finish(&sum);
        #pragma omp barrier
        // fixed summation order over threads: reproducible for a given thread count
        const int64_t o0 = n_embd * ith / nth, o1 = n_embd * (ith + 1) / nth;
        for (int64_t o = o0; o < o1; ++o) {
            float s = 0.0f;
            for (int k = 0; k < nth; ++k) {
                s += p->y[(size_t) k * n_embd + o];
            }
            out[o] = s;
        }
    } else {
        // many active neurons: the model's own down rows beat the columns (and give dense's numerics)
        if (ith == 0) {
            const float * glu_t = (const float *) ((const char *) p->glu->data + t * p->glu->nb[1]);
            pi2_convert_row(p->to_down_vdt, glu_t, p->gluq, n_ff);
        }
        #pragma omp barrier
        struct pi2_dense_args a = {
            .w = (const char *) p->w_down->data, .w_stride = p->w_down->nb[1], .k = n_ff, .n_tokens = 1,
            .x = p->gluq, .x_stride = 0, .dst = out, .dst_stride = 0, .vec_dot = p->down_dot,
        };
        pi2_dense_rows(&a, n_embd * ith / nth, n_embd * (ith + 1) / nth);
    }
    #pragma omp barrier // buffers are reused by the next token
}

static void pi2_sparse_count(struct pi2_counters * c, int layer, const struct pi2_sparse_plan * p) {
    int64_t predicted = 0, admitted = 0, active = 0, missed = 0;
    for (int k = 0; k < p->nth; ++k) {
        predicted += p->stats[k].predicted;
        admitted  += p->stats[k].admitted;
        active    += p->stats[k].active;
        missed    += p->stats[k].missed;
    }
    struct pi2_layer_counters * lc = &c->layer[layer];
    pi2_count_layer_seen(c, layer);
    for (int m = 0; m < PI2_N_MATRIX; ++m) {
        pi2_count(&lc->matmul_calls[m], 1);
        pi2_count(&lc->matmul_tokens[m], (uint64_t) p->n_tokens);
    }
    pi2_count(&lc->glu_calls, 1);
    pi2_count(&lc->glu_tokens, (uint64_t) p->n_tokens);
    const int64_t sparse_down_tokens = p->n_down_sparse;
    pi2_count(&lc->rows[PI2_MATRIX_GATE], (uint64_t) (predicted + (p->check ? p->n_ff * p->n_tokens - predicted : 0)));
    pi2_count(&lc->rows[PI2_MATRIX_UP], (uint64_t) admitted);
    pi2_count(&lc->rows[PI2_MATRIX_DOWN], (uint64_t) ((p->n_tokens - sparse_down_tokens) * p->n_embd));
    pi2_count(&lc->sparse_tokens, (uint64_t) p->n_tokens);
    pi2_count(&lc->neurons, (uint64_t) (p->n_ff * p->n_tokens));
    pi2_count(&lc->predicted, (uint64_t) predicted);
    pi2_count(&lc->active, (uint64_t) active);
    pi2_count(&lc->down_sparse_tokens, (uint64_t) sparse_down_tokens);
    if (p->check) {
        pi2_count(&lc->checked_tokens, (uint64_t) p->n_tokens);
        pi2_count(&lc->missed, (uint64_t) missed);
    }
    if (p->cache != NULL) {
        uint64_t wait = 0;
        for (int k = 0; k < p->nth; ++k) {
            wait += p->stats[k].wait_ns;
        }
        pi2_count(&lc->hot_hits, p->io.hot_hits);
        pi2_count(&lc->cold_hits, p->io.cold_hits);
        pi2_count(&lc->misses, p->io.misses);
        pi2_count(&lc->bytes_read, p->io.bytes_read);
        pi2_count(&lc->io_requests, p->io.requests);
        pi2_count(&lc->prefetched, p->io.prefetched);
        pi2_count(&lc->io_wait_ns, wait / (uint64_t) p->nth); // per thread, on average
    }
}

static void pi2_sparse_run(struct pi2_sparse_plan * p, int nth) {
    #pragma omp parallel num_threads(nth)
    {
        // the runtime may give fewer threads than asked; the workspace fits any count up to nth
        #pragma omp single
        p->nth = omp_get_num_threads();
        const int ith = omp_get_thread_num();
        for (int64_t t = 0; t < p->n_tokens; ++t) {
            pi2_sparse_token(p, ith, p->nth, t);
        }
    }
}

// A layer of a flash-resident model: the same engine, bundles through the neuron cache. The cache is
// made at the first compute when the budget came from PI2_MEMORY_BUDGET (other frontends).
static enum ggml_status pi2_exec_flash(struct pi2_backend_ctx * ctx, struct pi2_binding * b, struct pi2_sparse_plan * p) {
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
    p->cache = b->cache;
    // llama runs the layers in order, the last one followed by the first of the next token
    const int next = (p->layer + 1) % (int) b->sc->n_layer;
    if (!pi2_binding_layer_predicted(b, next, atomic_load(&b->mode), ctx->dev->predictor_always)) {
        p->prefetch_layer = next;
    }
    const uint64_t t0 = pi2_now_ns();
    pi2_sparse_run(p, ctx->n_threads > 0 ? ctx->n_threads : 1);
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
    pi2_sparse_count(&ctx->dev->counters, p->layer, p);
    return GGML_STATUS_SUCCESS;
}

enum ggml_status pi2_exec_sparse_ffn(struct pi2_backend_ctx * ctx, struct pi2_binding * b, int layer,
                                     struct ggml_tensor * glu, struct ggml_tensor * down) {
    struct ggml_tensor * gate = glu->src[0];
    struct ggml_tensor * up   = glu->src[1];
    const struct pi2_sidecar_layer * L = &b->sc->layer[layer];
    const int mode = atomic_load(&b->mode);
    struct pi2_sparse_plan p = {
        .x = gate->src[1], .gate = gate, .up = up, .glu = glu, .down = down, .w_down = down->src[0],
        .op = ggml_get_glu_op(glu), .L = L, .B = &b->layer[layer],
        .relu = b->sc->sparsity_method == PI2_SPARSITY_METHOD_RELU,
        .product = b->sc->sparsity_method == PI2_SPARSITY_METHOD_PRODUCT && mode != PI2_MODE_DENSE,
        // flash keeps only the predictors that run (the others were freed at load)
        .predicted = pi2_binding_layer_predicted(b, layer, mode, ctx->dev->predictor_always),
        .all_active = mode == PI2_MODE_DENSE, .layer = layer, .prefetch_layer = -1,
        .n_embd = b->sc->n_embd, .n_ff = L->n_ff, .rank = L->rank,
        .n_clusters = (L->n_ff + PI2_CLUSTER - 1) / PI2_CLUSTER, .n_tokens = gate->src[1]->ne[1],
        .down_sparse_max = ctx->dev->down_sparse_max,
    };
    p.check = mode == PI2_MODE_PREDICTED && atomic_load(&b->check_recall);
    p.model_rows = !b->flash && mode == PI2_MODE_PREDICTED && !p.predicted && !p.check && ctx->dev->model_rows &&
                   ggml_is_contiguous(gate->src[0]) && ggml_is_contiguous(up->src[0]);
    atomic_init(&p.failed, 0);
    if (pi2_glu_for(b->sc->activation) != p.op) {
        snprintf(b->error, sizeof(b->error), "sidecar %s was made for a model whose FFN activation differs from the "
                 "%s llama.cpp runs for layer %d (a ReLU-family model needs the patched llama.cpp of patches/)",
                 b->sc->path, ggml_glu_op_name(p.op), layer);
        PI2_LOG_REFUSAL("pi2: %s\n", b->error);
        return GGML_STATUS_FAILED;
    }
    // bundles hold the model's gate/up rows byte for byte, so the gate/up types are the model's
    const struct ggml_type_traits_cpu * tg = ggml_get_type_traits_cpu(L->gate_type);
    const struct ggml_type_traits_cpu * tu = ggml_get_type_traits_cpu(L->up_type);
    const struct ggml_type_traits_cpu * td = ggml_get_type_traits_cpu(p.w_down->type);
    p.gate_dot = tg->vec_dot; p.gate_vdt = tg->vec_dot_type;
    p.up_dot   = tu->vec_dot; p.up_vdt   = tu->vec_dot_type;
    p.down_dot = td->vec_dot; p.down_vdt = td->vec_dot_type;
    const struct ggml_type_traits_cpu * tp = ggml_get_type_traits_cpu(b->layer[layer].pred_type);
    p.pred_dot    = tp->vec_dot;
    p.to_pred_vdt = pi2_needs_convert(tp->vec_dot_type) ? ggml_get_type_traits_cpu(tp->vec_dot_type)->from_float : NULL;
    p.to_gate_vdt = pi2_needs_convert(p.gate_vdt) ? ggml_get_type_traits_cpu(p.gate_vdt)->from_float : NULL;
    p.to_up_vdt   = pi2_needs_convert(p.up_vdt) ? ggml_get_type_traits_cpu(p.up_vdt)->from_float : NULL;
    p.to_down_vdt = pi2_needs_convert(p.down_vdt) ? ggml_get_type_traits_cpu(p.down_vdt)->from_float : NULL;

    const int nth = ctx->n_threads > 0 ? ctx->n_threads : 1;
    p.nth = nth;
    // weights come from the predictor's scores, cheaply only on ReLU models (no activation function to
    // evaluate), and with W2 blocks that are whole clusters; flash keeps the interleaved order
    p.balance = !b->flash && p.predicted && p.relu && !p.check && !p.model_rows &&
                ggml_blck_size(p.B->w2_type) == PI2_CLUSTER;
    p.xq_stride    = ggml_row_size(p.gate_vdt, p.n_embd);
    p.tmp_stride   = pi2_column_scratch(p.n_embd); // down columns of n_embd; z's F16 rows need 256 at most
    p.xq_up_stride = ggml_row_size(p.up_vdt, p.n_embd);
    const bool same_vdt = p.gate_vdt == p.up_vdt;
    // workspace: one arena, carved in 64-byte aligned pieces
    const size_t sizes[] = {
        pi2_align64(p.xq_stride * (size_t) p.n_tokens),
        same_vdt ? 0 : pi2_align64(p.xq_up_stride * (size_t) p.n_tokens),
        pi2_align64(ggml_row_size(tp->vec_dot_type, p.n_embd)),
        pi2_align64((size_t) p.rank * sizeof(float)),
        pi2_align64((size_t) p.n_ff * sizeof(float)),
        pi2_align64((size_t) nth * p.n_embd * sizeof(float)),
        pi2_align64((size_t) nth * p.tmp_stride * sizeof(float)),
        pi2_align64((size_t) p.n_ff * sizeof(struct pi2_active)),
        pi2_align64((size_t) p.n_clusters * sizeof(int32_t)),
        pi2_align64((size_t) p.n_clusters * sizeof(int32_t)),
        pi2_align64((size_t) nth * sizeof(struct pi2_thread_stats)),
        pi2_align64(ggml_row_size(p.down_vdt, p.n_ff)),
        b->flash ? pi2_align64((size_t) p.n_ff) : 0,
        pi2_align64((size_t) nth * p.n_ff * sizeof(int32_t)),
    };
    size_t total = 0;
    for (size_t k = 0; k < sizeof(sizes) / sizeof(sizes[0]); ++k) {
        total += sizes[k];
    }
    char * w = pi2_work_reserve(ctx, total);
    if (w == NULL) {
        PI2_LOG_ERROR("pi2: out of memory for the sparse decode workspace (%zu bytes)\n", total);
        return GGML_STATUS_ALLOC_FAILED;
    }
    p.xq    = w;                          w += sizes[0];
    p.xq_up = same_vdt ? p.xq : w;        w += sizes[1];
    p.xp    = w;                          w += sizes[2];
    p.h     = (float *) w;                w += sizes[3];
    p.z     = (float *) w;                w += sizes[4];
    p.y     = (float *) w;                w += sizes[5];
    p.tmp   = (float *) w;                w += sizes[6];
    p.list  = (struct pi2_active *) w;    w += sizes[7];
    p.n_act  = (int32_t *) w;             w += sizes[8];
    p.weight = (int32_t *) w;             w += sizes[9];
    p.stats = (struct pi2_thread_stats *) w; w += sizes[10];
    p.gluq  = w;                          w += sizes[11];
    p.want  = (uint8_t *) w;              w += sizes[12];
    p.cand  = (int32_t *) w;
    memset(p.stats, 0, (size_t) nth * sizeof(struct pi2_thread_stats));

    if (b->flash) {
        return pi2_exec_flash(ctx, b, &p);
    }

    pi2_sparse_run(&p, nth);
    pi2_sparse_count(&ctx->dev->counters, layer, &p);
    return GGML_STATUS_SUCCESS;
}
