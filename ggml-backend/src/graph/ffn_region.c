#include "graph/ffn_region.h"

#include "graph/ffn_names.h"
#include "ggml-cpu.h"

bool pi2_ffn_region_elementwise(const struct ggml_tensor * t) {
    switch (t->op) {
        case GGML_OP_UNARY: {
            const enum ggml_unary_op u = ggml_get_unary_op(t);
            return u == GGML_UNARY_OP_RELU || u == GGML_UNARY_OP_STEP;
        }
        case GGML_OP_SCALE:
        case GGML_OP_MUL:
            return true;
        default:
            return false;
    }
}

const struct ggml_tensor * pi2_ffn_product_weight(const struct ggml_tensor * t, int depth, bool through_add) {
    if (t == NULL) {
        return NULL;
    }
    if (t->op == GGML_OP_MUL_MAT) {
        int layer = 0;
        enum pi2_matrix m;
        return t->src[0] != NULL && pi2_ffn_weight_parse(t->src[0]->name, &layer, &m) ? t->src[0] : NULL;
    }
    if (depth == 0 || !(t->op == GGML_OP_GLU || pi2_ffn_region_elementwise(t) || (through_add && t->op == GGML_OP_ADD))) {
        return NULL;
    }
    const struct ggml_tensor * w = pi2_ffn_product_weight(t->src[0], depth - 1, through_add);
    return w != NULL ? w : pi2_ffn_product_weight(t->src[1], depth - 1, through_add);
}

static bool pi2_member(struct ggml_tensor * const * m, int n, const struct ggml_tensor * t) {
    for (int k = 0; k < n; ++k) {
        if (m[k] == t) {
            return true;
        }
    }
    return false;
}

// every source of t is a node of the region so far (an elementwise op of gate/up-derived values only)
static bool pi2_sources_members(struct ggml_tensor * const * m, int n, const struct ggml_tensor * t) {
    const int n_src = t->op == GGML_OP_MUL || (t->op == GGML_OP_GLU && t->src[1] != NULL) ? 2 : 1;
    for (int s = 0; s < n_src; ++s) {
        if (t->src[s] == NULL || !pi2_member(m, n, t->src[s])) {
            return false;
        }
    }
    return true;
}

bool pi2_ffn_fused_glu(const struct ggml_tensor * glu) {
    const struct ggml_tensor * p = glu->src[0];
    int layer = 0;
    enum pi2_matrix m;
    return glu->op == GGML_OP_GLU && glu->src[1] == NULL && ((const int32_t *) glu->op_params)[1] == 0 && p != NULL &&
           p->op == GGML_OP_MUL_MAT && pi2_ffn_weight_parse(p->src[0]->name, &layer, &m) && m == PI2_MATRIX_UP &&
           p->ne[0] % 2 == 0 && glu->ne[0] * 2 == p->ne[0];
}

void pi2_fused_half(struct ggml_tensor * hw, struct ggml_tensor * hp, const struct ggml_tensor * t, int k) {
    const struct ggml_tensor * w = t->src[0];
    const int64_t n_ff = t->ne[0] / 2;
    *hw = *w;
    hw->ne[1] = n_ff;
    if (w->ne[2] == 1) { // a 2-D weight: the half is a matrix of its own (a stacked one keeps the experts' stride)
        hw->nb[2] = hw->nb[3] = (size_t) n_ff * w->nb[1];
    }
    hw->data  = w->data != NULL ? (char *) w->data + (size_t) k * (size_t) n_ff * w->nb[1] : NULL;
    *hp = *t;
    hp->ne[0] = n_ff;
    hp->data  = t->data != NULL ? (char *) t->data + (size_t) k * (size_t) n_ff * t->nb[0] : NULL;
    hp->src[0] = hw;
}

// phi3's FFN: the fused gate+up product, one GLU of it (act(first half) * second half), the down product of that
static bool pi2_ffn_region_fused(struct ggml_cgraph * g, int i, const struct pi2_stated_act * stated, struct pi2_ffn_region * r,
                                 const char ** why) {
    const int n = ggml_graph_n_nodes(g);
    struct ggml_tensor * first = ggml_graph_node(g, i);
    struct ggml_tensor * glu = i + 1 < n ? ggml_graph_node(g, i + 1) : NULL;
    if (glu == NULL || (glu->flags & GGML_TENSOR_FLAG_COMPUTE) == 0 || glu->src[0] != first || !pi2_ffn_fused_glu(glu)) {
        *why = "its fused gate+up product does not feed one GLU directly";
        return false;
    }
    if (!pi2_act_for_glu(stated, glu, &r->act)) {
        *why = "its GLU is not ReGLU, SwiGLU or GeGLU";
        return false;
    }
    if (first->type != GGML_TYPE_F32 || glu->type != GGML_TYPE_F32 || first->nb[0] != sizeof(float) ||
        !ggml_is_contiguous_1(glu)) {
        *why = "its fused product or GLU rows are not contiguous f32 rows";
        return false;
    }
    for (int k = 0; k < 2; ++k) {
        pi2_fused_half(&r->fused_w[k], &r->fused_p[k], first, k);
    }
    r->gate = &r->fused_p[0];
    r->up   = &r->fused_p[1];
    r->out  = glu;
    r->n_nodes = 2;
    struct ggml_tensor * down = i + 2 < n ? ggml_graph_node(g, i + 2) : NULL;
    int layer = -1;
    enum pi2_matrix m;
    if (down != NULL && (down->flags & GGML_TENSOR_FLAG_COMPUTE) != 0 && down->op == GGML_OP_MUL_MAT && down->src[1] == glu &&
        pi2_ffn_weight_parse(down->src[0]->name, &layer, &m) && layer == r->layer && m == PI2_MATRIX_DOWN) {
        r->down = down;
        r->n_nodes = 3;
    }
    return true;
}

