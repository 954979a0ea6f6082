// The pi2 sidecar reader: ggml's GGUF reader for the header, pread for the small tensors.
// Checks run in the order a user can act on: is the file there and GGUF at all, is it whole, is it a
// pi2 sidecar of a version this reader knows, are all keys there with their types and lengths, do the
// per-layer figures make sense, are all tensors there with their types and shapes, is the order a
// permutation. Every refusal is a message "sidecar PATH: problem".
#include "model/sidecar.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "flash/bundle_io.h"
#include "core/config.h"
#include "model/fingerprint.h"
#include "gguf.h"
#include "model/gguf_file.h"
#include "model/sidecar_format.h"

//
// declarations of the format: keys and tensors
//

enum pi2_key_len {
    PI2_LEN_SCALAR,
    PI2_LEN_LAYERS,  // n_layer elements
    PI2_LEN_TENSORS, // 3 * n_layer elements
};

struct pi2_key_spec {
    const char *     key;
    enum gguf_type   type; // element type for arrays
    enum pi2_key_len len;
    const char *     desc; // the type as FORMAT.md writes it
    const char *     only; // NULL: in every sidecar; else only in sidecars of this sparsity method
};

static const struct pi2_key_spec pi2_keys[] = {
    { PI2_KEY_FORMAT_VERSION,             GGUF_TYPE_UINT32,  PI2_LEN_SCALAR,  "u32", NULL },
    { PI2_KEY_SOURCE_ARCHITECTURE,        GGUF_TYPE_STRING,  PI2_LEN_SCALAR,  "string", NULL },
    { PI2_KEY_SOURCE_NAME,                GGUF_TYPE_STRING,  PI2_LEN_SCALAR,  "string", NULL },
    { PI2_KEY_SOURCE_FILE_SIZE,           GGUF_TYPE_UINT64,  PI2_LEN_SCALAR,  "u64", NULL },
    { PI2_KEY_SOURCE_FINGERPRINT,         GGUF_TYPE_UINT64,  PI2_LEN_SCALAR,  "u64", NULL },
    { PI2_KEY_SOURCE_TENSOR_FINGERPRINTS, GGUF_TYPE_UINT64,  PI2_LEN_TENSORS, "u64[3 * n_layer]", NULL },
    { PI2_KEY_N_LAYER,                    GGUF_TYPE_UINT32,  PI2_LEN_SCALAR,  "u32", NULL },
    { PI2_KEY_N_EMBD,                     GGUF_TYPE_UINT32,  PI2_LEN_SCALAR,  "u32", NULL },
    { PI2_KEY_N_FF,                       GGUF_TYPE_UINT32,  PI2_LEN_LAYERS,  "u32[n_layer]", NULL },
    { PI2_KEY_ACTIVATION,                 GGUF_TYPE_STRING,  PI2_LEN_SCALAR,  "string", NULL },
    { PI2_KEY_ACTIVATION_THRESHOLD,       GGUF_TYPE_FLOAT32, PI2_LEN_SCALAR,  "f32", NULL },
    { PI2_KEY_SPARSITY_METHOD,            GGUF_TYPE_STRING,  PI2_LEN_SCALAR,  "string", NULL },
    { PI2_KEY_SPARSITY_TARGET,            GGUF_TYPE_FLOAT32, PI2_LEN_SCALAR,  "f32", NULL },
    { PI2_KEY_SPARSITY_THRESHOLDS,        GGUF_TYPE_FLOAT32, PI2_LEN_LAYERS,  "f32[n_layer]", NULL },
    { PI2_KEY_SPARSITY_PRODUCT_THRESHOLDS, GGUF_TYPE_FLOAT32, PI2_LEN_LAYERS, "f32[n_layer]", PI2_SPARSITY_PRODUCT },
    { PI2_KEY_SPARSITY_DENSITY,           GGUF_TYPE_FLOAT32, PI2_LEN_LAYERS,  "f32[n_layer]", NULL },
    { PI2_KEY_PREDICTOR_RANK,             GGUF_TYPE_UINT32,  PI2_LEN_LAYERS,  "u32[n_layer]", NULL },
    { PI2_KEY_PREDICTOR_CUTOFF,           GGUF_TYPE_FLOAT32, PI2_LEN_LAYERS,  "f32[n_layer]", NULL },
    { PI2_KEY_PREDICTOR_RECALL_TARGET,    GGUF_TYPE_FLOAT32, PI2_LEN_SCALAR,  "f32", NULL },
    { PI2_KEY_PREDICTOR_RECALL,           GGUF_TYPE_FLOAT32, PI2_LEN_LAYERS,  "f32[n_layer]", NULL },
    { PI2_KEY_PREDICTOR_PRECISION,        GGUF_TYPE_FLOAT32, PI2_LEN_LAYERS,  "f32[n_layer]", NULL },
    { PI2_KEY_PREDICTOR_DENSITY,          GGUF_TYPE_FLOAT32, PI2_LEN_LAYERS,  "f32[n_layer]", NULL },
    { PI2_KEY_HOT_COUNT,                  GGUF_TYPE_UINT32,  PI2_LEN_LAYERS,  "u32[n_layer]", NULL },
    { PI2_KEY_CALIB_CORPUS,               GGUF_TYPE_STRING,  PI2_LEN_SCALAR,  "string", NULL },
    { PI2_KEY_CALIB_CORPUS_SHA256,        GGUF_TYPE_STRING,  PI2_LEN_SCALAR,  "string", NULL },
    { PI2_KEY_CALIB_TOKENS,               GGUF_TYPE_UINT64,  PI2_LEN_SCALAR,  "u64", NULL },
    { PI2_KEY_CALIB_HELDOUT_TOKENS,       GGUF_TYPE_UINT64,  PI2_LEN_SCALAR,  "u64", NULL },
    { PI2_KEY_CALIB_DATE,                 GGUF_TYPE_STRING,  PI2_LEN_SCALAR,  "string", NULL },
    { PI2_KEY_BUNDLE_ALIGN,               GGUF_TYPE_UINT32,  PI2_LEN_SCALAR,  "u32", NULL },
    { PI2_KEY_BUNDLE_SIZE,                GGUF_TYPE_UINT32,  PI2_LEN_LAYERS,  "u32[n_layer]", NULL },
    { PI2_KEY_BUNDLE_NEURONS,             GGUF_TYPE_UINT32,  PI2_LEN_LAYERS,  "u32[n_layer]", NULL },
    { PI2_KEY_BUNDLE_GATE_TYPE,           GGUF_TYPE_UINT32,  PI2_LEN_LAYERS,  "u32[n_layer]", NULL },
    { PI2_KEY_BUNDLE_UP_TYPE,             GGUF_TYPE_UINT32,  PI2_LEN_LAYERS,  "u32[n_layer]", NULL },
    { PI2_KEY_BUNDLE_DOWN_TYPE,           GGUF_TYPE_UINT32,  PI2_LEN_LAYERS,  "u32[n_layer]", NULL },
    { PI2_KEY_BUNDLE_DOWN_TOLERANCE,      GGUF_TYPE_FLOAT32, PI2_LEN_LAYERS,  "f32[n_layer]", NULL },
    { PI2_KEY_BUNDLE_DOWN_ERROR,          GGUF_TYPE_FLOAT32, PI2_LEN_LAYERS,  "f32[n_layer]", NULL },
};

