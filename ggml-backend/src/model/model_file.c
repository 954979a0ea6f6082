// What pi2_gguf.Llama checks of a model before llama loads it: the GGUF header (gguf_file.c), the gated
// FFN layers (blk.N.ffn_{gate,up,down}.weight, 2-D, shapes that agree), their fingerprint (FORMAT.md)
// and the bytes a memory budget leaves out of RAM. Of the tensor data only the fingerprint's samples are
// read. (gguf-py's reader built ~500 MB of Python objects for Qwen2.5-1.5B's vocabulary, and 36 MB of
// them stayed resident after it was dropped: memory a budget then took from the neuron cache.)
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "graph/activation.h"
#include "flash/bundle_io.h"
#include "graph/ffn_names.h"
#include "model/fingerprint.h"
#include "ggml-pi2.h"
#include "model/gguf_file.h"
#include "flash/output_rows.h"
#include "core/pi2_log.h"
#include "model/sidecar_format.h"

#define PI2_MODEL "model file"

// tensor name's 2-D shape and type, or -1 with err set
static int pi2_ffn_tensor(const struct pi2_gguf_file * f, const char * path, const char * gate, const char * name,
                          const struct ggml_tensor ** t, char * err, size_t errlen) {
    *t = ggml_get_tensor(f->meta, name);
    if (*t == NULL) {
        return pi2_gguf_fail(err, errlen, PI2_MODEL, path, "has %s but no %s", gate, name);
    }
    if (ggml_n_dims(*t) != 2) {
        return pi2_gguf_fail(err, errlen, PI2_MODEL, path, "%s has %d dimensions, expected 2", name, ggml_n_dims(*t));
    }
    return 0;
}

// the fingerprint of a tensor of the file, from its samples (read, not mapped: the kernel's fault-around
// made a mapping of SmolLM2 resident by 67 MB for 1.4k sampled pages)
static int pi2_file_tensor_fingerprint(const struct pi2_gguf_file * f, const char * path, const struct ggml_tensor * t,
                                       uint64_t offset, size_t nbytes, uint64_t * fp, char * err, size_t errlen) {
    uint8_t buf[PI2_FP_SAMPLE_BYTES];
    uint64_t h = pi2_fingerprint_header(t->type, t->ne[0], t->ne[1], nbytes);
    for (int k = 0; k < PI2_FP_SAMPLES; ++k) {
        size_t len = 0;
        const size_t off = pi2_fingerprint_sample(nbytes, k, &len);
        const int r = pi2_read_exact(f->fd, buf, len, offset + off); // within the file: pi2_gguf_file_open checked
        if (r != 0) {
            return pi2_gguf_fail(err, errlen, PI2_MODEL, path, "cannot read %s: %s", t->name,
                                 r == PI2_READ_EOF ? "the file ends early" : strerror(r));
        }
        h = pi2_fnv1a64(buf, len, h);
    }
    *fp = h;
    return 0;
}

