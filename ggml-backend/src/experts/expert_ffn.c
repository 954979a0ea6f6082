#include "experts/expert_ffn.h"

#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <omp.h>

#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "graph/ffn_names.h"
#include "graph/ffn_region.h"
#include "graph/route.h"
#include "dense/ffn_exec.h"
#include "dense/glu.h"
#include "flash/expert_file.h"
#include "model/model_binding.h"
#include "flash/pipeline.h"
#include "sparse/predictor.h"
#include "core/pi2_log.h"
#include "sparse/sparse_ffn.h"

// a product's operands, as MUL_MAT_ID defines them: out[:, s, t] = W[ids[s, t]] . x[:, s % n_b, t]
struct pi2_id_operands {
    const struct ggml_tensor * w, * x, * ids;
    struct ggml_tensor *       out;
    int64_t k, n_rows, n_expert, n_b, n_used, n_tokens;
    const int32_t * order; // the order pairs run in (pair q = order[i]: slot q % n_used of token q / n_used); NULL: i
};

static inline int64_t pi2_pair_at(const struct pi2_id_operands * o, int64_t i) {
    return o->order != NULL ? o->order[i] : i;
}

static struct pi2_id_operands pi2_id_operands(struct ggml_tensor * node) {
    const struct ggml_tensor * w = node->src[0];
    const struct ggml_tensor * x = node->src[1];
    const struct ggml_tensor * ids = node->src[2];
    return (struct pi2_id_operands) {
        .w = w, .x = x, .ids = ids, .out = node,
        .k = w->ne[0], .n_rows = w->ne[1], .n_expert = w->ne[2], .n_b = x->ne[1], .n_used = ids->ne[0], .n_tokens = ids->ne[1],
    };
}

bool pi2_expert_mul_mat_id_shapes(const struct ggml_tensor * op) {
    const struct ggml_tensor * w = op->src[0];
    const struct ggml_tensor * x = op->src[1];
    const struct ggml_tensor * ids = op->src[2];
    if (w == NULL || x == NULL || ids == NULL) {
        return false;
    }
    return ggml_is_contiguous(w) && w->ne[3] == 1 && w->ne[0] % ggml_blck_size(w->type) == 0 &&
           x->type == GGML_TYPE_F32 && x->ne[0] == w->ne[0] && x->ne[3] == 1 && x->nb[0] == sizeof(float) &&
           ids->type == GGML_TYPE_I32 && ids->ne[1] == x->ne[2] && ids->ne[2] == 1 && ids->ne[3] == 1 && ids->nb[0] == sizeof(int32_t) &&
           (x->ne[1] == 1 || x->ne[1] == ids->ne[0]) &&
           op->type == GGML_TYPE_F32 && op->nb[0] == sizeof(float) && op->ne[0] == w->ne[1] &&
           op->ne[1] == ids->ne[0] && op->ne[2] == ids->ne[1] && op->ne[3] == 1;
}

static int32_t pi2_id_at(const struct pi2_id_operands * o, int64_t s, int64_t t) {
    return *(const int32_t *) ((const char *) o->ids->data + t * o->ids->nb[1] + s * o->ids->nb[0]);
}

static float * pi2_id_out(const struct ggml_tensor * out, int64_t s, int64_t t) {
    return (float *) ((char *) out->data + t * out->nb[2] + s * out->nb[1]);
}

// the FFN input of the pair at position i of the order
static const float * pi2_pair_x(const struct pi2_id_operands * o, int64_t i) {
    const int64_t q = pi2_pair_at(o, i), s = q % o->n_used, t = q / o->n_used;
    return (const float *) ((const char *) o->x->data + t * o->x->nb[2] + (s % o->n_b) * o->x->nb[1]);
}

static int32_t pi2_pair_expert(const struct pi2_id_operands * o, int64_t i) {
    const int64_t q = pi2_pair_at(o, i);
    return pi2_id_at(o, q % o->n_used, q / o->n_used);
}

// the routed work of a layer's batch (o: its gate product), counted once whichever path computed it
static void pi2_count_routing(struct pi2_counters * c, int layer, const struct pi2_id_operands * o) {
    pi2_count_layer_seen(c, layer);
    struct pi2_layer_counters * L = &c->layer[layer];
    pi2_count(&L->expert_tokens, (uint64_t) o->n_tokens);
    pi2_count(&L->experts_routed, (uint64_t) (o->n_used * o->n_tokens));
    pi2_count(&L->expert_neurons, (uint64_t) (o->n_rows * o->n_used * o->n_tokens));
}

static void pi2_count_experts(struct pi2_counters * c, const struct pi2_id_operands * o, int layer, enum pi2_matrix m,
                              int64_t n_loaded, uint64_t rows) {
    pi2_count_layer_seen(c, layer);
    struct pi2_layer_counters * L = &c->layer[layer];
    pi2_count(&L->matmul_calls[m], 1);
    pi2_count(&L->matmul_tokens[m], (uint64_t) o->n_tokens);
    pi2_count(&L->rows[m], rows);
    pi2_count(&L->weight_bytes[m], (uint64_t) n_loaded * (uint64_t) o->n_rows * o->w->nb[1]);
    if (m == PI2_MATRIX_GATE) {
        pi2_count_routing(c, layer, o);
        pi2_count(&L->experts_loaded, (uint64_t) n_loaded);
    } else if (m == PI2_MATRIX_UP) {
        pi2_count(&L->expert_active, rows);
    }
}

// One MUL_MAT_ID. The (slot, token) pairs are grouped by expert; work units are (expert used, span of rows), each
// computing its rows for every pair routed to that expert. With `gate` (the region's gate product, same shape as
// node) a row is computed only where act passes its cut on the gate, else written 0.
static enum ggml_status pi2_run_mul_mat_id(struct pi2_backend_ctx * ctx, struct ggml_tensor * node,
                                           const struct ggml_tensor * gate, const struct pi2_ffn_act * act) {
    const struct pi2_id_operands o = pi2_id_operands(node);
    int layer = 0;
    enum pi2_matrix m = PI2_MATRIX_GATE;
    if (!pi2_expert_weight_parse(o.w->name, &layer, &m)) {
        PI2_LOG_ERROR("pi2: MUL_MAT_ID on %s, which PI2 does not own\n", o.w->name);
        return GGML_STATUS_FAILED;
    }
    if (!ggml_backend_buffer_is_host(o.w->buffer)) {
        PI2_LOG_ERROR("pi2: %s is on flash (a memory budget), where only its sidecar's bundles hold it; this product of it "
                      "is not one the sparse engine runs\n", o.w->name);
        return GGML_STATUS_FAILED;
    }
    const struct ggml_type_traits_cpu * tt = ggml_get_type_traits_cpu(o.w->type);
    const enum ggml_type vdt = tt->vec_dot_type;
    const bool convert = vdt != GGML_TYPE_F32;
    const size_t xq_stride = convert ? ggml_row_size(vdt, o.k) : (size_t) o.k * sizeof(float);
    const int64_t n_cols = o.n_b * o.n_tokens;
    const int64_t n_pairs = o.n_used * o.n_tokens;

    // work: converted columns, then per expert its count and first pair, the pairs by expert, the experts used
    const size_t xq_bytes = ((xq_stride * (size_t) n_cols) + 63) & ~(size_t) 63;
    const size_t need = xq_bytes + sizeof(int64_t) * (size_t) (2 * o.n_expert + n_pairs + o.n_expert);
    if (pi2_work_reserve(ctx, need) == NULL) {
        PI2_LOG_ERROR("pi2: out of memory for %lld routed tokens\n", (long long) o.n_tokens);
        return GGML_STATUS_ALLOC_FAILED;
    }
    char *    xq     = ctx->work;
    int64_t * count  = (int64_t *) (ctx->work + xq_bytes);
    int64_t * first  = count + o.n_expert;
    int64_t * pairs  = first + o.n_expert;  // s + t * n_used, grouped by expert
    int64_t * used   = pairs + n_pairs;     // the experts with pairs, in expert order
    memset(count, 0, sizeof(int64_t) * (size_t) o.n_expert);
    for (int64_t t = 0; t < o.n_tokens; ++t) {
        for (int64_t s = 0; s < o.n_used; ++s) {
            const int32_t e = pi2_id_at(&o, s, t);
            if (e < 0 || e >= o.n_expert) {
                PI2_LOG_ERROR("pi2: %s: token %lld routed to expert %d of %lld\n", o.w->name, (long long) t, e, (long long) o.n_expert);
                return GGML_STATUS_FAILED;
            }
            count[e]++;
        }
    }
    int64_t n_loaded = 0;
    for (int64_t e = 0, at = 0; e < o.n_expert; ++e) {
        first[e] = at;
        at += count[e];
        if (count[e] > 0) {
            used[n_loaded++] = e;
        }
        count[e] = 0; // refilled below as the fill position
    }
    for (int64_t t = 0; t < o.n_tokens; ++t) {
        for (int64_t s = 0; s < o.n_used; ++s) {
            const int32_t e = pi2_id_at(&o, s, t);
            pairs[first[e] + count[e]++] = s + t * o.n_used;
        }
    }

    // one token an expert: long spans stream its rows; several: short spans keep a tile in cache for all of them
    const int64_t span    = o.n_tokens == 1 ? 64 : 16;
    const int64_t n_spans = (o.n_rows + span - 1) / span;
    const int64_t n_units = n_loaded * n_spans;
    const int     want    = ctx->n_threads > 0 ? ctx->n_threads : 1;
    const int     nth     = n_units < want ? (int) (n_units > 0 ? n_units : 1) : want;
    ggml_from_float_t to_vec_dot = convert ? ggml_get_type_traits_cpu(vdt)->from_float : NULL;
    const bool masked = gate != NULL && pi2_act_relu_family(act->kind);
    const float cut = masked && act->kind == PI2_ACT_FATRELU ? act->threshold : 0.0f;
    atomic_llong next = 0;
    atomic_ullong computed = 0;

    #pragma omp parallel num_threads(nth)
    {
        const int ith = omp_get_thread_num();
        const int nt  = omp_get_num_threads();
        for (int64_t c = n_cols * ith / nt; c < n_cols * (ith + 1) / nt; ++c) {
            const float * src = (const float *) ((const char *) o.x->data + (c / o.n_b) * o.x->nb[2] + (c % o.n_b) * o.x->nb[1]);
            if (convert) {
                to_vec_dot(src, xq + (size_t) c * xq_stride, o.k);
            } else {
                memcpy(xq + (size_t) c * xq_stride, src, xq_stride);
            }
        }
        #pragma omp barrier
        uint64_t mine = 0;
        for (;;) {
            const long long u = atomic_fetch_add_explicit(&next, 1, memory_order_relaxed);
            if (u >= n_units) {
                break;
            }
            const int64_t e  = used[u / n_spans];
            const int64_t r0 = (u % n_spans) * span;
            const int64_t r1 = r0 + span < o.n_rows ? r0 + span : o.n_rows;
            const char * we = (const char *) o.w->data + (size_t) e * o.w->nb[2];
            for (int64_t p = first[e]; p < first[e] + count[e]; ++p) {
                const int64_t s = pairs[p] % o.n_used;
                const int64_t t = pairs[p] / o.n_used;
                const char * xc = xq + (size_t) (t * o.n_b + s % o.n_b) * xq_stride;
                float * d = pi2_id_out(o.out, s, t);
                const float * g = masked ? pi2_id_out(gate, s, t) : NULL;
                for (int64_t r = r0; r < r1; ++r) {
                    if (masked && !(g[r] > cut)) {
                        d[r] = 0.0f;
                        continue;
                    }
                    tt->vec_dot((int) o.k, d + r, 0, we + (size_t) r * o.w->nb[1], 0, xc, 0, 1);
                    mine++;
                }
            }
        }
        atomic_fetch_add_explicit(&computed, mine, memory_order_relaxed);
    }
    pi2_count_experts(&ctx->dev->counters, &o, layer, m, n_loaded, (uint64_t) atomic_load(&computed));
    return GGML_STATUS_SUCCESS;
}