bool pi2_ffn_region_find(struct ggml_cgraph * g, int i, const struct pi2_stated_act * stated, struct pi2_ffn_region * r,
                         const char ** why) {
    const int n = ggml_graph_n_nodes(g);
    *r = (struct pi2_ffn_region) { 0 };
    struct ggml_tensor * first = ggml_graph_node(g, i);
    enum pi2_matrix m0;
    if (first->op != GGML_OP_MUL_MAT || !pi2_ffn_weight_parse(first->src[0]->name, &r->layer, &m0) || m0 == PI2_MATRIX_DOWN) {
        *why = "it does not start with the layer's gate or up product";
        return false;
    }
    if (m0 == PI2_MATRIX_UP && i + 1 < n && ggml_graph_node(g, i + 1)->src[0] == first &&
        ggml_graph_node(g, i + 1)->op == GGML_OP_GLU && ggml_graph_node(g, i + 1)->src[1] == NULL) {
        return pi2_ffn_region_fused(g, i, stated, r, why);
    }
    const struct ggml_tensor * x = first->src[1];
    struct ggml_tensor * members[PI2_FFN_REGION_MAX];
    int n_members = 0, n_glu = 0, n_other = 0;
    struct ggml_tensor * glu = NULL;
    int j = i;
    for (; j < n && j < i + PI2_FFN_REGION_MAX; ++j) {
        struct ggml_tensor * t = ggml_graph_node(g, j);
        if ((t->flags & GGML_TENSOR_FLAG_COMPUTE) == 0) {
            break;
        }
        int layer = -1;
        enum pi2_matrix m;
        if (t->op == GGML_OP_MUL_MAT) {
            if (!pi2_ffn_weight_parse(t->src[0]->name, &layer, &m) || layer != r->layer) {
                break;
            }
            if (m == PI2_MATRIX_DOWN) {
                if (r->out != NULL && t->src[1] == r->out) {
                    r->down = t;
                    ++j;
                }
                break;
            }
            struct ggml_tensor ** slot = m == PI2_MATRIX_GATE ? &r->gate : &r->up;
            if (*slot != NULL || t->src[1] != x) {
                break;
            }
            *slot = members[n_members++] = t;
            continue;
        }
        const bool is_glu = t->op == GGML_OP_GLU;
        if (!(is_glu || pi2_ffn_region_elementwise(t)) || !pi2_sources_members(members, n_members, t)) {
            break;
        }
        members[n_members++] = r->out = t;
        if (is_glu) {
            glu = t;
            ++n_glu;
        } else {
            ++n_other;
        }
    }
    if (r->gate == NULL || r->up == NULL || r->out == NULL || (r->out->op != GGML_OP_GLU && r->out->op != GGML_OP_MUL)) {
        *why = "its gate and up products do not feed one GLU directly (an op between a product and the GLU, a bias say, "
               "that PI2 does not take)";
        return false;
    }
    r->n_nodes = j - i;
    const bool relu_family = pi2_act_overrides_glu(stated);
    if (n_glu == 1 && n_other == 0 && glu == r->out) {
        if (glu->src[0] != r->gate || glu->src[1] != r->up || ((const int32_t *) glu->op_params)[1] != 0) {
            *why = "its GLU does not take gate and up in that order";
            return false;
        }
        if (!pi2_act_for_glu(stated, glu, &r->act)) {
            *why = "its GLU is not ReGLU, SwiGLU or GeGLU";
            return false;
        }
    } else if (relu_family) {
        r->act = stated->act; // the ops between spell the activation the model states (patches/)
    } else {
        *why = "elementwise ops sit between its products and the down product, and the model states no ReLU-family "
               "activation that explains them";
        return false;
    }
    const struct ggml_tensor * wg = r->gate->src[0];
    const struct ggml_tensor * wu = r->up->src[0];
    if (wg->ne[0] != wu->ne[0] || wg->ne[1] != wu->ne[1] || r->out->type != GGML_TYPE_F32 ||
        !ggml_are_same_shape(r->out, r->gate) || !ggml_is_contiguous_1(r->out) || !ggml_is_contiguous_1(r->gate) ||
        !ggml_is_contiguous_1(r->up)) {
        *why = "its gate, up or GLU rows are not contiguous f32 rows of one shape";
        return false;
    }
    return true;
}
