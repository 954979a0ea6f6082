#include "dense/ffn_exec.h"

#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include <omp.h>

#include "dense/dense_matmul.h"
#include "graph/ffn_names.h"
#include "core/pi2_clock.h"
#include "core/pi2_log.h"

static int pi2_threads_for(const struct pi2_backend_ctx * ctx, int64_t units) {
    int n = ctx->n_threads > 0 ? ctx->n_threads : 1;
    return units < n ? (int) (units > 0 ? units : 1) : n;
}

static void pi2_count_matmul(struct pi2_counters * c, const struct ggml_tensor * w, int64_t n_tokens) {
    int layer = 0;
    enum pi2_matrix matrix = PI2_MATRIX_GATE;
    if (!pi2_ffn_weight_parse(w->name, &layer, &matrix)) {
        return;
    }
    pi2_count_layer_seen(c, layer);
    pi2_count(&c->layer[layer].matmul_calls[matrix], 1);
    pi2_count(&c->layer[layer].matmul_tokens[matrix], (uint64_t) n_tokens);
    pi2_count(&c->layer[layer].rows[matrix], (uint64_t) (w->ne[1] * n_tokens));
    pi2_count(&c->layer[layer].weight_bytes[matrix], (uint64_t) w->ne[1] * w->nb[1]);
}

// out: act(gate) * up of the layer whose ffn_gate weight is gate_w
static void pi2_count_glu(struct pi2_counters * c, const struct ggml_tensor * gate_w, const struct ggml_tensor * glu) {
    int layer = 0;
    enum pi2_matrix matrix = PI2_MATRIX_GATE;
    if (gate_w == NULL || !pi2_ffn_weight_parse(gate_w->name, &layer, &matrix)) {
        return;
    }
    pi2_count_layer_seen(c, layer);
    pi2_count(&c->layer[layer].glu_calls, 1);
    pi2_count(&c->layer[layer].glu_tokens, (uint64_t) ggml_nrows(glu));
}

// act(gate) * up of one token's columns [c0, c1) into out (activation.h)
static bool pi2_glu_columns(const struct pi2_glu_tables * tables, const struct pi2_ffn_act * act, struct ggml_tensor * out,
                            const struct ggml_tensor * gate, const struct ggml_tensor * up, int64_t t, int64_t c0, int64_t c1) {
    float *       y  = (float *) ((char *) out->data + t * out->nb[1]) + c0;
    const float * xg = (const float *) ((const char *) gate->data + t * gate->nb[1]) + c0;
    const float * xu = (const float *) ((const char *) up->data + t * up->nb[1]) + c0;
    return pi2_glu_span(tables, act, (int) (c1 - c0), y, xg, xu);
}

// Work shared by every matmul pass: activations converted to vec_dot_type once (in parallel, in the
// context's work buffer), then row spans handed out by an atomic counter to the team's threads.
typedef void (*pi2_span_fn)(void * arg, const char * xq, size_t xq_stride, int64_t r0, int64_t r1);

static enum ggml_status pi2_run_spans(struct pi2_backend_ctx * ctx, const struct ggml_tensor * x, enum ggml_type vec_dot_type,
                                      int64_t n_rows, pi2_span_fn fn, void * arg) {
    const int64_t k        = x->ne[0];
    const int64_t n_tokens = x->ne[1];
    const bool    convert  = vec_dot_type != GGML_TYPE_F32;
    ggml_from_float_t to_vec_dot = NULL;
    size_t       xq_stride = x->nb[1];
    const char * xq        = (const char *) x->data;
    if (convert) {
        // the activation converter belongs to vec_dot_type, not to the weight type
        to_vec_dot = ggml_get_type_traits_cpu(vec_dot_type)->from_float;
        xq_stride  = ggml_row_size(vec_dot_type, k);
        if (pi2_work_reserve(ctx, xq_stride * (size_t) n_tokens) == NULL) {
            PI2_LOG_ERROR("pi2: out of memory for %lld activation rows\n", (long long) n_tokens);
            return GGML_STATUS_ALLOC_FAILED;
        }
        xq = ctx->work;
    }
    // one token: long spans stream the weights; a batch: short spans keep tiles in cache. Both are
    // multiples of the GLU's SIMD width, so per-span GLUs match ggml's whole-row vector/tail split.
    const int64_t span    = n_tokens == 1 ? 64 : 16;
    const int64_t n_spans = (n_rows + span - 1) / span;
    const int     nth     = pi2_threads_for(ctx, n_spans);
    atomic_llong  next    = 0;

    #pragma omp parallel num_threads(nth)
    {
        const int ith = omp_get_thread_num();
        const int nt  = omp_get_num_threads();
        if (convert) {
            pi2_dense_quantize_tokens((const float *) x->data, x->nb[1], k, to_vec_dot, ctx->work, xq_stride,
                                      n_tokens * ith / nt, n_tokens * (ith + 1) / nt);
        }
        #pragma omp barrier
        for (;;) {
            const long long s = atomic_fetch_add_explicit(&next, 1, memory_order_relaxed);
            if (s >= n_spans) {
                break;
            }
            const int64_t r0 = s * span;
            fn(arg, xq, xq_stride, r0, r0 + span < n_rows ? r0 + span : n_rows);
        }
    }
    return GGML_STATUS_SUCCESS;
}

