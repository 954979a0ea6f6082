// PI2 ggml backend: glue only (buffer, buffer type, backend, device and registry interfaces), in the shape
// of ggml-blas. The FFN work lives in sparse_ffn.c (sparse decode) and ffn_exec.c (dense), model loads
// in binding_registry.c, the PI2_* settings in config.c; docs/BACKEND.md maps the rest.
// MAP_ANONYMOUS and MAP_NORESERVE are outside POSIX
#define _DEFAULT_SOURCE
#include "ggml-pi2.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/mman.h>
#include <unistd.h>

#include "build_info.h"
#include "column_axpy.h"
#include "expert_ffn.h"
#include "ffn_exec.h"
#include "ffn_names.h"
#include "ggml-backend-impl.h"
#include "ggml-cpu.h"
#include "model_binding.h"
#include "placement.h"
#include "pi2_log.h"
#include "pi2_context.h"
#include "ffn_region.h"
#include "host_ggml.h"
#include "memory_budget.h"
#include "sparse_ffn.h"

#define PI2_NAME      "PI2"
#define PI2_ALIGNMENT 64

//
// buffer interface: plain host memory, so the CPU backend reads PI2's outputs without copies
//

// A PI2 buffer: its memory (owned, or llama's mmap of the model file) and the model binding that was
// pending when llama allocated it (NULL for models without a sidecar).
// A flash buffer (the binding has a memory budget) holds no memory: its address range is reserved
// PROT_NONE so tensors get addresses, and any stray access faults instead of reading garbage.
struct pi2_buffer_ctx {
    void *               data;
    bool                 owned;
    bool                 flash;
    size_t               reserved; // flash: bytes of address space
    struct pi2_binding * binding;
    struct pi2_stated_act act;     // the FFN activation the model states (activation.h)
};

static void pi2_buffer_free(ggml_backend_buffer_t buffer) {
    struct pi2_buffer_ctx * bc = buffer->context;
    if (bc->flash) {
        if (bc->data != NULL && munmap(bc->data, bc->reserved) != 0) {
            PI2_LOG_ERROR("pi2: munmap of a flash weight buffer failed: %s\n", strerror(errno));
        }
    } else if (bc->owned) {
        free(bc->data);
    }
    pi2_binding_unref(bc->binding);
    free(bc);
}

static void * pi2_buffer_get_base(ggml_backend_buffer_t buffer) {
    // a zero-size buffer (llama's support probe) still needs a non-NULL, aligned base
    const struct pi2_buffer_ctx * bc = buffer->context;
    return bc->data != NULL ? bc->data : (void *) PI2_ALIGNMENT;
}

static void pi2_buffer_memset_tensor(ggml_backend_buffer_t buffer, struct ggml_tensor * tensor, uint8_t value, size_t offset, size_t size) {
    const struct pi2_buffer_ctx * bc = buffer->context;
    if (bc->flash) {
        return; // nothing is kept
    }
    memset((char *) tensor->data + offset, value, size);
}

// flash: llama uploads an FFN weight; it is checked against the sidecar (which holds its bytes as
// bundles) and not kept
static void pi2_flash_set_tensor(const struct pi2_buffer_ctx * bc, struct ggml_tensor * tensor, const void * data, size_t offset,
                                 size_t size) {
    int layer = -1;
    enum pi2_matrix m;
    if (bc->binding != NULL && pi2_embedding_matches(bc->binding->embd, tensor)) {
        atomic_store(&bc->binding->uploading, true);
        pi2_embedding_check_upload(bc->binding->embd, data, offset, size);
        return;
    }
    if (bc->binding != NULL && pi2_output_matches(bc->binding->output, tensor)) {
        atomic_store(&bc->binding->uploading, true);
        pi2_output_upload(bc->binding->output, (int64_t) pi2_binding_setting(bc->binding, PI2_SET_OUTPUT_ROWS),
                          pi2_binding_setting(bc->binding, PI2_SET_OUTPUT_COPY) > 0, data, offset, size);
        return;
    }
    if (bc->binding != NULL && bc->binding->sc->n_expert > 0 && pi2_expert_weight_parse(tensor->name, &layer, &m)) {
        // routed experts: each expert's slice is the sidecar layer layer * n_expert + expert (FORMAT.md, "MoE sidecars")
        const int64_t n_expert = tensor->ne[2];
        const size_t  slice    = tensor->nb[2];
        for (int64_t e = 0; e < n_expert; ++e) {
            struct ggml_tensor one = *tensor;
            one.ne[2] = 1;
            one.nb[3] = one.nb[2];
            const bool whole = offset == 0 && size == ggml_nbytes(tensor);
            pi2_binding_check_upload(bc->binding, layer * (int) n_expert + (int) e, m, &one, (const char *) data + (size_t) e * slice,
                                     whole ? slice : 0);
        }
        return;
    }
    if (bc->binding == NULL || !pi2_ffn_weight_parse(tensor->name, &layer, &m)) {
        PI2_LOG_ERROR("pi2: tensor %s cannot be held by a flash weight buffer (only FFN weights live on flash)\n", tensor->name);
        return;
    }
    pi2_binding_check_upload(bc->binding, layer, m, tensor, data, offset == 0 ? size : 0);
}