enum pi2_dim {
    PI2_DIM_ONE,
    PI2_DIM_N_EMBD,
    PI2_DIM_RANK,
    PI2_DIM_N_FF,
    PI2_DIM_BUNDLE_SIZE,
    PI2_DIM_N_BUNDLES,
};

static const char * const pi2_dim_name[] = {
    [PI2_DIM_ONE]         = "1",
    [PI2_DIM_N_EMBD]      = "n_embd",
    [PI2_DIM_RANK]        = "r",
    [PI2_DIM_N_FF]        = "n_ff",
    [PI2_DIM_BUNDLE_SIZE] = "bundle size",
    [PI2_DIM_N_BUNDLES]   = "n_bundles",
};

enum pi2_tensor_id {
    PI2_T_PRED_W1,
    PI2_T_PRED_B1,
    PI2_T_PRED_W2,
    PI2_T_PRED_B2,
    PI2_T_FREQ,
    PI2_T_ORDER,
    PI2_T_BUNDLES,
    PI2_N_TENSOR,
};

struct pi2_tensor_spec {
    const char *   suffix;
    enum ggml_type type;
    enum pi2_dim   ne0;
    enum pi2_dim   ne1;
};

static const struct pi2_tensor_spec pi2_tensors[PI2_N_TENSOR] = {
    [PI2_T_PRED_W1] = { PI2_TENSOR_PRED_W1, GGML_TYPE_F16, PI2_DIM_N_EMBD,      PI2_DIM_RANK },
    [PI2_T_PRED_B1] = { PI2_TENSOR_PRED_B1, GGML_TYPE_F32, PI2_DIM_RANK,        PI2_DIM_ONE },
    [PI2_T_PRED_W2] = { PI2_TENSOR_PRED_W2, GGML_TYPE_F16, PI2_DIM_RANK,        PI2_DIM_N_FF },
    [PI2_T_PRED_B2] = { PI2_TENSOR_PRED_B2, GGML_TYPE_F32, PI2_DIM_N_FF,        PI2_DIM_ONE },
    [PI2_T_FREQ]    = { PI2_TENSOR_FREQ,    GGML_TYPE_F32, PI2_DIM_N_FF,        PI2_DIM_ONE },
    [PI2_T_ORDER]   = { PI2_TENSOR_ORDER,   GGML_TYPE_I32, PI2_DIM_N_FF,        PI2_DIM_ONE },
    [PI2_T_BUNDLES] = { PI2_TENSOR_BUNDLES, GGML_TYPE_I8,  PI2_DIM_BUNDLE_SIZE, PI2_DIM_N_BUNDLES },
};

static const char * const pi2_matrix_name[PI2_N_MATRIX] = {
    [PI2_MATRIX_GATE] = "ffn_gate",
    [PI2_MATRIX_UP]   = "ffn_up",
    [PI2_MATRIX_DOWN] = "ffn_down",
};

//
// the state of one open call, and how it fails
//

struct pi2_reader {
    const char *         path;
    struct pi2_gguf_file file;
    char *               err;
    size_t               errlen;
};

// err = "sidecar PATH: " + the formatted problem; returns -1
static int pi2_fail_at(char * err, size_t errlen, const char * path, const char * fmt, va_list ap) {
    return pi2_gguf_vfail(err, errlen, "sidecar", path, fmt, ap);
}

static int pi2_fail(struct pi2_reader * rd, const char * fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    pi2_fail_at(rd->err, rd->errlen, rd->path, fmt, ap);
    va_end(ap);
    return -1;
}

static int pi2_fail_path(char * err, size_t errlen, const char * path, const char * fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    pi2_fail_at(err, errlen, path, fmt, ap);
    va_end(ap);
    return -1;
}

static const char * pi2_type_name(int t) {
    return t >= 0 && t < GGML_TYPE_COUNT ? ggml_type_name((enum ggml_type) t) : "an unknown ggml type";
}

static const char * pi2_gguf_type_name(enum gguf_type t) {
    const char * name = gguf_type_name(t);
    return name != NULL ? name : "unknown";
}

//
// file access
//

// exactly n bytes at offset, or -1 with the reason
static int pi2_read_at(struct pi2_reader * rd, void * dst, size_t n, uint64_t offset, const char * what) {
    const int e = pi2_read_exact(rd->file.fd, dst, n, offset);
    if (e == PI2_READ_EOF) {
        return pi2_fail(rd, "is truncated: %s (%zu bytes at offset %" PRIu64 ") ends past the end of the file", what, n, offset);
    }
    if (e != 0) {
        return pi2_fail(rd, "cannot read %s (%zu bytes at offset %" PRIu64 "): %s", what, n, offset, strerror(e));
    }
    return 0;
}

static int pi2_open_gguf(struct pi2_reader * rd) {
    return pi2_gguf_file_open(&rd->file, "sidecar", rd->path, false, rd->err, rd->errlen);
}

// after the identity check, so that a model file given as a sidecar is named as such
static int pi2_check_alignment(struct pi2_reader * rd) {
    const uint64_t data = gguf_get_data_offset(rd->file.gguf);
    const int64_t  n    = gguf_get_n_tensors(rd->file.gguf);
    for (int64_t i = 0; i < n; ++i) {
        const uint64_t off = data + gguf_get_tensor_offset(rd->file.gguf, i);
        if (off % PI2_BUNDLE_ALIGN != 0) {
            return pi2_fail(rd, "tensor %s starts at file offset %" PRIu64 ", not a multiple of %d (general.alignment is %zu, must be %d)",
                            gguf_get_tensor_name(rd->file.gguf, i), off, PI2_BUNDLE_ALIGN, gguf_get_alignment(rd->file.gguf), PI2_BUNDLE_ALIGN);
        }
    }
    return 0;
}

//
// keys
//

static int64_t pi2_find(const struct pi2_reader * rd, const char * key) {
    return gguf_find_key(rd->file.gguf, key);
}

