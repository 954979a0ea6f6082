#include "sparse/sparse_kernels.h"

#include <math.h>
#include <string.h>

#include "sparse/column_axpy.h"
#include "dense/dense_matmul.h"

// down columns are prefetched this many columns before they are added: a neuron's column is needed only
// after every cluster's gates and ups, by when a layer's worth of rows has pushed it out of L2, so it
// is not fetched together with its up row
#define PI2_DOWN_AHEAD 4
// Scattered rows are latency-bound: a Q4_K row of 2,048 takes ~60 ns from L1 or in a contiguous stream, ~190 ns
// when rows are 4 KiB apart at random (this machine, Zen 4). Prefetching into L2 rather than L1 (locality 2:
// prefetcht1), candidates 16 ahead, a candidate's gate and up rows together (one contiguous 2-row run; its
// up row is needed if it fires, 70-80% of predicted candidates on our ReLU and dReLU models): 190 -> 140 ns a
// row alone, and in-RAM predicted decode +20-38% (dReLU 1.5B 42 -> 54 tok/s, ts3 44 -> 60; docs/MEASUREMENTS.md
// 2026-11-26) against L1 prefetches 8 ahead of the gate row alone. Up rows are prefetched again, and read
// PI2_UP_AHEAD fired neurons later.
#define PI2_GATE_AHEAD 16
#define PI2_UP_AHEAD   8

void pi2_convert_row(ggml_from_float_t f, const float * src, void * dst, int64_t n) {
    if (f == NULL) {
        memcpy(dst, src, (size_t) n * sizeof(float));
    } else {
        f(src, dst, n);
    }
}

void pi2_convert_token(struct pi2_sparse_plan * p, int64_t t) {
    const float * xt = (const float *) ((const char *) p->x->data + t * p->x->nb[1]);
    pi2_convert_row(p->to_gate_vdt, xt, p->xq + (size_t) t * p->xq_stride, p->n_embd);
    if (p->xq_up != p->xq) {
        pi2_convert_row(p->to_up_vdt, xt, p->xq_up + (size_t) t * p->xq_up_stride, p->n_embd);
    }
}

struct pi2_token_rows pi2_token_rows(struct pi2_sparse_plan * p, int ith, int64_t t) {
    return (struct pi2_token_rows) {
        .xq       = p->xq + (size_t) t * p->xq_stride,
        .xqu      = p->xq_up + (size_t) t * p->xq_up_stride,
        .gate_out = (float *) ((char *) p->gate->data + t * p->gate->nb[1]),
        .up_out   = (float *) ((char *) p->up->data + t * p->up->nb[1]),
        .glu_out  = (float *) ((char *) p->glu->data + t * p->glu->nb[1]),
        .st       = &p->stats[ith],
    };
}

// a neuron that fired, waiting for its up row
struct pi2_fired {
    const uint8_t * bundle;
    const void *    up;     // its up row: in the bundle, or (model rows) the model's row
    int32_t         neuron; // the model's index
    int32_t         c;      // its cluster
    float           act;
};

// the fired neuron's up row -> its up and GLU outputs and, if it is active, its entry in its cluster's down list
static void pi2_fired_up(struct pi2_sparse_plan * p, struct pi2_token_rows * r, const struct pi2_fired * f) {
    float u = 0.0f;
    p->up_dot((int) p->n_embd, &u, 0, f->up, 0, r->xqu, 0, 1);
    u = pi2_plan_up(p, u, f->neuron);
    r->up_out[f->neuron] = u;
    r->st->admitted++;
    const float a = f->act * pi2_act_up(&p->act, u);
    if (!pi2_active(p, a, u)) {
        return; // its GLU output stays 0, as the down pass sees it
    }
    r->glu_out[f->neuron] = a;
    struct pi2_active * e = &p->list[(size_t) f->c * PI2_CLUSTER + p->n_act[f->c]++];
    e->bundle = f->bundle;
    e->a      = a;
    r->st->active++;
}

