#include "graph/graph_claim.h"

#include <stdatomic.h>

#include "core/pi2_context.h"
#include "experts/expert_ffn.h"
#include "flash/embedding_rows.h"
#include "flash/output_rows.h"
#include "ggml-cpu.h"
#include "graph/ffn_names.h"
#include "graph/ffn_region.h"
#include "graph/placement.h"
#include "graph/route.h"
#include "model/model_binding.h"
#include "model/weight_buffer.h"

static bool pi2_is_own_buffer(ggml_backend_dev_t dev, const struct ggml_tensor * t) {
    GGML_UNUSED(dev);
    return t != NULL && t->buffer != NULL && pi2_is_pi2_buft(t->buffer->buft);
}

// llama's weight-placement probe (a zero-size buffer of PI2's in-RAM type): does PI2 hold this layer of the
// model being loaded, or leave it to ggml-cpu (placement.h)? A layer left is recorded in its binding.
static bool pi2_probe_holds(struct pi2_device_ctx * d, int layer) {
    pthread_mutex_lock(&d->lock);
    pi2_announce_once(d); // said at placement too: a model may leave every layer to ggml-cpu
    if (d->config.error[0] != '\0') { // held, so that the buffer allocation refuses the load with the message
        pthread_mutex_unlock(&d->lock);
        return true;
    }
    struct pi2_binding * b = d->pending;
    const int sl = b != NULL ? pi2_sidecar_dense_layer(b->sc, layer) : -1; // the layer as the sidecar numbers it
    const bool holds = pi2_placement_holds(b, d->pending_act, &d->config.defaults, sl);
    if (!holds && sl >= 0) {
        atomic_store(&b->layer[sl].left, true);
    }
    pthread_mutex_unlock(&d->lock);
    return holds;
}

// ggml-cpu has a dot product for weights of type t and converts f32 activations to its vec_dot_type
static bool pi2_cpu_can_dot(enum ggml_type t) {
    const struct ggml_type_traits_cpu * tt = ggml_get_type_traits_cpu(t);
    if (tt == NULL || tt->vec_dot == NULL) {
        return false;
    }
    return tt->vec_dot_type == GGML_TYPE_F32 || ggml_get_type_traits_cpu(tt->vec_dot_type)->from_float != NULL;
}

// MUL_MAT of an FFN weight held in a PI2 buffer by an f32 activation ggml-cpu can dot with it
static bool pi2_supports_ffn_mul_mat(ggml_backend_dev_t dev, const struct ggml_tensor * op) {
    const struct ggml_tensor * w = op->src[0];
    const struct ggml_tensor * x = op->src[1];
    int layer = 0;
    enum pi2_matrix matrix = PI2_MATRIX_GATE;
    if (!pi2_is_own_buffer(dev, w) || !pi2_ffn_weight_parse(w->name, &layer, &matrix)) {
        return false;
    }
    struct pi2_device_ctx * d = dev->context;
    if (w->buffer->buft == &d->buft && ggml_backend_buffer_get_size(w->buffer) == 0 && !pi2_probe_holds(d, layer)) {
        return false;
    }
    return pi2_cpu_can_dot(w->type) && w->ne[2] == 1 && w->ne[3] == 1 && ggml_is_contiguous(w) &&
           x->type == GGML_TYPE_F32 && x->ne[0] == w->ne[0] && x->ne[2] == 1 && x->ne[3] == 1 &&
           x->nb[0] == sizeof(float) && ggml_is_contiguous_rows(x) &&
           op->type == GGML_TYPE_F32 && op->nb[0] == sizeof(float) &&
           w->ne[0] % ggml_blck_size(w->type) == 0;
}