// Model layer il's routed experts: one FFN per expert, numbered from *n on in the order the sidecar numbers its
// layers (FORMAT.md, "MoE sidecars"), each fingerprinted over its expert's slice of the stacked tensors. 0 with
// *n advanced; 1 when the layer has no routed experts; -1 with err.
static int pi2_summarize_experts(const struct pi2_gguf_file * f, const char * path, uint32_t il, uint64_t * fps, uint32_t * n,
                                 int64_t * n_expert, uint64_t * ffn_bytes, char * err, size_t errlen) {
    const uint64_t data = gguf_get_data_offset(f->gguf);
    static const char * const suffix[PI2_N_MATRIX] = { "ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight" };
    char name[PI2_N_MATRIX][PI2_FFN_NAME_MAX];
    const struct ggml_tensor * t[PI2_N_MATRIX];
    for (int m = 0; m < PI2_N_MATRIX; ++m) {
        snprintf(name[m], sizeof(name[m]), "blk.%" PRIu32 ".%s", il, suffix[m]);
    }
    // ffn_gate_up_exps (the converter's --fuse-gate-up-exps): each expert's gate rows, then its up rows
    char fused_name[PI2_FFN_NAME_MAX];
    snprintf(fused_name, sizeof(fused_name), "blk.%" PRIu32 ".ffn_gate_up_exps.weight", il);
    const bool fused = gguf_find_tensor(f->gguf, name[0]) < 0 && gguf_find_tensor(f->gguf, fused_name) >= 0;
    struct ggml_tensor half[2];
    if (fused) {
        const struct ggml_tensor * gu = ggml_get_tensor(f->meta, fused_name);
        if (gu == NULL || ggml_n_dims(gu) != 3 || gu->ne[1] % 2 != 0) {
            return pi2_gguf_fail(err, errlen, PI2_MODEL, path, "%s is not [*, 2 n_ff, n_expert]", fused_name);
        }
        for (int k = 0; k < 2; ++k) {
            half[k] = *gu;
            half[k].ne[1] = gu->ne[1] / 2;
            t[k] = &half[k];
            snprintf(name[k], sizeof(name[k]), "%s", fused_name);
        }
    } else if (gguf_find_tensor(f->gguf, name[0]) < 0) {
        return 1;
    }
    for (int m = fused ? PI2_MATRIX_DOWN : 0; m < PI2_N_MATRIX; ++m) {
        t[m] = ggml_get_tensor(f->meta, name[m]);
        if (t[m] == NULL) {
            return pi2_gguf_fail(err, errlen, PI2_MODEL, path, "has %s but no %s", name[0], name[m]);
        }
        if (ggml_n_dims(t[m]) != 3 || (*n_expert >= 0 && t[m]->ne[2] != *n_expert)) {
            return pi2_gguf_fail(err, errlen, PI2_MODEL, path, "%s is not [*, *, n_expert] like the other expert tensors", name[m]);
        }
        *n_expert = t[m]->ne[2];
    }
    if (!(t[0]->ne[0] == t[1]->ne[0] && t[1]->ne[0] == t[2]->ne[1] && t[0]->ne[1] == t[1]->ne[1] && t[1]->ne[1] == t[2]->ne[0]) ||
        t[0]->ne[2] != *n_expert) {
        return pi2_gguf_fail(err, errlen, PI2_MODEL, path, "layer %" PRIu32 " expert shapes disagree", il);
    }
    if ((uint64_t) *n + (uint64_t) *n_expert > PI2_MAX_LAYERS) {
        return pi2_gguf_fail(err, errlen, PI2_MODEL, path, "has more than %d (layer, expert) FFNs", PI2_MAX_LAYERS);
    }
    for (int64_t e = 0; e < *n_expert; ++e, ++*n) {
        for (int m = 0; m < PI2_N_MATRIX; ++m) {
            const bool    in_fused = fused && m != PI2_MATRIX_DOWN; // half m of the expert's fused slice
            const int64_t id    = gguf_find_tensor(f->gguf, name[m]);
            const size_t  slice = gguf_get_tensor_size(f->gguf, id) / (size_t) *n_expert / (in_fused ? 2 : 1);
            const uint64_t at   = data + gguf_get_tensor_offset(f->gguf, id) + (uint64_t) e * slice * (in_fused ? 2 : 1) +
                                  (in_fused && m == PI2_MATRIX_UP ? slice : 0);
            if (pi2_file_tensor_fingerprint(f, path, t[m], at, slice, &fps[PI2_N_MATRIX * *n + m], err, errlen) != 0) {
                return -1;
            }
            *ffn_bytes += slice;
        }
    }
    return 0;
}

static int pi2_summarize_layers(const struct pi2_gguf_file * f, const char * path, uint64_t * fps,
                                struct pi2_model_summary * out, char * err, size_t errlen);