// the several-token kernel for a batch of rows of `type`, where the batch has that many tokens
static pi2_dot_tokens_t pi2_batch_dot_tokens(struct pi2_backend_ctx * ctx, enum ggml_type type, int64_t n_tokens) {
    return n_tokens >= PI2_DOT_TOKENS && type >= 0 && type < GGML_TYPE_COUNT
               ? pi2_dot_tokens_for(type, ggml_get_type_traits_cpu(type)->vec_dot, &ctx->dot_tokens_checked[type])
               : NULL;
}

static void pi2_mul_mat_span(void * arg, const char * xq, size_t xq_stride, int64_t r0, int64_t r1) {
    struct pi2_dense_args a = *(const struct pi2_dense_args *) arg;
    a.x        = xq;
    a.x_stride = xq_stride;
    pi2_dense_rows(&a, r0, r1);
}

enum ggml_status pi2_exec_mul_mat_with(struct pi2_backend_ctx * ctx, struct ggml_tensor * node, enum ggml_type type,
                                       const void * data, size_t stride) {
    const struct ggml_tensor * w = node->src[0];
    const struct ggml_tensor * x = node->src[1];
    const struct ggml_type_traits_cpu * tt = ggml_get_type_traits_cpu(type);
    struct pi2_dense_args args = {
        .w          = (const char *) data,
        .w_stride   = stride,
        .k          = w->ne[0],
        .n_tokens   = x->ne[1],
        .dst        = (float *) node->data,
        .dst_stride = (int64_t) (node->nb[1] / sizeof(float)),
        .vec_dot    = tt->vec_dot,
        .dot_tokens = pi2_batch_dot_tokens(ctx, type, x->ne[1]),
    };
    return pi2_run_spans(ctx, x, tt->vec_dot_type, w->ne[1], pi2_mul_mat_span, &args);
}

enum ggml_status pi2_exec_mul_mat(struct pi2_backend_ctx * ctx, struct ggml_tensor * node) {
    const struct ggml_tensor * w = node->src[0];
    const struct ggml_tensor * x = node->src[1];

    int layer = 0;
    enum pi2_matrix matrix = PI2_MATRIX_GATE;
    if (!pi2_ffn_weight_parse(w->name, &layer, &matrix)) {
        PI2_LOG_ERROR("pi2: MUL_MAT on %s, which PI2 does not own\n", w->name);
        return GGML_STATUS_FAILED;
    }
    const enum ggml_status st = pi2_exec_mul_mat_with(ctx, node, w->type, w->data, w->nb[1]);
    if (st == GGML_STATUS_SUCCESS) {
        pi2_count_matmul(&ctx->dev->counters, w, x->ne[1]);
    }
    return st;
}