// MUL_MAT_ID of a routed-expert weight held in a PI2 buffer (expert_ffn.h). llama's placement probe asks with a
// zero-size in-RAM buffer (placement.h, pi2_placement_holds_experts).
static bool pi2_supports_expert_mul_mat_id(ggml_backend_dev_t dev, const struct ggml_tensor * op) {
    const struct ggml_tensor * w = op->src[0];
    struct pi2_device_ctx * d = dev->context;
    int layer = 0;
    enum pi2_matrix matrix = PI2_MATRIX_GATE;
    if (w == NULL || w->buffer == NULL || !pi2_expert_weight_parse(w->name, &layer, &matrix)) {
        return false;
    }
    if (w->buffer->buft == &d->flash_buft) {
        // on flash only with a sidecar of the model's experts (the bundles are the only copy of the weights)
        const struct pi2_buffer_ctx * bc = w->buffer->context;
        pthread_mutex_lock(&d->lock);
        const struct pi2_binding * b = bc != NULL ? bc->binding : d->pending;
        const bool ok = b != NULL && b->flash && b->sc->n_expert > 0;
        pthread_mutex_unlock(&d->lock);
        return ok && pi2_expert_mul_mat_id_shapes(op);
    }
    if (w->buffer->buft != &d->buft) {
        return false;
    }
    if (ggml_backend_buffer_get_size(w->buffer) == 0) {
        pthread_mutex_lock(&d->lock);
        pi2_announce_once(d);
        // a configuration error holds them, so that the buffer allocation refuses the load with the message
        struct pi2_binding * b = d->pending;
        const bool holds = d->config.error[0] != '\0' ||
                           pi2_placement_holds_experts(b, d->pending_act, &d->config.defaults, layer);
        if (!holds && b != NULL && pi2_sidecar_expert_layer(b->sc, layer, 0) >= 0) {
            for (uint32_t e = 0; e < b->sc->n_expert; ++e) { // the layer's experts, as the sidecar numbers them
                atomic_store(&b->layer[pi2_sidecar_expert_layer(b->sc, layer, e)].left, true);
            }
        }
        pthread_mutex_unlock(&d->lock);
        if (!holds) {
            return false;
        }
    }
    return pi2_cpu_can_dot(w->type) && pi2_expert_mul_mat_id_shapes(op);
}

// the own FFN weight whose product t derives from (ffn_region.h), or NULL
static const struct ggml_tensor * pi2_own_product_weight(ggml_backend_dev_t dev, const struct ggml_tensor * t, int depth,
                                                         bool through_add) {
    const struct ggml_tensor * w = pi2_ffn_product_weight(t, depth, through_add);
    return w != NULL && pi2_is_own_buffer(dev, w) ? w : NULL;
}

// an own routed-expert product (MUL_MAT_ID), a view of one (the gate or up half of ffn_gate_up_exps'), or one with
// an expert bias added (gpt-oss's ADD_ID): its weight, or NULL
static const struct ggml_tensor * pi2_expert_product_weight(ggml_backend_dev_t dev, const struct ggml_tensor * t) {
    int layer = 0;
    enum pi2_matrix m;
    if (t != NULL && t->op == GGML_OP_VIEW) {
        t = t->view_src;
    } else if (t != NULL && t->op == GGML_OP_ADD_ID) {
        t = t->src[0];
    }
    return t != NULL && t->op == GGML_OP_MUL_MAT_ID && pi2_is_own_buffer(dev, t->src[0]) &&
           pi2_expert_weight_parse(t->src[0]->name, &layer, &m) ? t->src[0] : NULL;
}

// the routed experts' GLU: both inputs are PI2's expert products (expert_ffn.h), contiguous
static bool pi2_supports_expert_glu(ggml_backend_dev_t dev, const struct ggml_tensor * op) {
    const struct ggml_tensor * a = op->src[0];
    const struct ggml_tensor * b = op->src[1];
    const struct ggml_tensor * wa = pi2_expert_product_weight(dev, a);
    if (wa == NULL || pi2_expert_product_weight(dev, b) == NULL) {
        return false;
    }
    const struct pi2_stated_act sa = pi2_weight_act(wa);
    if (!pi2_glu_supported(ggml_get_glu_op(op)) && !pi2_act_overrides_glu(&sa)) {
        return false;
    }
    // the halves of a fused gate+up product are views with its row stride (contiguous rows)
    return a->type == GGML_TYPE_F32 && b->type == GGML_TYPE_F32 && op->type == GGML_TYPE_F32 && ggml_are_same_shape(a, b) &&
           ggml_is_contiguous_1(a) && ggml_is_contiguous_1(b) && a->nb[0] == sizeof(float) && b->nb[0] == sizeof(float) &&
           ggml_is_contiguous(op);
}

