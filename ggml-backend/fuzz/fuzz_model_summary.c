// Fuzz target: the model-file summary. Each input is a candidate model GGUF handed to pi2_model_summary
// (model_file.c, through gguf_file.c and ggml's GGUF reader): the header, the gated FFN layers and their
// shapes, the fingerprint's samples read from the tensor data, the stated activation
// (<arch>.ffn_activation and its threshold). A summary it returns must be consistent with the file.
#include <math.h>
#include <stdint.h>

#include "fuzz_common.h"
#include "ggml-pi2.h"

int LLVMFuzzerInitialize(int * argc, char *** argv) {
    (void) argc;
    (void) argv;
    fuzz_init();
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t * data, size_t size) {
    const char * path = fuzz_file(data, size);
    char err[512];
    struct pi2_model_summary s;
    if (pi2_model_summary(path, &s, err, sizeof(err)) != 0) {
        fuzz_check_err(err, sizeof(err));
        return 0;
    }
    FUZZ_ASSERT(s.file_size == size && s.n_tensors >= 0);
    FUZZ_ASSERT(s.n_layer <= PI2_MAX_LAYERS && (uint64_t) s.n_tensors >= 3ull * s.n_layer + (s.embedding_bytes > 0 ? 2 : 0));
    // distinct tensors of the file, which ggml's reader lays out one after the other
    FUZZ_ASSERT(s.ffn_bytes <= s.file_size && s.embedding_bytes <= s.file_size - s.ffn_bytes);
    FUZZ_ASSERT(s.n_layer > 0 || (s.fingerprint == 0 && s.ffn_bytes == 0));
    FUZZ_ASSERT(s.activation >= -1 && s.activation <= 5);
    FUZZ_ASSERT(isfinite(s.activation_threshold) && s.activation_threshold >= 0.0f);
    FUZZ_ASSERT(s.activation == 5 || s.activation_threshold == 0.0f);
    return 0;
}
