#include "graph/node_dispatch.h"

#include "core/pi2_log.h"
#include "dense/ffn_exec.h"
#include "experts/expert_ffn.h"
#include "flash/embedding_rows.h"
#include "flash/output_rows.h"
#include "graph/ffn_names.h"
#include "graph/ffn_region.h"
#include "model/model_binding.h"
#include "model/weight_buffer.h"
#include "sparse/sparse_ffn.h"

// Node i, a MUL_MAT: if it starts a layer's FFN region (ffn_region.h), the region runs (sparse for a model
// with a sidecar, else dense) with the activation the model states, and the nodes consumed are returned;
// 0 when node i runs alone.
static int pi2_compute_ffn_region(struct pi2_backend_ctx * ctx, struct ggml_cgraph * cgraph, int i, enum ggml_status * st) {
    const struct ggml_tensor * w = ggml_graph_node(cgraph, i)->src[0];
    int layer = 0;
    enum pi2_matrix m;
    if (!pi2_ffn_weight_parse(w->name, &layer, &m)) {
        return 0;
    }
    const struct pi2_stated_act sa = pi2_weight_act(w);
    struct pi2_binding * b = pi2_weight_binding(w);
    struct pi2_ffn_region r;
    const char * why = NULL;
    const int sl = b != NULL ? pi2_sidecar_dense_layer(b->sc, layer) : -1; // the layer as the sidecar numbers it
    if (pi2_ffn_region_find(cgraph, i, &sa, &r, &why)) {
        if (b != NULL) {
            r.layer = sl;
            return pi2_sparse_ffn_compute(ctx, b, &r, layer, st);
        }
        *st = pi2_exec_gate_up_act(ctx, &r);
        return r.n_nodes - (r.down != NULL); // down runs next, alone
    }
    if (b != NULL && m != PI2_MATRIX_DOWN && pi2_binding_unfit_layer(b, sl, why)) {
        *st = GGML_STATUS_FAILED;
        return 1;
    }
    return 0; // alone: llama's graph computes the activation (an FFN with biases runs right only with patches/)
}

// node i alone or as the start of a region: the nodes consumed; 0 for a view (nothing computed)
static int pi2_run_node(struct pi2_backend_ctx * ctx, struct ggml_cgraph * cgraph, int i, enum ggml_status * st) {
    struct ggml_tensor * node = ggml_graph_node(cgraph, i);
    if (node->op == GGML_OP_MUL_MAT) {
        const int used = pi2_compute_ffn_region(ctx, cgraph, i, st);
        if (used > 0 || *st != GGML_STATUS_SUCCESS) {
            return used > 0 ? used : 1;
        }
    }
    if (node->op == GGML_OP_MUL_MAT_ID) {
        const struct pi2_stated_act sa = pi2_weight_act(node->src[0]);
        struct pi2_expert_region r;
        if (pi2_expert_region_find(cgraph, i, &sa, &r)) {
            struct pi2_binding * b = pi2_weight_binding(node->src[0]);
            const int used = b != NULL ? pi2_exec_expert_region_sparse(ctx, b, &r, st) : 0;
            if (used > 0) {
                return used;
            }
            *st = pi2_exec_expert_region(ctx, &r);
            return r.n_nodes;
        }
    }
    switch (node->op) {
        case GGML_OP_MUL_MAT_ID:
            *st = pi2_exec_mul_mat_id(ctx, node);
            break;
        case GGML_OP_MUL_MAT: {
            struct pi2_binding * b = pi2_weight_binding(node->src[0]);
            *st = b != NULL && pi2_output_matches(b->output, node->src[0]) ? pi2_exec_output(ctx, b, node)
                                                                           : pi2_exec_mul_mat(ctx, node);
        } break;
        case GGML_OP_GLU: {
            // alone (its products ran on the CPU, a prompt batch, or a bias or LoRA term sits between): the model's
            // activation if it states one
            const struct pi2_stated_act sa = pi2_weight_act(pi2_ffn_product_weight(node->src[0], PI2_GLU_INPUT_DEPTH, true));
            struct pi2_ffn_act act;
            if (!pi2_act_for_glu(&sa, node, &act)) {
                PI2_LOG_ERROR("pi2: GLU op %s is not implemented\n", ggml_glu_op_name(ggml_get_glu_op(node)));
                *st = GGML_STATUS_FAILED;
                return 1;
            }
            *st = pi2_exec_glu(ctx, node, &act);
        } break;
        case GGML_OP_ADD_ID: // an expert's bias added to down's product (gpt-oss), after its region
            *st = pi2_exec_add_id(ctx, node);
            break;
        case GGML_OP_GET_ROWS:
            *st = pi2_exec_embedding_rows(ctx, pi2_weight_binding(node->src[0]), node);
            break;
        case GGML_OP_NONE:
        case GGML_OP_RESHAPE:
        case GGML_OP_VIEW:
        case GGML_OP_PERMUTE:
        case GGML_OP_TRANSPOSE:
            return 0;
        default:
            PI2_LOG_ERROR("pi2: unsupported op %s\n", ggml_op_desc(node));
            *st = GGML_STATUS_FAILED;
            return 1;
    }
    return 1;
}

int pi2_dispatch_node(struct pi2_backend_ctx * ctx, struct ggml_cgraph * cgraph, int i, enum ggml_status * st) {
    *st = GGML_STATUS_SUCCESS;
    const int used = pi2_run_node(ctx, cgraph, i, st);
    if (*st == GGML_STATUS_SUCCESS && used > 0) {
        pi2_count(&ctx->dev->counters.nodes_computed, (uint64_t) used);
    }
    return used > 0 ? used : 1;
}