static bool pi2_is_prompt_batch(const struct ggml_tensor * w, int64_t n_tokens, enum ggml_op op, bool by_id);

// the FFN's GLU: both inputs are products of PI2-owned FFN weights (for a model that states a ReLU-family
// activation, possibly through the elementwise ops a patched llama.cpp spells it with)
static bool pi2_supports_ffn_glu(ggml_backend_dev_t dev, const struct ggml_tensor * op) {
    const struct ggml_tensor * a = op->src[0];
    const struct ggml_tensor * b = op->src[1];
    if (pi2_expert_product_weight(dev, a) != NULL) {
        return pi2_supports_expert_glu(dev, op);
    }
    if (b == NULL) { // one fused gate+up product (phi3's ffn_up), split by the GLU itself
        const struct ggml_tensor * w = pi2_own_product_weight(dev, a, 0, false);
        if (w == NULL || !pi2_ffn_fused_glu(op)) {
            return false;
        }
        const struct pi2_stated_act sa = pi2_weight_act(w);
        return (pi2_glu_supported(ggml_get_glu_op(op)) || pi2_act_overrides_glu(&sa)) && a->type == GGML_TYPE_F32 &&
               op->type == GGML_TYPE_F32 && a->nb[0] == sizeof(float) && ggml_is_contiguous_1(op);
    }
    const struct ggml_tensor * wa = pi2_own_product_weight(dev, a, PI2_GLU_INPUT_DEPTH, true);
    if (b == NULL || wa == NULL || pi2_own_product_weight(dev, b, PI2_GLU_INPUT_DEPTH, true) == NULL) {
        return false;
    }
    const struct pi2_stated_act sa = pi2_weight_act(wa);
    const bool relu_family = pi2_act_overrides_glu(&sa);
    if ((a->op != GGML_OP_MUL_MAT || b->op != GGML_OP_MUL_MAT) && !relu_family) {
        return false;
    }
    if (!pi2_glu_supported(ggml_get_glu_op(op)) && !relu_family) {
        return false;
    }
    return a->type == GGML_TYPE_F32 && b->type == GGML_TYPE_F32 && op->type == GGML_TYPE_F32 &&
           ggml_are_same_shape(a, b) && ggml_is_contiguous_1(a) && ggml_is_contiguous_1(b) && ggml_is_contiguous_1(op);
}

// an elementwise op with which a patched llama.cpp spells the ReLU-family activation of a model that states
// one (ffn_region.h): it runs inside PI2's FFN region
static bool pi2_supports_ffn_elementwise(ggml_backend_dev_t dev, const struct ggml_tensor * op) {
    const struct ggml_tensor * w = pi2_own_product_weight(dev, op, 4, false);
    if (w == NULL || !pi2_ffn_region_elementwise(op)) {
        return false;
    }
    const struct pi2_stated_act sa = pi2_weight_act(w);
    return sa.stated && pi2_act_relu_family(sa.act.kind) && op->type == GGML_TYPE_F32 && ggml_is_contiguous_1(op) &&
           !pi2_is_prompt_batch(w, op->ne[1], op->op, false); // with its products, in ggml-cpu
}

// GET_ROWS of a token embedding left in the model file (a flash binding with an embedding)
// Whether w is a table a flash binding leaves in the model file (its embedding, or its output matrix), as
// matches says. llama's placement probe asks with a zero-size buffer, which has no context: then the pending
// load's binding.
static bool pi2_flash_table_is(ggml_backend_dev_t dev, const struct ggml_tensor * w,
                               bool (*matches)(const struct pi2_binding *, const struct ggml_tensor *)) {
    struct pi2_device_ctx * d = dev->context;
    if (w == NULL || w->buffer == NULL || w->buffer->buft != &d->flash_buft) {
        return false;
    }
    const struct pi2_buffer_ctx * bc = w->buffer->context;
    pthread_mutex_lock(&d->lock);
    const struct pi2_binding * b = bc != NULL ? bc->binding : d->pending;
    const bool yes = b != NULL && matches(b, w);
    pthread_mutex_unlock(&d->lock);
    return yes;
}