enum ggml_status pi2_exec_mul_mat_id(struct pi2_backend_ctx * ctx, struct ggml_tensor * node) {
    return pi2_run_mul_mat_id(ctx, node, NULL, NULL);
}

bool pi2_add_id_shapes(const struct ggml_tensor * op) {
    const struct ggml_tensor * a = op->src[0], * b = op->src[1], * ids = op->src[2];
    return a != NULL && b != NULL && ids != NULL && op->op == GGML_OP_ADD_ID && a->type == GGML_TYPE_F32 &&
           b->type == GGML_TYPE_F32 && ids->type == GGML_TYPE_I32 && op->type == GGML_TYPE_F32 && a->nb[0] == sizeof(float) &&
           b->nb[0] == sizeof(float) && op->nb[0] == sizeof(float) && a->ne[0] == b->ne[0] && b->ne[2] == 1 && b->ne[3] == 1 &&
           a->ne[3] == 1 && ggml_are_same_shape(op, a) && ids->ne[0] == a->ne[1] && ids->ne[1] == a->ne[2] && ids->ne[2] == 1 &&
           ids->ne[3] == 1;
}

enum ggml_status pi2_exec_add_id(struct pi2_backend_ctx * ctx, struct ggml_tensor * node) {
    const struct ggml_tensor * a = node->src[0], * b = node->src[1], * ids = node->src[2];
    if (!pi2_add_id_shapes(node)) {
        PI2_LOG_ERROR("pi2: ADD_ID %s of shapes PI2 does not compute\n", node->name);
        return GGML_STATUS_FAILED;
    }
    const int64_t n = a->ne[0], n_used = a->ne[1], n_tokens = a->ne[2];
    for (int64_t t = 0; t < n_tokens; ++t) { // every id checked before any row is written
        for (int64_t s = 0; s < n_used; ++s) {
            const int32_t e = *(const int32_t *) ((const char *) ids->data + t * ids->nb[1] + s * ids->nb[0]);
            if (e < 0 || e >= b->ne[1]) {
                PI2_LOG_ERROR("pi2: %s: token %lld routed to expert %d of %lld\n", node->name, (long long) t, e, (long long) b->ne[1]);
                return GGML_STATUS_FAILED;
            }
        }
    }
    const int64_t nr = n_used * n_tokens;
    const int     want = ctx->n_threads > 0 ? ctx->n_threads : 1;
    const int     nth = nr < want ? (int) (nr > 0 ? nr : 1) : want;
    #pragma omp parallel for num_threads(nth) schedule(static)
    for (int64_t r = 0; r < nr; ++r) {
        const int64_t s = r % n_used, t = r / n_used;
        const int32_t e = *(const int32_t *) ((const char *) ids->data + t * ids->nb[1] + s * ids->nb[0]);
        const float * x = (const float *) ((const char *) a->data + t * a->nb[2] + s * a->nb[1]);
        const float * y = (const float *) ((const char *) b->data + e * b->nb[1]);
        float * d = (float *) ((char *) node->data + t * node->nb[2] + s * node->nb[1]);
        for (int64_t k = 0; k < n; ++k) {
            d[k] = x[k] + y[k]; // ggml_vec_add_f32
        }
    }
    return GGML_STATUS_SUCCESS;
}

// node, an ADD_ID of product t's rows and an expert bias (gpt-oss's experts), or false
static bool pi2_is_bias_add(const struct ggml_tensor * node, const struct ggml_tensor * t) {
    return node != NULL && node->op == GGML_OP_ADD_ID && node->src[0] == t && node->src[2] == t->src[2] &&
           pi2_add_id_shapes(node) && node->src[1]->ne[1] == t->src[0]->ne[2] && ggml_is_contiguous(node);
}

// an expert's row of a bias [n, n_expert] (an ADD_ID's src[1]), or NULL without a bias
static const float * pi2_expert_bias(const struct ggml_tensor * add, int32_t e) {
    return add != NULL ? (const float *) ((const char *) add->src[1]->data + (size_t) e * add->src[1]->nb[1]) : NULL;
}

static bool pi2_is_expert_product(const struct ggml_tensor * t, int layer, enum pi2_matrix want) {
    int l = 0;
    enum pi2_matrix m = PI2_MATRIX_GATE;
    return t != NULL && t->op == GGML_OP_MUL_MAT_ID && pi2_expert_weight_parse(t->src[0]->name, &l, &m) && l == layer && m == want;
}

// a view of t's half k (as build_moe_ffn makes them: [n_ff, n_used, n_tokens] at offset k n_ff floats)
static bool pi2_is_half_view(const struct ggml_tensor * v, const struct ggml_tensor * t, int k) {
    return v != NULL && v->op == GGML_OP_VIEW && v->view_src == t && v->ne[0] * 2 == t->ne[0] && v->ne[1] == t->ne[1] &&
           v->ne[2] == t->ne[2] && v->nb[1] == t->nb[1] && v->nb[2] == t->nb[2] &&
           v->view_offs == (size_t) k * (size_t) v->ne[0] * sizeof(float);
}