// act(gate) * up over all of out's rows, the threads splitting rows or (decode) spans of a row
static enum ggml_status pi2_exec_act(struct pi2_backend_ctx * ctx, const struct pi2_ffn_act * act, struct ggml_tensor * node,
                                     const struct ggml_tensor * gate, const struct ggml_tensor * up) {

    const int64_t nc = node->ne[0];
    const int64_t nr = ggml_nrows(node);

    // fewer rows than threads (decode): split each row into spans aligned to the SIMD width, which
    // keeps ggml's exact vector/tail split
    const int     want          = ctx->n_threads > 0 ? ctx->n_threads : 1;
    const int64_t spans_per_row = nr >= want ? 1 : want;
    int64_t span = (nc + spans_per_row - 1) / spans_per_row;
    span = (span + PI2_GLU_SPAN_ALIGN - 1) / PI2_GLU_SPAN_ALIGN * PI2_GLU_SPAN_ALIGN;
    const int64_t n_units = nr * ((nc + span - 1) / span);
    const int64_t units_per_row = (nc + span - 1) / span;
    const int     nth = pi2_threads_for(ctx, n_units);
    atomic_int    failed = 0;

    #pragma omp parallel for num_threads(nth) schedule(static)
    for (int64_t u = 0; u < n_units; ++u) {
        const int64_t row = u / units_per_row;
        const int64_t c0  = (u % units_per_row) * span;
        const int64_t c1  = c0 + span < nc ? c0 + span : nc;
        if (!pi2_glu_columns(&ctx->dev->glu, act, node, gate, up, row, c0, c1)) {
            atomic_store(&failed, 1);
        }
    }
    if (atomic_load(&failed)) {
        PI2_LOG_ERROR("pi2: FFN activation %s is not implemented\n", pi2_activation_names[act->kind]);
        return GGML_STATUS_FAILED;
    }
    return GGML_STATUS_SUCCESS;
}

enum ggml_status pi2_exec_glu(struct pi2_backend_ctx * ctx, struct ggml_tensor * node, const struct pi2_ffn_act * act) {
    const struct ggml_tensor * a = node->src[0], * b = node->src[1];
    struct ggml_tensor halves[2];
    if (b == NULL) { // one fused gate+up input (phi3): act(first half) * second half; swapped ones are not claimed
        for (int k = 0; k < 2; ++k) {
            halves[k] = *a;
            halves[k].ne[0] = node->ne[0];
            halves[k].data  = (char *) a->data + (size_t) k * (size_t) node->ne[0] * a->nb[0];
        }
        a = &halves[0];
        b = &halves[1];
    }
    const enum ggml_status st = pi2_exec_act(ctx, act, node, a, b);
    if (st == GGML_STATUS_SUCCESS) {
        pi2_count_glu(&ctx->dev->counters, node->src[0]->src[0], node);
    }
    return st;
}

struct pi2_gate_up_glu {
    struct pi2_dense_args         gate, up; // x is set per span from the runner's activations
    const struct pi2_glu_tables * tables;
    const struct pi2_ffn_region * r;
    atomic_int                    failed;
};

static void pi2_gate_up_glu_span(void * arg, const char * xq, size_t xq_stride, int64_t r0, int64_t r1) {
    struct pi2_gate_up_glu * f = arg;
    struct pi2_dense_args gate = f->gate;
    struct pi2_dense_args up   = f->up;
    gate.x = up.x = xq;  // both read the activations the runner converted once
    gate.x_stride = up.x_stride = xq_stride;
    pi2_dense_rows(&gate, r0, r1);
    pi2_dense_rows(&up, r0, r1);
    for (int64_t t = 0; t < up.n_tokens; ++t) {
        if (!pi2_glu_columns(f->tables, &f->r->act, f->r->out, f->r->gate, f->r->up, t, r0, r1)) {
            atomic_store(&f->failed, 1);
        }
    }
}