static bool pi2_is_embedding_table(const struct pi2_binding * b, const struct ggml_tensor * w) {
    return pi2_embedding_matches(b->embd, w);
}

static bool pi2_is_output_table(const struct pi2_binding * b, const struct ggml_tensor * w) {
    return pi2_output_matches(b->output, w) && pi2_binding_setting(b, PI2_SET_OUTPUT_ROWS) > 0;
}

static bool pi2_supports_embedding_rows(ggml_backend_dev_t dev, const struct ggml_tensor * op) {
    const struct ggml_tensor * w   = op->src[0];
    const struct ggml_tensor * ids = op->src[1];
    return ids != NULL && pi2_flash_table_is(dev, w, pi2_is_embedding_table) && ids->type == GGML_TYPE_I32 &&
           ids->ne[1] == 1 && ids->ne[2] == 1 && ids->ne[3] == 1 && op->type == GGML_TYPE_F32 && op->nb[0] == sizeof(float) &&
           op->ne[0] == w->ne[0] && op->ne[1] == ids->ne[0] && op->ne[2] == 1 && op->ne[3] == 1;
}

// MUL_MAT of an output matrix left in the model file (a flash binding with PI2_OUTPUT_ROWS > 0)
static bool pi2_supports_output_mul_mat(ggml_backend_dev_t dev, const struct ggml_tensor * op) {
    const struct ggml_tensor * w = op->src[0];
    const struct ggml_tensor * x = op->src[1];
    return x != NULL && pi2_flash_table_is(dev, w, pi2_is_output_table) && x->type == GGML_TYPE_F32 &&
           x->ne[0] == w->ne[0] && x->ne[2] == 1 && x->ne[3] == 1 &&
           x->nb[0] == sizeof(float) && ggml_is_contiguous_rows(x) && op->type == GGML_TYPE_F32 &&
           op->nb[0] == sizeof(float) && op->ne[0] == w->ne[1] && op->ne[1] == x->ne[1];
}

// Prompt batches (more tokens than the sparse limit) go to ggml-cpu's own kernels, which read the
// weights in place from PI2's host buffer: its batched matmul measured 1.5-2.5x PI2's row-by-row kernel
// here (route.h says when). llama's weight-placement probe asks with a 512-token batch and an empty buffer;
// that must still say yes, or the weights would not be placed in PI2 at all. A model that states a ReLU-family
// activation sends only its gate and up products there: PI2 computes the GLU with the stated activation, and
// ggml's scheduler gives a node without weights to PI2 only next to a PI2 node, so PI2 keeps the down product
// after it. Flash weights are not in memory, so their prompts stay in PI2.
static bool pi2_is_prompt_batch(const struct ggml_tensor * w, int64_t n_tokens, enum ggml_op op, bool by_id) {
    const struct pi2_device_ctx * d = pi2_device_ctx();
    if (w->buffer == NULL || w->buffer->buft != &d->buft || ggml_backend_buffer_get_size(w->buffer) == 0) {
        return false; // on flash, or llama's placement probe
    }
    int layer;
    enum pi2_matrix m;
    const bool gate_or_up = !by_id && op != GGML_OP_GLU && pi2_ffn_weight_parse(w->name, &layer, &m) && m != PI2_MATRIX_DOWN;
    const struct pi2_binding * b = pi2_weight_binding(w);
    const struct pi2_stated_act act = pi2_weight_act(w);
    return pi2_route_to_cpu(b != NULL ? &b->settings : NULL, &d->config.defaults, &act, gate_or_up, n_tokens);
}

// an expert bias added to an own expert product (gpt-oss: before the GLU, and to down's product)
static bool pi2_supports_expert_bias(ggml_backend_dev_t dev, const struct ggml_tensor * op) {
    return op->src[0] != NULL && op->src[0]->op == GGML_OP_MUL_MAT_ID && pi2_expert_product_weight(dev, op->src[0]) != NULL &&
           pi2_add_id_shapes(op);
}

