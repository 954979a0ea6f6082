#include "sparse/sparse_ffn.h"

#include <stdlib.h>
#include <string.h>

#include "graph/activation.h"
#include "sparse/cluster_sched.h"
#include "dense/ffn_exec.h"
#include "sparse/column_axpy.h"
#include "graph/ffn_names.h"
#include "graph/route.h"
#include "ggml-cpu.h"
#include "core/pi2_log.h"
#include "flash/dense_whole.h"
#include "flash/pipeline.h"
#include "sparse/predictor.h"
#include "sparse/sparse_plan.h"

// t's bytes overlap u's (llama's allocator may put an elementwise op's output over its input)
static bool pi2_overlaps(const struct ggml_tensor * t, const struct ggml_tensor * u) {
    const char * a = t->data, * b = u->data;
    return a < b + ggml_nbytes(u) && b < a + ggml_nbytes(t);
}

static size_t pi2_align64(size_t n) {
    return (n + 63) & ~(size_t) 63;
}

// why a layer's FFN region is not one sparse decode can run; NULL when it is
static const char * pi2_sparse_ffn_unfit(const struct pi2_ffn_region * r) {
    if (r->down == NULL || (r->down->flags & GGML_TENSOR_FLAG_COMPUTE) == 0) {
        return "its down product does not take act(gate) * up directly (a bias or a scale between them?)";
    }
    if (r->act.kind != PI2_ACT_SILU && r->act.kind != PI2_ACT_GELU && r->act.kind != PI2_ACT_GELU_ERF &&
        r->act.kind != PI2_ACT_SWIGLU_OAI && !pi2_act_relu_family(r->act.kind)) {
        return "its activation is not one sparse decode computes";
    }
    return NULL;
}