// ffn_gate_up_exps' product at node i, then its gate and up views and their GLU (build_moe_ffn's merged path)
static bool pi2_expert_region_fused(struct ggml_cgraph * g, int i, int layer, const struct pi2_stated_act * stated,
                                    struct pi2_expert_region * r) {
    const int n = ggml_graph_n_nodes(g);
    struct ggml_tensor * t = ggml_graph_node(g, i);
    if (i + 3 >= n || t->type != GGML_TYPE_F32 || t->nb[0] != sizeof(float) || t->ne[0] % 2 != 0) {
        return false;
    }
    struct ggml_tensor * vg = ggml_graph_node(g, i + 1), * vu = ggml_graph_node(g, i + 2), * glu = ggml_graph_node(g, i + 3);
    if (!pi2_is_half_view(vg, t, 0) || !pi2_is_half_view(vu, t, 1) || glu->op != GGML_OP_GLU || glu->src[0] != vg ||
        glu->src[1] != vu || ((const int32_t *) glu->op_params)[1] != 0 || !ggml_are_same_shape(glu, vg) ||
        !ggml_is_contiguous(glu)) {
        return false;
    }
    struct pi2_ffn_act act;
    if (!pi2_act_for_glu(stated, glu, &act)) {
        return false;
    }
    struct ggml_tensor * down = i + 4 < n ? ggml_graph_node(g, i + 4) : NULL;
    if (down != NULL && !(pi2_is_expert_product(down, layer, PI2_MATRIX_DOWN) && down->src[1] == glu && down->src[2] == t->src[2] &&
                          ggml_is_contiguous(down))) {
        down = NULL;
    }
    *r = (struct pi2_expert_region) { .layer = layer, .n_nodes = 4, .glu = glu, .down = down, .act = act };
    for (int k = 0; k < 2; ++k) {
        pi2_fused_half(&r->fused_w[k], &r->fused_p[k], t, k);
    }
    r->gate = &r->fused_p[0];
    r->up   = &r->fused_p[1];
    return true;
}

bool pi2_expert_region_find(struct ggml_cgraph * g, int i, const struct pi2_stated_act * stated, struct pi2_expert_region * r) {
    const int n = ggml_graph_n_nodes(g);
    if (i + 2 >= n) {
        return false;
    }
    {
        const struct ggml_tensor * t = ggml_graph_node(g, i);
        int layer = 0;
        enum pi2_matrix m = PI2_MATRIX_GATE;
        bool fused = false;
        if (t->op == GGML_OP_MUL_MAT_ID && pi2_expert_weight_parse_fused(t->src[0]->name, &layer, &m, &fused) && fused) {
            return pi2_expert_region_fused(g, i, layer, stated, r);
        }
    }
    // ggml orders a node's sources first to last: the GLU's gate product, then its up product, then the GLU
    struct ggml_tensor * gate = ggml_graph_node(g, i);
    int layer = 0;
    enum pi2_matrix m = PI2_MATRIX_GATE;
    if (gate->op != GGML_OP_MUL_MAT_ID || !pi2_expert_weight_parse(gate->src[0]->name, &layer, &m) || m != PI2_MATRIX_GATE) {
        return false;
    }
    // gpt-oss: gate, its bias added, up, its bias added, then the GLU of the two sums
    const bool biased = pi2_is_bias_add(ggml_graph_node(g, i + 1), gate);
    if (biased && i + 4 >= n) {
        return false;
    }
    struct ggml_tensor * gate_b = biased ? ggml_graph_node(g, i + 1) : NULL;
    struct ggml_tensor * up     = ggml_graph_node(g, i + 1 + biased);
    struct ggml_tensor * up_b   = biased ? ggml_graph_node(g, i + 3) : NULL;
    struct ggml_tensor * glu    = ggml_graph_node(g, i + 2 + 2 * biased);
    if (biased && !pi2_is_bias_add(up_b, up)) {
        return false;
    }
    if (!pi2_is_expert_product(up, layer, PI2_MATRIX_UP) || gate->src[1] != up->src[1] || gate->src[2] != up->src[2] ||
        !ggml_are_same_shape(gate, up) || glu->op != GGML_OP_GLU || glu->src[0] != (biased ? gate_b : gate) ||
        glu->src[1] != (biased ? up_b : up) ||
        ((const int32_t *) glu->op_params)[1] != 0 || !ggml_are_same_shape(glu, gate) ||
        !ggml_is_contiguous(glu) || !ggml_is_contiguous(gate) || !ggml_is_contiguous(up)) {
        return false;
    }
    struct pi2_ffn_act act;
    if (!pi2_act_for_glu(stated, glu, &act)) {
        return false;
    }
    const int n_nodes = 3 + 2 * biased;
    struct ggml_tensor * down = i + n_nodes < n ? ggml_graph_node(g, i + n_nodes) : NULL;
    if (down != NULL && !(pi2_is_expert_product(down, layer, PI2_MATRIX_DOWN) && down->src[1] == glu && down->src[2] == gate->src[2] &&
                          ggml_is_contiguous(down))) {
        down = NULL;
    }
    *r = (struct pi2_expert_region) { .layer = layer, .n_nodes = n_nodes, .up = up, .gate = gate, .gate_biased = gate_b,
                                      .up_biased = up_b, .glu = glu, .down = down, .act = act };
    return true;
}

// act(gate, up) over the region's [n_ff, n_used, n_tokens], each thread a share of the (slot, token) rows
static enum ggml_status pi2_expert_act(struct pi2_backend_ctx * ctx, const struct pi2_expert_region * r) {
    const int64_t nc = r->glu->ne[0];
    const int64_t nr = ggml_nrows(r->glu);
    const int     want = ctx->n_threads > 0 ? ctx->n_threads : 1;
    const int     nth = nr < want ? (int) nr : want;
    atomic_int failed = 0;
    #pragma omp parallel for num_threads(nth > 0 ? nth : 1) schedule(static)
    for (int64_t row = 0; row < nr; ++row) {
        float * y = (float *) ((char *) r->glu->data + row * r->glu->nb[1]);
        const struct ggml_tensor * gate = r->gate_biased != NULL ? r->gate_biased : r->gate;
        const struct ggml_tensor * up   = r->up_biased != NULL ? r->up_biased : r->up;
        const float * xg = (const float *) ((const char *) gate->data + row * gate->nb[1]);
        const float * xu = (const float *) ((const char *) up->data + row * up->nb[1]);
        if (!pi2_glu_span(&ctx->dev->glu, &r->act, (int) nc, y, xg, xu)) {
            atomic_store(&failed, 1);
        }
    }
    if (atomic_load(&failed)) {
        PI2_LOG_ERROR("pi2: FFN activation %s is not implemented\n", pi2_activation_names[r->act.kind]);
        return GGML_STATUS_FAILED;
    }
    struct pi2_layer_counters * L = &ctx->dev->counters.layer[r->layer];
    pi2_count(&L->glu_calls, 1);
    pi2_count(&L->glu_tokens, (uint64_t) r->glu->ne[2]);
    return GGML_STATUS_SUCCESS;
}

enum ggml_status pi2_exec_expert_region(struct pi2_backend_ctx * ctx, const struct pi2_expert_region * r) {
    enum ggml_status st = pi2_run_mul_mat_id(ctx, r->gate, NULL, NULL);
    if (st == GGML_STATUS_SUCCESS && r->gate_biased != NULL) { // the graph's order: the sum before up's product
        st = pi2_exec_add_id(ctx, r->gate_biased);
    }
    if (st == GGML_STATUS_SUCCESS) {
        // up's rows only where the gate fires: a ReLU family has no biases (a biased region's act is SwiGLU-OAI)
        st = pi2_run_mul_mat_id(ctx, r->up, r->gate, &r->act);
    }
    if (st == GGML_STATUS_SUCCESS && r->up_biased != NULL) {
        st = pi2_exec_add_id(ctx, r->up_biased);
    }
    if (st == GGML_STATUS_SUCCESS) {
        st = pi2_expert_act(ctx, r);
    }
    return st;
}

// the expert's matrix of a stacked [k, rows, n_expert] weight, as a 2-D tensor
static struct ggml_tensor pi2_expert_matrix(const struct ggml_tensor * w, int64_t e) {
    struct ggml_tensor m = *w;
    m.ne[2] = 1;
    m.nb[3] = m.nb[2];
    m.data  = (char *) w->data + (size_t) e * w->nb[2];
    return m;
}

// column (s, t) of a [n, slots, tokens] tensor as an [n, 1] tensor
static struct ggml_tensor pi2_pair_column(const struct ggml_tensor * t, int64_t s, int64_t tok) {
    struct ggml_tensor c = *t;
    c.ne[1] = c.ne[2] = c.ne[3] = 1;
    c.nb[2] = c.nb[3] = c.nb[1];
    c.data  = (char *) t->data + tok * t->nb[2] + s * t->nb[1];
    return c;
}

// Reads ahead the bundles of a batch's routed (token, expert) pairs on flash: pair q's bundles are queued before
// pair i computes, for q < i + window, so the disk reads the layer's experts while the first of them computes.
// Entries pinned for requests after pair i's are capped at the cache's ahead room, so pair i always finds
// entries for its own misses.
struct pi2_expert_ahead {
    struct pi2_binding *             b;
    const struct pi2_id_operands *   o;
    const struct pi2_expert_region * r;
    bool                             predicted; // want from the predictor (else every bundle: dense, oracle, recall check)
    bool                             always;
    int64_t                          n_pairs, issued, window;
    uint32_t                         room;
    uint32_t *                       pinned;    // [n_pairs] entries pinned for each pair
    uint8_t *                        want;      // [n_ff] (the largest of this layer's and the next one's experts)
    void *                           scratch;   // the predictor's
    // guessing the next layer's experts (expert_speculate.h): NULL routers where it does not run
    const struct pi2_routers *       routers;
    struct pi2_counters *            counters;
    bool                             guessed;
    int32_t *                        top;       // [n_used]
    int32_t *                        order;     // [n_expert] the guessed experts, in the order they were ranked
    int64_t *                        order_tok; // [n_expert] the token that ranked each
    int32_t                          n_order;   // -1: no guess made yet
    void *                           rscratch;
};

