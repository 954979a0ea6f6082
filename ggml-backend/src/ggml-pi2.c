// PI2 ggml backend: glue only (buffer type, backend, device, registry), in the shape of ggml-blas.
// The FFN work itself lives in ffn_exec.c (scheduling) and the kernel files beside it.
#include "ggml-pi2.h"

#include <stdlib.h>
#include <string.h>

#include "ffn_exec.h"
#include "ffn_names.h"
#include "ggml-backend-impl.h"
#include "ggml-cpu.h"
#include "pi2_log.h"
#include "pi2_context.h"

#define PI2_NAME      "PI2"
#define PI2_ALIGNMENT 64
#define PI2_STR_(x)   #x
#define PI2_STR(x)    PI2_STR_(x)

#ifndef PI2_VERSION
#define PI2_VERSION "dev"
#endif
#ifndef PI2_LLAMA_CPP_PYTHON_VERSION
#define PI2_LLAMA_CPP_PYTHON_VERSION "unknown"
#endif

static struct pi2_device_ctx * pi2_device_ctx(void);

//
// buffer interface: plain host memory, so the CPU backend reads PI2's outputs without copies
//

static void pi2_buffer_free(ggml_backend_buffer_t buffer) {
    free(buffer->context);
}

static void * pi2_buffer_get_base(ggml_backend_buffer_t buffer) {
    // a zero-size buffer (llama's support probe) still needs a non-NULL, aligned base
    return buffer->context != NULL ? buffer->context : (void *) PI2_ALIGNMENT;
}

static void pi2_buffer_memset_tensor(ggml_backend_buffer_t buffer, struct ggml_tensor * tensor, uint8_t value, size_t offset, size_t size) {
    memset((char *) tensor->data + offset, value, size);
    GGML_UNUSED(buffer);
}

static void pi2_buffer_set_tensor(ggml_backend_buffer_t buffer, struct ggml_tensor * tensor, const void * data, size_t offset, size_t size) {
    memcpy((char *) tensor->data + offset, data, size);
    GGML_UNUSED(buffer);
}

static void pi2_buffer_get_tensor(ggml_backend_buffer_t buffer, const struct ggml_tensor * tensor, void * data, size_t offset, size_t size) {
    memcpy(data, (const char *) tensor->data + offset, size);
    GGML_UNUSED(buffer);
}

static bool pi2_buffer_cpy_tensor(ggml_backend_buffer_t buffer, const struct ggml_tensor * src, struct ggml_tensor * dst) {
    if (ggml_backend_buffer_is_host(src->buffer)) {
        memcpy(dst->data, src->data, ggml_nbytes(src));
        return true;
    }
    return false;
    GGML_UNUSED(buffer);
}

static void pi2_buffer_clear(ggml_backend_buffer_t buffer, uint8_t value) {
    if (buffer->context != NULL) {
        memset(buffer->context, value, buffer->size);
    }
}

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

