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
#include "flash/embedding_rows.h"
#include "experts/expert_speculate.h"
#include "flash/output_rows.h"
#include "core/config.h"
#include "flash/neuron_cache.h"
#include "sparse/predictor.h"
#include "model/sidecar.h"

struct pi2_binding_layer {
    const uint8_t *      bundles;  // slot j at bundles + pi2_slot_offset(L, j) (inside the mapping); NULL on flash
    struct pi2_predictor pred;     // prepared at the first weight buffer of the load (pi2_binding_prepare)
    int32_t *            slot_of;  // [n_ff] bundle slot of each neuron (in RAM: rows walked in the model's order)
    atomic_int           verified; // 0 not yet, 1 the model's weights match the sidecar, -1 they do not
    atomic_int           uploaded[PI2_N_MATRIX]; // flash: 1 when llama's upload of the weight matched, -1 if not
    atomic_bool          dense_logged; // the layer's graph was found unfit for sparse decode (logged once)
    atomic_bool          left;     // at load its weights were left to ggml-cpu (placement.h)
    bool                 read_whole; // flash: this budget reads the layer whole from the model file, not its bundles
                                     // (PI2_DENSE_READS=auto, memory_budget.c); set while the cache is made
};

struct pi2_binding {
    int                        id;
    atomic_int                 refs;
    struct pi2_sidecar *       sc;
    const uint8_t *            map; // the whole sidecar file, PROT_READ
    size_t                     map_size;
    struct pi2_binding_layer * layer; // [sc->n_layer]
    atomic_int                 mode;         // enum pi2_mode
    int                        load_mode;    // the mode it was loaded in, which placed its layers (placement.h)
    atomic_int                 check_recall; // predicted mode also runs the full gate to count misses
    struct pi2_settings        settings;     // this model's own values (NaN: follow the defaults)
    const struct pi2_settings * defaults;    // the device's (config.h)
    bool                       prepared;     // predictors prepared (device lock)
    char                       error[512];   // why a compute failed (fingerprint mismatch), for the frontend

    // Flash-resident FFN (a memory budget): the weight buffers keep nothing, each upload is checked
    // against the sidecar instead, and bundles come through the neuron cache, made once the budget is set.
    bool                      flash;
    atomic_bool               uploading;   // llama started uploading weights: its weight buffers all exist
    uint64_t                  env_budget;  // PI2_MEMORY_BUDGET: the cache is sized at the first compute
    pthread_mutex_t           cache_lock;  // one FFN at a time per model: the cache is shared by its contexts
    struct pi2_pipeline *     pipe;        // the neuron cache and the reads behind it (pipeline.h)
    struct pi2_expert_file *  experts;     // PI2_EXPERT_READS=model: routed experts read whole from the model file
    uint64_t                  fixed_bytes; // predictor weights kept in RAM
    struct pi2_embedding *    embd;        // the token embedding, left in the model file (NULL: in RAM)
    struct pi2_output *       output;      // the output matrix, if PI2_OUTPUT_ROWS leaves it in the model file
    struct pi2_expert_guess   guess;       // MoE on flash: guessing the next layer's experts (expert_speculate.h)
    char *                    model_path;  // flash: the model file (NULL: unknown)
    uint64_t                  ffn_ns;      // time in flash FFN layers since the cache was made (cache_lock)
    struct pi2_budget_use {                // how the budget was spent when the cache was sized (memory_budget.c)
        uint64_t budget, resident, reserved, tables, margin;
    }                         budget_use;
};

// flash: an upload of blk.<layer>.ffn_* weight `matrix` (the whole tensor) is checked, then dropped
void pi2_binding_check_upload(struct pi2_binding * b, int layer, int matrix, const struct ggml_tensor * w, const void * data,
                              size_t nbytes);

// Opens the sidecar and maps its bundles; NULL with err set on failure. flash: bundles are read through a
// neuron cache (memory_budget.h) instead of a mapping; model_path (may be NULL) is the model file, whose
// token embedding then stays there (embedding_rows.h). config: the device's settings, which a model without
// its own follows; a setting the sidecar records (pi2.budget.output_rows) becomes the model's own unless the
// environment set it.
struct pi2_binding * pi2_binding_create(int id, const char * sidecar_path, enum pi2_mode mode, bool flash, const char * model_path,
                                        const struct pi2_config * config, char * err, size_t errlen);
// Prepares the predictors, once, when llama allocates the model's first weight buffer (after the frontend
// had its chance to set PI2_PREDICTOR for this model): on flash only those that run are kept. 0, or -1
// with b->error set.
int                  pi2_binding_prepare(struct pi2_binding * b);
// this model's value of a per-model setting
static inline double pi2_binding_setting(const struct pi2_binding * b, enum pi2_setting k) {
    return pi2_setting(&b->settings, b->defaults, k);
}
void                 pi2_binding_ref(struct pi2_binding * b);
void                 pi2_binding_unref(struct pi2_binding * b);

// Checks once per layer that the weights handed to PI2 are those the sidecar was made from.
// false (and b->error set) when they are not.
bool pi2_binding_verify_layer(struct pi2_binding * b, int layer, const struct ggml_tensor * w_gate,
                              const struct ggml_tensor * w_up, const struct ggml_tensor * w_down);

// A layer of this model whose FFN graph sparse decode cannot run (why: what differs). Said once per layer;
// in RAM the layer runs dense (false), on flash it cannot run at all: true, with b->error set.
bool pi2_binding_unfit_layer(struct pi2_binding * b, int layer, const char * why);