static void pi2_expert_ahead_free(struct pi2_expert_ahead * A) {
    free(A->pinned);
    free(A->want);
    free(A->scratch);
    free(A->top);
    free(A->order);
    free(A->order_tok);
    free(A->rscratch);
}

// false with nothing to free where read-ahead does not run (in RAM, PI2_EXPERT_AHEAD 0, no cache yet)
static bool pi2_expert_ahead_init(struct pi2_expert_ahead * A, struct pi2_backend_ctx * ctx, struct pi2_binding * b,
                                  const struct pi2_id_operands * o, const struct pi2_expert_region * r) {
    memset(A, 0, sizeof(*A));
    const int64_t window = b->flash ? (int64_t) pi2_binding_setting(b, PI2_SET_EXPERT_AHEAD) : 0;
    if (window == 0) {
        return false;
    }
    A->room = pi2_pipeline_ahead_room(b);
    const int mode = atomic_load(&b->mode);
    A->b = b;
    A->counters = &ctx->dev->counters;
    A->o = o;
    A->r = r;
    A->predicted = mode == PI2_MODE_PREDICTED && !atomic_load(&b->check_recall);
    A->always = pi2_binding_setting(b, PI2_SET_PREDICTOR) != 0.0;
    A->n_pairs = o->n_used * o->n_tokens;
    A->window = window;
    // the next MoE layer's experts are guessed where the model's routers were read and that layer is the sidecar's
    const uint32_t n_expert = (uint32_t) o->n_expert;
    const bool guess = b->guess.routers != NULL && (uint32_t) r->layer + 1 < b->guess.routers->n_layer &&
                       pi2_sidecar_expert_layer(b->sc, r->layer + 1, 0) >= 0 && pi2_binding_setting(b, PI2_SET_EXPERT_GUESS) != 0.0;
    size_t scratch = 0;
    uint32_t n_ff = 0;
    for (int64_t k = 0; k < (guess ? 2 : 1) * o->n_expert; ++k) { // this layer's experts, and the next one's guessed
        const int v = pi2_sidecar_expert_layer(b->sc, r->layer + (int) (k / o->n_expert), k % o->n_expert);
        const struct pi2_sidecar_layer * L = &b->sc->layer[v];
        n_ff = L->n_ff > n_ff ? L->n_ff : n_ff;
        if (b->layer[v].pred.w1 != NULL) {
            const size_t need = pi2_predictor_want_scratch(L, &b->layer[v].pred, b->sc->n_embd);
            scratch = need > scratch ? need : scratch;
        }
    }
    A->pinned  = calloc((size_t) A->n_pairs, sizeof(*A->pinned));
    A->want    = malloc(n_ff > 0 ? n_ff : 1);
    A->scratch = malloc(scratch > 0 ? scratch : 1);
    if (A->pinned == NULL || A->want == NULL || A->scratch == NULL) { // read-ahead is an optimization: go without
        pi2_expert_ahead_free(A);
        return false;
    }
    if (guess) {
        A->top      = malloc(sizeof(*A->top) * (size_t) o->n_used);
        A->order     = malloc(sizeof(*A->order) * n_expert);
        A->order_tok = malloc(sizeof(*A->order_tok) * n_expert);
        A->rscratch  = malloc(pi2_routers_scratch(b->guess.routers));
        A->n_order   = -1;
        A->routers   = A->top != NULL && A->order != NULL && A->order_tok != NULL && A->rscratch != NULL
                     ? b->guess.routers : NULL; // else no guess
    }
    return true;
}

// the want of sidecar layer v for FFN input x: its predictor's choice, or every bundle
static void pi2_expert_want(struct pi2_expert_ahead * A, int v, const float * x) {
    const struct pi2_binding_layer * B = &A->b->layer[v];
    const struct pi2_sidecar_layer * L = &A->b->sc->layer[v];
    if (A->predicted && pi2_predictor_runs(&B->pred, true, A->always)) {
        pi2_predictor_want(B, L, &A->r->act, A->b->sc->n_embd, x, A->scratch, A->want);
    } else {
        memset(A->want, 1, L->n_ff);
    }
}

// Once this batch's own reads are queued: the experts the next layer's router ranks highest for this layer's FFN
// inputs, each with the bundles its predictor picks for that input, read ahead and pinned until this batch's last
// pair (within the ahead room left), so the next layer finds them cached or in flight when its router has chosen;
// its own read-ahead then pins those it routes to. The guess is made once a batch and remembered for the next
// layer's count of how often it was right; its reads are tried again before each pair until there is room, and
// skipped while recent guesses were too often wrong (pi2_expert_guess_scored, expert_speculate.c).
static void pi2_expert_guess(struct pi2_expert_ahead * A, int64_t i) {
    const struct pi2_id_operands * o = A->o;
    struct pi2_binding * b = A->b;
    const uint32_t n_expert = (uint32_t) o->n_expert, next = (uint32_t) A->r->layer + 1;
    if (A->n_order < 0) {
        // the guess goes straight to the binding, where the next layer scores it (its layers run one at a time)
        memset(b->guess.set, 0, n_expert);
        A->n_order = 0;
        for (int64_t t = 0; t < o->n_tokens; ++t) {
            const float * x = (const float *) ((const char *) o->x->data + t * o->x->nb[2]);
            pi2_routers_top(A->routers, next, x, (int) o->n_used, A->top, A->rscratch);
            for (int64_t j = 0; j < o->n_used; ++j) {
                const int32_t e = A->top[j];
                if (e >= 0 && !b->guess.set[e]) {
                    b->guess.set[e] = 1;
                    A->order[A->n_order] = e;
                    A->order_tok[A->n_order++] = t;
                }
            }
        }
        b->guess.layer = (int32_t) next;
        if (b->guess.precision < PI2_GUESS_MIN_PRECISION) {
            A->guessed = true; // made, to be scored, but not read
            return;
        }
    }
    uint64_t later = 0;
    for (int64_t j = i + 1; j < A->n_pairs; ++j) {
        later += A->pinned[j];
    }
    if (later >= A->room) {
        return;
    }
    uint32_t max_pin = (uint32_t) (A->room - later);
    A->guessed = true;
    uint64_t n_read = 0;
    for (int32_t k = 0; k < A->n_order && max_pin > 0; ++k) {
        const int v = pi2_sidecar_expert_layer(b->sc, (int) next, A->order[k]);
        pi2_expert_want(A, v, (const float *) ((const char *) o->x->data + A->order_tok[k] * o->x->nb[2]));
        const uint32_t n = pi2_pipeline_read_ahead(b, v, A->want, (uint32_t) (A->n_pairs - i), max_pin, false);
        A->pinned[A->n_pairs - 1] += n;
        max_pin -= n < max_pin ? n : max_pin;
        b->guess.set[A->order[k]] = 2;
        n_read++;
    }
    pi2_count_layer_seen(A->counters, (int) next);
    pi2_count(&A->counters->layer[next].experts_guessed, n_read);
}

// Before unit i computes, the reads of units up to i + window - 1 queued. A unit is a routed pair (g0 NULL: unit q is
// pair q), or in a prompt batch an expert's group of pairs [g0[q], g0[q + 1]), whose batch requests the union of its
// tokens' wants (built in uni). Each unit makes one request, so unit q's is the (q - i + 1)-th from now.
static void pi2_expert_ahead_before(struct pi2_expert_ahead * A, const int64_t * g0, int64_t n_units, int64_t i, uint8_t * uni) {
    const struct pi2_id_operands * o = A->o;
    while (A->issued < n_units && A->issued < i + A->window) {
        const int64_t q = A->issued;
        uint64_t later = 0; // pinned for units after i and before q
        for (int64_t j = i + 1; j < q; ++j) {
            later += A->pinned[j];
        }
        if (q > i && later >= A->room) {
            return; // the next units' reads wait until earlier units free entries
        }
        const uint32_t max_pin = q == i ? UINT32_MAX : (uint32_t) (A->room - later);
        const int64_t p0 = g0 != NULL ? g0[q] : q, p1 = g0 != NULL ? g0[q + 1] : q + 1;
        const int v = pi2_sidecar_expert_layer(A->b->sc, A->r->layer, pi2_pair_expert(o, p0));
        const uint8_t * want = A->want;
        pi2_expert_want(A, v, pi2_pair_x(o, p0));
        if (p1 - p0 > 1) {
            const uint32_t n_ff = A->b->sc->layer[v].n_ff;
            memcpy(uni, A->want, n_ff);
            for (int64_t k = p0 + 1; k < p1; ++k) {
                pi2_expert_want(A, v, pi2_pair_x(o, k));
                for (uint32_t f = 0; f < n_ff; ++f) {
                    uni[f] |= A->want[f];
                }
            }
            want = uni;
        }
        A->pinned[q] = pi2_pipeline_read_ahead(A->b, v, want, (uint32_t) (q - i + 1), max_pin, q == 0);
        A->issued++;
    }
    if (g0 == NULL && A->issued == n_units && A->routers != NULL && !A->guessed) {
        pi2_expert_guess(A, i);
    }
}

