// Fuzz target: the sidecar reader. Each input is a candidate <model>.pi2.gguf handed to
// pi2_sidecar_open (sidecar.c, through gguf_file.c and ggml's GGUF reader). A sidecar it accepts must
// satisfy what decode relies on without further checks (every bundle slot inside the file, the small
// tensors as long as their shapes say, order a permutation); each array's last element is read so that
// ASan sees a buffer shorter than its shape. Then pi2_sidecar_check_tensor runs on every layer and
// matrix (bytes from the input) and on indices out of range.
#include <stdbool.h>
#include <stdint.h>

#include "fuzz_common.h"
#include "model/sidecar.h"
#include "model/sidecar_format.h"

#define FUZZ_CHECK_MAX (1u << 20) // bytes of weight data handed to pi2_sidecar_check_tensor at most

static uint8_t fuzz_weights[FUZZ_CHECK_MAX];

int LLVMFuzzerInitialize(int * argc, char *** argv) {
    (void) argc;
    (void) argv;
    fuzz_init();
    return 0;
}

static void fuzz_check_layer(const struct pi2_sidecar * sc, const struct pi2_sidecar_layer * L) {
    FUZZ_ASSERT(L->n_ff >= 1 && L->rank >= 1 && L->hot_count <= L->n_ff);
    FUZZ_ASSERT(L->bundle_neurons >= 1 && L->bundle_neurons <= PI2_MAX_BUNDLE_NEURONS);
    FUZZ_ASSERT((uint64_t) L->n_bundles * L->bundle_neurons >= L->n_ff);
    FUZZ_ASSERT(L->neuron_stride >= L->data_end && L->data_end > L->down_offset && L->down_offset > L->up_offset);
    FUZZ_ASSERT((uint64_t) L->bundle_size >= (uint64_t) L->bundle_neurons * L->neuron_stride);
    FUZZ_ASSERT(L->bundles_offset % PI2_BUNDLE_ALIGN == 0);
    const uint64_t bundles_bytes = (uint64_t) L->n_bundles * L->bundle_size;
    FUZZ_ASSERT(L->bundles_offset <= sc->file_size && bundles_bytes <= sc->file_size - L->bundles_offset);
    // the last slot's parts end within the bundles tensor
    FUZZ_ASSERT(pi2_slot_offset(L, (int64_t) L->n_ff - 1) + L->data_end <= bundles_bytes);

    // the predictor's F16 weights stay in the file until a binding keeps them (sidecar.h): within it
    const uint64_t w1_bytes = (uint64_t) sc->n_embd * L->rank * 2, w2_bytes = (uint64_t) L->rank * L->n_ff * 2;
    FUZZ_ASSERT(L->pred_w1 == NULL && L->pred_w2 == NULL);
    FUZZ_ASSERT(L->pred_w1_offset <= sc->file_size && w1_bytes <= sc->file_size - L->pred_w1_offset);
    FUZZ_ASSERT(L->pred_w2_offset <= sc->file_size && w2_bytes <= sc->file_size - L->pred_w2_offset);
    volatile float sink = 0.0f;
    sink += L->pred_b1[L->rank - 1];
    sink += L->pred_b2[L->n_ff - 1];
    sink += L->freq[L->n_ff - 1];
    (void) sink;

    // order is a permutation of 0..n_ff-1
    uint8_t * seen = calloc(L->n_ff, 1);
    FUZZ_ASSERT(seen != NULL);
    for (uint32_t j = 0; j < L->n_ff; ++j) {
        const int32_t i = L->order[j];
        FUZZ_ASSERT(i >= 0 && (uint32_t) i < L->n_ff && !seen[i]);
        seen[i] = 1;
    }
    free(seen);
}

int LLVMFuzzerTestOneInput(const uint8_t * data, size_t size) {
    const char * path = fuzz_file(data, size);
    char err[512];
    struct pi2_sidecar * sc = NULL;
    if (pi2_sidecar_open(path, &sc, err, sizeof(err)) != 0) {
        FUZZ_ASSERT(sc == NULL);
        fuzz_check_err(err, sizeof(err));
        return 0;
    }
    FUZZ_ASSERT(sc->n_layer >= 1 && sc->n_embd >= 1 && sc->file_size == size);
    FUZZ_ASSERT(sc->activation.kind < PI2_ACT_COUNT && sc->source_arch != NULL && sc->source_name != NULL);
    for (uint32_t il = 0; il < sc->n_layer; ++il) {
        fuzz_check_layer(sc, &sc->layer[il]);
    }

    // the fingerprint check on weights of the shapes the sidecar states (bytes from the input, capped)
    const size_t n = size < FUZZ_CHECK_MAX ? size : FUZZ_CHECK_MAX;
    memcpy(fuzz_weights, data, n);
    const uint32_t layers = sc->n_layer < 4 ? sc->n_layer : 4;
    for (uint32_t il = 0; il < layers; ++il) {
        for (int m = 0; m < PI2_N_MATRIX; ++m) {
            const int64_t ne0 = m == PI2_MATRIX_DOWN ? sc->layer[il].n_ff : sc->n_embd;
            const int64_t ne1 = m == PI2_MATRIX_DOWN ? sc->n_embd : sc->layer[il].n_ff;
            const size_t full = ggml_row_size(GGML_TYPE_F16, ne0) * (size_t) ne1;
            const size_t nbytes = full < FUZZ_CHECK_MAX ? full : FUZZ_CHECK_MAX;
            if (pi2_sidecar_check_tensor(sc, (int) il, m, GGML_TYPE_F16, ne0, ne1, fuzz_weights, nbytes, err, sizeof(err)) != 0) {
                fuzz_check_err(err, sizeof(err));
            }
            // a shape that is not the sidecar's is refused
            FUZZ_ASSERT(pi2_sidecar_check_tensor(sc, (int) il, m, GGML_TYPE_F16, ne0 + 1, ne1, fuzz_weights, nbytes, err,
                                                 sizeof(err)) != 0);
            fuzz_check_err(err, sizeof(err));
        }
    }
    FUZZ_ASSERT(pi2_sidecar_check_tensor(sc, -1, 0, GGML_TYPE_F16, 1, 1, fuzz_weights, 2, err, sizeof(err)) != 0);
    FUZZ_ASSERT(pi2_sidecar_check_tensor(sc, (int) sc->n_layer, 0, GGML_TYPE_F16, 1, 1, fuzz_weights, 2, err, sizeof(err)) != 0);
    FUZZ_ASSERT(pi2_sidecar_check_tensor(sc, 0, PI2_N_MATRIX, GGML_TYPE_F16, 1, 1, fuzz_weights, 2, err, sizeof(err)) != 0);
    fuzz_check_err(err, sizeof(err));
    pi2_sidecar_free(sc);
    return 0;
}