bool pi2_claim_op(ggml_backend_dev_t dev, const struct ggml_tensor * op) {
    if ((op->op == GGML_OP_MUL_MAT || op->op == GGML_OP_MUL_MAT_ID || op->op == GGML_OP_GLU || op->op == GGML_OP_ADD_ID) &&
        op->src[0] != NULL) {
        // a GLU's or a bias sum's input product, also through the view of a fused gate+up's half or a bias sum
        const struct ggml_tensor * in = op->op == GGML_OP_GLU || op->op == GGML_OP_ADD_ID ? op->src[0] : NULL;
        if (in != NULL && in->op == GGML_OP_VIEW && in->view_src != NULL) {
            in = in->view_src;
        } else if (in != NULL && in->op == GGML_OP_ADD_ID) {
            in = in->src[0];
        }
        const bool by_id = op->op == GGML_OP_MUL_MAT_ID || (in != NULL && in->op == GGML_OP_MUL_MAT_ID);
        const struct ggml_tensor * w = in != NULL ? in->src[0] : op->src[0];
        if (w != NULL && pi2_is_prompt_batch(w, by_id ? op->ne[2] : op->ne[1], op->op, by_id)) {
            return false;
        }
    }
    switch (op->op) {
        case GGML_OP_NONE:
        case GGML_OP_RESHAPE:
        case GGML_OP_VIEW:
        case GGML_OP_PERMUTE:
        case GGML_OP_TRANSPOSE:
            // llama checks that pre-allocated tensors in PI2 buffers can be used "by" PI2
            // and a view of an own expert product (ffn_gate_up_exps' gate or up half): a region's node
            return pi2_is_own_buffer(dev, op) || (op->view_src != NULL && pi2_is_own_buffer(dev, op->view_src)) ||
                   (op->op == GGML_OP_VIEW && pi2_expert_product_weight(dev, op) != NULL);
        case GGML_OP_MUL_MAT:
            return pi2_supports_ffn_mul_mat(dev, op) || pi2_supports_output_mul_mat(dev, op);
        case GGML_OP_MUL_MAT_ID:
            return pi2_supports_expert_mul_mat_id(dev, op);
        case GGML_OP_GET_ROWS:
            return pi2_supports_embedding_rows(dev, op);
        case GGML_OP_GLU:
            return pi2_supports_ffn_glu(dev, op);
        case GGML_OP_ADD_ID:
            return pi2_supports_expert_bias(dev, op);
        case GGML_OP_UNARY:
        case GGML_OP_SCALE:
        case GGML_OP_MUL:
            return pi2_supports_ffn_elementwise(dev, op);
        default:
            return false;
    }
}

// Sees each graph llama schedules on PI2 before it computes (also the graphs llama reserves when a context
// is made): an FFN of a model with a sidecar that sparse decode cannot run is found here, so a model loaded
// for a memory budget is refused while it loads (pi2_binding_error), not at its first token.
void pi2_claim_check_graph(struct ggml_cgraph * cgraph) {
    const int n_nodes = ggml_graph_n_nodes(cgraph);
    for (int i = 0; i < n_nodes; i++) {
        const struct ggml_tensor * node = ggml_graph_node(cgraph, i);
        struct pi2_binding * b = node->op == GGML_OP_MUL_MAT ? pi2_weight_binding(node->src[0]) : NULL;
        int layer = 0;
        enum pi2_matrix m;
        const char * why = NULL;
        if (b == NULL || !pi2_ffn_weight_parse(node->src[0]->name, &layer, &m)) {
            continue;
        }
        struct pi2_ffn_region r;
        const struct pi2_stated_act sa = pi2_weight_act(node->src[0]);
        const int sl = pi2_sidecar_dense_layer(b->sc, layer);
        if (pi2_ffn_region_find(cgraph, i, &sa, &r, &why)) {
            if (r.down == NULL) {
                pi2_binding_unfit_layer(b, sl, "its down product does not take act(gate) * up directly");
            }
            i += r.n_nodes - 1;
        } else if (m != PI2_MATRIX_DOWN) { // a down product alone follows a region reported above
            pi2_binding_unfit_layer(b, sl, why);
        }
    }
}
