// MAP_POPULATE is a Linux mmap flag outside POSIX
#define _DEFAULT_SOURCE
#include "model_binding.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#if defined(__GLIBC__)
#include <malloc.h>
#endif
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "column_axpy.h"
#include "pi2_log.h"

static void pi2_binding_destroy(struct pi2_binding * b) {
    pi2_cache_free(b->cache);
    pi2_embedding_free(b->embd);
    pthread_mutex_destroy(&b->cache_lock);
    if (b->layer != NULL) {
        for (uint32_t il = 0; il < b->sc->n_layer; ++il) {
            free(b->layer[il].w1);
            free(b->layer[il].w2);
            free(b->layer[il].b2_slot);
            free(b->layer[il].slot_of);
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

static int pi2_prepare_layer(struct pi2_binding * b, uint32_t il, bool keep_predictor, char * err, size_t errlen) {
    struct pi2_sidecar_layer * L = &b->sc->layer[il];
    struct pi2_binding_layer * B = &b->layer[il];
    // the reader checked that the bundles lie inside the file it read; the mapping is that file
    if (!b->flash && L->bundles_offset + (uint64_t) L->n_bundles * L->bundle_size > b->map_size) {
        snprintf(err, errlen, "sidecar %s: layer %u bundles end past the file (changed since it was read?)", b->sc->path, il);
        return -1;
    }
    if (!pi2_column_type_usable(L->down_type)) {
        snprintf(err, errlen, "sidecar %s: layer %u down columns are %s, which this build cannot dequantize",
                 b->sc->path, il, ggml_type_name(L->down_type));
        return -1;
    }
    B->bundles = b->flash ? NULL : b->map + L->bundles_offset;
    if (!b->flash) {
        B->slot_of = malloc((size_t) L->n_ff * sizeof(int32_t));
        if (B->slot_of == NULL) {
            snprintf(err, errlen, "sidecar %s: out of memory for layer %u", b->sc->path, il);
            return -1;
        }
        for (uint32_t j = 0; j < L->n_ff; ++j) {
            B->slot_of[L->order[j]] = (int32_t) j; // a permutation: the reader checked it
        }
    }
    atomic_init(&B->verified, 0);
    for (int m = 0; m < PI2_N_MATRIX; ++m) {
        atomic_init(&B->uploaded[m], 0);
    }
    const uint32_t n_embd = b->sc->n_embd;
    B->pred_type = (n_embd % 32 == 0 && L->rank % 32 == 0) ? GGML_TYPE_Q8_0 : GGML_TYPE_F16;
    B->w1_stride = ggml_row_size(B->pred_type, n_embd);
    B->w2_type   = L->n_ff % 32 == 0 ? GGML_TYPE_Q8_0 : GGML_TYPE_F16;
    B->w2_stride = ggml_row_size(B->w2_type, L->n_ff);
    // all of w2 counted, though only the rows of non-zero hidden units are read: a bound that holds
    const double pred_bytes = (double) L->rank * B->w1_stride + (double) L->rank * B->w2_stride;
    const double gate_bytes = (double) L->n_ff * ggml_row_size(L->gate_type, b->sc->n_embd);
    B->use_predictor = pred_bytes < (1.0 - L->pred_density) * gate_bytes;
    if (b->flash && !B->use_predictor && !keep_predictor) {
        // under a budget every byte kept is a byte less of neuron cache (61 MB of them on Qwen2.5-1.5B)
        free(L->pred_w1);
        free(L->pred_w2);
        L->pred_w1 = NULL;
        L->pred_w2 = NULL;
        return 0;
    }
    B->w1      = malloc((size_t) L->rank * B->w1_stride);
    B->w2      = malloc((size_t) L->rank * B->w2_stride);
    B->b2_slot = malloc((size_t) L->n_ff * sizeof(float));
    float * row = malloc((size_t) (n_embd > L->n_ff ? n_embd : L->n_ff) * sizeof(float));
    if (B->w1 == NULL || B->w2 == NULL || B->b2_slot == NULL || row == NULL) {
        free(row);
        snprintf(err, errlen, "sidecar %s: out of memory for layer %u predictor", b->sc->path, il);
        return -1;
    }
    for (uint32_t j = 0; j < L->rank; ++j) {
        ggml_fp16_to_fp32_row(L->pred_w1 + (size_t) j * n_embd, row, n_embd);
        pi2_store_row(B->pred_type, row, B->w1 + (size_t) j * B->w1_stride, n_embd);
    }
    for (uint32_t k = 0; k < L->rank; ++k) { // the sidecar's w2 is [n_ff][rank] in neuron order
        for (uint32_t j = 0; j < L->n_ff; ++j) {
            row[j] = ggml_fp16_to_fp32(L->pred_w2[(size_t) L->order[j] * L->rank + k]); // order: a permutation
        }
        pi2_store_row(B->w2_type, row, B->w2 + (size_t) k * B->w2_stride, L->n_ff);
    }
    for (uint32_t j = 0; j < L->n_ff; ++j) {
        B->b2_slot[j] = L->pred_b2[L->order[j]];
    }
    free(row);
    // the converted copies replace the F16 ones for the binding's life (113 MB on Qwen2.5-1.5B)
    free(L->pred_w1);
    free(L->pred_w2);
    L->pred_w1 = NULL;
    L->pred_w2 = NULL;
    b->fixed_bytes += (uint64_t) L->rank * (B->w1_stride + B->w2_stride) + (uint64_t) L->n_ff * sizeof(float);
    return 0;
}

struct pi2_binding * pi2_binding_create(int id, const char * sidecar_path, enum pi2_mode mode, bool flash, const char * model_path,
                                        bool keep_predictors, char * err, size_t errlen) {
    struct pi2_binding * b = calloc(1, sizeof(*b));
    if (b == NULL) {
        snprintf(err, errlen, "sidecar %s: out of memory", sidecar_path);
        return NULL;
    }
    b->id = id;
    atomic_init(&b->refs, 1);
    atomic_init(&b->mode, mode);
    atomic_init(&b->check_recall, 0);
    pthread_mutex_init(&b->cache_lock, NULL);
    b->flash      = flash;
    atomic_init(&b->uploading, false);
#if defined(__GLIBC__)
    if (flash) {
        // The cache is sized from what is resident once the model is loaded. glibc's mmap threshold
        // adapts to what was freed, so llama's compute buffers sometimes reused heap that loading had
        // touched (resident, and reserved again as compute buffers) and sometimes came fresh from mmap:
        // the same 600 MB budget gave Qwen 1.5B a cache of 62 or 105 MB from one load to the next. A
        // fixed threshold makes every large block a fresh mapping, returned to the system when freed.
        // Set before the layers are prepared: their freed predictor copies would already raise the
        // threshold (set after them instead, six loads all got a 38 MB hot segment instead of 85 MB).
        mallopt(M_MMAP_THRESHOLD, 1 << 20);
    }
#endif
    // queue depth: DESIGN.md measured 4 KiB reads ~10k/s one at a time, 50-80k/s at depth 16-32; 32
    // threads measured 3-12% faster decode than 8 here (ReLU 1.5B at 600 MB, 4.2 GB model at 2.1 GB)
    const char * io = getenv("PI2_IO_THREADS");
    b->io_threads = io != NULL && atoi(io) > 0 ? atoi(io) : 32;
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
    if (!flash && pi2_map_file(b, err, errlen) != 0) {
        pi2_binding_destroy(b);
        return NULL;
    }
    for (uint32_t il = 0; il < b->sc->n_layer; ++il) {
        if (pi2_prepare_layer(b, il, keep_predictors, err, errlen) != 0) {
            pi2_binding_destroy(b);
            return NULL;
        }
    }
    if (flash && model_path != NULL && pi2_embedding_open(model_path, &b->embd, err, errlen) < 0) {
        pi2_binding_destroy(b);
        return NULL;
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
    if (b->flash) { // the weights were checked as llama uploaded them (pi2_binding_check_upload)
        for (int m = 0; m < PI2_N_MATRIX; ++m) {
            const int up = atomic_load(&B->uploaded[m]);
            if (up == 0) {
                snprintf(b->error, sizeof(b->error), "sidecar %s: weight %s was not uploaded whole, so it could not be "
                         "checked against the sidecar", b->sc->path, w[m]->name);
            }
            if (up <= 0) {
                atomic_store(&B->verified, -1);
                return false;
            }
        }
        atomic_store(&B->verified, 1);
        return true;
    }
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

void pi2_binding_check_upload(struct pi2_binding * b, int layer, int matrix, const struct ggml_tensor * w, const void * data,
                              size_t nbytes) {
    if (layer < 0 || (uint32_t) layer >= b->sc->n_layer) {
        snprintf(b->error, sizeof(b->error), "sidecar %s has %u layers, but the model has a layer %d: "
                 "the sidecar was made for another model", b->sc->path, b->sc->n_layer, layer);
        return; // verify_layer refuses the layer at the first compute
    }
    atomic_store(&b->uploading, true);
    char err[sizeof(b->error)];
    struct pi2_binding_layer * B = &b->layer[layer];
    if (nbytes != ggml_nbytes(w)) {
        snprintf(b->error, sizeof(b->error), "sidecar %s: weight %s was uploaded in parts, which a memory budget "
                 "cannot check", b->sc->path, w->name);
        atomic_store(&B->uploaded[matrix], 0);
        return;
    }
    if (pi2_sidecar_check_tensor(b->sc, layer, matrix, w->type, w->ne[0], w->ne[1], data, nbytes, err, sizeof(err)) != 0) {
        memcpy(b->error, err, sizeof(err));
        atomic_store(&B->uploaded[matrix], -1);
        return;
    }
    atomic_store(&B->uploaded[matrix], 1);
}

uint64_t pi2_resident_bytes(void) {
#if defined(__GLIBC__)
    // freed heap (the predictors a flash binding dropped, loading's temporaries) stays resident until
    // trimmed: without this the cache got 61 or 95 MB of the same 600 MB budget from one load to the next
    malloc_trim(0);
#endif
    FILE * f = fopen("/proc/self/statm", "r");
    if (f == NULL) {
        return 0;
    }
    unsigned long long size = 0, resident = 0;
    const int n = fscanf(f, "%llu %llu", &size, &resident);
    fclose(f);
    const long page = sysconf(_SC_PAGESIZE);
    return n == 2 && page > 0 ? (uint64_t) resident * (uint64_t) page : 0;
}

static double pi2_mb(uint64_t v) {
    return (double) v / 1e6;
}

bool pi2_binding_layer_predicted(const struct pi2_binding * b, int layer, int mode, bool predictor_always) {
    const struct pi2_binding_layer * B = &b->layer[layer];
    return mode == PI2_MODE_PREDICTED && B->w1 != NULL && (B->use_predictor || predictor_always);
}

// Cold room for prefetching the next layer's first bundles while a layer finishes (PI2_PREFETCH_BYTES,
// default 8 MiB: ~3 ms of this disk, the time a Qwen2.5-1.5B layer's tail and attention leave it idle),
// where some layer reads every bundle in predicted mode; sparse layers do not know their bundles early.
static uint64_t pi2_prefetch_bytes(const struct pi2_binding * b) {
    const char * v = getenv("PI2_PREFETCH_BYTES");
    const uint64_t bytes = v != NULL ? strtoull(v, NULL, 10) : 8u << 20;
    for (uint32_t il = 0; il < b->sc->n_layer; ++il) {
        if (!pi2_binding_layer_predicted(b, (int) il, PI2_MODE_PREDICTED, false)) {
            return bytes;
        }
    }
    return 0;
}

int pi2_binding_size_cache(struct pi2_binding * b, uint64_t budget, uint64_t reserved, char * err, size_t errlen) {
    if (!b->flash) {
        snprintf(err, errlen, "sidecar %s: the model was loaded without a memory budget", b->sc->path);
        return -1;
    }
    pthread_mutex_lock(&b->cache_lock);
    if (b->cache != NULL) { // a new budget replaces the cache (its hot segment is read again)
        pi2_cache_free(b->cache);
        b->cache = NULL;
    }
    const uint64_t resident = pi2_resident_bytes();
    const uint64_t overhead = pi2_cache_overhead_bytes(b->sc) + PI2_BUDGET_MARGIN;
    const uint64_t min_cache = pi2_cache_min_bytes(b->sc);
    const uint64_t fixed = resident + reserved + overhead;
    if (resident == 0 || budget < fixed + min_cache) {
        snprintf(err, errlen, "memory budget %.0f MB is too small for this model: it needs at least %.0f MB "
                 "(resident now %.0f MB: llama.cpp's weights and KV cache, the predictors %.0f MB, the runtime; "
                 "compute buffers %.0f MB; neuron cache at least %.0f MB, one layer's bundles; tables and margin %.0f MB)",
                 pi2_mb(budget), pi2_mb(fixed + min_cache), pi2_mb(resident), pi2_mb(b->fixed_bytes), pi2_mb(reserved),
                 pi2_mb(min_cache), pi2_mb(overhead));
        pthread_mutex_unlock(&b->cache_lock);
        return -1;
    }
    uint64_t cache_bytes = budget - fixed;
    // PI2_CACHE_MAX caps the cache below what the budget allows: a smaller device's cache on this one
    const char * cap = getenv("PI2_CACHE_MAX");
    if (cap != NULL && strtoull(cap, NULL, 10) > 0) {
        const uint64_t v = strtoull(cap, NULL, 10);
        cache_bytes = v < min_cache ? min_cache : (v < cache_bytes ? v : cache_bytes);
    }
    struct pi2_cache_plan plan;
    if (!pi2_cache_plan(b->sc, cache_bytes, pi2_prefetch_bytes(b), &plan)) {
        snprintf(err, errlen, "sidecar %s: cannot plan a neuron cache of %.0f MB", b->sc->path, pi2_mb(cache_bytes));
        pthread_mutex_unlock(&b->cache_lock);
        return -1;
    }
    b->cache = pi2_cache_create(b->sc, &plan, b->io_threads, err, errlen);
    b->ffn_ns = 0;
    pthread_mutex_unlock(&b->cache_lock);
    return b->cache != NULL ? 0 : -1;
}