int pi2_sparse_ffn_compute(struct pi2_backend_ctx * ctx, struct pi2_binding * b, const struct pi2_ffn_region * r,
                           int model_layer, enum ggml_status * st) {
    const char * why = pi2_sparse_ffn_unfit(r);
    if (why != NULL) {
        if (pi2_binding_unfit_layer(b, r->layer, why)) {
            *st = GGML_STATUS_FAILED;
            return r->n_nodes;
        }
        *st = pi2_exec_gate_up_act(ctx, r);
        return r->n_nodes - (r->down != NULL); // down, if it is in the region, runs dense alone
    }
    if (!pi2_binding_verify_layer(b, r->layer, r->gate->src[0], r->up->src[0], r->down->src[0])) {
        PI2_LOG_REFUSAL("pi2: %s\n", b->error);
        *st = GGML_STATUS_FAILED;
        return r->n_nodes;
    }
    // read whole from the model file (the sidecar says so, or this budget reads it so): no bundles, no predictor
    if ((b->sc->layer[r->layer].whole || b->layer[r->layer].read_whole) && b->flash) {
        *st = pi2_dense_whole_run(ctx, b, r, model_layer);
        return r->n_nodes;
    }
    if (b->sc->layer[r->layer].whole || pi2_route_region(b, r->gate->src[1]->ne[1]) == PI2_ROUTE_DENSE) {
        *st = pi2_exec_gate_up_act(ctx, r);
        if (*st == GGML_STATUS_SUCCESS) {
            *st = pi2_exec_mul_mat(ctx, r->down);
        }
        return r->n_nodes;
    }
    *st = pi2_exec_sparse_ffn(ctx, b, r, NULL);
    return r->n_nodes;
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
    pi2_count(&lc->rows[PI2_MATRIX_GATE], (uint64_t) (predicted + (p->select == PI2_SELECT_CHECKED ? p->n_ff * p->n_tokens - predicted : 0)));
    pi2_count(&lc->rows[PI2_MATRIX_UP], (uint64_t) admitted);
    pi2_count(&lc->rows[PI2_MATRIX_DOWN], (uint64_t) ((p->n_tokens - sparse_down_tokens) * p->n_embd));
    pi2_count(&lc->sparse_tokens, (uint64_t) p->n_tokens);
    pi2_count(&lc->neurons, (uint64_t) (p->n_ff * p->n_tokens));
    pi2_count(&lc->predicted, (uint64_t) predicted);
    pi2_count(&lc->active, (uint64_t) active);
    pi2_count(&lc->down_sparse_tokens, (uint64_t) sparse_down_tokens);
    if (p->recall_check) {
        pi2_count(&lc->checked_tokens, (uint64_t) p->n_tokens);
        pi2_count(&lc->missed, (uint64_t) missed);
    }
    if (p->source == PI2_SOURCE_CACHE) {
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

static ggml_from_float_t pi2_converter(enum ggml_type vec_dot_type) {
    return vec_dot_type != GGML_TYPE_F32 ? ggml_get_type_traits_cpu(vec_dot_type)->from_float : NULL;
}

// The choices of one layer's decode: which neurons fire, whose gates are computed, where rows come from and
// how clusters go to threads.
static void pi2_plan_choose(struct pi2_sparse_plan * p, const struct pi2_binding * b, int mode) {
    const enum pi2_sparsity_method method = b->sc->sparsity_method;
    const bool always = pi2_setting(&b->settings, b->defaults, PI2_SET_PREDICTOR) != 0.0;
    // flash keeps only the predictors that run (the others were dropped at load)
    const bool predicted = pi2_predictor_runs(&p->B->pred, mode == PI2_MODE_PREDICTED, always);
    p->recall_check = mode == PI2_MODE_PREDICTED && atomic_load(&b->check_recall) && !p->batch;
    p->rule   = mode == PI2_MODE_DENSE ? PI2_RULE_ALL : method == PI2_SPARSITY_METHOD_RELU ? PI2_RULE_RELU
              : method == PI2_SPARSITY_METHOD_PRODUCT ? PI2_RULE_PRODUCT : PI2_RULE_THRESHOLD;
    p->select = !predicted ? PI2_SELECT_ALL : p->recall_check ? PI2_SELECT_CHECKED : PI2_SELECT_PREDICTED;
    if (p->batch) { // the neurons of the batch's union (batch_ffn.h), each token by the mode's rule
        p->select = predicted ? PI2_SELECT_PREDICTED : PI2_SELECT_ALL;
    }
    // in RAM, predicted mode without a predictor (it would cost more than it saves): every gate row is
    // computed anyway, so gate and up rows stream from the model's own contiguous matrices in row order
    // instead of from the 4 KiB-strided bundles; not where the bundles hold the rows in another type (convert
    // --bundle-type), so that a layer computes the same values in RAM as from flash
    const bool model_rows = !b->flash && mode == PI2_MODE_PREDICTED && !predicted && !p->recall_check &&
                            pi2_setting(&b->settings, b->defaults, PI2_SET_ROWS) != 0.0 &&
                            p->gate->src[0]->type == p->L->gate_type && p->up->src[0]->type == p->L->up_type &&
                            ggml_is_contiguous(p->gate->src[0]) && ggml_is_contiguous(p->up->src[0]);
    p->source = b->flash ? PI2_SOURCE_CACHE : model_rows ? PI2_SOURCE_MODEL_ROWS : PI2_SOURCE_MAPPED;
    // weights come from the predictor's scores, cheaply only on ReLU models (no activation function to
    // evaluate), and with W2 blocks that are whole clusters; flash keeps the interleaved order
    p->assign = !b->flash && p->select == PI2_SELECT_PREDICTED && p->rule == PI2_RULE_RELU &&
                ggml_blck_size(p->B->pred.w2_type) == PI2_CLUSTER ? PI2_ASSIGN_BALANCED : PI2_ASSIGN_INTERLEAVED;
    p->down_sparse_max = (float) pi2_setting(&b->settings, b->defaults, PI2_SET_DOWN_SPARSE_MAX);
}

enum ggml_status pi2_exec_sparse_ffn(struct pi2_backend_ctx * ctx, struct pi2_binding * b, const struct pi2_ffn_region * r,
                                     struct pi2_cache_token_stats * io) {
    return pi2_exec_sparse_ffn_split(ctx, b, r, io, ctx->n_threads > 0 ? ctx->n_threads : 1);
}

enum ggml_status pi2_exec_sparse_ffn_split(struct pi2_backend_ctx * ctx, struct pi2_binding * b, const struct pi2_ffn_region * r,
                                           struct pi2_cache_token_stats * io, int n_split) {
    struct ggml_tensor * gate = r->gate;
    const int layer = r->layer;
    const struct pi2_sidecar_layer * L = &b->sc->layer[layer];
    struct pi2_sparse_plan p = {
        .x = gate->src[1], .gate = gate, .up = r->up, .glu = r->out, .down = r->down, .w_down = r->down->src[0],
        .act = r->act, .bias_gate = r->bias_gate, .bias_up = r->bias_up, .L = L, .B = &b->layer[layer], .layer = layer, .prefetch_layer = -1,
        .n_embd = b->sc->n_embd, .n_ff = L->n_ff, .rank = L->rank,
        .n_clusters = (L->n_ff + PI2_CLUSTER - 1) / PI2_CLUSTER, .n_tokens = gate->src[1]->ne[1],
    };
    atomic_init(&p.failed, 0);
    if (!pi2_act_equal(&p.act, &b->sc->activation)) {
        snprintf(b->error, sizeof(b->error), "sidecar %s was made for FFN activation %s, but layer %d of the model computes "
                 "%s (a model states a ReLU-family activation in <arch>.ffn_activation; pi2_gguf.Llama reads it)",
                 b->sc->path, pi2_activation_names[b->sc->activation.kind], layer, pi2_activation_names[p.act.kind]);
        PI2_LOG_REFUSAL("pi2: %s\n", b->error);
        return GGML_STATUS_FAILED;
    }
    // on flash a prompt (a batch past PI2_SPARSE_BATCH, or a routed expert's tokens of one) runs as a batch
    p.batch = b->flash && (r->batch || pi2_route_region(b, p.n_tokens) == PI2_ROUTE_SPARSE_BATCH);
    pi2_plan_choose(&p, b, atomic_load(&b->mode));
    const bool alias_gate = pi2_overlaps(r->gate, r->out), alias_up = pi2_overlaps(r->up, r->out);
    struct ggml_tensor gate_scratch = *r->gate, up_scratch = *r->up;
    // the types the bundles hold gate/up rows in: the model's, or convert --bundle-type's (model rows are used only
    // where the two agree)
    const struct ggml_type_traits_cpu * tg = ggml_get_type_traits_cpu(L->gate_type);
    const struct ggml_type_traits_cpu * tu = ggml_get_type_traits_cpu(L->up_type);
    const struct ggml_type_traits_cpu * td = ggml_get_type_traits_cpu(p.w_down->type);
    const struct ggml_type_traits_cpu * tp = ggml_get_type_traits_cpu(p.B->pred.w1_type);
    p.gate_dot    = tg->vec_dot;
    p.up_dot      = tu->vec_dot;
    p.down_dot    = td->vec_dot;
    p.pred_dot    = tp->vec_dot;
    p.to_gate_vdt = pi2_converter(tg->vec_dot_type);
    p.to_up_vdt   = pi2_converter(tu->vec_dot_type);
    p.to_down_vdt = pi2_converter(td->vec_dot_type);
    p.to_pred_vdt = pi2_converter(tp->vec_dot_type);
    if (p.batch && p.n_tokens >= PI2_DOT_TOKENS) {
        p.gate_dot_tokens = pi2_dot_tokens_for(L->gate_type, p.gate_dot, &ctx->dot_tokens_checked[L->gate_type]);
        p.up_dot_tokens   = pi2_dot_tokens_for(L->up_type, p.up_dot, &ctx->dot_tokens_checked[L->up_type]);
    }

    const int nth = ctx->n_threads > 0 ? ctx->n_threads : 1;
    p.nth = nth;
    p.n_split = n_split > 0 ? n_split : 1;
    const int n_part = nth > p.n_split ? nth : p.n_split; // per-thread or per-split rows
    // a batch computing each token's own predicted neurons, as decode would (convert's perplexity scores)
    const bool token_want = p.batch && p.select == PI2_SELECT_PREDICTED &&
                            pi2_setting(&b->settings, b->defaults, PI2_SET_BATCH_NEURONS) != 0.0;
    p.xq_stride    = ggml_row_size(tg->vec_dot_type, p.n_embd);
    p.tmp_stride   = pi2_column_scratch(p.n_embd); // down columns of n_embd; z's F16 rows need 256 at most
    p.xq_up_stride = ggml_row_size(tu->vec_dot_type, p.n_embd);
    const bool same_vdt = tg->vec_dot_type == tu->vec_dot_type;
    // workspace: one arena, carved in 64-byte aligned pieces
    const size_t sizes[] = {
        pi2_align64(p.xq_stride * (size_t) p.n_tokens),
        same_vdt ? 0 : pi2_align64(p.xq_up_stride * (size_t) p.n_tokens),
        pi2_align64(ggml_row_size(tp->vec_dot_type, p.n_embd)),
        pi2_align64((size_t) p.rank * sizeof(float)),
        pi2_align64((size_t) p.n_ff * sizeof(float)),
        pi2_align64((size_t) (p.batch ? nth * p.n_tokens : p.n_split) * p.n_embd * sizeof(float)),
        p.batch ? pi2_align64((size_t) nth * p.n_tokens * PI2_CLUSTER * sizeof(float)) : 0,
        pi2_align64((size_t) n_part * p.tmp_stride * sizeof(float)),
        pi2_align64((size_t) p.n_ff * sizeof(struct pi2_active)),
        pi2_align64((size_t) p.n_clusters * sizeof(int32_t)),
        pi2_align64((size_t) p.n_clusters * sizeof(int32_t)),
        pi2_align64((size_t) nth * sizeof(struct pi2_thread_stats)),
        pi2_align64(ggml_row_size(td->vec_dot_type, p.n_ff)),
        b->flash ? pi2_align64((size_t) p.n_ff) : 0,
        pi2_align64((size_t) nth * p.n_ff * sizeof(int32_t)),
        token_want ? pi2_align64((size_t) p.n_tokens * (size_t) p.n_ff) : 0,
        // a patched llama.cpp's FATReLU graph may place act(gate) * up over the gate or up product (an
        // in-place MUL): their values then go to scratch, as nothing but that product reads them
        alias_gate ? pi2_align64(ggml_nbytes(r->gate)) : 0,
        alias_up ? pi2_align64(ggml_nbytes(r->up)) : 0,
        p.batch ? pi2_align64((size_t) nth * PI2_CLUSTER * (size_t) p.n_embd * sizeof(float)) : 0,
        p.batch ? pi2_align64((size_t) nth * 2 * (size_t) p.n_tokens * sizeof(int32_t)) : 0,
        p.batch ? pi2_align64((size_t) nth * 2 * (size_t) p.n_tokens * sizeof(float)) : 0,
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
    p.xq     = w;                             w += sizes[0];
    p.xq_up  = same_vdt ? p.xq : w;           w += sizes[1];
    p.xp     = w;                             w += sizes[2];
    p.h      = (float *) w;                   w += sizes[3];
    p.z      = (float *) w;                   w += sizes[4];
    p.y      = (float *) w;                   w += sizes[5];
    p.acts   = (float *) w;                   w += sizes[6];
    p.tmp    = (float *) w;                   w += sizes[7];
    p.list   = (struct pi2_active *) w;       w += sizes[8];
    p.n_act  = (int32_t *) w;                 w += sizes[9];
    p.weight = (int32_t *) w;                 w += sizes[10];
    p.stats  = (struct pi2_thread_stats *) w; w += sizes[11];
    p.gluq   = w;                             w += sizes[12];
    p.want   = b->flash ? (uint8_t *) w : NULL; w += sizes[13];
    p.cand   = (int32_t *) w;          w += sizes[14];
    p.token_want = token_want ? (uint8_t *) w : NULL; w += sizes[15];
    if (alias_gate) {
        gate_scratch.data = w;
        gate_scratch.nb[1] = (size_t) p.n_ff * sizeof(float);
        p.gate = &gate_scratch;
    }
    w += sizes[16];
    if (alias_up) {
        up_scratch.data = w;
        up_scratch.nb[1] = (size_t) p.n_ff * sizeof(float);
        p.up = &up_scratch;
    }
    w += sizes[17];
    p.colf = p.batch ? (float *) w : NULL;   w += sizes[18];
    p.tok = p.batch ? (int32_t *) w : NULL;  w += sizes[19];
    p.tok_vals = p.batch ? (float *) w : NULL;
    memset(p.stats, 0, (size_t) nth * sizeof(struct pi2_thread_stats));

    if (b->flash) {
        const enum ggml_status st = pi2_pipeline_run(b, &p, nth);
        if (st != GGML_STATUS_SUCCESS) {
            return st;
        }
    } else {
        pi2_sched_run(&p, nth);
    }
    pi2_sparse_count(&ctx->dev->counters, layer, &p);
    if (io != NULL) {
        *io = p.io;
    }
    return GGML_STATUS_SUCCESS;
}