// Routed pair i of a region as one FFN of its own: the expert's matrices, the pair's columns of the products, and the
// sidecar layer (layer, expert). The region's nodes point into the struct: it must not move while they are used.
struct pi2_pair_ffn {
    struct ggml_tensor    wg, wu, wd, x, gate, up, glu, down;
    struct pi2_ffn_region region;
};

// pair i of the region as one FFN: the expert's matrices, the token's columns, and the sidecar layer of sc it is
static void pi2_pair_ffn(struct pi2_pair_ffn * f, const struct pi2_sidecar * sc, const struct pi2_id_operands * o,
                         const struct pi2_expert_region * r, int64_t i) {
    const int64_t q = pi2_pair_at(o, i), s = q % o->n_used, t = q / o->n_used;
    const int32_t e = pi2_id_at(o, s, t);
    f->wg = pi2_expert_matrix(r->gate->src[0], e);
    f->wu = pi2_expert_matrix(r->up->src[0], e);
    f->wd = pi2_expert_matrix(r->down->src[0], e);
    f->x  = pi2_pair_column(o->x, s % o->n_b, t); // the gate's FFN input (or the copy pi2_expert_order made)
    f->gate = pi2_pair_column(r->gate, s, t);
    f->up   = pi2_pair_column(r->up, s, t);
    f->glu  = pi2_pair_column(r->glu, s, t);
    f->down = pi2_pair_column(r->down, s, t);
    f->gate.src[0] = &f->wg;  f->gate.src[1] = &f->x;
    f->up.src[0]   = &f->wu;  f->up.src[1]   = &f->x;
    f->glu.src[0]  = &f->gate; f->glu.src[1] = &f->up;
    f->down.src[0] = &f->wd;  f->down.src[1] = &f->glu;
    f->region = (struct pi2_ffn_region) { .n_nodes = 4, .layer = pi2_sidecar_expert_layer(sc, r->layer, e), .gate = &f->gate,
                                          .up = &f->up, .out = &f->glu, .down = &f->down, .act = r->act,
                                          .bias_gate = pi2_expert_bias(r->gate_biased, e), .bias_up = pi2_expert_bias(r->up_biased, e) };
}

// the pair's gate, up and GLU rows into rows[3 * n_ff] instead of the graph's products (which llama's allocator may
// have given to another node of the region: the callers' comments say which)
static void pi2_pair_ffn_scratch(struct pi2_pair_ffn * f, float * rows) {
    const int64_t n_ff = f->gate.ne[0];
    f->gate.data = rows;
    f->up.data   = rows + n_ff;
    f->glu.data  = rows + 2 * n_ff;
}

// ctx->sub[0 .. nth): one-thread contexts, one per thread of a parallel region, each with its own scratch
static bool pi2_sub_contexts(struct pi2_backend_ctx * ctx, int nth) {
    if (ctx->n_sub < nth) {
        struct pi2_backend_ctx * sub = realloc(ctx->sub, (size_t) nth * sizeof(*sub));
        if (sub == NULL) {
            return false;
        }
        for (int k = ctx->n_sub; k < nth; ++k) {
            sub[k] = (struct pi2_backend_ctx) { .dev = ctx->dev, .n_threads = 1 };
        }
        ctx->sub = sub;
        ctx->n_sub = nth;
    }
    return true;
}

// In RAM, a batch's routed pairs run one per thread, each on that thread alone, instead of each pair on every
// thread in turn: a pair's decode is short (a few hundred rows), and splitting it costs each pair a parallel region
// and its barriers, where the threads wait on each other (11% of a TurboSparse-shaped decode's samples were
// OpenMP's wait). The sums keep ctx->n_threads parts (pi2_exec_sparse_ffn_split), so the values are those of the
// pair run on every thread.
// llama's allocator may place the down product over the gate and up products, which the GLU has consumed: one
// after another that is harmless, side by side a pair's down would overwrite another's gate. So each thread's
// pair writes its gate, up and GLU rows to the thread's own scratch and its down row to a buffer of all the pairs,
// copied to the down product once every pair is done (nothing in the graph reads the region's gate, up or GLU
// products but the region itself).
// false, with nothing run, where it does not apply (one thread or one pair, or no memory); else true with *st.
static bool pi2_expert_pairs_parallel(struct pi2_backend_ctx * ctx, struct pi2_binding * b, const struct pi2_id_operands * o,
                                      const struct pi2_expert_region * r, enum ggml_status * st) {
    const int     nth     = ctx->n_threads > 0 ? ctx->n_threads : 1;
    const int64_t n_pairs = o->n_used * o->n_tokens;
    if (nth < 2 || n_pairs < 2 || !pi2_act_equal(&r->act, &b->sc->activation)) {
        return false; // (a wrong activation: the one-pair path refuses it with the message)
    }
    if (!pi2_sub_contexts(ctx, nth)) {
        return false;
    }
    const int64_t n_embd = r->down->ne[0], n_ff = r->gate->ne[0];
    const size_t  downs  = ((size_t) n_pairs * (size_t) n_embd * sizeof(float) + 63) & ~(size_t) 63;
    const size_t  rows   = ((size_t) 3 * (size_t) n_ff * sizeof(float) + 63) & ~(size_t) 63; // a thread's gate, up, GLU
    const int     n_run  = n_pairs < nth ? (int) n_pairs : nth;
    char * w = pi2_work_reserve(ctx, downs + (size_t) n_run * rows);
    if (w == NULL) {
        return false;
    }
    atomic_llong next = 0;
    atomic_int  status = GGML_STATUS_SUCCESS;
    #pragma omp parallel num_threads(n_run)
    {
        const int ith = omp_get_thread_num();
        struct pi2_backend_ctx * mine = &ctx->sub[ith];
        float * own = (float *) (w + downs + (size_t) ith * rows);
        for (;;) {
            const long long i = atomic_fetch_add_explicit(&next, 1, memory_order_relaxed);
            if (i >= n_pairs || atomic_load_explicit(&status, memory_order_relaxed) != GGML_STATUS_SUCCESS) {
                break;
            }
            struct pi2_pair_ffn f;
            pi2_pair_ffn(&f, b->sc, o, r, i);
            pi2_pair_ffn_scratch(&f, own);
            f.down.data = (float *) w + (size_t) i * (size_t) n_embd;
            const enum ggml_status s = pi2_exec_sparse_ffn_split(mine, b, &f.region, NULL, nth);
            if (s != GGML_STATUS_SUCCESS) {
                int expected = GGML_STATUS_SUCCESS;
                atomic_compare_exchange_strong(&status, &expected, (int) s);
            }
        }
    }
    *st = (enum ggml_status) atomic_load(&status);
    for (int64_t i = 0; i < n_pairs && *st == GGML_STATUS_SUCCESS; ++i) {
        memcpy(pi2_id_out(r->down, i % o->n_used, i / o->n_used), (float *) w + (size_t) i * (size_t) n_embd,
               (size_t) n_embd * sizeof(float));
    }
    return true;
}

// A batch of several tokens on flash (a prompt) runs its pairs expert by expert, so an expert's bundles are read
// once and its other tokens find them in the cache, instead of token by token, where a layer's experts take turns
// in a cache smaller than the layer. Each pair computes as before, so the values are the same. Out of token order,
// a pair's down product may land where llama's allocator put an input not yet read (the down product may share
// memory with the FFN input or the gate and up products, which the graph has consumed by then): so the input is
// copied first and the pairs' gate, up and GLU rows go to scratch, and nothing but down columns is written.
struct pi2_expert_order {
    int32_t *          order; // [n_pairs]
    float *            x;     // the FFN input's copy
    float *            rows;  // a pair's gate, up and GLU rows
    struct ggml_tensor xt;    // the copy, as the FFN input's tensor
};

// The batch's (slot, token) pairs sorted by expert, token order kept within an expert (a counting sort; ids were checked
// in range by the caller): order[start[e] .. start[e + 1]) are expert e's pairs. start: [n_expert + 1] zeros.
static void pi2_pairs_by_expert(const struct pi2_id_operands * o, int32_t * order, int64_t * start) {
    const int64_t n_pairs = o->n_used * o->n_tokens;
    for (int64_t q = 0; q < n_pairs; ++q) {
        ++start[pi2_id_at(o, q % o->n_used, q / o->n_used) + 1];
    }
    for (int64_t e = 0; e < o->n_expert; ++e) {
        start[e + 1] += start[e];
    }
    for (int64_t q = 0; q < n_pairs; ++q) { // each start[e] moves to the end of expert e's pairs ...
        order[start[pi2_id_at(o, q % o->n_used, q / o->n_used)]++] = (int32_t) q;
    }
    for (int64_t e = o->n_expert; e > 0; --e) { // ... which is where expert e + 1's begin: back to their first
        start[e] = start[e - 1];
    }
    start[0] = 0;
}