static void pi2_buffer_set_tensor(ggml_backend_buffer_t buffer, struct ggml_tensor * tensor, const void * data, size_t offset, size_t size) {
    const struct pi2_buffer_ctx * bc = buffer->context;
    if (bc->flash) {
        pi2_flash_set_tensor(bc, tensor, data, offset, size);
        return;
    }
    memcpy((char *) tensor->data + offset, data, size);
}

static void pi2_buffer_get_tensor(ggml_backend_buffer_t buffer, const struct ggml_tensor * tensor, void * data, size_t offset, size_t size) {
    const struct pi2_buffer_ctx * bc = buffer->context;
    if (bc->flash) {
        // the weights are on flash in bundle form; NaN rather than plausible zeros if anything asks
        PI2_LOG_ERROR("pi2: %s lives on flash and cannot be read back\n", tensor->name);
        memset(data, 0xff, size);
        return;
    }
    memcpy(data, (const char *) tensor->data + offset, size);
}

static bool pi2_buffer_cpy_tensor(ggml_backend_buffer_t buffer, const struct ggml_tensor * src, struct ggml_tensor * dst) {
    const struct pi2_buffer_ctx * bc = buffer->context;
    if (!bc->flash && ggml_backend_buffer_is_host(src->buffer)) {
        memcpy(dst->data, src->data, ggml_nbytes(src));
        return true;
    }
    return false;
}

static void pi2_buffer_clear(ggml_backend_buffer_t buffer, uint8_t value) {
    const struct pi2_buffer_ctx * bc = buffer->context;
    if (bc->data != NULL && !bc->flash) {
        memset(bc->data, value, buffer->size);
    }
}

// the same interface serves buffers PI2 allocated and llama's mmap of the model (owned = false)
static const struct ggml_backend_buffer_i pi2_buffer_i = {
    /* .free_buffer   = */ pi2_buffer_free,
    /* .get_base      = */ pi2_buffer_get_base,
    /* .init_tensor   = */ NULL,
    /* .memset_tensor = */ pi2_buffer_memset_tensor,
    /* .set_tensor    = */ pi2_buffer_set_tensor,
    /* .get_tensor    = */ pi2_buffer_get_tensor,
    /* .set_tensor_2d = */ NULL,
    /* .get_tensor_2d = */ NULL,
    /* .cpy_tensor    = */ pi2_buffer_cpy_tensor,
    /* .clear         = */ pi2_buffer_clear,
    /* .reset         = */ NULL,
};

//
// buffer type interface
//

static const char * pi2_buft_get_name(ggml_backend_buffer_type_t buft) {
    return PI2_NAME;
    GGML_UNUSED(buft);
}

// Once per process, at the first load outside pi2_load_begin/end (llama.cpp's tools; pi2_gguf says it
// itself): that PI2 is active and what PI2_* made of it. On stderr: the tools show ggml's INFO only with -v.
static void pi2_announce(const struct pi2_config * c) {
    static const char * const modes[] = { "dense", "oracle", "predicted" };
    if (c->sidecar[0] == '\0') {
        fprintf(stderr, "pi2: PI2 backend %s active: FFN dense, in RAM (no PI2_SIDECAR)%s\n", PI2_VERSION,
                pi2_setting(NULL, &c->defaults, PI2_SET_LAYERS) != 0.0
                    ? "" : "; left to ggml-cpu unless the model states a ReLU-family activation (PI2_LAYERS=auto)");
    } else if (c->memory_budget > 0) {
        fprintf(stderr, "pi2: PI2 backend %s active: mode %s, sidecar %s, FFN on flash within a memory budget of %.0f MB\n",
                PI2_VERSION, modes[c->mode], c->sidecar, (double) c->memory_budget / 1e6);
    } else {
        fprintf(stderr, "pi2: PI2 backend %s active: mode %s, sidecar %s, FFN in RAM\n", PI2_VERSION, modes[c->mode], c->sidecar);
    }
}

// the announcement, at the first load outside pi2_load_begin/end (d->lock held)
static void pi2_announce_once(struct pi2_device_ctx * d) {
    if (!d->frontend_load && !d->announced) {
        pi2_announce(&d->config);
        d->announced = true;
    }
}