// the same interface over memory PI2 does not own (llama's mmap of the model file)
static const struct ggml_backend_buffer_i pi2_buffer_from_ptr_i = {
    /* .free_buffer   = */ NULL,
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

static ggml_backend_buffer_t pi2_buft_alloc_buffer(ggml_backend_buffer_type_t buft, size_t size) {
    void * data = NULL;
    if (size > 0) {
        const size_t rounded = (size + PI2_ALIGNMENT - 1) / PI2_ALIGNMENT * PI2_ALIGNMENT;
        if (posix_memalign(&data, PI2_ALIGNMENT, rounded) != 0) {
            PI2_LOG_ERROR("pi2: failed to allocate a buffer of %zu bytes\n", size);
            return NULL;
        }
    }
    return ggml_backend_buffer_init(buft, pi2_buffer_i, data, size);
}

static size_t pi2_buft_get_alignment(ggml_backend_buffer_type_t buft) {
    return PI2_ALIGNMENT;
    GGML_UNUSED(buft);
}

static bool pi2_buft_is_host(ggml_backend_buffer_type_t buft) {
    return true;
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

//
// backend interface
//

static const char * pi2_backend_get_name(ggml_backend_t backend) {
    return PI2_NAME;
    GGML_UNUSED(backend);
}

static void pi2_backend_free(ggml_backend_t backend) {
    struct pi2_backend_ctx * ctx = backend->context;
    free(ctx->work);
    free(ctx);
    free(backend);
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
        if (node->op == GGML_OP_MUL_MAT && i + 2 < n_nodes &&
            pi2_ffn_fusable(node, ggml_graph_node(cgraph, i + 1), ggml_graph_node(cgraph, i + 2))) {
            st = pi2_exec_gate_up_glu(ctx, ggml_graph_node(cgraph, i + 2));
            if (st != GGML_STATUS_SUCCESS) {
                return st;
            }
            pi2_count(&ctx->dev->counters.nodes_computed, 3);
            i += 2;
            continue;
        }
        switch (node->op) {
            case GGML_OP_MUL_MAT:
                st = pi2_exec_mul_mat(ctx, node);
                break;
            case GGML_OP_GLU:
                st = pi2_exec_glu(ctx, node);
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
    /* .graph_optimize      = */ NULL,
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

static ggml_backend_buffer_type_t pi2_device_get_buffer_type(ggml_backend_dev_t dev) {
    struct pi2_device_ctx * dctx = dev->context;
    return &dctx->buft;
}

static ggml_backend_buffer_t pi2_device_buffer_from_host_ptr(ggml_backend_dev_t dev, void * ptr, size_t size, size_t max_tensor_size) {
    return ggml_backend_buffer_init(pi2_device_get_buffer_type(dev), pi2_buffer_from_ptr_i, ptr, size);
    GGML_UNUSED(max_tensor_size);
}

static bool pi2_is_own_buffer(ggml_backend_dev_t dev, const struct ggml_tensor * t) {
    return t != NULL && t->buffer != NULL && t->buffer->buft == pi2_device_get_buffer_type(dev);
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
    const struct ggml_type_traits_cpu * tt = ggml_get_type_traits_cpu(w->type);
    if (tt == NULL || tt->vec_dot == NULL) {
        return false;
    }
    if (tt->vec_dot_type != GGML_TYPE_F32 && ggml_get_type_traits_cpu(tt->vec_dot_type)->from_float == NULL) {
        return false;
    }
    return w->ne[2] == 1 && w->ne[3] == 1 && ggml_is_contiguous(w) &&
           x->type == GGML_TYPE_F32 && x->ne[0] == w->ne[0] && x->ne[2] == 1 && x->ne[3] == 1 &&
           x->nb[0] == sizeof(float) && ggml_is_contiguous_rows(x) &&
           op->type == GGML_TYPE_F32 && op->nb[0] == sizeof(float) &&
           w->ne[0] % ggml_blck_size(w->type) == 0;
}

// the FFN's GLU: both inputs are products of PI2-owned FFN weights
static bool pi2_supports_ffn_glu(ggml_backend_dev_t dev, const struct ggml_tensor * op) {
    const struct ggml_tensor * a = op->src[0];
    const struct ggml_tensor * b = op->src[1];
    if (b == NULL || !pi2_glu_supported(ggml_get_glu_op(op))) {
        return false;
    }
    if (a->op != GGML_OP_MUL_MAT || b->op != GGML_OP_MUL_MAT || !pi2_is_own_buffer(dev, a->src[0]) || !pi2_is_own_buffer(dev, b->src[0])) {
        return false;
    }
    return a->type == GGML_TYPE_F32 && b->type == GGML_TYPE_F32 && op->type == GGML_TYPE_F32 &&
           ggml_are_same_shape(a, b) && ggml_is_contiguous_1(a) && ggml_is_contiguous_1(b) && ggml_is_contiguous_1(op);
}

static bool pi2_device_supports_op(ggml_backend_dev_t dev, const struct ggml_tensor * op) {
    switch (op->op) {
        case GGML_OP_NONE:
        case GGML_OP_RESHAPE:
        case GGML_OP_VIEW:
        case GGML_OP_PERMUTE:
        case GGML_OP_TRANSPOSE:
            // llama checks that pre-allocated tensors in PI2 buffers can be used "by" PI2
            return pi2_is_own_buffer(dev, op) || (op->view_src != NULL && pi2_is_own_buffer(dev, op->view_src));
        case GGML_OP_MUL_MAT:
            return pi2_supports_ffn_mul_mat(dev, op);
        case GGML_OP_GLU:
            return pi2_supports_ffn_glu(dev, op);
        default:
            return false;
    }
}

static bool pi2_device_supports_buft(ggml_backend_dev_t dev, ggml_backend_buffer_type_t buft) {
    return ggml_backend_buft_is_host(buft);
    GGML_UNUSED(dev);
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

static struct pi2_device_ctx * pi2_device_ctx(void) {
    return &pi2_dev_ctx;
}

ggml_backend_reg_t ggml_backend_pi2_reg(void) {
    if (pi2_reg.iface.get_name == NULL) {
        pi2_glu_tables_init(&pi2_dev_ctx.glu);
        pi2_dev_ctx.buft = (struct ggml_backend_buffer_type) {
            /* .iface   = */ pi2_buft_i,
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

void pi2_counters_read(struct pi2_counters * out) {
    // counters are atomically incremented; a snapshot may straddle one node, which readers tolerate
    memcpy(out, &pi2_device_ctx()->counters, sizeof(*out));
}

void pi2_counters_reset(void) {
    memset(&pi2_device_ctx()->counters, 0, sizeof(struct pi2_counters));
}

size_t pi2_counters_size(void) {
    return sizeof(struct pi2_counters);
}

const char * pi2_build_info(void) {
    return "pi2 " PI2_VERSION "; ggml api " PI2_STR(GGML_BACKEND_API_VERSION) "; llama-cpp-python " PI2_LLAMA_CPP_PYTHON_VERSION;
}

static int pi2_score(void) {
    return 1;
}

GGML_BACKEND_DL_IMPL(ggml_backend_pi2_reg)
GGML_BACKEND_DL_SCORE_IMPL(pi2_score)
