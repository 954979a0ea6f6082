// MAP_ANONYMOUS and MAP_NORESERVE are outside POSIX
#define _DEFAULT_SOURCE
#include "flash/flash_buffer.h"

#include <errno.h>
#include <stdatomic.h>
#include <string.h>
#include <sys/mman.h>

#include "core/pi2_log.h"
#include "flash/embedding_rows.h"
#include "flash/output_rows.h"
#include "graph/ffn_names.h"
#include "model/model_binding.h"

void * pi2_flash_reserve(size_t size, size_t * reserved) {
    *reserved = size > 0 ? (size + 4095) & ~(size_t) 4095 : 0;
    if (*reserved == 0) {
        return NULL;
    }
    void * data = mmap(NULL, *reserved, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (data == MAP_FAILED) {
        PI2_LOG_ERROR("pi2: cannot reserve %zu bytes of address space: %s\n", *reserved, strerror(errno));
        return NULL;
    }
    return data;
}

void pi2_flash_release(void * data, size_t reserved) {
    if (data != NULL && munmap(data, reserved) != 0) {
        PI2_LOG_ERROR("pi2: munmap of a flash weight buffer failed: %s\n", strerror(errno));
    }
}

// flash: llama uploads an FFN weight; it is checked against the sidecar (which holds its bytes as
// bundles) and not kept
void pi2_flash_set_tensor(const struct pi2_buffer_ctx * bc, struct ggml_tensor * tensor, const void * data, size_t offset,
                                 size_t size) {
    int layer = -1;
    enum pi2_matrix m;
    // a tied embedding under PI2_OUTPUT_ROWS: the output MUL_MAT multiplies by the same tensor (llama reuses the table
    // for its duplicate where both are placed in this buffer type), and the output shares the embedding's table
    // (pi2_output_share_embedding), so the output's upload below checks it once and makes the copy
    const bool tied_rows = bc->binding != NULL && bc->binding->output != NULL &&
                           bc->binding->output->table == bc->binding->embd &&
                           pi2_binding_setting(bc->binding, PI2_SET_OUTPUT_ROWS) > 0;
    if (bc->binding != NULL && !tied_rows && pi2_embedding_matches(bc->binding->embd, tensor)) {
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
    bool fused = false;
    if (bc->binding != NULL && bc->binding->sc->n_expert > 0 && pi2_expert_weight_parse_fused(tensor->name, &layer, &m, &fused)) {
        // routed experts: each expert's slice is one sidecar layer (FORMAT.md, "MoE sidecars"); of ffn_gate_up_exps
        // each slice holds the expert's gate rows, then its up rows, checked as its gate and up
        const int64_t n_expert = tensor->ne[2];
        const size_t  slice    = tensor->nb[2];
        const int     parts    = fused ? 2 : 1;
        const bool    whole    = offset == 0 && size == ggml_nbytes(tensor);
        for (int64_t e = 0; e < n_expert; ++e) {
            const struct pi2_sidecar * sc = bc->binding->sc;
            const int sl = n_expert == (int64_t) sc->n_expert ? pi2_sidecar_expert_layer(sc, layer, e) : -1;
            for (int k = 0; k < parts; ++k) {
                struct ggml_tensor one = *tensor;
                one.ne[1] /= parts;
                one.ne[2] = 1;
                one.nb[2] = one.nb[3] = slice / (size_t) parts;
                pi2_binding_check_upload(bc->binding, sl, fused ? (k == 0 ? PI2_MATRIX_GATE : PI2_MATRIX_UP) : m, &one,
                                         (const char *) data + (size_t) e * slice + (size_t) k * (slice / (size_t) parts),
                                         whole ? slice / (size_t) parts : 0);
            }
        }
        return;
    }
    if (bc->binding == NULL || !pi2_ffn_weight_parse(tensor->name, &layer, &m)) {
        PI2_LOG_ERROR("pi2: tensor %s cannot be held by a flash weight buffer (only FFN weights live on flash)\n", tensor->name);
        return;
    }
    const int sl = pi2_sidecar_dense_layer(bc->binding->sc, layer);
    if (sl >= 0 && m == PI2_MATRIX_UP && tensor->ne[1] == 2 * (int64_t) bc->binding->sc->layer[sl].n_ff) {
        // a fused gate+up (phi3's ffn_up): the gate's rows, then the up's, each checked as the sidecar's
        const size_t half = ggml_nbytes(tensor) / 2;
        const bool whole = offset == 0 && size == ggml_nbytes(tensor);
        for (int k = 0; k < 2; ++k) {
            struct ggml_tensor one = *tensor;
            one.ne[1] = tensor->ne[1] / 2;
            one.nb[2] = one.nb[3] = half;
            pi2_binding_check_upload(bc->binding, sl, k == 0 ? PI2_MATRIX_GATE : PI2_MATRIX_UP, &one,
                                     (const char *) data + (size_t) k * half, whole ? half : 0);
        }
        return;
    }
    pi2_binding_check_upload(bc->binding, sl, m, tensor, data, offset == 0 ? size : 0);
}