// the key exists with the declared type and length; -1 with the message otherwise
static int pi2_check_key(struct pi2_reader * rd, const struct pi2_key_spec * spec, uint32_t n_layer) {
    const int64_t id = pi2_find(rd, spec->key);
    if (id < 0) {
        if (spec->only != NULL) { // whether the method needs it is checked with the method
            return 0;
        }
        return pi2_fail(rd, "key %s (%s) is missing", spec->key, spec->desc);
    }
    const enum gguf_type kt = gguf_get_kv_type(rd->file.gguf, id);
    if (spec->len == PI2_LEN_SCALAR) {
        if (kt != spec->type) {
            return pi2_fail(rd, "key %s is %s%s, expected %s", spec->key, kt == GGUF_TYPE_ARRAY ? "an array of " : "",
                            pi2_gguf_type_name(kt == GGUF_TYPE_ARRAY ? gguf_get_arr_type(rd->file.gguf, id) : kt), spec->desc);
        }
        return 0;
    }
    if (kt != GGUF_TYPE_ARRAY || gguf_get_arr_type(rd->file.gguf, id) != spec->type) {
        return pi2_fail(rd, "key %s is %s%s, expected %s", spec->key, kt == GGUF_TYPE_ARRAY ? "an array of " : "a single ",
                        pi2_gguf_type_name(kt == GGUF_TYPE_ARRAY ? gguf_get_arr_type(rd->file.gguf, id) : kt), spec->desc);
    }
    const size_t want = spec->len == PI2_LEN_LAYERS ? (size_t) n_layer : (size_t) PI2_N_MATRIX * n_layer;
    const size_t got  = gguf_get_arr_n(rd->file.gguf, id);
    if (got != want) {
        return pi2_fail(rd, "key %s has %zu elements, expected %s = %zu (pi2.n_layer is %" PRIu32 ")",
                        spec->key, got, spec->desc, want, n_layer);
    }
    return 0;
}

static const struct pi2_key_spec * pi2_key_spec(const char * key) {
    for (size_t i = 0; i < sizeof(pi2_keys) / sizeof(pi2_keys[0]); ++i) {
        if (strcmp(pi2_keys[i].key, key) == 0) {
            return &pi2_keys[i];
        }
    }
    return NULL;
}

// u32 scalar key, checked alone (before pi2.n_layer is known)
static int pi2_get_u32(struct pi2_reader * rd, const char * key, uint32_t * v) {
    if (pi2_check_key(rd, pi2_key_spec(key), 0) != 0) {
        return -1;
    }
    *v = gguf_get_val_u32(rd->file.gguf, pi2_find(rd, key));
    return 0;
}

// the following read keys pi2_check_key has accepted
static const uint32_t * pi2_arr_u32(const struct pi2_reader * rd, const char * key) {
    return gguf_get_arr_data(rd->file.gguf, pi2_find(rd, key));
}

static const float * pi2_arr_f32(const struct pi2_reader * rd, const char * key) {
    return gguf_get_arr_data(rd->file.gguf, pi2_find(rd, key));
}

static const char * pi2_str(const struct pi2_reader * rd, const char * key) {
    return gguf_get_val_str(rd->file.gguf, pi2_find(rd, key));
}

static int pi2_check_identity(struct pi2_reader * rd) {
    const int64_t id = pi2_find(rd, "general.architecture");
    if (id < 0 || gguf_get_kv_type(rd->file.gguf, id) != GGUF_TYPE_STRING) {
        return pi2_fail(rd, "is not a pi2 sidecar (it has no general.architecture string)");
    }
    const char * arch = gguf_get_val_str(rd->file.gguf, id);
    if (strcmp(arch, PI2_ARCHITECTURE) != 0) {
        return pi2_fail(rd, "is not a pi2 sidecar: general.architecture is '%s', not '%s' (is it a model file?)", arch, PI2_ARCHITECTURE);
    }
    uint32_t version = 0;
    if (pi2_get_u32(rd, PI2_KEY_FORMAT_VERSION, &version) != 0) {
        return -1;
    }
    if (version != PI2_FORMAT_VERSION) {
        return pi2_fail(rd, "has format version %" PRIu32 " (pi2.format_version), but this reader reads only version %d; "
                            "convert the model again with this pi2-gguf", version, PI2_FORMAT_VERSION);
    }
    return 0;
}

static int pi2_parse_enum(const char * s, const char * const * names, int n) {
    for (int i = 0; i < n; ++i) {
        if (strcmp(s, names[i]) == 0) {
            return i;
        }
    }
    return -1;
}

// reads and checks the model-wide keys into sc; all keys have passed pi2_check_key
// An optional key recording a per-model setting (a u32 or a string): its type checked as every key's, its value
// by the setting's own parser; *out the parsed value, -1 where the key is absent.
static int pi2_recorded_setting(struct pi2_reader * rd, const char * key, enum gguf_type type, const char * setting,
                                int32_t * out) {
    *out = -1;
    const int64_t id = pi2_find(rd, key);
    if (id < 0) {
        return 0;
    }
    const bool u32 = type == GGUF_TYPE_UINT32;
    const struct pi2_key_spec spec = { key, type, PI2_LEN_SCALAR, u32 ? "u32" : "string", NULL };
    if (pi2_check_key(rd, &spec, 0) != 0) {
        return -1;
    }
    char number[16], why[192];
    if (u32) {
        snprintf(number, sizeof(number), "%" PRIu32, gguf_get_val_u32(rd->file.gguf, id));
    }
    enum pi2_setting which;
    double x;
    if (pi2_setting_parse(setting, u32 ? number : gguf_get_val_str(rd->file.gguf, id), &which, &x, why, sizeof(why)) != 0) {
        return pi2_fail(rd, "key %s: %s", key, why);
    }
    *out = (int32_t) x;
    return 0;
}