// the buffer context of a new buffer, bound to the pending model binding; NULL (logged) on failure
static struct pi2_buffer_ctx * pi2_buffer_ctx_new(void * data, bool owned) {
    struct pi2_device_ctx * dctx = pi2_device_ctx();
    pthread_mutex_lock(&dctx->lock);
    if (dctx->config.error[0] != '\0') {
        PI2_LOG_REFUSAL("pi2: %s\n", dctx->config.error);
        pthread_mutex_unlock(&dctx->lock);
        return NULL;
    }
    pi2_announce_once(dctx);
    // the first buffer of a load: the frontend has set this model's settings by now
    if (dctx->pending != NULL && pi2_binding_prepare(dctx->pending) != 0) {
        PI2_LOG_REFUSAL("pi2: %s\n", dctx->pending->error);
        pthread_mutex_unlock(&dctx->lock);
        return NULL;
    }
    // PI2_MEMORY_BUDGET's model: a buffer after the weights were uploaded is a context's compute buffer, and
    // model and KV cache are resident by then, so the cache is sized now and a budget that cannot work is
    // refused while the tool is loading (the context fails), not at its first request
    struct pi2_binding * eb = dctx->env_binding;
    if (dctx->pending != NULL && dctx->pending == eb && eb->flash && eb->env_budget > 0 && atomic_load(&eb->uploading) &&
        !pi2_binding_has_cache(eb) &&
        pi2_binding_size_cache(eb, eb->env_budget, eb->env_budget / 20, eb->error, sizeof(eb->error)) != 0) {
        PI2_LOG_REFUSAL("pi2: PI2_MEMORY_BUDGET: %s\n", eb->error);
        pthread_mutex_unlock(&dctx->lock);
        return NULL;
    }
    struct pi2_buffer_ctx * bc = calloc(1, sizeof(*bc));
    if (bc != NULL) {
        bc->data    = data;
        bc->owned   = owned;
        bc->binding = dctx->pending;
        bc->act     = dctx->pending_act;
        if (bc->binding != NULL) {
            pi2_binding_ref(bc->binding);
        }
    }
    pthread_mutex_unlock(&dctx->lock);
    return bc;
}

static ggml_backend_buffer_t pi2_flash_buft_alloc_buffer(ggml_backend_buffer_type_t buft, size_t size) {
    const size_t reserved = size > 0 ? (size + 4095) & ~(size_t) 4095 : 0;
    void * data = NULL;
    if (reserved > 0) {
        data = mmap(NULL, reserved, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (data == MAP_FAILED) {
            PI2_LOG_ERROR("pi2: cannot reserve %zu bytes of address space: %s\n", reserved, strerror(errno));
            return NULL;
        }
    }
    struct pi2_buffer_ctx * bc = pi2_buffer_ctx_new(data, true);
    if (bc == NULL) {
        if (data != NULL) {
            munmap(data, reserved);
        }
        return NULL;
    }
    bc->flash    = true;
    bc->reserved = reserved;
    return ggml_backend_buffer_init(buft, pi2_buffer_i, bc, size);
}

static ggml_backend_buffer_t pi2_buft_alloc_buffer(ggml_backend_buffer_type_t buft, size_t size) {
    void * data = NULL;
    if (size > 0) {
        const size_t rounded = (size + PI2_ALIGNMENT - 1) / PI2_ALIGNMENT * PI2_ALIGNMENT;
        if (posix_memalign(&data, PI2_ALIGNMENT, rounded) != 0) {
            PI2_LOG_ERROR("pi2: failed to allocate a buffer of %zu bytes\n", size);
            return NULL;
        }
    }
    struct pi2_buffer_ctx * bc = pi2_buffer_ctx_new(data, true);
    if (bc == NULL) {
        free(data);
        return NULL;
    }
    return ggml_backend_buffer_init(buft, pi2_buffer_i, bc, size);
}

static size_t pi2_buft_get_alignment(ggml_backend_buffer_type_t buft) {
    return PI2_ALIGNMENT;
    GGML_UNUSED(buft);
}

static bool pi2_buft_is_host(ggml_backend_buffer_type_t buft) {
    return true;
    GGML_UNUSED(buft);
}

// not host memory: llama then uploads each weight through set_tensor instead of reading into ->data
static bool pi2_flash_buft_is_host(ggml_backend_buffer_type_t buft) {
    return false;
    GGML_UNUSED(buft);
}

static const struct ggml_backend_buffer_type_i pi2_buft_i = {
    /* .get_name       = */ pi2_buft_get_name,
    /* .alloc_buffer   = */ pi2_buft_alloc_buffer,
    /* .get_alignment  = */ pi2_buft_get_alignment,
    /* .get_max_size   = */ NULL,
    /* .get_alloc_size = */ NULL,
    /* .is_host        = */ pi2_buft_is_host,
};

// weights of a model loaded with a memory budget (the binding pending at load is flash)
static const struct ggml_backend_buffer_type_i pi2_flash_buft_i = {
    /* .get_name       = */ pi2_buft_get_name,
    /* .alloc_buffer   = */ pi2_flash_buft_alloc_buffer,
    /* .get_alignment  = */ pi2_buft_get_alignment,
    /* .get_max_size   = */ NULL,
    /* .get_alloc_size = */ NULL,
    /* .is_host        = */ pi2_flash_buft_is_host,
};

//
// backend interface
//

static const char * pi2_backend_get_name(ggml_backend_t backend) {
    return PI2_NAME;
    GGML_UNUSED(backend);
}

static void pi2_backend_free(ggml_backend_t backend) {
    struct pi2_backend_ctx * ctx = backend->context;
    for (int k = 0; k < ctx->n_sub; ++k) {
        free(ctx->sub[k].work);
    }
    free(ctx->sub);
    free(ctx->work);
    free(ctx);
    free(backend);
}

static struct pi2_binding * pi2_weight_binding(const struct ggml_tensor * w) {
    if (w == NULL || w->buffer == NULL || w->buffer->buft->iface.get_name != pi2_buft_get_name) {
        return NULL;
    }
    // the buffers of a model loaded without memory (no_alloc: llama's parameter fitting) have no context
    const struct pi2_buffer_ctx * bc = w->buffer->context;
    return bc != NULL ? bc->binding : NULL;
}

// the FFN activation the model of weight w states; llama's placement probe asks with a zero-size buffer,
// which has no context: the pending load's
static struct pi2_stated_act pi2_weight_act(const struct ggml_tensor * w) {
    struct pi2_device_ctx * d = pi2_device_ctx();
    if (w == NULL || w->buffer == NULL || w->buffer->buft->iface.get_name != pi2_buft_get_name) {
        return (struct pi2_stated_act) { 0 };
    }
    const struct pi2_buffer_ctx * bc = w->buffer->context;
    if (bc != NULL) {
        return bc->act;
    }
    pthread_mutex_lock(&d->lock);
    const struct pi2_stated_act a = d->pending_act;
    pthread_mutex_unlock(&d->lock);
    return a;
}

// the model's value of a per-model setting, for a weight of a model with a sidecar (else the default)
static double pi2_weight_setting(const struct ggml_tensor * w, enum pi2_setting k) {
    const struct pi2_binding * b = pi2_weight_binding(w);
    return pi2_setting(b != NULL ? &b->settings : NULL, &pi2_device_ctx()->config.defaults, k);
}

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
    if (pi2_ffn_region_find(cgraph, i, &sa, &r, &why)) {
        if (b != NULL) {
            return pi2_sparse_ffn_compute(ctx, b, &r, st);
        }
        *st = pi2_exec_gate_up_act(ctx, &r);
        return r.n_nodes - (r.down != NULL); // down runs next, alone
    }
    if (b != NULL && m != PI2_MATRIX_DOWN && pi2_binding_unfit_layer(b, layer, why)) {
        *st = GGML_STATUS_FAILED;
        return 1;
    }
    return 0; // alone: llama's graph computes the activation (an FFN with biases runs right only with patches/)
}

