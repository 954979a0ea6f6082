// MAP_POPULATE is a Linux mmap flag outside POSIX
#define _DEFAULT_SOURCE
#include "model_binding.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "column_axpy.h"
#include "pi2_log.h"

static void pi2_binding_destroy(struct pi2_binding * b) {
    if (b->layer != NULL) {
        for (uint32_t il = 0; il < b->sc->n_layer; ++il) {
            free(b->layer[il].w1);
            free(b->layer[il].w2);
            free(b->layer[il].b2_slot);
        }
    }
    free(b->layer);
    if (b->map != NULL && munmap((void *) b->map, b->map_size) != 0) {
        PI2_LOG_ERROR("pi2: munmap of sidecar %s failed: %s\n", b->sc->path, strerror(errno));
    }
    pi2_sidecar_free(b->sc);
    free(b);
}

static int pi2_map_file(struct pi2_binding * b, char * err, size_t errlen) {
    const int fd = open(b->sc->path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        snprintf(err, errlen, "sidecar %s: cannot open: %s", b->sc->path, strerror(errno));
        return -1;
    }
    // all in RAM: populate now so the first decoded token does not pay for page faults
    void * p = mmap(NULL, b->sc->file_size, PROT_READ, MAP_SHARED | MAP_POPULATE, fd, 0);
    const int map_errno = errno;
    close(fd);
    if (p == MAP_FAILED) {
        snprintf(err, errlen, "sidecar %s: cannot map %llu bytes: %s", b->sc->path,
                 (unsigned long long) b->sc->file_size, strerror(map_errno));
        return -1;
    }
    b->map      = p;
    b->map_size = b->sc->file_size;
    return 0;
}

static void pi2_store_row(enum ggml_type t, const float * src, char * dst, int64_t n) {
    if (t == GGML_TYPE_F16) {
        ggml_fp32_to_fp16_row(src, (ggml_fp16_t *) dst, n);
    } else {
        ggml_quantize_chunk(t, src, dst, 0, 1, n, NULL);
    }
}

static int pi2_prepare_layer(struct pi2_binding * b, uint32_t il, char * err, size_t errlen) {
    struct pi2_sidecar_layer * L = &b->sc->layer[il];
    struct pi2_binding_layer * B = &b->layer[il];
    // the reader checked that the bundles lie inside the file it read; the mapping is that file
    if (L->bundles_offset + (uint64_t) L->n_ff * L->bundle_size > b->map_size) {
        snprintf(err, errlen, "sidecar %s: layer %u bundles end past the file (changed since it was read?)", b->sc->path, il);
        return -1;
    }
    if (!pi2_column_type_usable(L->down_type)) {
        snprintf(err, errlen, "sidecar %s: layer %u down columns are %s, which this build cannot dequantize",
                 b->sc->path, il, ggml_type_name(L->down_type));
        return -1;
    }
    B->bundles = b->map + L->bundles_offset;
    const uint32_t n_embd = b->sc->n_embd;
    B->pred_type = (n_embd % 32 == 0 && L->rank % 32 == 0) ? GGML_TYPE_Q8_0 : GGML_TYPE_F16;
    B->w1_stride = ggml_row_size(B->pred_type, n_embd);
    B->w2_stride = ggml_row_size(B->pred_type, L->rank);
    B->w1      = malloc((size_t) L->rank * B->w1_stride);
    B->w2      = malloc((size_t) L->n_ff * B->w2_stride);
    B->b2_slot = malloc((size_t) L->n_ff * sizeof(float));
    float * row = malloc((size_t) (n_embd > L->rank ? n_embd : L->rank) * sizeof(float));
    if (B->w1 == NULL || B->w2 == NULL || B->b2_slot == NULL || row == NULL) {
        free(row);
        snprintf(err, errlen, "sidecar %s: out of memory for layer %u predictor", b->sc->path, il);
        return -1;
    }
    for (uint32_t j = 0; j < L->rank; ++j) {
        ggml_fp16_to_fp32_row(L->pred_w1 + (size_t) j * n_embd, row, n_embd);
        pi2_store_row(B->pred_type, row, B->w1 + (size_t) j * B->w1_stride, n_embd);
    }
    for (uint32_t j = 0; j < L->n_ff; ++j) {
        const int32_t i = L->order[j]; // a permutation: the reader checked it
        ggml_fp16_to_fp32_row(L->pred_w2 + (size_t) i * L->rank, row, L->rank);
        pi2_store_row(B->pred_type, row, B->w2 + (size_t) j * B->w2_stride, L->rank);
        B->b2_slot[j] = L->pred_b2[i];
    }
    free(row);
    // the converted copies replace the F16 ones for the binding's life (113 MB on Qwen2.5-1.5B)
    free(L->pred_w1);
    free(L->pred_w2);
    L->pred_w1 = NULL;
    L->pred_w2 = NULL;
    atomic_init(&B->verified, 0);
    const double pred_bytes = (double) L->rank * B->w1_stride + (double) L->n_ff * B->w2_stride;
    const double gate_bytes = (double) L->n_ff * ggml_row_size(L->gate_type, b->sc->n_embd);
    B->use_predictor = pred_bytes < (1.0 - L->pred_density) * gate_bytes;
    return 0;
}