// Which sidecar layers each model layer's FFN is (FORMAT.md, "MoE sidecars"): first[il] .. first[il + 1] - 1.
// A dense sidecar: layer il is model layer il. An MoE one: pi2.moe.layer_experts says per model layer 0 (a dense
// FFN, one sidecar layer), pi2.moe.expert_count (one per expert) or one more (the shared expert after them);
// absent, every model layer routes.
static int pi2_read_layer_map(struct pi2_reader * rd, struct pi2_sidecar * sc) {
    const int64_t id = pi2_find(rd, PI2_KEY_MOE_LAYER_EXPERTS);
    if (id >= 0 && sc->n_expert == 0) {
        return pi2_fail(rd, "has key %s but no %s", PI2_KEY_MOE_LAYER_EXPERTS, PI2_KEY_MOE_EXPERT_COUNT);
    }
    if (id >= 0 && (gguf_get_kv_type(rd->file.gguf, id) != GGUF_TYPE_ARRAY || gguf_get_arr_type(rd->file.gguf, id) != GGUF_TYPE_UINT32)) {
        return pi2_fail(rd, "key %s is not a u32 array", PI2_KEY_MOE_LAYER_EXPERTS);
    }
    const uint32_t n_model = id >= 0 ? (uint32_t) gguf_get_arr_n(rd->file.gguf, id)
                                     : sc->n_expert > 0 ? sc->n_layer / sc->n_expert : sc->n_layer;
    sc->first  = malloc(sizeof(uint32_t) * ((size_t) n_model + 1));
    sc->routed = malloc((size_t) n_model + 1); // + 1: an empty array is refused below, not as out of memory
    if (sc->first == NULL || sc->routed == NULL) {
        return pi2_fail(rd, "out of memory");
    }
    sc->n_model_layer = n_model;
    const uint32_t * counts = id >= 0 ? gguf_get_arr_data(rd->file.gguf, id) : NULL;
    uint64_t at = 0;
    bool routed = false;
    for (uint32_t il = 0; il < n_model; ++il) {
        const uint32_t c = counts != NULL ? counts[il] : sc->n_expert;
        if (counts != NULL && c != 0 && c != sc->n_expert && c != sc->n_expert + 1) {
            return pi2_fail(rd, "key %s[%" PRIu32 "] is %" PRIu32 ", not 0 (a dense FFN layer), %s %" PRIu32 " (routed experts) "
                            "or one more (and a shared expert)", PI2_KEY_MOE_LAYER_EXPERTS, il, c, PI2_KEY_MOE_EXPERT_COUNT,
                            sc->n_expert);
        }
        routed = routed || c > 0;
        sc->first[il]  = (uint32_t) at;
        sc->routed[il] = c > 0;
        at += c > 0 ? c : 1;
    }
    if (at != sc->n_layer || (sc->n_expert > 0 && !routed)) {
        return pi2_fail(rd, "key %s describes %" PRIu64 " sidecar layers%s, not its %" PRIu32, PI2_KEY_MOE_LAYER_EXPERTS, at,
                        routed ? "" : " and no routed layer", sc->n_layer);
    }
    sc->first[n_model] = (uint32_t) at;
    return 0;
}

static int pi2_read_globals(struct pi2_reader * rd, struct pi2_sidecar * sc) {
    static const char * const method_names[] = {
        [PI2_SPARSITY_METHOD_CATS] = PI2_SPARSITY_CATS, [PI2_SPARSITY_METHOD_RELU] = PI2_SPARSITY_RELU,
        [PI2_SPARSITY_METHOD_PRODUCT] = PI2_SPARSITY_PRODUCT,
    };
    const char * act = pi2_str(rd, PI2_KEY_ACTIVATION);
    const int a = pi2_parse_enum(act, pi2_activation_names, PI2_ACT_COUNT);
    if (a < 0) {
        return pi2_fail(rd, "%s is '%s', not one of silu, gelu, gelu_erf, relu, drelu, fatrelu, swiglu_oai", PI2_KEY_ACTIVATION, act);
    }
    const float t = gguf_get_val_f32(rd->file.gguf, pi2_find(rd, PI2_KEY_ACTIVATION_THRESHOLD));
    if (!(isfinite(t) && t >= 0.0f) || (a != PI2_ACT_FATRELU && t != 0.0f)) {
        return pi2_fail(rd, "%s is %g: FATReLU's threshold is finite and >= 0, and the other activations have 0",
                        PI2_KEY_ACTIVATION_THRESHOLD, (double) t);
    }
    const char * method = pi2_str(rd, PI2_KEY_SPARSITY_METHOD);
    const int m = pi2_parse_enum(method, method_names, (int) (sizeof(method_names) / sizeof(method_names[0])));
    if (m < 0) {
        return pi2_fail(rd, "%s is '%s', not one of cats, product, relu", PI2_KEY_SPARSITY_METHOD, method);
    }
    for (size_t i = 0; i < sizeof(pi2_keys) / sizeof(pi2_keys[0]); ++i) {
        const struct pi2_key_spec * k = &pi2_keys[i];
        if (k->only != NULL && strcmp(k->only, method) == 0 && pi2_find(rd, k->key) < 0) {
            return pi2_fail(rd, "key %s (%s) is missing: method %s needs it", k->key, k->desc, method);
        }
    }
    sc->activation      = (struct pi2_ffn_act) { .kind = (enum pi2_activation) a, .threshold = t };
    sc->sparsity_method = (enum pi2_sparsity_method) m;

    const uint32_t align = gguf_get_val_u32(rd->file.gguf, pi2_find(rd, PI2_KEY_BUNDLE_ALIGN));
    if (align < PI2_BUNDLE_ALIGN_MIN || align > PI2_BUNDLE_ALIGN || (align & (align - 1)) != 0) {
        return pi2_fail(rd, "%s is %" PRIu32 ", not a power of two from %d to %d", PI2_KEY_BUNDLE_ALIGN, align,
                        PI2_BUNDLE_ALIGN_MIN, PI2_BUNDLE_ALIGN);
    }
    sc->bundle_align = align;

    const uint64_t * fps = gguf_get_arr_data(rd->file.gguf, pi2_find(rd, PI2_KEY_SOURCE_TENSOR_FINGERPRINTS));
    sc->fingerprint = gguf_get_val_u64(rd->file.gguf, pi2_find(rd, PI2_KEY_SOURCE_FINGERPRINT));
    const uint64_t fp = pi2_fingerprint_model(fps, (size_t) PI2_N_MATRIX * sc->n_layer);
    if (fp != sc->fingerprint) {
        return pi2_fail(rd, "is inconsistent: %s is 0x%016" PRIx64 " but its %s hash to 0x%016" PRIx64,
                        PI2_KEY_SOURCE_FINGERPRINT, sc->fingerprint, PI2_KEY_SOURCE_TENSOR_FINGERPRINTS, fp);
    }
    // optional settings convert measured: -1 where the sidecar records none
    if (pi2_recorded_setting(rd, PI2_KEY_BUDGET_OUTPUT_ROWS, GGUF_TYPE_UINT32, "PI2_OUTPUT_ROWS", &sc->output_rows) != 0 ||
        pi2_recorded_setting(rd, PI2_KEY_BUDGET_OUTPUT_COPY, GGUF_TYPE_STRING, "PI2_OUTPUT_COPY", &sc->output_copy) != 0) {
        return -1;
    }
    static const struct pi2_key_spec expert_count = { PI2_KEY_MOE_EXPERT_COUNT, GGUF_TYPE_UINT32, PI2_LEN_SCALAR, "u32", NULL };
    sc->n_expert = 0;
    const int64_t nexp = pi2_find(rd, PI2_KEY_MOE_EXPERT_COUNT);
    if (nexp >= 0) {
        if (pi2_check_key(rd, &expert_count, sc->n_layer) != 0) {
            return -1;
        }
        const uint32_t v = gguf_get_val_u32(rd->file.gguf, nexp);
        if (v == 0 || (pi2_find(rd, PI2_KEY_MOE_LAYER_EXPERTS) < 0 && sc->n_layer % v != 0)) {
            return pi2_fail(rd, "key %s is %" PRIu32 ", which does not divide its %" PRIu32 " layers", PI2_KEY_MOE_EXPERT_COUNT, v,
                            sc->n_layer);
        }
        sc->n_expert = v;
    }
    if (pi2_read_layer_map(rd, sc) != 0) {
        return -1;
    }
    const int64_t reads = pi2_find(rd, PI2_KEY_MOE_EXPERT_READS);
    if (reads >= 0) {
        const char * v = gguf_get_kv_type(rd->file.gguf, reads) == GGUF_TYPE_STRING ? gguf_get_val_str(rd->file.gguf, reads) : NULL;
        if (v == NULL || (strcmp(v, PI2_EXPERT_READS_BUNDLES) != 0 && strcmp(v, PI2_EXPERT_READS_MODEL) != 0)) {
            return pi2_fail(rd, "key %s is not the string %s or %s", PI2_KEY_MOE_EXPERT_READS, PI2_EXPERT_READS_BUNDLES,
                            PI2_EXPERT_READS_MODEL);
        }
        if (sc->n_expert == 0) {
            return pi2_fail(rd, "has key %s but no %s", PI2_KEY_MOE_EXPERT_READS, PI2_KEY_MOE_EXPERT_COUNT);
        }
        sc->experts_whole = strcmp(v, PI2_EXPERT_READS_MODEL) == 0;
    }
    const int64_t dense_reads = pi2_find(rd, PI2_KEY_DENSE_READS);
    if (dense_reads >= 0) {
        const char * v = gguf_get_kv_type(rd->file.gguf, dense_reads) == GGUF_TYPE_STRING
                       ? gguf_get_val_str(rd->file.gguf, dense_reads) : NULL;
        if (v == NULL || (strcmp(v, PI2_EXPERT_READS_BUNDLES) != 0 && strcmp(v, PI2_EXPERT_READS_MODEL) != 0)) {
            return pi2_fail(rd, "key %s is not the string %s or %s", PI2_KEY_DENSE_READS, PI2_EXPERT_READS_BUNDLES,
                            PI2_EXPERT_READS_MODEL);
        }
        if (sc->n_expert != 0) {
            return pi2_fail(rd, "has key %s, which only a dense model's sidecar has, beside %s", PI2_KEY_DENSE_READS,
                            PI2_KEY_MOE_EXPERT_COUNT);
        }
        sc->dense_whole = strcmp(v, PI2_EXPERT_READS_MODEL) == 0;
    }
    sc->pred_w2_type = GGML_TYPE_Q8_0;
    const int64_t w2_type = pi2_find(rd, PI2_KEY_PREDICTOR_W2_TYPE);
    if (w2_type >= 0) {
        const char * v = gguf_get_kv_type(rd->file.gguf, w2_type) == GGUF_TYPE_STRING ? gguf_get_val_str(rd->file.gguf, w2_type) : NULL;
        if (v == NULL || (strcmp(v, PI2_W2_TYPE_Q8_0) != 0 && strcmp(v, PI2_W2_TYPE_Q4_0) != 0)) {
            return pi2_fail(rd, "key %s is not the string %s or %s", PI2_KEY_PREDICTOR_W2_TYPE, PI2_W2_TYPE_Q8_0, PI2_W2_TYPE_Q4_0);
        }
        sc->pred_w2_type = strcmp(v, PI2_W2_TYPE_Q4_0) == 0 ? GGML_TYPE_Q4_0 : GGML_TYPE_Q8_0;
    }
    sc->source_arch = strdup(pi2_str(rd, PI2_KEY_SOURCE_ARCHITECTURE));
    sc->source_name = strdup(pi2_str(rd, PI2_KEY_SOURCE_NAME));
    if (sc->source_arch == NULL || sc->source_name == NULL) {
        return pi2_fail(rd, "out of memory");
    }
    return 0;
}