static enum ggml_status pi2_backend_graph_compute(ggml_backend_t backend, struct ggml_cgraph * cgraph) {
    struct pi2_backend_ctx * ctx = backend->context;
    pi2_count(&ctx->dev->counters.graph_computes, 1);

    const int n_nodes = ggml_graph_n_nodes(cgraph);
    for (int i = 0; i < n_nodes; i++) {
        struct ggml_tensor * node = ggml_graph_node(cgraph, i);
        if ((node->flags & GGML_TENSOR_FLAG_COMPUTE) == 0) {
            continue;
        }
        enum ggml_status st = GGML_STATUS_SUCCESS;
        if (node->op == GGML_OP_MUL_MAT) {
            const int used = pi2_compute_ffn_region(ctx, cgraph, i, &st);
            if (st != GGML_STATUS_SUCCESS) {
                return st;
            }
            if (used > 0) {
                pi2_count(&ctx->dev->counters.nodes_computed, (uint64_t) used);
                i += used - 1;
                continue;
            }
        }
        if (node->op == GGML_OP_MUL_MAT_ID) {
            const struct pi2_stated_act sa = pi2_weight_act(node->src[0]);
            struct pi2_expert_region r;
            if (pi2_expert_region_find(cgraph, i, &sa, &r)) {
                struct pi2_binding * b = pi2_weight_binding(node->src[0]);
                const int used = b != NULL ? pi2_exec_expert_region_sparse(ctx, b, &r, &st) : 0;
                if (used > 0) {
                    if (st != GGML_STATUS_SUCCESS) {
                        return st;
                    }
                    pi2_count(&ctx->dev->counters.nodes_computed, (uint64_t) used);
                    i += used - 1;
                    continue;
                }
                st = pi2_exec_expert_region(ctx, &r);
                if (st != GGML_STATUS_SUCCESS) {
                    return st;
                }
                pi2_count(&ctx->dev->counters.nodes_computed, 3);
                i += 2;
                continue;
            }
        }
        switch (node->op) {
            case GGML_OP_MUL_MAT_ID:
                st = pi2_exec_mul_mat_id(ctx, node);
                break;
            case GGML_OP_MUL_MAT: {
                struct pi2_binding * b = pi2_weight_binding(node->src[0]);
                st = b != NULL && pi2_output_matches(b->output, node->src[0]) ? pi2_exec_output(ctx, b, node)
                                                                              : pi2_exec_mul_mat(ctx, node);
            } break;
            case GGML_OP_GLU: {
                // alone (its products ran on the CPU, a prompt batch): the model's activation if it states one
                const struct pi2_stated_act sa = pi2_weight_act(node->src[0]->src[0]);
                struct pi2_ffn_act act;
                if (!pi2_act_for_glu(&sa, ggml_get_glu_op(node), &act)) {
                    PI2_LOG_ERROR("pi2: GLU op %s is not implemented\n", ggml_glu_op_name(ggml_get_glu_op(node)));
                    return GGML_STATUS_FAILED;
                }
                st = pi2_exec_glu(ctx, node, &act);
            } break;
            case GGML_OP_GET_ROWS:
                st = pi2_exec_embedding_rows(ctx, pi2_weight_binding(node->src[0]), node);
                break;
            case GGML_OP_NONE:
            case GGML_OP_RESHAPE:
            case GGML_OP_VIEW:
            case GGML_OP_PERMUTE:
            case GGML_OP_TRANSPOSE:
                continue;
            default:
                PI2_LOG_ERROR("pi2: unsupported op %s\n", ggml_op_desc(node));
                return GGML_STATUS_FAILED;
        }
        if (st != GGML_STATUS_SUCCESS) {
            return st;
        }
        pi2_count(&ctx->dev->counters.nodes_computed, 1);
    }
    return GGML_STATUS_SUCCESS;
}