static bool pi2_expert_order_init(struct pi2_expert_order * d, struct pi2_id_operands * o, const struct pi2_expert_region * r) {
    *d = (struct pi2_expert_order) { 0 };
    const int64_t n_pairs = o->n_used * o->n_tokens;
    if (o->n_tokens < 2) {
        return true; // one token: its pairs already run one expert after another
    }
    const size_t x_bytes = ggml_nbytes(o->x);
    d->order = malloc((size_t) n_pairs * sizeof(int32_t));
    d->x     = malloc(x_bytes);
    d->rows  = malloc((size_t) 3 * (size_t) r->gate->ne[0] * sizeof(float));
    int64_t * start = calloc((size_t) o->n_expert + 1, sizeof(int64_t));
    if (d->order == NULL || d->x == NULL || d->rows == NULL || start == NULL) {
        free(start);
        free(d->order);
        free(d->x);
        free(d->rows);
        *d = (struct pi2_expert_order) { 0 };
        return false;
    }
    pi2_pairs_by_expert(o, d->order, start);
    free(start);
    memcpy(d->x, o->x->data, x_bytes);
    d->xt      = *o->x;
    d->xt.data = d->x;
    o->x       = &d->xt;
    o->order   = d->order;
    return true;
}

static void pi2_expert_order_free(struct pi2_expert_order * d) {
    free(d->order);
    free(d->x);
    free(d->rows);
}

// A [ne0, n] f32 tensor over a contiguous buffer, with the type and name of `like`
static struct ggml_tensor pi2_scratch_matrix(const struct ggml_tensor * like, int64_t ne0, int64_t n, float * data) {
    struct ggml_tensor m = *like;
    m.ne[0] = ne0;
    m.ne[1] = n;
    m.ne[2] = m.ne[3] = 1;
    m.nb[0] = sizeof(float);
    m.nb[1] = (size_t) ne0 * sizeof(float);
    m.nb[2] = m.nb[3] = m.nb[1] * (size_t) n;
    m.data  = data;
    return m;
}

// One routed expert's FFN over n tokens of a batch, on contiguous scratch: their inputs at xs [n][n_embd], gate, up and
// GLU rows at rows [3][n][n_ff], down rows at ys [n][n_embd]; the weights wg, wu, wd are the caller's to set. The nodes
// point into the struct: it must not move while they are used.
struct pi2_expert_batch {
    struct ggml_tensor wg, wu, wd, x, gate, up, glu, down;
};

static void pi2_expert_batch_init(struct pi2_expert_batch * f, const struct pi2_id_operands * o, const struct pi2_expert_region * r,
                                  int64_t n, float * xs, float * rows, float * ys) {
    const int64_t n_embd = r->down->ne[0], n_ff = r->gate->ne[0];
    f->x    = pi2_scratch_matrix(o->x, n_embd, n, xs);
    f->gate = pi2_scratch_matrix(r->gate, n_ff, n, rows);
    f->up   = pi2_scratch_matrix(r->up, n_ff, n, rows + n * n_ff);
    f->glu  = pi2_scratch_matrix(r->glu, n_ff, n, rows + 2 * n * n_ff);
    f->down = pi2_scratch_matrix(r->down, n_embd, n, ys);
    f->gate.src[0] = &f->wg;   f->gate.src[1] = &f->x;
    f->up.src[0]   = &f->wu;   f->up.src[1]   = &f->x;
    f->glu.src[0]  = &f->gate; f->glu.src[1]  = &f->up;
    f->down.src[0] = &f->wd;   f->down.src[1] = &f->glu;
}

// A batch's routed pairs one after another, each on every thread (rows: scratch for the pairs' gate, up and GLU
// rows, or NULL to write the graph's), the reads of the next PI2_EXPERT_AHEAD pairs queued before each computes.
static enum ggml_status pi2_expert_pairs_in_turn(struct pi2_backend_ctx * ctx, struct pi2_binding * b, const struct pi2_id_operands * o,
                                                 const struct pi2_expert_region * r, float * rows, uint64_t * hits, uint64_t * misses) {
    const int64_t n_pairs = o->n_used * o->n_tokens;
    struct pi2_expert_ahead ahead;
    const bool reads_ahead = pi2_expert_ahead_init(&ahead, ctx, b, o, r);
    enum ggml_status st = GGML_STATUS_SUCCESS;
    for (int64_t i = 0; i < n_pairs && st == GGML_STATUS_SUCCESS; ++i) {
        if (reads_ahead) {
            pi2_expert_ahead_before(&ahead, NULL, n_pairs, i, NULL);
        }
        struct pi2_pair_ffn f;
        pi2_pair_ffn(&f, b->sc, o, r, i);
        if (rows != NULL) {
            pi2_pair_ffn_scratch(&f, rows);
        }
        struct pi2_cache_token_stats io = { 0 };
        st = pi2_exec_sparse_ffn(ctx, b, &f.region, &io);
        *hits   += io.misses == 0;
        *misses += io.misses != 0;
    }
    if (reads_ahead) {
        pi2_expert_ahead_free(&ahead);
    }
    return st;
}

// A prompt on flash (a batch past PI2_SPARSE_BATCH; o->order sorts its pairs by expert): each routed expert runs
// once, as one FFN over the tokens routed to it (batch_ffn.h), so its bundles are requested once and each of its
// rows serves all those tokens; pair by pair, every pair requested what its own predictor chose, and read again
// what earlier pairs' requests had read past (the bridged gaps go to scratch). The next experts' reads are queued
// ahead (PI2_EXPERT_AHEAD groups), so the disk reads them while one computes. The tokens' inputs are gathered from
// the copy pi2_expert_order made, and the down rows scattered to the pairs' columns.
static enum ggml_status pi2_expert_batches(struct pi2_backend_ctx * ctx, struct pi2_binding * b, struct pi2_id_operands * o,
                                           const struct pi2_expert_region * r, uint64_t * hits, uint64_t * misses) {
    const int64_t n_pairs = o->n_used * o->n_tokens, n_embd = r->down->ne[0], n_ff = r->gate->ne[0];
    float *   buf = malloc(sizeof(float) * (size_t) o->n_tokens * (size_t) (2 * n_embd + 3 * n_ff));
    int64_t * g0  = malloc(sizeof(int64_t) * (size_t) (n_pairs + 1));
    uint8_t * uni = malloc((size_t) n_ff);
    if (buf == NULL || g0 == NULL || uni == NULL) {
        free(buf);
        free(g0);
        free(uni);
        PI2_LOG_ERROR("pi2: out of memory for the expert batches of a %lld-token batch\n", (long long) o->n_tokens);
        return GGML_STATUS_ALLOC_FAILED;
    }
    int64_t n_groups = 0;
    for (int64_t i = 0; i < n_pairs; ++i) {
        if (i == 0 || pi2_pair_expert(o, i) != pi2_pair_expert(o, i - 1)) {
            g0[n_groups++] = i;
        }
    }
    g0[n_groups] = n_pairs;
    struct pi2_expert_ahead ahead;
    const bool reads_ahead = pi2_expert_ahead_init(&ahead, ctx, b, o, r);
    float * xs = buf, * ys = xs + o->n_tokens * n_embd, * rows = ys + o->n_tokens * n_embd;
    enum ggml_status st = GGML_STATUS_SUCCESS;
    for (int64_t g = 0; g < n_groups && st == GGML_STATUS_SUCCESS; ++g) {
        if (reads_ahead) {
            pi2_expert_ahead_before(&ahead, g0, n_groups, g, uni);
        }
        const int64_t i0 = g0[g], i1 = g0[g + 1], n = i1 - i0;
        const int32_t e  = pi2_pair_expert(o, i0);
        for (int64_t i = i0; i < i1; ++i) {
            memcpy(xs + (i - i0) * n_embd, pi2_pair_x(o, i), (size_t) n_embd * sizeof(float));
        }
        struct pi2_expert_batch f;
        pi2_expert_batch_init(&f, o, r, n, xs, rows, ys);
        f.wg = pi2_expert_matrix(r->gate->src[0], e);
        f.wu = pi2_expert_matrix(r->up->src[0], e);
        f.wd = pi2_expert_matrix(r->down->src[0], e);
        const struct pi2_ffn_region region = { .n_nodes = 4, .layer = pi2_sidecar_expert_layer(b->sc, r->layer, e), .gate = &f.gate,
                                               .up = &f.up, .out = &f.glu, .down = &f.down, .act = r->act, .batch = true,
                                               .bias_gate = pi2_expert_bias(r->gate_biased, e),
                                               .bias_up = pi2_expert_bias(r->up_biased, e) };
        struct pi2_cache_token_stats io = { 0 };
        st = pi2_exec_sparse_ffn(ctx, b, &region, &io);
        for (int64_t i = i0; i < i1 && st == GGML_STATUS_SUCCESS; ++i) {
            const int64_t q = pi2_pair_at(o, i);
            memcpy(pi2_id_out(r->down, q % o->n_used, q / o->n_used), ys + (i - i0) * n_embd, (size_t) n_embd * sizeof(float));
        }
        *hits   += io.misses == 0 ? (uint64_t) n : 0;
        *misses += io.misses != 0 ? (uint64_t) n : 0;
    }
    if (reads_ahead) {
        pi2_expert_ahead_free(&ahead);
    }
    free(buf);
    free(g0);
    free(uni);
    return st;
}