// a ggml type a bundle part can hold: a real type whose blocks divide n_embd
static int pi2_check_part_type(struct pi2_reader * rd, const char * key, uint32_t il, uint32_t t, uint32_t n_embd) {
    if (t >= GGML_TYPE_COUNT || ggml_blck_size((enum ggml_type) t) <= 0 || ggml_type_size((enum ggml_type) t) == 0) {
        return pi2_fail(rd, "%s[%" PRIu32 "] is %" PRIu32 ", not a ggml type", key, il, t);
    }
    const int64_t blck = ggml_blck_size((enum ggml_type) t);
    if ((int64_t) n_embd % blck != 0) {
        return pi2_fail(rd, "%s[%" PRIu32 "] is %s, whose blocks of %" PRId64 " values do not divide n_embd = %" PRIu32,
                        key, il, ggml_type_name((enum ggml_type) t), blck, n_embd);
    }
    return 0;
}

static int pi2_read_layers(struct pi2_reader * rd, struct pi2_sidecar * sc) {
    const uint32_t * n_ff      = pi2_arr_u32(rd, PI2_KEY_N_FF);
    const uint32_t * rank      = pi2_arr_u32(rd, PI2_KEY_PREDICTOR_RANK);
    const uint32_t * hot       = pi2_arr_u32(rd, PI2_KEY_HOT_COUNT);
    const uint32_t * size      = pi2_arr_u32(rd, PI2_KEY_BUNDLE_SIZE);
    const uint32_t * neurons   = pi2_arr_u32(rd, PI2_KEY_BUNDLE_NEURONS);
    const uint32_t * gate_type = pi2_arr_u32(rd, PI2_KEY_BUNDLE_GATE_TYPE);
    const uint32_t * up_type   = pi2_arr_u32(rd, PI2_KEY_BUNDLE_UP_TYPE);
    const uint32_t * down_type = pi2_arr_u32(rd, PI2_KEY_BUNDLE_DOWN_TYPE);
    const float *    threshold = pi2_arr_f32(rd, PI2_KEY_SPARSITY_THRESHOLDS);
    const float *    product_threshold = sc->sparsity_method == PI2_SPARSITY_METHOD_PRODUCT
                                             ? pi2_arr_f32(rd, PI2_KEY_SPARSITY_PRODUCT_THRESHOLDS) : NULL;
    const float *    cutoff    = pi2_arr_f32(rd, PI2_KEY_PREDICTOR_CUTOFF);
    const float *    pdensity  = pi2_arr_f32(rd, PI2_KEY_PREDICTOR_DENSITY);
    const float *    density   = pi2_arr_f32(rd, PI2_KEY_SPARSITY_DENSITY);
    const uint64_t * fps       = gguf_get_arr_data(rd->file.gguf, pi2_find(rd, PI2_KEY_SOURCE_TENSOR_FINGERPRINTS));

    for (uint32_t il = 0; il < sc->n_layer; ++il) {
        struct pi2_sidecar_layer * L = &sc->layer[il];
        if (n_ff[il] == 0 || n_ff[il] > INT32_MAX) {
            return pi2_fail(rd, "%s[%" PRIu32 "] is %" PRIu32 ", expected 1..%d", PI2_KEY_N_FF, il, n_ff[il], INT32_MAX);
        }
        L->whole = sc->dense_whole || (sc->experts_whole && pi2_sidecar_layer_routed(sc, il));
        if ((rank[il] == 0 && !L->whole) || rank[il] > INT32_MAX) {
            return pi2_fail(rd, "%s[%" PRIu32 "] is %" PRIu32 ", expected 1..%d", PI2_KEY_PREDICTOR_RANK, il, rank[il], INT32_MAX);
        }
        if (hot[il] > n_ff[il]) {
            return pi2_fail(rd, "%s[%" PRIu32 "] is %" PRIu32 ", more than n_ff = %" PRIu32, PI2_KEY_HOT_COUNT, il, hot[il], n_ff[il]);
        }
        if (pi2_check_part_type(rd, PI2_KEY_BUNDLE_GATE_TYPE, il, gate_type[il], sc->n_embd) != 0 ||
            pi2_check_part_type(rd, PI2_KEY_BUNDLE_UP_TYPE, il, up_type[il], sc->n_embd) != 0 ||
            pi2_check_part_type(rd, PI2_KEY_BUNDLE_DOWN_TYPE, il, down_type[il], sc->n_embd) != 0) {
            return -1;
        }
        // fractions the plugin plans with (placement.h): a value outside [0, 1] is not one
        if (!(density[il] >= 0.0f && density[il] <= 1.0f) || !(pdensity[il] >= 0.0f && pdensity[il] <= 1.0f)) {
            return pi2_fail(rd, "%s[%" PRIu32 "] or %s[%" PRIu32 "] is not a fraction in 0..1", PI2_KEY_SPARSITY_DENSITY, il,
                            PI2_KEY_PREDICTOR_DENSITY, il);
        }
        if (L->whole) { // read whole from the model file: no predictor, bundles or ranking (FORMAT.md)
            L->n_ff = n_ff[il];
            L->density = L->pred_density = 1.0f;
            L->gate_type = (enum ggml_type) gate_type[il];
            L->up_type   = (enum ggml_type) up_type[il];
            L->down_type = (enum ggml_type) down_type[il];
            for (int m = 0; m < PI2_N_MATRIX; ++m) {
                L->tensor_fp[m] = fps[(size_t) PI2_N_MATRIX * il + (size_t) m];
            }
            continue;
        }
        L->n_ff        = n_ff[il];
        L->density     = density[il];
        L->rank        = rank[il];
        L->hot_count   = hot[il];
        L->threshold   = threshold[il];
        L->product_threshold = product_threshold != NULL ? product_threshold[il] : 0.0f;
        L->cutoff      = cutoff[il];
        L->pred_density = pdensity[il];
        L->pred_w2_type = sc->pred_w2_type;
        L->bundle_size = size[il];
        L->gate_type   = (enum ggml_type) gate_type[il];
        L->up_type     = (enum ggml_type) up_type[il];
        L->down_type   = (enum ggml_type) down_type[il];
        L->up_offset   = ggml_row_size(L->gate_type, sc->n_embd);
        L->down_offset = L->up_offset + ggml_row_size(L->up_type, sc->n_embd);
        L->data_end    = L->down_offset + ggml_row_size(L->down_type, sc->n_embd);
        if (neurons[il] < 1 || neurons[il] > PI2_MAX_BUNDLE_NEURONS) {
            return pi2_fail(rd, "%s[%" PRIu32 "] is %" PRIu32 ", expected 1..%d", PI2_KEY_BUNDLE_NEURONS, il, neurons[il],
                            PI2_MAX_BUNDLE_NEURONS);
        }
        L->bundle_neurons = neurons[il];
        L->neuron_stride  = (L->data_end + PI2_NEURON_ALIGN - 1) / PI2_NEURON_ALIGN * PI2_NEURON_ALIGN;
        L->n_bundles      = (L->n_ff + L->bundle_neurons - 1) / L->bundle_neurons;
        if (L->bundle_size % sc->bundle_align != 0) {
            return pi2_fail(rd, "%s[%" PRIu32 "] is %" PRIu32 ", not a multiple of %s = %" PRIu32,
                            PI2_KEY_BUNDLE_SIZE, il, L->bundle_size, PI2_KEY_BUNDLE_ALIGN, sc->bundle_align);
        }
        if (L->bundle_size < (size_t) L->bundle_neurons * L->neuron_stride) {
            return pi2_fail(rd, "%s[%" PRIu32 "] is %" PRIu32 ", smaller than its %" PRIu32 " neurons of %zu bytes "
                                "(gate %s %zu + up %s %zu + down %s %zu for n_embd = %" PRIu32 ", to a multiple of %d)",
                            PI2_KEY_BUNDLE_SIZE, il, L->bundle_size, L->bundle_neurons, L->neuron_stride,
                            ggml_type_name(L->gate_type), L->up_offset, ggml_type_name(L->up_type), L->down_offset - L->up_offset,
                            ggml_type_name(L->down_type), L->data_end - L->down_offset, sc->n_embd, PI2_NEURON_ALIGN);
        }
        for (int m = 0; m < PI2_N_MATRIX; ++m) {
            L->tensor_fp[m] = fps[(size_t) PI2_N_MATRIX * il + (size_t) m];
        }
    }
    return 0;
}