// Sees each graph llama schedules on PI2 before it computes (also the graphs llama reserves when a context
// is made): an FFN of a model with a sidecar that sparse decode cannot run is found here, so a model loaded
// for a memory budget is refused while it loads (pi2_binding_error), not at its first token.
static void pi2_backend_graph_optimize(ggml_backend_t backend, struct ggml_cgraph * cgraph,
                                       struct ggml_backend_graph_optimize_params * params) {
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
        if (pi2_ffn_region_find(cgraph, i, &sa, &r, &why)) {
            if (r.down == NULL) {
                pi2_binding_unfit_layer(b, layer, "its down product does not take act(gate) * up directly");
            }
            i += r.n_nodes - 1;
        } else if (m != PI2_MATRIX_DOWN) { // a down product alone follows a region reported above
            pi2_binding_unfit_layer(b, layer, why);
        }
    }
    GGML_UNUSED(backend);
    GGML_UNUSED(params);
}

static const struct ggml_backend_i pi2_backend_i = {
    /* .get_name            = */ pi2_backend_get_name,
    /* .free                = */ pi2_backend_free,
    /* .set_tensor_async    = */ NULL,
    /* .get_tensor_async    = */ NULL,
    /* .set_tensor_2d_async = */ NULL,
    /* .get_tensor_2d_async = */ NULL,
    /* .cpy_tensor_async    = */ NULL,
    /* .synchronize         = */ NULL,
    /* .graph_plan_create   = */ NULL,
    /* .graph_plan_free     = */ NULL,
    /* .graph_plan_update   = */ NULL,
    /* .graph_plan_compute  = */ NULL,
    /* .graph_compute       = */ pi2_backend_graph_compute,
    /* .event_record        = */ NULL,
    /* .event_wait          = */ NULL,
    /* .graph_optimize      = */ pi2_backend_graph_optimize,
};

static ggml_guid_t pi2_backend_guid(void) {
    static ggml_guid guid = { 0x70, 0x69, 0x32, 0x2d, 0x67, 0x67, 0x75, 0x66, 0x2d, 0x66, 0x66, 0x6e, 0x00, 0x01, 0x02, 0x03 };
    return &guid;
}

static void pi2_backend_set_n_threads(ggml_backend_t backend, int n_threads) {
    if (backend == NULL || !ggml_guid_matches(backend->guid, pi2_backend_guid())) {
        return;
    }
    struct pi2_backend_ctx * ctx = backend->context;
    ctx->n_threads = n_threads > 0 ? n_threads : 1;
}

//
// device interface
//

static const char * pi2_device_get_name(ggml_backend_dev_t dev) {
    return PI2_NAME;
    GGML_UNUSED(dev);
}

static const char * pi2_device_get_description(ggml_backend_dev_t dev) {
    return "PowerInfer-2 FFN engine (pi2-gguf)";
    GGML_UNUSED(dev);
}

static void pi2_device_get_memory(ggml_backend_dev_t dev, size_t * free_mem, size_t * total) {
    // host memory is shared with the CPU device; report none so llama falls back to host figures
    *free_mem = 0;
    *total    = 0;
    GGML_UNUSED(dev);
}

static enum ggml_backend_dev_type pi2_device_get_type(ggml_backend_dev_t dev) {
    return GGML_BACKEND_DEVICE_TYPE_ACCEL;
    GGML_UNUSED(dev);
}