// the expert's matrix m (0 gate, 1 up, 2 down) as the region's weight describes it, its rows at data
static struct ggml_tensor pi2_expert_at(const struct ggml_tensor * w, const void * data) {
    struct ggml_tensor m = pi2_expert_matrix(w, 0);
    m.data = (void *) data;
    return m;
}

// Routed experts read whole run one per thread (each thread computing a whole expert alone, as pi2_expert_pairs_parallel
// does in RAM) for batches of at most this many tokens: a decode's expert is three products of a few hundred rows,
// and splitting each over the threads costs it three parallel regions and their barriers (48 layers x 8 experts x 3
// a token on the Qwen3-30B-A3B-shaped model, whose steady decode under 8 GB went from ~6.9 to ~9 tok/s). Larger
// batches split each expert's rows, where an expert's many tokens keep every thread busy.
#define PI2_EXPERT_ALONE_TOKENS 4

// whether the expert's matrices as read from the model file have the loaded model's types (else b->error says not)
static bool pi2_expert_types_match(struct pi2_binding * b, const struct pi2_expert_region * r, const struct pi2_expert_matrices * em) {
    const struct ggml_tensor * const w[3] = { r->gate->src[0], r->up->src[0], r->down->src[0] };
    return pi2_expert_matrices_match(em, w, b->model_path, r->layer, true, b->error, sizeof(b->error));
}

// Expert e's n pairs (order[0 .. n)) computed from its matrices where they landed, on ctx's threads (one-thread
// sub-contexts: the calling thread alone): the gate and up products (plus gpt-oss's biases), the activation, down,
// each down row copied to its pair's column. The FFN inputs come from xcopy (down's output may share the graph's
// input memory); buf: n * (2 n_embd + 3 n_ff) floats of scratch.
static enum ggml_status pi2_expert_compute(struct pi2_backend_ctx * ctx, const struct pi2_id_operands * o,
                                           const struct pi2_expert_region * r, const struct pi2_expert_matrices * em, int32_t e,
                                           const int32_t * order, int64_t n, const float * xcopy, float * buf) {
    const int64_t n_embd = r->down->ne[0], n_ff = r->gate->ne[0];
    float * xs = buf, * ys = xs + n * n_embd, * rows = ys + n * n_embd;
    for (int64_t i = 0; i < n; ++i) {
        const int64_t q = order[i], s = q % o->n_used, t = q / o->n_used;
        memcpy(xs + i * n_embd, (const char *) xcopy + t * o->x->nb[2] + (s % o->n_b) * o->x->nb[1], (size_t) n_embd * sizeof(float));
    }
    const struct ggml_tensor * w[3] = { r->gate->src[0], r->up->src[0], r->down->src[0] };
    struct pi2_expert_batch f;
    pi2_expert_batch_init(&f, o, r, n, xs, rows, ys);
    f.wg = pi2_expert_at(w[0], em->data[0]);
    f.wu = pi2_expert_at(w[1], em->data[1]);
    f.wd = pi2_expert_at(w[2], em->data[2]);
    enum ggml_status st = pi2_exec_mul_mat_with(ctx, &f.gate, f.wg.type, f.wg.data, f.wg.nb[1]);
    if (st == GGML_STATUS_SUCCESS) {
        st = pi2_exec_mul_mat_with(ctx, &f.up, f.wu.type, f.wu.data, f.wu.nb[1]);
    }
    const float * bg = pi2_expert_bias(r->gate_biased, e), * bu = pi2_expert_bias(r->up_biased, e);
    for (int64_t i = 0; i < n && st == GGML_STATUS_SUCCESS; ++i) {
        float * g = rows + i * n_ff, * u = rows + (n + i) * n_ff;
        for (int64_t k = 0; k < n_ff; ++k) { // llama's ADD_ID of each bias, before the activation
            g[k] = bg != NULL ? g[k] + bg[k] : g[k];
            u[k] = bu != NULL ? u[k] + bu[k] : u[k];
        }
        if (!pi2_glu_span(&ctx->dev->glu, &r->act, (int) n_ff, rows + (2 * n + i) * n_ff, g, u)) {
            PI2_LOG_ERROR("pi2: FFN activation %s is not implemented\n", pi2_activation_names[r->act.kind]);
            st = GGML_STATUS_FAILED;
        }
    }
    if (st == GGML_STATUS_SUCCESS) {
        st = pi2_exec_mul_mat_with(ctx, &f.down, f.wd.type, f.wd.data, f.wd.nb[1]);
    }
    for (int64_t i = 0; i < n && st == GGML_STATUS_SUCCESS; ++i) {
        const int64_t q = order[i];
        memcpy(pi2_id_out(r->down, q % o->n_used, q / o->n_used), ys + i * n_embd, (size_t) n_embd * sizeof(float));
    }
    return st;
}

// The next expert of the batch in memory (pi2_expert_file_next) and its matrices, as its index in list, -1 when all
// are done, or -2 with b->error (a read failed, or the file's types are not the model's).
static int pi2_expert_whole_next(struct pi2_binding * b, const struct pi2_expert_region * r, const int32_t * list, uint8_t * done,
                                 int n_wanted, struct pi2_expert_matrices * em, struct pi2_expert_read_stats * io) {
    const int i = pi2_expert_file_next(b->experts, r->layer, list, done, n_wanted, io);
    if (i < 0) {
        return -1;
    }
    done[i] = 1;
    if (pi2_expert_file_get(b->experts, r->layer, list[i], em, io, b->error, sizeof(b->error)) != 0 ||
        !pi2_expert_types_match(b, r, em)) {
        PI2_LOG_ERROR("pi2: %s\n", b->error);
        return -2;
    }
    return i;
}