static int pi2_summarize(const struct pi2_gguf_file * f, const char * path, struct pi2_model_summary * out, char * err,
                         size_t errlen) {
    uint64_t * fps = malloc(sizeof(uint64_t) * PI2_N_MATRIX * PI2_MAX_LAYERS); // 384 KiB: not on the stack
    if (fps == NULL) {
        return pi2_gguf_fail(err, errlen, PI2_MODEL, path, "out of memory for its fingerprints");
    }
    const int rc = pi2_summarize_layers(f, path, fps, out, err, errlen);
    free(fps);
    return rc;
}

// Model layer il's 2-D FFN (its dense FFN, or with `shared` the shared expert beside its routed ones) as FFN *n,
// fingerprinted whole. 0 with *n advanced; 1 when the layer has none; -1 with err.
static int pi2_summarize_ffn(const struct pi2_gguf_file * f, const char * path, uint32_t il, bool shared, uint64_t * fps,
                             uint32_t * n, uint64_t * ffn_bytes, char * err, size_t errlen) {
    const uint64_t data = gguf_get_data_offset(f->gguf);
    char name[PI2_N_MATRIX][PI2_FFN_NAME_MAX];
    for (int m = 0; m < PI2_N_MATRIX; ++m) {
        (shared ? pi2_shexp_weight_name : pi2_ffn_weight_name)((int) il, (enum pi2_matrix) m, name[m], sizeof(name[m]));
    }
    const struct ggml_tensor * t[PI2_N_MATRIX];
    struct ggml_tensor half[2]; // a fused gate+up (phi3's ffn_up, no ffn_gate): its gate rows, then its up rows
    int64_t fused_id = -1;
    if (gguf_find_tensor(f->gguf, name[0]) < 0) {
        const struct ggml_tensor * up = shared ? NULL : ggml_get_tensor(f->meta, name[PI2_MATRIX_UP]);
        const struct ggml_tensor * dn = shared ? NULL : ggml_get_tensor(f->meta, name[PI2_MATRIX_DOWN]);
        if (up == NULL || dn == NULL || ggml_n_dims(up) != 2 || ggml_n_dims(dn) != 2 || up->ne[1] != 2 * dn->ne[0]) {
            return 1;
        }
        for (int k = 0; k < 2; ++k) {
            half[k] = *up;
            half[k].ne[1] = dn->ne[0];
            half[k].nb[2] = half[k].nb[3] = (size_t) dn->ne[0] * up->nb[1];
            t[k] = &half[k];
        }
        t[PI2_MATRIX_DOWN] = dn;
        fused_id = gguf_find_tensor(f->gguf, name[PI2_MATRIX_UP]);
    }
    if (*n == PI2_MAX_LAYERS) {
        return pi2_gguf_fail(err, errlen, PI2_MODEL, path, "has more than %d FFN layers", PI2_MAX_LAYERS);
    }
    for (int m = 0; fused_id < 0 && m < PI2_N_MATRIX; ++m) {
        if (pi2_ffn_tensor(f, path, name[0], name[m], &t[m], err, errlen) != 0) {
            return -1;
        }
    }
    if (!(t[0]->ne[0] == t[1]->ne[0] && t[1]->ne[0] == t[2]->ne[1] && t[0]->ne[1] == t[1]->ne[1] && t[1]->ne[1] == t[2]->ne[0])) {
        return pi2_gguf_fail(err, errlen, PI2_MODEL, path, "layer %" PRIu32 " %s shapes disagree: gate %" PRId64 "x%" PRId64
                             ", up %" PRId64 "x%" PRId64 ", down %" PRId64 "x%" PRId64, il, shared ? "shared expert" : "FFN",
                             t[0]->ne[0], t[0]->ne[1], t[1]->ne[0], t[1]->ne[1], t[2]->ne[0], t[2]->ne[1]);
    }
    for (int m = 0; m < PI2_N_MATRIX; ++m) {
        const bool    in_fused = fused_id >= 0 && m != PI2_MATRIX_DOWN;
        const int64_t id    = in_fused ? fused_id : gguf_find_tensor(f->gguf, name[m]);
        const size_t  bytes = in_fused ? gguf_get_tensor_size(f->gguf, id) / 2 : gguf_get_tensor_size(f->gguf, id);
        const uint64_t at   = data + gguf_get_tensor_offset(f->gguf, id) + (in_fused && m == PI2_MATRIX_UP ? bytes : 0);
        if (pi2_file_tensor_fingerprint(f, path, t[m], at, bytes, &fps[PI2_N_MATRIX * *n + m], err, errlen) != 0) {
            return -1;
        }
        *ffn_bytes += bytes;
    }
    ++*n;
    return 0;
}