static void pi2_device_get_props(ggml_backend_dev_t dev, struct ggml_backend_dev_props * props) {
    memset(props, 0, sizeof(*props));
    props->name        = pi2_device_get_name(dev);
    props->description = pi2_device_get_description(dev);
    props->type        = pi2_device_get_type(dev);
    pi2_device_get_memory(dev, &props->memory_free, &props->memory_total);
    props->caps.async                = false;
    props->caps.host_buffer          = false;
    props->caps.buffer_from_host_ptr = true;
    props->caps.events               = false;
}

static ggml_backend_t pi2_device_init_backend(ggml_backend_dev_t dev, const char * params) {
    struct pi2_backend_ctx * ctx = calloc(1, sizeof(*ctx));
    ggml_backend_t backend = calloc(1, sizeof(*backend));
    if (ctx == NULL || backend == NULL) {
        free(ctx);
        free(backend);
        return NULL;
    }
    ctx->dev       = dev->context;
    ctx->n_threads = GGML_DEFAULT_N_THREADS;
    backend->guid    = pi2_backend_guid();
    backend->iface   = pi2_backend_i;
    backend->device  = dev;
    backend->context = ctx;
    return backend;
    GGML_UNUSED(params);
}

// A model loading for a memory budget gets the flash buffer type for its weights. llama allocates all
// weight buffers before it uploads any weight, and creates contexts (compute buffers, which must be real
// memory) after; llama-cpp-python does both inside one constructor, so the first upload ends the flash
// answers.
static ggml_backend_buffer_type_t pi2_device_get_buffer_type(ggml_backend_dev_t dev) {
    struct pi2_device_ctx * dctx = dev->context;
    pthread_mutex_lock(&dctx->lock);
    const bool flash = dctx->pending != NULL && dctx->pending->flash && !atomic_load(&dctx->pending->uploading);
    pthread_mutex_unlock(&dctx->lock);
    return flash ? &dctx->flash_buft : &dctx->buft;
}

static ggml_backend_buffer_t pi2_device_buffer_from_host_ptr(ggml_backend_dev_t dev, void * ptr, size_t size, size_t max_tensor_size) {
    struct pi2_device_ctx * dctx = dev->context;
    pthread_mutex_lock(&dctx->lock);
    const bool flash = dctx->pending != NULL && dctx->pending->flash;
    pthread_mutex_unlock(&dctx->lock);
    if (flash) {
        // a mapping of the model file would make the FFN resident as it is read: it must stay on flash
        PI2_LOG_REFUSAL("pi2: a memory budget keeps the FFN on flash, so the model must be loaded without mmap: "
                        "llama.cpp's tools take -lm none (--load-mode none), llama-cpp-python use_mmap=False\n");
        return NULL;
    }
    struct pi2_buffer_ctx * bc = pi2_buffer_ctx_new(ptr, false);
    if (bc == NULL) {
        return NULL;
    }
    return ggml_backend_buffer_init(pi2_device_get_buffer_type(dev), pi2_buffer_i, bc, size);
    GGML_UNUSED(max_tensor_size);
}

static bool pi2_is_own_buffer(ggml_backend_dev_t dev, const struct ggml_tensor * t) {
    const struct pi2_device_ctx * dctx = dev->context;
    return t != NULL && t->buffer != NULL && (t->buffer->buft == &dctx->buft || t->buffer->buft == &dctx->flash_buft);
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
    const bool holds = pi2_placement_holds(b, d->pending_act, &d->config.defaults, layer);
    if (!holds && b != NULL && layer >= 0 && (uint32_t) layer < b->sc->n_layer) {
        atomic_store(&b->layer[layer].left, true);
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
        if (!holds && b != NULL && b->sc->n_expert > 0 && (uint64_t) (layer + 1) * b->sc->n_expert <= b->sc->n_layer) {
            for (uint32_t e = 0; e < b->sc->n_expert; ++e) { // the layer's experts, as the sidecar numbers them
                atomic_store(&b->layer[(uint32_t) layer * b->sc->n_expert + e].left, true);
            }
        }
        pthread_mutex_unlock(&d->lock);
        if (!holds) {
            return false;
        }
    }
    return pi2_cpu_can_dot(w->type) && pi2_expert_mul_mat_id_shapes(op);
}

// the own FFN weight whose product t derives from through at most `depth` elementwise ops, or NULL
static const struct ggml_tensor * pi2_ffn_product_weight(ggml_backend_dev_t dev, const struct ggml_tensor * t, int depth) {
    if (t == NULL) {
        return NULL;
    }
    if (t->op == GGML_OP_MUL_MAT) {
        int layer = 0;
        enum pi2_matrix m;
        return pi2_is_own_buffer(dev, t->src[0]) && pi2_ffn_weight_parse(t->src[0]->name, &layer, &m) ? t->src[0] : NULL;
    }
    if (depth == 0 || !(t->op == GGML_OP_GLU || pi2_ffn_region_elementwise(t))) {
        return NULL;
    }
    const struct ggml_tensor * w = pi2_ffn_product_weight(dev, t->src[0], depth - 1);
    return w != NULL ? w : pi2_ffn_product_weight(dev, t->src[1], depth - 1);
}

