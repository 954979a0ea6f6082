#include "ffn_exec.h"

#include <stdatomic.h>
#include <stdlib.h>

#include <omp.h>

#include "dense_matmul.h"
#include "ffn_names.h"
#include "pi2_log.h"

static void pi2_count_matmul(struct pi2_counters * c, const struct ggml_tensor * w, int64_t n_tokens);

static bool pi2_work_reserve(struct pi2_backend_ctx * ctx, size_t size) {
    if (ctx->work_size >= size) {
        return true;
    }
    const size_t rounded = (size + 4095) & ~(size_t) 4095;
    void * p = NULL;
    if (posix_memalign(&p, 64, rounded) != 0) {
        return false;
    }
    free(ctx->work);
    ctx->work      = p;
    ctx->work_size = rounded;
    return true;
}

static int pi2_threads_for(const struct pi2_backend_ctx * ctx, int64_t units) {
    int n = ctx->n_threads > 0 ? ctx->n_threads : 1;
    return units < n ? (int) (units > 0 ? units : 1) : n;
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

    const struct ggml_type_traits_cpu * tt = ggml_get_type_traits_cpu(w->type);
    // the activation converter belongs to vec_dot_type, not to the weight type
    const ggml_from_float_t to_vec_dot = ggml_get_type_traits_cpu(tt->vec_dot_type)->from_float;
    const int64_t k        = w->ne[0];
    const int64_t n_rows   = w->ne[1];
    const int64_t n_tokens = x->ne[1];

    const bool convert = tt->vec_dot_type != GGML_TYPE_F32;
    size_t x_stride = x->nb[1];
    if (convert) {
        x_stride = ggml_row_size(tt->vec_dot_type, k);
        if (!pi2_work_reserve(ctx, x_stride * (size_t) n_tokens)) {
            PI2_LOG_ERROR("pi2: out of memory for %lld activation rows\n", (long long) n_tokens);
            return GGML_STATUS_ALLOC_FAILED;
        }
    }

    const struct pi2_dense_args args = {
        .w          = (const char *) w->data,
        .w_stride   = w->nb[1],
        .k          = k,
        .x          = convert ? ctx->work : (const char *) x->data,
        .x_stride   = x_stride,
        .n_tokens   = n_tokens,
        .dst        = (float *) node->data,
        .dst_stride = (int64_t) (node->nb[1] / sizeof(float)),
        .vec_dot    = tt->vec_dot,
    };

    // one token: long row spans stream the weights; a batch: short spans keep tiles in cache
    const int64_t span     = n_tokens == 1 ? 64 : 16;
    const int64_t n_spans  = (n_rows + span - 1) / span;
    const int     nth      = pi2_threads_for(ctx, n_spans);
    atomic_llong  next     = 0;

    #pragma omp parallel num_threads(nth)
    {
        const int ith = omp_get_thread_num();
        const int nt  = omp_get_num_threads();
        if (convert) {
            pi2_dense_quantize_tokens((const float *) x->data, x->nb[1], k, to_vec_dot, ctx->work, x_stride,
                                      n_tokens * ith / nt, n_tokens * (ith + 1) / nt);
        }
        #pragma omp barrier
        for (;;) {
            const long long s = atomic_fetch_add_explicit(&next, 1, memory_order_relaxed);
            if (s >= n_spans) {
                break;
            }
            const int64_t r0 = s * span;
            pi2_dense_rows(&args, r0, r0 + span < n_rows ? r0 + span : n_rows);
        }
    }

    pi2_count_matmul(&ctx->dev->counters, w, n_tokens);
    return GGML_STATUS_SUCCESS;
}

enum ggml_status pi2_exec_glu(struct pi2_backend_ctx * ctx, struct ggml_tensor * node) {
    const struct ggml_tensor * gate = node->src[0];
    const struct ggml_tensor * up   = node->src[1];
    const enum ggml_glu_op     op   = ggml_get_glu_op(node);

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
        float *       y   = (float *) ((char *) node->data + row * node->nb[1]) + c0;
        const float * xg  = (const float *) ((const char *) gate->data + row * gate->nb[1]) + c0;
        const float * xu  = (const float *) ((const char *) up->data + row * up->nb[1]) + c0;
        if (!pi2_glu_span(&ctx->dev->glu, op, (int) (c1 - c0), y, xg, xu)) {
            atomic_store(&failed, 1);
        }
    }
    if (atomic_load(&failed)) {
        PI2_LOG_ERROR("pi2: GLU op %s is not implemented\n", ggml_glu_op_name(op));
        return GGML_STATUS_FAILED;
    }

    int layer = 0;
    enum pi2_matrix matrix = PI2_MATRIX_GATE;
    if (gate->src[0] != NULL && pi2_ffn_weight_parse(gate->src[0]->name, &layer, &matrix)) {
        struct pi2_counters * c = &ctx->dev->counters;
        pi2_count(&c->layer[layer].glu_calls, 1);
        pi2_count(&c->layer[layer].glu_tokens, (uint64_t) nr);
    }
    return GGML_STATUS_SUCCESS;
}

