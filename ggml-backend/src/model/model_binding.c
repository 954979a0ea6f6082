// MAP_POPULATE is a Linux mmap flag outside POSIX
#define _DEFAULT_SOURCE
#include "model/model_binding.h"

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

#include "flash/expert_file.h"
#include "sparse/column_axpy.h"
#include "flash/pipeline.h"
#include "core/pi2_log.h"

static void pi2_binding_destroy(struct pi2_binding * b) {
    pi2_pipeline_free(b->pipe);
    pi2_expert_file_free(b->experts);
    pi2_embedding_free(b->embd);
    pi2_output_free(b->output);
    pi2_expert_guess_free(&b->guess);
    free(b->model_path);
    pthread_mutex_destroy(&b->cache_lock);
    if (b->layer != NULL) {
        for (uint32_t il = 0; il < b->sc->n_layer; ++il) {
            pi2_predictor_free(&b->layer[il].pred);
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

// the layer's checks and bundle tables; its predictor waits for pi2_binding_prepare
static int pi2_prepare_layer(struct pi2_binding * b, uint32_t il, char * err, size_t errlen) {
    struct pi2_sidecar_layer * L = &b->sc->layer[il];
    struct pi2_binding_layer * B = &b->layer[il];
    atomic_init(&B->verified, 0);
    for (int m = 0; m < PI2_N_MATRIX; ++m) {
        atomic_init(&B->uploaded[m], 0);
    }
    atomic_init(&B->dense_logged, false);
    if (L->whole) {
        return 0; // a routed expert read whole from the model file: no bundles, no ranking
    }
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
    return 0;
}

int pi2_binding_prepare(struct pi2_binding * b) {
    if (b->prepared) {
        return 0;
    }
    // on flash, a predictor that does not pay is dropped unless this model runs every predictor
    const bool keep = !b->flash || pi2_binding_setting(b, PI2_SET_PREDICTOR) != 0.0;
    for (uint32_t il = 0; il < b->sc->n_layer; ++il) {
        if (b->sc->layer[il].whole) {
            continue; // no predictor
        }
        if (pi2_predictor_prepare(&b->layer[il].pred, &b->sc->layer[il], b->sc->n_embd, keep, &b->fixed_bytes, b->sc->path,
                                  il, b->error, sizeof(b->error)) != 0) {
            return -1;
        }
    }
    b->prepared = true;
    return 0;
}

struct pi2_binding * pi2_binding_create(int id, const char * sidecar_path, enum pi2_mode mode, bool flash, const char * model_path,
                                        const struct pi2_config * config, char * err, size_t errlen) {
    struct pi2_binding * b = calloc(1, sizeof(*b));
    if (b == NULL) {
        snprintf(err, errlen, "sidecar %s: out of memory", sidecar_path);
        return NULL;
    }
    b->id = id;
    atomic_init(&b->refs, 1);
    atomic_init(&b->mode, mode);
    b->load_mode = mode;
    pi2_expert_guess_init(&b->guess);
    atomic_init(&b->check_recall, 0);
    pi2_settings_unset(&b->settings);
    b->defaults = &config->defaults;
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
    if (pi2_sidecar_open(sidecar_path, &b->sc, err, errlen) != 0) {
        free(b);
        return NULL;
    }
    if (b->sc->output_rows >= 0 && !config->set[PI2_SET_OUTPUT_ROWS]) {
        atomic_store(&b->settings.v[PI2_SET_OUTPUT_ROWS], (double) b->sc->output_rows);
    }
    if (b->sc->output_copy >= 0 && !config->set[PI2_SET_OUTPUT_COPY]) {
        atomic_store(&b->settings.v[PI2_SET_OUTPUT_COPY], (double) b->sc->output_copy);
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
        if (pi2_prepare_layer(b, il, err, errlen) != 0) {
            pi2_binding_destroy(b);
            return NULL;
        }
    }
    if (flash && model_path != NULL && (pi2_embedding_open(model_path, &b->embd, err, errlen) < 0 ||
                                        pi2_output_open(model_path, &b->output, err, errlen) < 0)) {
        pi2_binding_destroy(b);
        return NULL;
    }
    if (b->output != NULL) {
        pi2_output_share_embedding(b->output, b->embd);
    }
    if (b->output != NULL && b->sc->out_copy_type != GGML_TYPE_COUNT &&
        pi2_output_use_sidecar_copy(b->output, sidecar_path, b->sc->out_copy_offset, b->sc->out_copy_type,
                                    b->sc->out_copy_rows, err, errlen) != 0) {
        pi2_binding_destroy(b);
        return NULL;
    }
    if (flash && model_path != NULL && (b->model_path = strdup(model_path)) == NULL) {
        snprintf(err, errlen, "sidecar %s: out of memory", sidecar_path);
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
        snprintf(b->error, sizeof(b->error), "sidecar %s describes no FFN of %s (its layers: %u): "
                 "the sidecar was made for another model", b->sc->path, w_gate->name, b->sc->n_layer);
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

void pi2_binding_check_upload(struct pi2_binding * b, int layer, int matrix, const struct ggml_tensor * w, const void * data,
                              size_t nbytes) {
    if (layer < 0 || (uint32_t) layer >= b->sc->n_layer) {
        snprintf(b->error, sizeof(b->error), "sidecar %s describes no FFN of %s (its layers: %u): "
                 "the sidecar was made for another model", b->sc->path, w->name, b->sc->n_layer);
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

bool pi2_binding_unfit_layer(struct pi2_binding * b, int layer, const char * why) {
    if (layer < 0 || (uint32_t) layer >= b->sc->n_layer) {
        return false; // pi2_binding_verify_layer refuses a layer the sidecar does not have
    }
    const bool first = !atomic_exchange(&b->layer[layer].dense_logged, true);
    if (b->flash) {
        char msg[sizeof(b->error)];
        snprintf(msg, sizeof(msg), "sidecar %s: layer %d cannot run from flash: %s; without a memory budget it would "
                 "run dense in RAM", b->sc->path, layer, why);
        if (first) {
            PI2_LOG_REFUSAL("pi2: %s\n", msg);
        }
        if (b->error[0] == '\0') { // the first layer found is the one the frontend reports
            memcpy(b->error, msg, sizeof(msg));
        }
        return true;
    }
    if (first) {
        PI2_LOG_WARN("pi2: layer %d runs dense, not sparse: %s\n", layer, why);
    }
    return false;
}