// the FFN's GLU: both inputs are products of PI2-owned FFN weights (for a model that states a ReLU-family
// activation, possibly through the elementwise ops a patched llama.cpp spells it with)
// an own routed-expert product (MUL_MAT_ID), or NULL
static const struct ggml_tensor * pi2_expert_product_weight(ggml_backend_dev_t dev, const struct ggml_tensor * t) {
    int layer = 0;
    enum pi2_matrix m;
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
    return a->type == GGML_TYPE_F32 && b->type == GGML_TYPE_F32 && op->type == GGML_TYPE_F32 && ggml_are_same_shape(a, b) &&
           ggml_is_contiguous(a) && ggml_is_contiguous(b) && ggml_is_contiguous(op);
}

static bool pi2_is_prompt_batch(const struct ggml_tensor * w, int64_t n_tokens, enum ggml_op op, bool by_id);

static bool pi2_supports_ffn_glu(ggml_backend_dev_t dev, const struct ggml_tensor * op) {
    const struct ggml_tensor * a = op->src[0];
    const struct ggml_tensor * b = op->src[1];
    if (pi2_expert_product_weight(dev, a) != NULL) {
        return pi2_supports_expert_glu(dev, op);
    }
    const struct ggml_tensor * wa = pi2_ffn_product_weight(dev, a, 3);
    if (b == NULL || wa == NULL || pi2_ffn_product_weight(dev, b, 3) == NULL) {
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
    const struct ggml_tensor * w = pi2_ffn_product_weight(dev, op, 4);
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
// here. llama's weight-placement probe asks with a 512-token batch and an empty buffer; that must still
// say yes, or the weights would not be placed in PI2 at all.
// A model that states a ReLU-family activation sends only its gate and up products there (and a patched
// llama.cpp's elementwise spelling of the activation, right as it is): PI2 must compute the GLU node with the
// stated activation (ggml-cpu would run the SwiGLU an unmodified llama.cpp's graph holds), and ggml's
// scheduler gives a node without weights to PI2 only next to a PI2 node, so PI2 keeps the down product after
// it. Its routed experts keep their prompts in PI2.
// (Flash weights are not in memory, so their prompts stay in PI2.)
static bool pi2_is_prompt_batch(const struct ggml_tensor * w, int64_t n_tokens, enum ggml_op op, bool by_id) {
    const struct pi2_device_ctx * d = pi2_device_ctx();
    if (w->buffer == NULL || w->buffer->buft != &d->buft || ggml_backend_buffer_get_size(w->buffer) == 0) {
        return false;
    }
    const struct pi2_stated_act sa = pi2_weight_act(w);
    if (sa.stated && pi2_act_relu_family(sa.act.kind)) {
        int layer;
        enum pi2_matrix m;
        if (by_id || op == GGML_OP_GLU || !pi2_ffn_weight_parse(w->name, &layer, &m) || m == PI2_MATRIX_DOWN) {
            return false;
        }
    }
    return pi2_weight_setting(w, PI2_SET_PROMPT) != 0.0 && n_tokens > pi2_weight_setting(w, PI2_SET_SPARSE_BATCH);
}

static bool pi2_device_supports_op(ggml_backend_dev_t dev, const struct ggml_tensor * op) {
    if ((op->op == GGML_OP_MUL_MAT || op->op == GGML_OP_MUL_MAT_ID || op->op == GGML_OP_GLU) && op->src[0] != NULL) {
        const bool by_id = op->op == GGML_OP_MUL_MAT_ID || op->src[0]->op == GGML_OP_MUL_MAT_ID;
        const struct ggml_tensor * w = op->op == GGML_OP_GLU ? op->src[0]->src[0] : op->src[0];
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
            return pi2_is_own_buffer(dev, op) || (op->view_src != NULL && pi2_is_own_buffer(dev, op->view_src));
        case GGML_OP_MUL_MAT:
            return pi2_supports_ffn_mul_mat(dev, op) || pi2_supports_output_mul_mat(dev, op);
        case GGML_OP_MUL_MAT_ID:
            return pi2_supports_expert_mul_mat_id(dev, op);
        case GGML_OP_GET_ROWS:
            return pi2_supports_embedding_rows(dev, op);
        case GGML_OP_GLU:
            return pi2_supports_ffn_glu(dev, op);
        case GGML_OP_UNARY:
        case GGML_OP_SCALE:
        case GGML_OP_MUL:
            return pi2_supports_ffn_elementwise(dev, op);
        default:
            return false;
    }
}

static bool pi2_device_supports_buft(ggml_backend_dev_t dev, ggml_backend_buffer_type_t buft) {
    const struct pi2_device_ctx * dctx = dev->context;
    return ggml_backend_buft_is_host(buft) || buft == &dctx->flash_buft;
}

static const struct ggml_backend_device_i pi2_device_i = {
    /* .get_name             = */ pi2_device_get_name,
    /* .get_description      = */ pi2_device_get_description,
    /* .get_memory           = */ pi2_device_get_memory,
    /* .get_type             = */ pi2_device_get_type,
    /* .get_props            = */ pi2_device_get_props,
    /* .init_backend         = */ pi2_device_init_backend,
    /* .get_buffer_type      = */ pi2_device_get_buffer_type,
    /* .get_host_buffer_type = */ NULL,
    /* .buffer_from_host_ptr = */ pi2_device_buffer_from_host_ptr,
    /* .supports_op          = */ pi2_device_supports_op,
    /* .supports_buft        = */ pi2_device_supports_buft,
    /* .offload_op           = */ NULL,
    /* .event_new            = */ NULL,
    /* .event_free           = */ NULL,
    /* .event_synchronize    = */ NULL,
};

//
// backend reg interface
//

static const char * pi2_reg_get_name(ggml_backend_reg_t reg) {
    return PI2_NAME;
    GGML_UNUSED(reg);
}

static size_t pi2_reg_get_device_count(ggml_backend_reg_t reg) {
    return 1;
    GGML_UNUSED(reg);
}

static ggml_backend_dev_t pi2_reg_get_device(ggml_backend_reg_t reg, size_t index) {
    return index == 0 ? (ggml_backend_dev_t) reg->context : NULL;
}

static void * pi2_reg_get_proc_address(ggml_backend_reg_t reg, const char * name) {
    if (strcmp(name, "ggml_backend_set_n_threads") == 0) {
        return (void *) pi2_backend_set_n_threads;
    }
    if (strcmp(name, "pi2_counters_read") == 0) {
        return (void *) pi2_counters_read;
    }
    if (strcmp(name, "pi2_counters_reset") == 0) {
        return (void *) pi2_counters_reset;
    }
    return NULL;
    GGML_UNUSED(reg);
}

static const struct ggml_backend_reg_i pi2_reg_i = {
    /* .get_name         = */ pi2_reg_get_name,
    /* .get_device_count = */ pi2_reg_get_device_count,
    /* .get_device       = */ pi2_reg_get_device,
    /* .get_proc_address = */ pi2_reg_get_proc_address,
};

// The registry, its one device and the device context are the backend's only static objects; ggml
// holds pointers to them for the life of the process.
static struct pi2_device_ctx     pi2_dev_ctx;
static struct ggml_backend_device pi2_device;
static struct ggml_backend_reg    pi2_reg;

struct pi2_device_ctx * pi2_device_ctx(void) {
    return &pi2_dev_ctx;
}

ggml_backend_reg_t ggml_backend_pi2_reg(void) {
    if (pi2_reg.iface.get_name == NULL) {
        pthread_mutex_init(&pi2_dev_ctx.lock, NULL);
        pi2_dev_ctx.next_binding_id = 1;
        pi2_config_from_env(&pi2_dev_ctx.config);
        pi2_registry_init(&pi2_dev_ctx);
        pi2_glu_tables_init(&pi2_dev_ctx.glu);
        pi2_dev_ctx.buft = (struct ggml_backend_buffer_type) {
            /* .iface   = */ pi2_buft_i,
            /* .device  = */ &pi2_device,
            /* .context = */ &pi2_dev_ctx,
        };
        pi2_dev_ctx.flash_buft = (struct ggml_backend_buffer_type) {
            /* .iface   = */ pi2_flash_buft_i,
            /* .device  = */ &pi2_device,
            /* .context = */ &pi2_dev_ctx,
        };
        pi2_device = (struct ggml_backend_device) {
            /* .iface   = */ pi2_device_i,
            /* .reg     = */ &pi2_reg,
            /* .context = */ &pi2_dev_ctx,
        };
        pi2_reg = (struct ggml_backend_reg) {
            /* .api_version = */ GGML_BACKEND_API_VERSION,
            /* .iface       = */ pi2_reg_i,
            /* .context     = */ &pi2_device,
        };
    }
    return &pi2_reg;
}

static int pi2_score(void) {
    return 1;
}

// ggml_backend_init, as GGML_BACKEND_DL_IMPL defines it, plus the check that the loader shares our ggml
GGML_BACKEND_API ggml_backend_reg_t ggml_backend_init(void);
ggml_backend_reg_t ggml_backend_init(void) {
    char err[1024];
    if (!pi2_host_shares_ggml(__builtin_return_address(0), err, sizeof(err))) {
        PI2_LOG_REFUSAL("pi2: %s\n", err);
        return NULL;
    }
    return ggml_backend_pi2_reg();
}
GGML_BACKEND_DL_SCORE_IMPL(pi2_score)
