// The configuration: every PI2_* variable the plugin reads, declared once in config.c's table (name,
// unit, default, range) and listed in docs/SETTINGS.md. The environment is read once, when the backend
// registers; a malformed or out-of-range value is refused with a message naming the variable and the
// value, and the same parser checks values set through the API (pi2_config_set).
//
// Two kinds: process settings (PI2_SIDECAR, PI2_MODEL, PI2_MODE, PI2_MEMORY_BUDGET: the model frontends load without
// pi2_gguf) and per-model settings, which a model binding may set for itself (NaN: follow the defaults).
#pragma once

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define PI2_PATH_MAX 4096

enum pi2_setting {
    PI2_SET_SPARSE_BATCH,      // decode batches of at most this many tokens run sparse
    PI2_SET_DOWN_SPARSE_MAX,   // down by columns when at most this fraction of neurons is active
    PI2_SET_PROMPT,            // 1: batches above the sparse limit run in ggml-cpu (cpu), 0: in PI2 (pi2)
    PI2_SET_PREDICTOR,         // 1: run every predictor (always), 0: only where it pays (auto)
    PI2_SET_ROWS,              // 1: predictor-less layers in RAM read gate/up rows from the model (model)
    PI2_SET_LAYERS,            // in RAM, 1: PI2 holds every FFN layer (all), 0: only those it runs faster (auto)
    PI2_SET_IO_THREADS,        // flash: I/O threads (queue depth)
    PI2_SET_IO_ENGINE,         // flash: 1: reads through io_uring where the kernel allows (uring), 0: I/O threads (threads)
    PI2_SET_IO_INFLIGHT_BYTES, // flash: bytes being read at once (0: no limit)
    PI2_SET_IO_MAX_BYTES,      // flash: largest request
    PI2_SET_IO_GAP,            // flash: bytes a read may bridge between two misses
    PI2_SET_PREFETCH_BYTES,    // flash: cold room for the next layer's first bundles
    PI2_SET_CACHE_MAX,         // flash: neuron cache cap below what the budget allows (0: none)
    PI2_SET_COLD_SHARE,        // flash: share of the cache kept cold beyond one layer
    PI2_SET_OUTPUT_ROWS,       // flash: output matrix left in the model file, this many exact rows a token (0: in RAM)
    PI2_SET_OUTPUT_COPY,       // flash, PI2_OUTPUT_ROWS > 0: the output matrix's in-RAM copy in 1: Q2_K (q2_k), 0: Q3_K (q3_k)
    PI2_SET_EXPERT_AHEAD,      // flash, MoE: routed (token, expert) pairs whose reads are issued before the first computes
    PI2_SET_EXPERT_GUESS,      // flash, MoE: 1: the next layer's experts guessed and read ahead (router), 0: not (off)
    PI2_SET_EXPERT_READS,      // flash, MoE: 1: routed experts read whole from the model file (model), 0: the sidecar's bundles
    PI2_SET_BATCH_NEURONS,     // flash, a batch: 1: each token computes its own predicted neurons (token), 0: the batch's union (union)
    PI2_SET_DENSE_READS,       // flash, dense: 1: the sidecar's bundles only (bundles), 0: layers read whole from the model file where they fit beside the others' bundles (auto)
    PI2_N_SETTINGS,
};

// Values of the per-model settings; NaN where a model follows the defaults. Atomic: the API may set a
// value while compute threads read it.
struct pi2_settings {
    _Atomic double v[PI2_N_SETTINGS];
};

// What the environment said when the backend registered.
struct pi2_config {
    char                sidecar[PI2_PATH_MAX]; // PI2_SIDECAR ("" unset)
    char                model[PI2_PATH_MAX];   // PI2_MODEL ("" unset): the model file the tools load, for a sidecar not beside it
    int                 mode;                  // PI2_MODE (enum pi2_mode); predicted when unset
    bool                mode_set;
    uint64_t            memory_budget;         // PI2_MEMORY_BUDGET (0 unset)
    struct pi2_settings defaults;              // every per-model setting, from the environment or the table
    bool                set[PI2_N_SETTINGS];   // the environment gave it (a sidecar's recorded value then yields)
    char                error[512];            // the first refused variable ("" if none)
};

// Reads every PI2_* variable; on a bad one, out->error says which and why (the rest keep their defaults).
void pi2_config_from_env(struct pi2_config * out);
// The same with variables looked up by lookup(ctx, name) (NULL: unset) instead of getenv: the parsing
// alone, for the fuzzer (ggml-backend/fuzz/fuzz_config.c).
typedef const char * (*pi2_config_lookup)(void * ctx, const char * name);
void pi2_config_read(struct pi2_config * out, pi2_config_lookup lookup, void * ctx);

// Parses `value` for the per-model setting called `name` (a PI2_* name): 0 and *which, *out; else -1 with
// err "PI2_NAME=value is not ..." (or naming an unknown variable).
int pi2_setting_parse(const char * name, const char * value, enum pi2_setting * which, double * out, char * err,
                      size_t errlen);

// Every value NaN: a model that follows the defaults.
void pi2_settings_unset(struct pi2_settings * s);

// "dense", "oracle", "predicted" -> enum pi2_mode; -1 for anything else
int pi2_mode_parse(const char * s);

// own's value where it has one (own may be NULL), else the default.
double pi2_setting(const struct pi2_settings * own, const struct pi2_settings * defaults, enum pi2_setting k);

// "600MB" (10^6), "1GiB" (2^30), "1500000000" -> bytes; 0, or -1 if s is not a size. Declared in ggml-pi2.h.
// int pi2_parse_size(const char * s, uint64_t * out);