struct pi2_binding * pi2_binding_create(int id, const char * sidecar_path, enum pi2_mode mode, char * err, size_t errlen) {
    struct pi2_binding * b = calloc(1, sizeof(*b));
    if (b == NULL) {
        snprintf(err, errlen, "sidecar %s: out of memory", sidecar_path);
        return NULL;
    }
    b->id = id;
    atomic_init(&b->refs, 1);
    atomic_init(&b->mode, mode);
    atomic_init(&b->check_recall, 0);
    if (pi2_sidecar_open(sidecar_path, &b->sc, err, errlen) != 0) {
        free(b);
        return NULL;
    }
    b->layer = calloc(b->sc->n_layer, sizeof(*b->layer));
    if (b->layer == NULL) {
        snprintf(err, errlen, "sidecar %s: out of memory", sidecar_path);
        pi2_binding_destroy(b);
        return NULL;
    }
    if (pi2_map_file(b, err, errlen) != 0) {
        pi2_binding_destroy(b);
        return NULL;
    }
    for (uint32_t il = 0; il < b->sc->n_layer; ++il) {
        if (pi2_prepare_layer(b, il, err, errlen) != 0) {
            pi2_binding_destroy(b);
            return NULL;
        }
    }
    return b;
}

void pi2_binding_ref(struct pi2_binding * b) {
    atomic_fetch_add(&b->refs, 1);
}

void pi2_binding_unref(struct pi2_binding * b) {
    if (b != NULL && atomic_fetch_sub(&b->refs, 1) == 1) {
        pi2_binding_destroy(b);
    }
}

bool pi2_binding_verify_layer(struct pi2_binding * b, int layer, const struct ggml_tensor * w_gate,
                              const struct ggml_tensor * w_up, const struct ggml_tensor * w_down) {
    if (layer < 0 || (uint32_t) layer >= b->sc->n_layer) {
        snprintf(b->error, sizeof(b->error), "sidecar %s has %u layers, but the model has a layer %d: "
                 "the sidecar was made for another model", b->sc->path, b->sc->n_layer, layer);
        return false;
    }
    struct pi2_binding_layer * B = &b->layer[layer];
    const int state = atomic_load(&B->verified);
    if (state != 0) {
        return state > 0;
    }
    const struct ggml_tensor * w[PI2_N_MATRIX] = { w_gate, w_up, w_down };
    char err[sizeof(b->error)];
    for (int m = 0; m < PI2_N_MATRIX; ++m) {
        if (pi2_sidecar_check_tensor(b->sc, layer, m, w[m]->type, w[m]->ne[0], w[m]->ne[1], w[m]->data,
                                     ggml_nbytes(w[m]), err, sizeof(err)) != 0) {
            memcpy(b->error, err, sizeof(err));
            atomic_store(&B->verified, -1);
            return false;
        }
    }
    atomic_store(&B->verified, 1);
    return true;
}

int pi2_mode_parse(const char * s) {
    if (s == NULL) {
        return -1;
    }
    if (strcmp(s, "dense") == 0) {
        return PI2_MODE_DENSE;
    }
    if (strcmp(s, "oracle") == 0) {
        return PI2_MODE_ORACLE;
    }
    if (strcmp(s, "predicted") == 0) {
        return PI2_MODE_PREDICTED;
    }
    return -1;
}