// Under a budget with PI2_EXPERT_READS=model: each expert the batch routes to is found in the expert cache or read
// whole from the model file (expert_file.h), then computed for its tokens by the dense kernels from where it landed,
// as in RAM. Each expert is read once a batch and computes all its tokens: the experts' reads are queued at once,
// then each computed as soon as it is in memory (cached first, then in the order reads complete), so compute overlaps
// the reads still in flight. A small batch's experts run one per thread (PI2_EXPERT_ALONE_TOKENS), the expert file
// taken by one thread at a time (it is not thread-safe); a larger one's each on every thread in turn.
static enum ggml_status pi2_expert_whole(struct pi2_backend_ctx * ctx, struct pi2_binding * b, const struct pi2_id_operands * o,
                                         const struct pi2_expert_region * r, uint64_t * hits, uint64_t * misses) {
    const int64_t n_pairs = o->n_used * o->n_tokens, n_embd = r->down->ne[0], n_ff = r->gate->ne[0];
    const int     nth     = ctx->n_threads > 0 ? ctx->n_threads : 1;
    bool          alone   = nth >= 2 && o->n_tokens <= PI2_EXPERT_ALONE_TOKENS && pi2_sub_contexts(ctx, nth);
    const size_t  x_bytes = ggml_nbytes(o->x);
    const size_t  per     = (size_t) o->n_tokens * (size_t) (2 * n_embd + 3 * n_ff); // a thread's scratch, floats
    float *   xcopy  = malloc(x_bytes);
    float *   buf    = malloc(sizeof(float) * per * (size_t) (alone ? nth : 1));
    int32_t * order  = malloc(sizeof(int32_t) * (size_t) n_pairs);
    int64_t * start  = calloc((size_t) o->n_expert + 1, sizeof(int64_t));
    int32_t * list   = malloc(sizeof(int32_t) * (size_t) o->n_expert); // the experts with pairs
    uint8_t * cached = calloc((size_t) o->n_expert, 1);
    uint8_t * done   = calloc((size_t) o->n_expert, 1);
    if (xcopy == NULL || buf == NULL || order == NULL || start == NULL || list == NULL || cached == NULL || done == NULL) {
        free(xcopy);
        free(buf);
        free(order);
        free(start);
        free(list);
        free(cached);
        free(done);
        PI2_LOG_ERROR("pi2: out of memory for the routed experts of a %lld-token batch\n", (long long) o->n_tokens);
        return GGML_STATUS_ALLOC_FAILED;
    }
    memcpy(xcopy, o->x->data, x_bytes);
    pi2_pairs_by_expert(o, order, start);
    struct pi2_expert_read_stats io = { 0 };
    pthread_mutex_lock(&b->cache_lock); // the entry stays while its expert computes: one FFN at a time per model
    int n_wanted = 0;
    for (int64_t e = 0; e < o->n_expert; ++e) {
        if (start[e + 1] > start[e]) {
            list[n_wanted++] = (int32_t) e;
        }
    }
    pi2_expert_file_want(b->experts, r->layer, list, n_wanted, cached, &io);
    for (int i = 0; i < n_wanted; ++i) { // routed pairs whose expert was cached
        const uint64_t n = (uint64_t) (start[list[i] + 1] - start[list[i]]);
        *hits   += cached[i] ? n : 0;
        *misses += cached[i] ? 0 : n;
    }
    atomic_int status = GGML_STATUS_SUCCESS;
    // side by side only where no expert needs an entry when got (a cache of a few entries has them take turns)
    alone = alone && n_wanted >= 2 && pi2_expert_file_all_placed(b->experts, r->layer, list, n_wanted);
    if (alone) {
        omp_lock_t file_lock; // the expert file's calls, one thread at a time; the experts compute outside it
        omp_init_lock(&file_lock);
        const int n_run = n_wanted < nth ? n_wanted : nth;
        #pragma omp parallel num_threads(n_run)
        {
            const int ith = omp_get_thread_num();
            float * mine = buf + per * (size_t) ith;
            for (;;) {
                struct pi2_expert_matrices em;
                omp_set_lock(&file_lock);
                const int i = atomic_load(&status) == GGML_STATUS_SUCCESS
                            ? pi2_expert_whole_next(b, r, list, done, n_wanted, &em, &io) : -1;
                omp_unset_lock(&file_lock);
                if (i < 0) {
                    if (i == -2) {
                        atomic_store(&status, GGML_STATUS_FAILED);
                    }
                    break;
                }
                const int32_t e = list[i];
                const enum ggml_status s = pi2_expert_compute(&ctx->sub[ith], o, r, &em, e, order + start[e],
                                                              start[e + 1] - start[e], xcopy, mine);
                omp_set_lock(&file_lock);
                pi2_expert_file_done(b->experts, r->layer, e);
                omp_unset_lock(&file_lock);
                if (s != GGML_STATUS_SUCCESS) {
                    int expected = GGML_STATUS_SUCCESS;
                    atomic_compare_exchange_strong(&status, &expected, (int) s);
                    break;
                }
            }
        }
        omp_destroy_lock(&file_lock);
    } else {
        for (int k = 0; k < n_wanted && atomic_load(&status) == GGML_STATUS_SUCCESS; ++k) {
            struct pi2_expert_matrices em;
            const int i = pi2_expert_whole_next(b, r, list, done, n_wanted, &em, &io);
            if (i < 0) {
                atomic_store(&status, i == -2 ? GGML_STATUS_FAILED : GGML_STATUS_SUCCESS);
                break;
            }
            const int32_t e = list[i];
            atomic_store(&status, pi2_expert_compute(ctx, o, r, &em, e, order + start[e], start[e + 1] - start[e], xcopy, buf));
            pi2_expert_file_done(b->experts, r->layer, e);
        }
    }
    free(list);
    free(cached);
    free(done);
    pthread_mutex_unlock(&b->cache_lock);
    pi2_expert_read_count(&ctx->dev->counters, r->layer, &io);
    free(xcopy);
    free(buf);
    free(order);
    free(start);
    return (enum ggml_status) atomic_load(&status);
}

int pi2_exec_expert_region_sparse(struct pi2_backend_ctx * ctx, struct pi2_binding * b, const struct pi2_expert_region * r,
                                  enum ggml_status * st) {
    struct pi2_id_operands o = pi2_id_operands(r->gate);
    if (b->flash && (r->down == NULL || b->sc->n_expert == 0)) {
        // on flash the bundles are the weights' only copy: a region the engine cannot run is refused
        snprintf(b->error, sizeof(b->error), "sidecar %s: layer %d's experts %s, which a memory budget cannot run", b->sc->path,
                 r->layer, b->sc->n_expert == 0 ? "are not in the sidecar (convert the MoE model again)"
                                                : "are not followed directly by their down product");
        PI2_LOG_REFUSAL("pi2: %s\n", b->error);
        *st = GGML_STATUS_FAILED;
        return r->n_nodes;
    }
    const enum pi2_route route = pi2_route_region(b, o.n_tokens);
    if (r->down == NULL || b->sc->n_expert == 0 || route == PI2_ROUTE_DENSE || (!b->flash && b->sc->experts_whole)) {
        return 0; // dense (in RAM, experts read whole from the model file under a budget are computed densely)
    }
    if ((int64_t) b->sc->n_expert != o.n_expert || pi2_sidecar_expert_layer(b->sc, r->layer, 0) < 0) {
        snprintf(b->error, sizeof(b->error), "sidecar %s describes no routed experts of the model's layer %d (%lld experts; the "
                 "sidecar's layers have %u): the sidecar was made for another model", b->sc->path, r->layer,
                 (long long) o.n_expert, b->sc->n_expert);
        PI2_LOG_REFUSAL("pi2: %s\n", b->error);
        *st = GGML_STATUS_FAILED;
        return r->n_nodes + 1;
    }
    for (int64_t t = 0; t < o.n_tokens; ++t) {
        for (int64_t s = 0; s < o.n_used; ++s) {
            const int32_t e = pi2_id_at(&o, s, t);
            if (e < 0 || e >= o.n_expert) {
                PI2_LOG_ERROR("pi2: %s: token %lld routed to expert %d of %lld\n", o.w->name, (long long) t, e, (long long) o.n_expert);
                *st = GGML_STATUS_FAILED;
                return r->n_nodes + 1;
            }
        }
    }
    const int64_t n_pairs = o.n_used * o.n_tokens;
    for (int64_t i = 0; i < n_pairs; ++i) { // every pair's expert verified before any computes
        struct pi2_pair_ffn f;
        pi2_pair_ffn(&f, b->sc, &o, r, i);
        if (!pi2_binding_verify_layer(b, f.region.layer, &f.wg, &f.wu, &f.wd)) {
            PI2_LOG_REFUSAL("pi2: %s\n", b->error);
            *st = GGML_STATUS_FAILED;
            return r->n_nodes + 1;
        }
    }
    // the distinct experts this batch routes to, and of those the ones guessed for this layer (flash)
    const bool guessed = b->flash && b->guess.layer == r->layer;
    uint64_t distinct = 0, right = 0, right_read = 0;
    for (int64_t e = 0; e < o.n_expert; ++e) {
        bool routed = false;
        for (int64_t p = 0; p < n_pairs && !routed; ++p) {
            routed = pi2_id_at(&o, p % o.n_used, p / o.n_used) == e;
        }
        distinct += routed;
        right += routed && guessed && b->guess.set[e] != 0;
        right_read += routed && guessed && b->guess.set[e] == 2;
    }
    pi2_count(&ctx->dev->counters.layer[r->layer].experts_loaded, distinct);
    if (guessed) {
        pi2_expert_guess_scored(&b->guess, b->sc->n_expert, right);
        pi2_count(&ctx->dev->counters.layer[r->layer].experts_guessed_routed, right_read);
    }
    if (b->flash && b->experts != NULL) {
        uint64_t hits = 0, misses = 0;
        *st = pi2_expert_whole(ctx, b, &o, r, &hits, &misses);
        pi2_count_routing(&ctx->dev->counters, r->layer, &o);
        pi2_count(&ctx->dev->counters.layer[r->layer].expert_hits, hits);
        pi2_count(&ctx->dev->counters.layer[r->layer].expert_misses, misses);
        return r->n_nodes + 1;
    }
    if (!b->flash && pi2_expert_pairs_parallel(ctx, b, &o, r, st)) {
        pi2_count_routing(&ctx->dev->counters, r->layer, &o);
        return r->n_nodes + 1;
    }
    struct pi2_expert_order ord;
    if (!pi2_expert_order_init(&ord, &o, r)) {
        PI2_LOG_ERROR("pi2: out of memory for the expert order of a %lld-token batch\n", (long long) o.n_tokens);
        *st = GGML_STATUS_ALLOC_FAILED;
        return r->n_nodes + 1;
    }
    uint64_t hits = 0, misses = 0;
    *st = o.order != NULL && route == PI2_ROUTE_SPARSE_BATCH
        ? pi2_expert_batches(ctx, b, &o, r, &hits, &misses)
        : pi2_expert_pairs_in_turn(ctx, b, &o, r, ord.rows, &hits, &misses);
    pi2_expert_order_free(&ord);
    if (*st != GGML_STATUS_SUCCESS) {
        return r->n_nodes + 1;
    }
    pi2_count_routing(&ctx->dev->counters, r->layer, &o); // at the real layer, as the dense path counts it
    if (b->flash) {
        pi2_count(&ctx->dev->counters.layer[r->layer].expert_hits, hits);
        pi2_count(&ctx->dev->counters.layer[r->layer].expert_misses, misses);
    }
    return r->n_nodes + 1;
}
