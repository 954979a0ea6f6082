// The sparse kernels of one token: gate rows of candidate neurons, up rows of those that fire, GLU, and
// down as a sum of the active neurons' columns (or the model's dense down rows). They reach bundle bytes
// through the plan's accessor only and know nothing of the neuron cache, I/O or threads: the cluster
// scheduler hands each call its share (candidate slots, rows, or down-list entries).
#pragma once

#include <stddef.h>
#include <stdint.h>

#include "sparse/sparse_plan.h"

// What one thread reads and writes for token t: the converted activations and the token's gate/up/GLU
// output rows.
struct pi2_token_rows {
    const char *              xq, * xqu;
    float *                   gate_out, * up_out, * glu_out;
    struct pi2_thread_stats * st;
};
struct pi2_token_rows pi2_token_rows(struct pi2_sparse_plan * p, int ith, int64_t t);

// The n bytes at p fetched into L2 (locality 2: prefetcht1), where scattered bundle rows are read from: L1's few miss
// buffers stay free (sparse_kernels.c says what it measured). Every cache line [p, p + n) touches is fetched: rows need
// not start on a line (a Q4_K row of 1,536 is 864 bytes), and one line left out is a full memory miss per row.
static inline void pi2_prefetch_bytes(const void * p, size_t n) {
    const char * end = (const char *) p + n;
    for (const char * a = (const char *) ((uintptr_t) p & ~(uintptr_t) 63); a < end; a += 64) {
        __builtin_prefetch(a, 0, 2);
    }
}

// f32 row -> vec_dot type (a copy when f is NULL: the type is f32)
void pi2_convert_row(ggml_from_float_t f, const float * src, void * dst, int64_t n);
// token t's FFN input in the gate's vec_dot type (p->xq) and, where it differs, the up's (p->xq_up)
void pi2_convert_token(struct pi2_sparse_plan * p, int64_t t);

// Gate/up/GLU of the candidate slots cand[0..n) (s for a predicted slot, -1 - s for one computed only for
// the recall check), in that order, bundles from the accessor. Each cluster's down list keeps slot order.
void pi2_kernel_gate_up(struct pi2_sparse_plan * p, struct pi2_token_rows * r, const int32_t * cand, int64_t n);
// Gate/up/GLU of every neuron of rows [f0, f1) (whole clusters), from the model's own matrices.
void pi2_kernel_gate_up_model_rows(struct pi2_sparse_plan * p, struct pi2_token_rows * r, int64_t f0, int64_t f1);

// Down by columns: entries [n_active * ith / nth, n_active * (ith + 1) / nth) of the down list summed into
// thread ith's partial row p->y[ith]; pi2_kernel_down_reduce adds the partial rows, in thread order, for
// outputs [n_embd * ith / nth, ..) of out.
void pi2_kernel_down_columns(struct pi2_sparse_plan * p, int ith, int nth, int64_t n_active);
void pi2_kernel_down_reduce(const struct pi2_sparse_plan * p, int ith, int nth, float * out);
// Down by the model's rows [n_embd * ith / nth, ..) over p->gluq (the GLU row, converted).
void pi2_kernel_down_rows(const struct pi2_sparse_plan * p, int ith, int nth, float * out);
