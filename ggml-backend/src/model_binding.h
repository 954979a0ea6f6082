// A model binding ties the FFN weights of one loaded model to its sidecar and a decode mode.
// pi2_gguf.Llama (or PI2_SIDECAR/PI2_MODE for other frontends) makes one before the model loads; every
// PI2 weight buffer llama allocates during that load keeps a reference, so the weights know their
// sidecar without any global lookup. The sidecar's bundles are memory-mapped read-only; the predictor
// rows are copied once into bundle-slot order so a neuron cluster reads its predictor rows, gate rows,
// up rows and down columns front to back.
#pragma once

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "ggml-pi2.h"
#include "ggml.h"
#include "embedding_rows.h"
#include "neuron_cache.h"
#include "sidecar.h"

struct pi2_binding_layer {
    const uint8_t * bundles;  // slot j at bundles + pi2_slot_offset(L, j) (inside the mapping); NULL on flash
    // predictor weights, Q8_0 where the widths allow (ggml's F16 dot measured ~5x slower than its Q8_0
    // dot here), else F16. Layer 2 is stored transposed, one row per hidden unit over the slots: relu
    // leaves about half of the hidden units at zero, and only the others' rows are read (as columns
    // added into the scores), half the bytes of one dot product per slot.
    enum ggml_type  pred_type; // w1
    enum ggml_type  w2_type;
    char *          w1;       // [rank] rows of n_embd
    char *          w2;       // [rank] rows of n_ff, slot order
    size_t          w1_stride, w2_stride;
    float *         b2_slot;  // [n_ff]
    int32_t *       slot_of;  // [n_ff] bundle slot of each neuron (in RAM: rows walked in the model's order)
    atomic_int      verified; // 0 not yet, 1 the model's weights match the sidecar, -1 they do not
    atomic_int      uploaded[PI2_N_MATRIX]; // flash: 1 when llama's upload of the weight matched, -1 if not
    // predicted mode runs the predictor only where it pays: its bytes (w1, w2) below the gate bytes it
    // saves, (1 - predictor density) * gate bytes. Elsewhere every gate row is computed (as oracle).
    bool            use_predictor;
};

struct pi2_binding {
    int                        id;
    atomic_int                 refs;
    struct pi2_sidecar *       sc;
    const uint8_t *            map; // the whole sidecar file, PROT_READ
    size_t                     map_size;
    struct pi2_binding_layer * layer; // [sc->n_layer]
    atomic_int                 mode;         // enum pi2_mode
    atomic_int                 check_recall; // predicted mode also runs the full gate to count misses
    char                       error[512];   // why a compute failed (fingerprint mismatch), for the frontend

    // Flash-resident FFN (a memory budget): the weight buffers keep nothing, each upload is checked
    // against the sidecar instead, and bundles come through the neuron cache, made once the budget is set.
    bool                      flash;
    atomic_bool               uploading;   // llama started uploading weights: its weight buffers all exist
    uint64_t                  env_budget;  // PI2_MEMORY_BUDGET: the cache is sized at the first compute
    int                       io_threads;
    pthread_mutex_t           cache_lock;  // one FFN at a time per model: the cache is shared by its contexts
    struct pi2_neuron_cache * cache;
    uint64_t                  fixed_bytes; // predictor weights kept in RAM
    struct pi2_embedding *    embd;        // the token embedding, left in the model file (NULL: in RAM)
    uint64_t                  ffn_ns;      // time in flash FFN layers since the cache was made (cache_lock)
};

// Budget accounting: a cache sized from `budget` minus what the process holds now (resident memory),
// minus `reserved` (memory the caller knows will be touched later: llama's compute buffers, logits
// arrays) and the cache's own tables and a margin. 0, or -1 with err naming the minimum budget.
#define PI2_BUDGET_MARGIN (32ull << 20)
int pi2_binding_size_cache(struct pi2_binding * b, uint64_t budget, uint64_t reserved, char * err, size_t errlen);
// Resident memory of this process (bytes), from /proc/self/statm; 0 if unreadable.
uint64_t pi2_resident_bytes(void);

// flash: an upload of blk.<layer>.ffn_* weight `matrix` (the whole tensor) is checked, then dropped
void pi2_binding_check_upload(struct pi2_binding * b, int layer, int matrix, const struct ggml_tensor * w, const void * data,
                              size_t nbytes);

// Opens the sidecar and maps its bundles; NULL with err set on failure.
// flash: bundles are read through a neuron cache (pi2_binding_set_budget) instead of a mapping; only the
// predictors that run are kept (all of them with keep_predictors); model_path (may be NULL) is the model
// file, whose token embedding then stays there (embedding_rows.h).
struct pi2_binding * pi2_binding_create(int id, const char * sidecar_path, enum pi2_mode mode, bool flash, const char * model_path,
                                        bool keep_predictors, char * err, size_t errlen);
void                 pi2_binding_ref(struct pi2_binding * b);
void                 pi2_binding_unref(struct pi2_binding * b);

// Checks once per layer that the weights handed to PI2 are those the sidecar was made from.
// false (and b->error set) when they are not.
bool pi2_binding_verify_layer(struct pi2_binding * b, int layer, const struct ggml_tensor * w_gate,
                              const struct ggml_tensor * w_up, const struct ggml_tensor * w_down);

// Whether a layer decodes with its predictor in this mode; otherwise every gate row is computed, and on
// flash every bundle of the layer is read each token.
bool pi2_binding_layer_predicted(const struct pi2_binding * b, int layer, int mode, bool predictor_always);

// "dense", "oracle", "predicted" -> enum pi2_mode; -1 for anything else
int pi2_mode_parse(const char * s);