static int pi2_summarize_layers(const struct pi2_gguf_file * f, const char * path, uint64_t * fps,
                                struct pi2_model_summary * out, char * err, size_t errlen) {
    // FFN layers in model order, as the sidecar numbers them (FORMAT.md, "MoE sidecars"): routed experts (one FFN
    // each) and after them their shared expert, or a dense FFN
    uint32_t n = 0; // FFNs so far
    int64_t n_expert = -1;
    for (uint32_t il = 0;; ++il) {
        int rc = pi2_summarize_experts(f, path, il, fps, &n, &n_expert, &out->ffn_bytes, err, errlen);
        if (rc == 0) {
            rc = pi2_summarize_ffn(f, path, il, true, fps, &n, &out->ffn_bytes, err, errlen);
            rc = rc > 0 ? 0 : rc;
        } else if (rc > 0) {
            rc = pi2_summarize_ffn(f, path, il, false, fps, &n, &out->ffn_bytes, err, errlen);
        }
        if (rc < 0) {
            return -1;
        }
        if (rc > 0) {
            break;
        }
    }
    out->n_layer     = n;
    out->fingerprint = n > 0 ? pi2_fingerprint_model(fps, PI2_N_MATRIX * (size_t) n) : 0;
    const int64_t embd = gguf_find_tensor(f->gguf, "token_embd.weight");
    const int64_t output = gguf_find_tensor(f->gguf, PI2_OUTPUT_NAME);
    if (embd >= 0 && output >= 0) {
        out->embedding_bytes = gguf_get_tensor_size(f->gguf, embd);
    }
    // the output matrix: output.weight, or a tied token_embd.weight (llama multiplies by a duplicate of it)
    const int64_t oid = output >= 0 ? output : embd;
    const struct ggml_tensor * ot = oid >= 0 ? ggml_get_tensor(f->meta, output >= 0 ? PI2_OUTPUT_NAME : PI2_EMBD_NAME) : NULL;
    if (ot != NULL && ggml_n_dims(ot) == 2) {
        out->output_bytes = gguf_get_tensor_size(f->gguf, oid);
        const enum ggml_type copy = pi2_output_copy_type(ot->type, ot->ne[0], false); // the larger copy: a bound
        out->output_copy_bytes = copy != GGML_TYPE_COUNT ? ggml_row_size(copy, ot->ne[0]) * (uint64_t) ot->ne[1] : 0;
    }
    return 0;
}