//
// tensors
//

static int64_t pi2_dim_value(const struct pi2_sidecar * sc, const struct pi2_sidecar_layer * L, enum pi2_dim d) {
    switch (d) {
        case PI2_DIM_N_EMBD:      return sc->n_embd;
        case PI2_DIM_RANK:        return L->rank;
        case PI2_DIM_N_FF:        return L->n_ff;
        case PI2_DIM_BUNDLE_SIZE: return L->bundle_size;
        case PI2_DIM_N_BUNDLES:   return L->n_bundles;
        case PI2_DIM_ONE:
        default:                  return 1;
    }
}

static int pi2_check_order(struct pi2_reader * rd, uint32_t il, const struct pi2_sidecar_layer * L) {
    int32_t * slot_of = malloc((size_t) L->n_ff * sizeof(int32_t)); // neuron -> slot holding it, or -1
    if (slot_of == NULL) {
        return pi2_fail(rd, "out of memory");
    }
    memset(slot_of, 0xff, (size_t) L->n_ff * sizeof(int32_t));
    int rc = 0;
    for (uint32_t j = 0; j < L->n_ff; ++j) {
        const int32_t i = L->order[j];
        if (i < 0 || (uint32_t) i >= L->n_ff) {
            rc = pi2_fail(rd, "blk.%" PRIu32 ".%s is not a permutation of 0..n_ff-1: slot %" PRIu32 " holds %" PRId32 " (n_ff = %" PRIu32 ")",
                          il, PI2_TENSOR_ORDER, j, i, L->n_ff);
            break;
        }
        if (slot_of[i] >= 0) {
            rc = pi2_fail(rd, "blk.%" PRIu32 ".%s is not a permutation of 0..n_ff-1: neuron %" PRId32 " is in slots %" PRId32 " and %" PRIu32,
                          il, PI2_TENSOR_ORDER, i, slot_of[i], j);
            break;
        }
        slot_of[i] = (int32_t) j;
    }
    free(slot_of);
    return rc;
}

