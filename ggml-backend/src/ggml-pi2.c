// PI2 ggml backend: glue only (buffer, buffer type, backend, device and registry interfaces), in the shape
// of ggml-blas. What PI2 takes from a graph is graph/graph_claim.c, how the nodes it took run
// graph/node_dispatch.c (the route of each FFN region: graph/route.c), which model a weight buffer belongs to
// model/weight_buffer.c, a flash buffer's memory and uploads flash/flash_buffer.c; docs/ARCHITECTURE.md maps
// the rest.
#include "ggml-pi2.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/pi2_context.h"
#include "core/pi2_log.h"
#include "flash/flash_buffer.h"
#include "ggml-backend-impl.h"
#include "graph/graph_claim.h"
#include "graph/host_ggml.h"
#include "graph/node_dispatch.h"
#include "model/weight_buffer.h"

#define PI2_NAME      "PI2"
#define PI2_ALIGNMENT 64

//
// buffer interface: plain host memory, so the CPU backend reads PI2's outputs without copies
//

static void pi2_buffer_free(ggml_backend_buffer_t buffer) {
    struct pi2_buffer_ctx * bc = buffer->context;
    if (bc->flash) {
        pi2_flash_release(bc->data, bc->reserved);
    } else if (bc->owned) {
        free(bc->data);
    }
    pi2_buffer_ctx_free(bc);
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

static ggml_backend_buffer_t pi2_flash_buft_alloc_buffer(ggml_backend_buffer_type_t buft, size_t size) {
    size_t reserved = 0;
    void * data = pi2_flash_reserve(size, &reserved);
    if (data == NULL && reserved > 0) {
        return NULL;
    }
    struct pi2_buffer_ctx * bc = pi2_buffer_ctx_new(data, true);
    if (bc == NULL) {
        pi2_flash_release(data, reserved);
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

static enum ggml_status pi2_backend_graph_compute(ggml_backend_t backend, struct ggml_cgraph * cgraph) {
    struct pi2_backend_ctx * ctx = backend->context;
    pi2_count(&ctx->dev->counters.graph_computes, 1);
    const int n_nodes = ggml_graph_n_nodes(cgraph);
    for (int i = 0; i < n_nodes; i++) {
        if ((ggml_graph_node(cgraph, i)->flags & GGML_TENSOR_FLAG_COMPUTE) == 0) {
            continue;
        }
        enum ggml_status st;
        const int used = pi2_dispatch_node(ctx, cgraph, i, &st);
        if (st != GGML_STATUS_SUCCESS) {
            return st;
        }
        i += used - 1;
    }
    return GGML_STATUS_SUCCESS;
}

// Sees each graph llama schedules on PI2 before it computes (also the graphs llama reserves when a context
// is made): an FFN of a model with a sidecar that sparse decode cannot run is found here, so a model loaded
// for a memory budget is refused while it loads (pi2_binding_error), not at its first token.
static void pi2_backend_graph_optimize(ggml_backend_t backend, struct ggml_cgraph * cgraph,
                                       struct ggml_backend_graph_optimize_params * params) {
    pi2_claim_check_graph(cgraph);
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
    return pi2_pending_load_flash(true) ? &dctx->flash_buft : &dctx->buft;
}

static ggml_backend_buffer_t pi2_device_buffer_from_host_ptr(ggml_backend_dev_t dev, void * ptr, size_t size, size_t max_tensor_size) {
    if (pi2_pending_load_flash(false)) {
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

static bool pi2_device_supports_op(ggml_backend_dev_t dev, const struct ggml_tensor * op) {
    return pi2_claim_op(dev, op);
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