// The FFN activation llama.cpp computes for the model: the one its architecture's graph builds whatever the file
// says (pi2_arch_activation: smallthinker's ReGLU experts, gemma's GEGLU), else the one it states in
// "<arch>.ffn_activation" (and, for FATReLU, its threshold in "<arch>.ffn_activation_threshold"); -1 when
// neither: the graph's GLU decides. An unknown or malformed statement is an error: llama would run the model
// with some other activation, silently wrong.
static int pi2_stated_activation(const struct pi2_gguf_file * f, const char * path, struct pi2_model_summary * out,
                                 char * err, size_t errlen) {
    out->activation = -1;
    const int64_t ia = gguf_find_key(f->gguf, "general.architecture");
    if (ia < 0 || gguf_get_kv_type(f->gguf, ia) != GGUF_TYPE_STRING) {
        return 0;
    }
    const char * arch = gguf_get_val_str(f->gguf, ia);
    char key[256], tkey[sizeof(key) + 16];
    snprintf(key, sizeof(key), "%s.ffn_activation", arch);
    snprintf(tkey, sizeof(tkey), "%s_threshold", key);
    const int64_t k = gguf_find_key(f->gguf, key);
    const int64_t kt = gguf_find_key(f->gguf, tkey);
    enum pi2_activation a = PI2_ACT_COUNT;
    float t = 0.0f;
    if (k < 0 && kt >= 0) {
        return pi2_gguf_fail(err, errlen, PI2_MODEL, path, "has %s but no %s", tkey, key);
    }
    if (k >= 0) {
        if (gguf_get_kv_type(f->gguf, k) != GGUF_TYPE_STRING) {
            return pi2_gguf_fail(err, errlen, PI2_MODEL, path, "%s is not a string", key);
        }
        const char * name = gguf_get_val_str(f->gguf, k);
        a = pi2_activation_parse(name);
        if (a == PI2_ACT_COUNT) {
            return pi2_gguf_fail(err, errlen, PI2_MODEL, path, "states FFN activation %s = '%s'; pi2 computes silu, gelu, "
                                 "gelu_erf, relu (reglu), drelu and fatrelu", key, name);
        }
        if (kt >= 0) {
            if (gguf_get_kv_type(f->gguf, kt) != GGUF_TYPE_FLOAT32) {
                return pi2_gguf_fail(err, errlen, PI2_MODEL, path, "%s is not a float32", tkey);
            }
            t = gguf_get_val_f32(f->gguf, kt);
        }
        if (a == PI2_ACT_FATRELU ? !(isfinite(t) && t >= 0.0f) : t != 0.0f) {
            return pi2_gguf_fail(err, errlen, PI2_MODEL, path, "%s is %g: fatrelu needs a finite threshold >= 0, and %s "
                                 "has none", tkey, (double) t, name);
        }
    }
    const struct pi2_arch_act * built = pi2_arch_activation(arch);
    if (built != NULL) {
        if (a != PI2_ACT_COUNT && (a != built->kind || t != 0.0f)) {
            PI2_LOG_WARN("pi2: %s states %s = %s, but llama.cpp's %s graph computes %s whatever it states; PI2 computes %s\n",
                         path, key, pi2_activation_names[a], arch, pi2_activation_names[built->kind],
                         pi2_activation_names[built->kind]);
        }
        a = built->kind;
        t = 0.0f;
    }
    if (a == PI2_ACT_COUNT) {
        return 0;
    }
    out->activation           = (int32_t) a;
    out->activation_threshold = t;
    out->experts_native       = built != NULL && built->experts_native;
    return 0;
}

int pi2_model_summary(const char * path, struct pi2_model_summary * out, char * err, size_t errlen) {
    memset(out, 0, sizeof(*out));
    if (err != NULL && errlen > 0) {
        err[0] = '\0';
    }
    if (path == NULL) {
        return pi2_gguf_fail(err, errlen, PI2_MODEL, "(null)", "no path given");
    }
    struct pi2_gguf_file f;
    int rc = pi2_gguf_file_open(&f, PI2_MODEL, path, true, err, errlen);
    if (rc == 0) {
        out->file_size = f.file_size;
        out->n_tensors = gguf_get_n_tensors(f.gguf);
        rc = pi2_summarize(&f, path, out, err, errlen);
    }
    if (rc == 0) {
        rc = pi2_stated_activation(&f, path, out, err, errlen);
    }
    pi2_gguf_file_close(&f);
    return rc;
}