// hands buf (malloc'd bytes of tensor t) to the layer, which frees it
static void pi2_layer_set_tensor(struct pi2_sidecar_layer * L, enum pi2_tensor_id t, void * buf) {
    switch (t) {
        case PI2_T_PRED_W1: L->pred_w1 = buf; break;
        case PI2_T_PRED_B1: L->pred_b1 = buf; break;
        case PI2_T_PRED_W2: L->pred_w2 = buf; break;
        case PI2_T_PRED_B2: L->pred_b2 = buf; break;
        case PI2_T_FREQ:    L->freq    = buf; break;
        case PI2_T_ORDER:   L->order   = buf; break;
        case PI2_T_BUNDLES:
        case PI2_N_TENSOR:
        default:            free(buf); break; // never: bundles stay on disk
    }
}

static int pi2_read_tensors(struct pi2_reader * rd, struct pi2_sidecar * sc) {
    const uint64_t data = gguf_get_data_offset(rd->file.gguf);
    for (uint32_t il = 0; il < sc->n_layer; ++il) {
        struct pi2_sidecar_layer * L = &sc->layer[il];
        for (int t = 0; t < PI2_N_TENSOR && !L->whole; ++t) { // a whole expert has none
            const struct pi2_tensor_spec * spec = &pi2_tensors[t];
            char name[GGML_MAX_NAME];
            snprintf(name, sizeof(name), "blk.%" PRIu32 ".%s", il, spec->suffix);
            const int64_t id = gguf_find_tensor(rd->file.gguf, name);
            if (id < 0) {
                return pi2_fail(rd, "tensor %s is missing", name);
            }
            const enum ggml_type type = gguf_get_tensor_type(rd->file.gguf, id);
            if (type != spec->type) {
                return pi2_fail(rd, "tensor %s is %s, expected %s", name, ggml_type_name(type), ggml_type_name(spec->type));
            }
            const int64_t * ne   = gguf_get_tensor_ne(rd->file.gguf, id);
            const int64_t   want0 = pi2_dim_value(sc, L, spec->ne0);
            const int64_t   want1 = pi2_dim_value(sc, L, spec->ne1);
            if (ne[0] != want0 || ne[1] != want1 || ne[2] != 1 || ne[3] != 1) {
                return pi2_fail(rd, "tensor %s has shape (%" PRId64 ", %" PRId64 ", %" PRId64 ", %" PRId64 "), expected (%s, %s) = (%" PRId64 ", %" PRId64 ")",
                                name, ne[0], ne[1], ne[2], ne[3], pi2_dim_name[spec->ne0], pi2_dim_name[spec->ne1], want0, want1);
            }
            const uint64_t off = data + gguf_get_tensor_offset(rd->file.gguf, id); // within the file: pi2_gguf_file_open checked
            if (t == PI2_T_BUNDLES) {
                L->bundles_offset = off;
                continue;
            }
            if (t == PI2_T_PRED_W1 || t == PI2_T_PRED_W2) { // read where a predictor is kept (sidecar.h)
                *(t == PI2_T_PRED_W1 ? &L->pred_w1_offset : &L->pred_w2_offset) = off;
                continue;
            }
            const size_t nbytes = gguf_get_tensor_size(rd->file.gguf, id);
            void * buf = malloc(nbytes > 0 ? nbytes : 1);
            if (buf == NULL) {
                return pi2_fail(rd, "out of memory reading tensor %s (%zu bytes)", name, nbytes);
            }
            if (pi2_read_at(rd, buf, nbytes, off, name) != 0) {
                free(buf);
                return -1;
            }
            pi2_layer_set_tensor(L, (enum pi2_tensor_id) t, buf);
        }
        if (!L->whole && pi2_check_order(rd, il, L) != 0) {
            return -1;
        }
    }
    return 0;
}

// output.pi2_copy where the sidecar has it: a 2-D matrix of n_embd columns in one of the copy types; its bytes stay on
// disk (a load reads them once, flash/output_rows.c)
static int pi2_read_output_copy(struct pi2_reader * rd, struct pi2_sidecar * sc) {
    sc->out_copy_type = GGML_TYPE_COUNT;
    const int64_t id = gguf_find_tensor(rd->file.gguf, PI2_OPTIONAL_TENSOR_OUTPUT_COPY);
    if (id < 0) {
        return 0;
    }
    const enum ggml_type type = gguf_get_tensor_type(rd->file.gguf, id);
    if (type != GGML_TYPE_Q3_K && type != GGML_TYPE_Q2_K && type != GGML_TYPE_Q4_0) {
        return pi2_fail(rd, "tensor %s is %s, expected %s, %s or %s", PI2_OPTIONAL_TENSOR_OUTPUT_COPY, ggml_type_name(type),
                        ggml_type_name(GGML_TYPE_Q3_K), ggml_type_name(GGML_TYPE_Q2_K), ggml_type_name(GGML_TYPE_Q4_0));
    }
    const int64_t * ne = gguf_get_tensor_ne(rd->file.gguf, id);
    if (ne[0] != (int64_t) sc->n_embd || ne[1] < 1 || ne[2] != 1 || ne[3] != 1) {
        return pi2_fail(rd, "tensor %s has shape (%" PRId64 ", %" PRId64 ", %" PRId64 ", %" PRId64 "), expected (n_embd, n_vocab) "
                        "with n_embd = %" PRIu32, PI2_OPTIONAL_TENSOR_OUTPUT_COPY, ne[0], ne[1], ne[2], ne[3], sc->n_embd);
    }
    sc->out_copy_type   = type;
    sc->out_copy_rows   = ne[1];
    sc->out_copy_offset = gguf_get_data_offset(rd->file.gguf) + gguf_get_tensor_offset(rd->file.gguf, id); // in the file: checked at open
    return 0;
}

//
// public entry points
//

