// PI2's weight buffers as the engine sees them: the model binding and FFN activation a buffer was allocated under
// (the load pending then, binding_registry.c), and from a weight tensor, the model it belongs to. The glue
// (ggml-pi2.c) owns the buffer interfaces; a flash buffer's memory and uploads are flash/flash_buffer.c's.
#pragma once

#include <stdbool.h>
#include <stddef.h>

#include "core/config.h"
#include "graph/activation.h"
#include "ggml-backend-impl.h"

struct pi2_binding;


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

// the context of a new buffer over data (owned, or llama's mapping of the model file), bound to the pending model
// load; NULL (logged) when the configuration is in error or the load's binding cannot be prepared
struct pi2_buffer_ctx * pi2_buffer_ctx_new(void * data, bool owned);
void pi2_buffer_ctx_free(struct pi2_buffer_ctx * bc);

// the model being loaded keeps its FFN on flash (a memory budget); before_upload: and llama has not begun
// uploading its weights (the buffers allocated after are a context's compute buffers, real memory)
bool pi2_pending_load_flash(bool before_upload);
// buft is one of PI2's buffer types (in RAM, or flash)
bool pi2_is_pi2_buft(ggml_backend_buffer_type_t buft);
// the binding of the model weight w belongs to, NULL for a model without a sidecar or a weight not in PI2
struct pi2_binding * pi2_weight_binding(const struct ggml_tensor * w);
// the FFN activation the model of weight w states; llama's placement probe asks with a zero-size buffer,
// which has no context: the pending load's
struct pi2_stated_act pi2_weight_act(const struct ggml_tensor * w);

// Once per process, at the first load outside pi2_load_begin/end (llama.cpp's tools; pi2_gguf says it itself):
// that PI2 is active and what PI2_* made of it (d->lock held).
struct pi2_device_ctx;
void pi2_announce_once(struct pi2_device_ctx * d);
