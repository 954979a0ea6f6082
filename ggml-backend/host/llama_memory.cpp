// Host-side helper, not part of the backend: what llama.cpp allocated for a context (model weights, context
// memory such as the KV cache, compute buffers), in bytes, as llama.cpp itself reports it through
// llama_get_memory_breakdown. That function is llama.cpp's staging C++ API (src/llama-ext.h, used by its own
// common/fit.cpp) and returns a std::map, which ctypes cannot call; this file is the C entry point for it, so a
// memory budget reads llama's compute buffers from llama.cpp instead of scraping its log.
//
// The caller passes the function's address as the loaded libllama exports it, so this library links to no
// llama.cpp library and always asks the copy the process runs (a wheel ships several copies of each library).
#include <cstdint>
#include <exception>
#include <type_traits>

#include "llama-ext.h"

using pi2_breakdown_fn = llama_memory_breakdown (*)(const struct llama_context *);
// the caller's address is taken for this signature; a llama.cpp whose header says otherwise fails to build here
static_assert(std::is_same<decltype(&llama_get_memory_breakdown), pi2_breakdown_fn>::value,
              "llama_get_memory_breakdown's signature changed: pi2_llama_memory must follow it");

extern "C" {

// One buffer type's bytes (CPU, PI2, ...). Layout shared with pi2_gguf/runtime/llama_memory.py (_Entry).
struct pi2_llama_memory {
    const void * buft;  // ggml_backend_buffer_type_t: its name is ggml_backend_buft_name's
    uint64_t     model;    // weight buffers by their size (a PI2 flash buffer's size, not what of it is resident)
    uint64_t     context;  // KV cache and other per-context memory
    uint64_t     compute;  // compute buffers its scheduler reserved
};

// Fills out[0 .. n) with one entry a buffer type and returns how many there are (more than max: only max
// filled); -1 for a null argument, -2 if llama.cpp threw.
__attribute__((visibility("default")))
int pi2_llama_memory_get(void * breakdown_fn, const struct llama_context * ctx, struct pi2_llama_memory * out, int max) {
    if (breakdown_fn == nullptr || ctx == nullptr || (out == nullptr && max > 0) || max < 0) {
        return -1;
    }
    try {
        const llama_memory_breakdown mb = reinterpret_cast<pi2_breakdown_fn>(breakdown_fn)(ctx);
        int n = 0;
        for (const auto & kv : mb) {
            if (n < max) {
                out[n] = {kv.first, kv.second.model, kv.second.context, kv.second.compute};
            }
            ++n;
        }
        return n;
    } catch (const std::exception &) {
        return -2;
    }
}

}  // extern "C"