void pi2_sidecar_free(struct pi2_sidecar * sc) {
    if (sc == NULL) {
        return;
    }
    if (sc->layer != NULL) {
        for (uint32_t il = 0; il < sc->n_layer; ++il) {
            struct pi2_sidecar_layer * L = &sc->layer[il];
            free(L->pred_w1);
            free(L->pred_b1);
            free(L->pred_w2);
            free(L->pred_b2);
            free(L->freq);
            free(L->order);
        }
    }
    free(sc->layer);
    free(sc->first);
    free(sc->routed);
    free(sc->source_arch);
    free(sc->source_name);
    free(sc->path);
    free(sc);
}

static int pi2_sidecar_read(struct pi2_reader * rd, struct pi2_sidecar * sc) {
    if (pi2_open_gguf(rd) != 0 || pi2_check_identity(rd) != 0 ||
        pi2_check_alignment(rd) != 0) {
        return -1;
    }
    uint32_t n_layer = 0;
    uint32_t n_embd  = 0;
    if (pi2_get_u32(rd, PI2_KEY_N_LAYER, &n_layer) != 0 || pi2_get_u32(rd, PI2_KEY_N_EMBD, &n_embd) != 0) {
        return -1;
    }
    if (n_layer == 0 || n_layer > PI2_MAX_LAYERS) {
        return pi2_fail(rd, "%s is %" PRIu32 ", expected 1..%d", PI2_KEY_N_LAYER, n_layer, PI2_MAX_LAYERS);
    }
    if (n_embd == 0 || n_embd > INT32_MAX) {
        return pi2_fail(rd, "%s is %" PRIu32 ", expected 1..%d", PI2_KEY_N_EMBD, n_embd, INT32_MAX);
    }
    for (size_t i = 0; i < sizeof(pi2_keys) / sizeof(pi2_keys[0]); ++i) {
        if (pi2_check_key(rd, &pi2_keys[i], n_layer) != 0) {
            return -1;
        }
    }
    sc->file_size = rd->file.file_size;
    sc->n_embd    = n_embd;
    sc->layer     = calloc(n_layer, sizeof(*sc->layer));
    if (sc->layer == NULL) {
        return pi2_fail(rd, "out of memory");
    }
    sc->n_layer = n_layer; // only once layer[] exists: pi2_sidecar_free walks it
    if (pi2_read_globals(rd, sc) != 0 || pi2_read_layers(rd, sc) != 0 || pi2_read_tensors(rd, sc) != 0 ||
        pi2_read_output_copy(rd, sc) != 0) {
        return -1;
    }
    return 0;
}

int pi2_sidecar_open(const char * path, struct pi2_sidecar ** out, char * err, size_t errlen) {
    *out = NULL;
    if (err != NULL && errlen > 0) {
        err[0] = '\0';
    }
    if (path == NULL) {
        return pi2_fail_path(err, errlen, "(null)", "no path given");
    }
    struct pi2_reader rd = { .path = path, .file = { .fd = -1 }, .err = err, .errlen = errlen };
    struct pi2_sidecar * sc = calloc(1, sizeof(*sc));
    int rc = -1;
    if (sc == NULL || (sc->path = strdup(path)) == NULL) {
        pi2_fail(&rd, "out of memory");
    } else {
        rc = pi2_sidecar_read(&rd, sc);
    }
    pi2_gguf_file_close(&rd.file);
    if (rc != 0) {
        pi2_sidecar_free(sc);
        return -1;
    }
    *out = sc;
    return 0;
}

int pi2_sidecar_check_tensor(const struct pi2_sidecar * sc, int layer, int matrix, enum ggml_type type,
                             int64_t ne0, int64_t ne1, const void * data, size_t nbytes, char * err, size_t errlen) {
    if (err != NULL && errlen > 0) {
        err[0] = '\0';
    }
    if (matrix < 0 || matrix >= PI2_N_MATRIX) {
        return pi2_fail_path(err, errlen, sc->path, "matrix %d is not gate (0), up (1) or down (2)", matrix);
    }
    const char * what = pi2_matrix_name[matrix];
    if (layer < 0 || (uint32_t) layer >= sc->n_layer) {
        return pi2_fail_path(err, errlen, sc->path, "was made for another model (it has %" PRIu32 " FFN layers; the model has blk.%d.%s.weight)",
                             sc->n_layer, layer, what);
    }
    const struct pi2_sidecar_layer * L = &sc->layer[layer];
    const int64_t want0 = matrix == PI2_MATRIX_DOWN ? L->n_ff : sc->n_embd;
    const int64_t want1 = matrix == PI2_MATRIX_DOWN ? sc->n_embd : L->n_ff;
    if (ne0 != want0 || ne1 != want1) {
        return pi2_fail_path(err, errlen, sc->path, "was made for another model (blk.%d.%s.weight is %" PRId64 " x %" PRId64 " in the model, "
                             "%" PRId64 " x %" PRId64 " in the %s model '%s' the sidecar was made from)",
                             layer, what, ne0, ne1, want0, want1, sc->source_arch, sc->source_name);
    }
    const uint64_t fp = pi2_fingerprint_tensor((int) type, ne0, ne1, data, nbytes);
    if (fp != L->tensor_fp[matrix]) {
        return pi2_fail_path(err, errlen, sc->path, "was made for another model (fingerprint of blk.%d.%s.weight differs: "
                             "0x%016" PRIx64 " in the model (%s), 0x%016" PRIx64 " in the sidecar, made from the %s model '%s')",
                             layer, what, fp, pi2_type_name((int) type), L->tensor_fp[matrix], sc->source_arch, sc->source_name);
    }
    return 0;
}

int pi2_sidecar_validate(const char * path, char * err, size_t errlen) {
    struct pi2_sidecar * sc = NULL;
    if (pi2_sidecar_open(path, &sc, err, errlen) != 0) {
        return -1;
    }
    pi2_sidecar_free(sc);
    return 0;
}

int pi2_sidecar_summary(const char * path, uint32_t * n_layer, uint64_t * fingerprint, char * err, size_t errlen) {
    struct pi2_sidecar * sc = NULL;
    if (pi2_sidecar_open(path, &sc, err, errlen) != 0) {
        return -1;
    }
    *n_layer     = sc->n_layer;
    *fingerprint = sc->fingerprint;
    pi2_sidecar_free(sc);
    return 0;
}

int pi2_sidecar_check_weight(const char * path, int layer, int matrix, int type, int64_t ne0, int64_t ne1,
                             const void * data, size_t nbytes, char * err, size_t errlen) {
    struct pi2_sidecar * sc = NULL;
    if (pi2_sidecar_open(path, &sc, err, errlen) != 0) {
        return -1;
    }
    const int rc = pi2_sidecar_check_tensor(sc, layer, matrix, (enum ggml_type) type, ne0, ne1, data, nbytes, err, errlen);
    pi2_sidecar_free(sc);
    return rc;
}