// Random rows are latency-bound, so the gate row of the candidate PI2_GATE_AHEAD places ahead is
// prefetched (if the accessor has it in memory), and a neuron that fires waits in a ring until
// PI2_UP_AHEAD more have fired before its prefetched up row is read.
void pi2_kernel_gate_up(struct pi2_sparse_plan * p, struct pi2_token_rows * r, const int32_t * cand, int64_t n) {
    const struct pi2_sidecar_layer * L = p->L;
    const size_t up_bytes = L->down_offset - L->up_offset;
    struct pi2_fired ring[PI2_UP_AHEAD];
    int head = 0, queued = 0;
    for (int64_t i = 0; i < n && !atomic_load_explicit(&p->failed, memory_order_relaxed); ++i) {
        if (i + PI2_GATE_AHEAD < n) {
            const int32_t a = cand[i + PI2_GATE_AHEAD];
            const uint8_t * ahead = pi2_plan_bundle_peek(p, a >= 0 ? a : -1 - a);
            if (ahead != NULL) {
                pi2_prefetch_bytes(ahead, L->down_offset); // gate and up rows
            }
        }
        const bool    pred = cand[i] >= 0;
        const int32_t s    = pred ? cand[i] : -1 - cand[i];
        const uint8_t * bundle = pi2_plan_bundle(p, s, r->st);
        if (bundle == NULL) {
            return;
        }
        const int32_t neuron = L->order[s];
        float g = 0.0f;
        p->gate_dot((int) p->n_embd, &g, 0, bundle, 0, r->xq, 0, 1);
        g = pi2_plan_gate(p, g, neuron);
        const float act    = pi2_act_gate(&p->act, g);
        const bool  active = pi2_fires(p, g, act);
        if (!pred) { // recall check: the gate was computed only to count what the predictor missed
            r->st->missed += active;
            continue;
        }
        r->st->predicted++;
        r->gate_out[neuron] = g;
        if (!active) {
            continue;
        }
        pi2_prefetch_bytes(bundle + L->up_offset, up_bytes);
        if (queued == PI2_UP_AHEAD) {
            pi2_fired_up(p, r, &ring[head]);
            head = (head + 1) % PI2_UP_AHEAD;
            --queued;
        }
        ring[(head + queued) % PI2_UP_AHEAD] = (struct pi2_fired) { bundle, bundle + L->up_offset, neuron, s / PI2_CLUSTER, act };
        ++queued;
    }
    for (; queued > 0 && !atomic_load_explicit(&p->failed, memory_order_relaxed); --queued) {
        pi2_fired_up(p, r, &ring[head]);
        head = (head + 1) % PI2_UP_AHEAD;
    }
}

// Gate rows stream in order; the up rows of the neurons that fire are scattered, so they are prefetched
// while the next PI2_CLUSTER gate rows compute and used after (list order unchanged).
void pi2_kernel_gate_up_model_rows(struct pi2_sparse_plan * p, struct pi2_token_rows * r, int64_t f0, int64_t f1) {
    const struct ggml_tensor * wg = p->gate->src[0];
    const struct ggml_tensor * wu = p->up->src[0];
    const struct pi2_sidecar_layer * L = p->L;
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
            p->gate_dot((int) p->n_embd, &g, 0, (const char *) wg->data + n * wg->nb[1], 0, r->xq, 0, 1);
            g = pi2_plan_gate(p, g, n);
            r->gate_out[n] = g;
            const float act = pi2_act_gate(&p->act, g);
            if (pi2_fires(p, g, act)) {
                const char * up_row = (const char *) wu->data + n * wu->nb[1];
                pi2_prefetch_bytes(up_row, up_bytes);
                fill[na[i % 2]++] = (struct pi2_fired) {
                    .bundle = p->B->bundles + pi2_slot_offset(L, p->B->slot_of[n]), .up = up_row,
                    .neuron = (int32_t) n, .c = (int32_t) (c0 / PI2_CLUSTER), .act = act,
                };
            }
        }
        for (int j = 0; i > 0 && j < na[(i + 1) % 2]; ++j) {
            pi2_fired_up(p, r, &k[(i + 1) % 2][j]);
        }
    }
    r->st->predicted += f1 - f0;
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

void pi2_kernel_down_columns(struct pi2_sparse_plan * p, int ith, int nth, int64_t n_active) {
    const int64_t n_embd = p->n_embd;
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
        pi2_prefetch_bytes(pi2_list_next(p, &ahead)->bundle + off, size);
    }
    for (int64_t e = e0; e < e1; ++e) {
        if (e_ahead < e1) {
            pi2_prefetch_bytes(pi2_list_next(p, &ahead)->bundle + off, size);
            ++e_ahead;
        }
        const struct pi2_active * a = pi2_list_next(p, &at);
        pi2_column_sum_add(&sum, a->a, a->bundle + off);
    }
    pi2_column_sum_finish(&sum);
}

void pi2_kernel_down_reduce(const struct pi2_sparse_plan * p, int ith, int nth, float * out) {
    // fixed summation order over threads: reproducible for a given thread count
    const int64_t n_embd = p->n_embd;
    const int64_t o0 = n_embd * ith / nth, o1 = n_embd * (ith + 1) / nth;
    for (int64_t o = o0; o < o1; ++o) {
        float s = 0.0f;
        for (int k = 0; k < nth; ++k) {
            s += p->y[(size_t) k * n_embd + o];
        }
        out[o] = s;
    }
}

void pi2_kernel_down_rows(const struct pi2_sparse_plan * p, int ith, int nth, float * out) {
    struct pi2_dense_args a = {
        .w = (const char *) p->w_down->data, .w_stride = p->w_down->nb[1], .k = p->n_ff, .n_tokens = 1,
        .x = p->gluq, .x_stride = 0, .dst = out, .dst_stride = 0, .vec_dot = p->down_dot,
    };
    pi2_dense_rows(&a, p->n_embd * ith / nth, p->n_embd * (ith + 1) / nth);
}