enum ggml_status pi2_exec_gate_up_act(struct pi2_backend_ctx * ctx, const struct pi2_ffn_region * r) {
    struct ggml_tensor *       gate = r->gate;
    struct ggml_tensor *       up   = r->up;
    const struct ggml_tensor * x    = gate->src[1];
    const struct ggml_tensor * wg   = gate->src[0];
    const struct ggml_tensor * wu   = up->src[0];
    struct pi2_counters *      c    = &ctx->dev->counters;
    if (ggml_get_type_traits_cpu(wg->type)->vec_dot_type != ggml_get_type_traits_cpu(wu->type)->vec_dot_type) {
        // the two products cannot share converted activations: one pass each, then the activation
        enum ggml_status st = pi2_exec_mul_mat(ctx, gate);
        if (st == GGML_STATUS_SUCCESS) {
            st = pi2_exec_mul_mat(ctx, up);
        }
        if (st == GGML_STATUS_SUCCESS) {
            st = pi2_exec_act(ctx, &r->act, r->out, gate, up);
        }
        if (st == GGML_STATUS_SUCCESS) {
            pi2_count_glu(c, wg, r->out);
        }
        return st;
    }
    struct pi2_gate_up_glu f = {
        .gate = { .w = (const char *) wg->data, .w_stride = wg->nb[1], .k = wg->ne[0], .n_tokens = x->ne[1],
                  .dst = (float *) gate->data, .dst_stride = (int64_t) (gate->nb[1] / sizeof(float)),
                  .vec_dot = ggml_get_type_traits_cpu(wg->type)->vec_dot,
                  .dot_tokens = pi2_batch_dot_tokens(ctx, wg->type, x->ne[1]) },
        .up   = { .w = (const char *) wu->data, .w_stride = wu->nb[1], .k = wu->ne[0], .n_tokens = x->ne[1],
                  .dst = (float *) up->data, .dst_stride = (int64_t) (up->nb[1] / sizeof(float)),
                  .vec_dot = ggml_get_type_traits_cpu(wu->type)->vec_dot,
                  .dot_tokens = pi2_batch_dot_tokens(ctx, wu->type, x->ne[1]) },
        .tables = &ctx->dev->glu,
        .r      = r,
    };
    atomic_init(&f.failed, 0);
    const enum ggml_status st = pi2_run_spans(ctx, x, ggml_get_type_traits_cpu(wg->type)->vec_dot_type, wg->ne[1],
                                              pi2_gate_up_glu_span, &f);
    if (st != GGML_STATUS_SUCCESS) {
        return st;
    }
    if (atomic_load(&f.failed)) {
        PI2_LOG_ERROR("pi2: FFN activation %s is not implemented\n", pi2_activation_names[r->act.kind]);
        return GGML_STATUS_FAILED;
    }
    pi2_count_matmul(c, wg, x->ne[1]);
    pi2_count_matmul(c, wu, x->ne[1]);
    pi2_count_glu(c, wg, r->out);
    return GGML_STATUS_SUCCESS;
}

int pi2_exec_time_rows(enum ggml_type type, int64_t k, int64_t n_rows, int threads, double seconds, double * bytes_per_s) {
    const struct ggml_type_traits_cpu * tr = ggml_get_type_traits_cpu(type);
    if (type < 0 || type >= GGML_TYPE_COUNT || tr->vec_dot == NULL || k <= 0 || n_rows <= 0 || threads <= 0 ||
        k % ggml_blck_size(type) != 0 || bytes_per_s == NULL || ggml_quantize_requires_imatrix(type)) {
        return -1;
    }
    const size_t row = ggml_row_size(type, k);
    float *      src = malloc((size_t) k * sizeof(float));
    char *       w   = malloc(row * (size_t) n_rows);
    float *      out = malloc((size_t) n_rows * sizeof(float));
    int          rc  = -1;
    struct pi2_backend_ctx ctx = { .n_threads = threads };
    if (src != NULL && w != NULL && out != NULL) {
        uint32_t seed = 12345u; // any values: the time of a dot product does not depend on them
        for (int64_t i = 0; i < k; ++i) {
            seed = seed * 1664525u + 1013904223u;
            src[i] = (float) (seed >> 8) / (float) (1u << 24) - 0.5f;
        }
        for (int64_t r = 0; r < n_rows; ++r) { // one row quantized, copied: the weights' bytes are all that stream
            if (r == 0) {
                ggml_quantize_chunk(type, src, w, 0, 1, k, NULL);
            } else {
                memcpy(w + (size_t) r * row, w, row);
            }
        }
        struct ggml_tensor x = { .type = GGML_TYPE_F32, .data = src };
        x.ne[0] = k; x.ne[1] = 1; x.ne[2] = 1; x.ne[3] = 1;
        x.nb[0] = sizeof(float); x.nb[1] = (size_t) k * sizeof(float); x.nb[2] = x.nb[1]; x.nb[3] = x.nb[1];
        struct pi2_dense_args a = { .w = w, .w_stride = row, .k = k, .n_tokens = 1, .dst = out, .dst_stride = n_rows,
                                    .vec_dot = tr->vec_dot };
        const uint64_t t0 = pi2_now_ns();
        uint64_t passes = 0;
        rc = 0;
        do {
            if (pi2_run_spans(&ctx, &x, tr->vec_dot_type, n_rows, pi2_mul_mat_span, &a) != GGML_STATUS_SUCCESS) {
                rc = -1;
                break;
            }
            ++passes;
        } while ((double) (pi2_now_ns() - t0) < seconds * 1e9);
        *bytes_per_s = rc == 0 ? (double) passes * (double) row * (double) n_rows / ((double) (pi2_now_ns() - t0) / 1e9) : 0.0;
    }
    free(ctx.work);
    free(out);
    free(w);
    free(src);
    return rc;
}