bool pi2_ffn_fusable(const struct ggml_tensor * a, const struct ggml_tensor * b, const struct ggml_tensor * glu) {
    if (a->op != GGML_OP_MUL_MAT || b->op != GGML_OP_MUL_MAT || glu->op != GGML_OP_GLU) {
        return false;
    }
    const struct ggml_tensor * gate = glu->src[0];
    const struct ggml_tensor * up   = glu->src[1];
    if (!((gate == a && up == b) || (gate == b && up == a))) {
        return false;
    }
    const struct ggml_tensor * wg = gate->src[0];
    const struct ggml_tensor * wu = up->src[0];
    return gate->src[1] == up->src[1] && wg->ne[0] == wu->ne[0] && wg->ne[1] == wu->ne[1] &&
           ggml_get_type_traits_cpu(wg->type)->vec_dot_type == ggml_get_type_traits_cpu(wu->type)->vec_dot_type &&
           (glu->flags & GGML_TENSOR_FLAG_COMPUTE) && (a->flags & GGML_TENSOR_FLAG_COMPUTE) && (b->flags & GGML_TENSOR_FLAG_COMPUTE);
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

enum ggml_status pi2_exec_gate_up_glu(struct pi2_backend_ctx * ctx, struct ggml_tensor * glu) {
    struct ggml_tensor *       gate = glu->src[0];
    struct ggml_tensor *       up   = glu->src[1];
    const struct ggml_tensor * x    = gate->src[1];
    const struct ggml_tensor * wg   = gate->src[0];
    const struct ggml_tensor * wu   = up->src[0];
    const enum ggml_glu_op     op   = ggml_get_glu_op(glu);

    const struct ggml_type_traits_cpu * tg = ggml_get_type_traits_cpu(wg->type);
    const struct ggml_type_traits_cpu * tu = ggml_get_type_traits_cpu(wu->type);
    const ggml_from_float_t to_vec_dot = ggml_get_type_traits_cpu(tg->vec_dot_type)->from_float;
    const int64_t k        = wg->ne[0];
    const int64_t n_rows   = wg->ne[1];
    const int64_t n_tokens = x->ne[1];

    const bool convert = tg->vec_dot_type != GGML_TYPE_F32;
    size_t x_stride = x->nb[1];
    if (convert) {
        x_stride = ggml_row_size(tg->vec_dot_type, k);
        if (!pi2_work_reserve(ctx, x_stride * (size_t) n_tokens)) {
            PI2_LOG_ERROR("pi2: out of memory for %lld activation rows\n", (long long) n_tokens);
            return GGML_STATUS_ALLOC_FAILED;
        }
    }
    const char * xq = convert ? ctx->work : (const char *) x->data;
    struct pi2_dense_args ag = {
        .w = (const char *) wg->data, .w_stride = wg->nb[1], .k = k, .x = xq, .x_stride = x_stride,
        .n_tokens = n_tokens, .dst = (float *) gate->data, .dst_stride = (int64_t) (gate->nb[1] / sizeof(float)),
        .vec_dot = tg->vec_dot,
    };
    struct pi2_dense_args au = ag;
    au.w = (const char *) wu->data;
    au.w_stride = wu->nb[1];
    au.dst = (float *) up->data;
    au.dst_stride = (int64_t) (up->nb[1] / sizeof(float));
    au.vec_dot = tu->vec_dot;

    // spans are multiples of the GLU's SIMD width, so the GLU of a span matches ggml's whole-row split
    const int64_t span    = n_tokens == 1 ? 64 : 16;
    const int64_t n_spans = (n_rows + span - 1) / span;
    const int     nth     = pi2_threads_for(ctx, n_spans);
    atomic_llong  next    = 0;
    atomic_int    failed  = 0;

    #pragma omp parallel num_threads(nth)
    {
        const int ith = omp_get_thread_num();
        const int nt  = omp_get_num_threads();
        if (convert) {
            pi2_dense_quantize_tokens((const float *) x->data, x->nb[1], k, to_vec_dot, ctx->work, x_stride,
                                      n_tokens * ith / nt, n_tokens * (ith + 1) / nt);
        }
        #pragma omp barrier
        for (;;) {
            const long long s = atomic_fetch_add_explicit(&next, 1, memory_order_relaxed);
            if (s >= n_spans) {
                break;
            }
            const int64_t r0 = s * span;
            const int64_t r1 = r0 + span < n_rows ? r0 + span : n_rows;
            pi2_dense_rows(&ag, r0, r1);
            pi2_dense_rows(&au, r0, r1);
            for (int64_t t = 0; t < n_tokens; ++t) {
                float *       y  = (float *) ((char *) glu->data + t * glu->nb[1]) + r0;
                const float * xg = (const float *) ((const char *) gate->data + t * gate->nb[1]) + r0;
                const float * xu = (const float *) ((const char *) up->data + t * up->nb[1]) + r0;
                if (!pi2_glu_span(&ctx->dev->glu, op, (int) (r1 - r0), y, xg, xu)) {
                    atomic_store(&failed, 1);
                }
            }
        }
    }
    if (atomic_load(&failed)) {
        PI2_LOG_ERROR("pi2: GLU op %s is not implemented\n", ggml_glu_op_name(op));
        return GGML_STATUS_FAILED;
    }

    struct pi2_counters * c = &ctx->dev->counters;
    pi2_count_matmul(c, wg, n_tokens);
    pi2_count_matmul(c, wu, n_tokens);
    int layer = 0;
    enum pi2_matrix matrix = PI2_MATRIX_GATE;
    if (pi2_ffn_weight_parse(wg->name, &layer, &matrix)) {
        pi2_count(&c->layer[layer].glu_calls, 1);
        pi2_count(&c->layer[layer].glu_tokens, (uint64_t) n_tokens);
    }
    return GGML_STATUS_SUCCESS;
}
