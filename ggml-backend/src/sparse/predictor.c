#include "sparse/predictor.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "flash/bundle_io.h"
#include "sparse/column_axpy.h"
#include "sparse/sparse_plan.h"

static void pi2_store_row(enum ggml_type t, const float * src, char * dst, int64_t n) {
    if (t == GGML_TYPE_F16) {
        ggml_fp32_to_fp16_row(src, (ggml_fp16_t *) dst, n);
    } else {
        ggml_quantize_chunk(t, src, dst, 0, 1, n, NULL);
    }
}

// the sidecar's F16 copies are not needed once decode has its own (113 MB on Qwen2.5-1.5B)
static void pi2_drop_f16(struct pi2_sidecar_layer * L) {
    free(L->pred_w1);
    free(L->pred_w2);
    L->pred_w1 = NULL;
    L->pred_w2 = NULL;
}

static enum ggml_type pi2_w1_type(const struct pi2_sidecar_layer * L, uint32_t n_embd) {
    return (n_embd % 32 == 0 && L->rank % 32 == 0) ? GGML_TYPE_Q8_0 : GGML_TYPE_F16;
}

// Q4_0 (pi2.predictor.w2_type) halves what a memory budget holds for W2, most of a wide predictor's bytes; convert
// calibrated the cutoff on the weights rounded so (converter/predictor.py, Predictor.as_decoded)
static enum ggml_type pi2_w2_type(const struct pi2_sidecar_layer * L) {
    return L->n_ff % 32 != 0 ? GGML_TYPE_F16 : L->pred_w2_type == GGML_TYPE_Q4_0 ? GGML_TYPE_Q4_0 : GGML_TYPE_Q8_0;
}

double pi2_predictor_bytes(const struct pi2_sidecar_layer * L, uint32_t n_embd) {
    // all of w2 counted, though only the rows of non-zero hidden units are read: a bound that holds
    return (double) L->rank * ggml_row_size(pi2_w1_type(L, n_embd), n_embd) + (double) L->rank * ggml_row_size(pi2_w2_type(L), L->n_ff);
}

bool pi2_predictor_pays(const struct pi2_sidecar_layer * L, uint32_t n_embd) {
    // A neuron left out saves its bundle: under a memory budget gate row, up row and down column are read and cached
    // as one piece (on the dReLU real8 at width 1024: 11 MB of predictor against 25 MB of bundles saved, but only
    // 8 MB of gate rows; dropped by the gate rows, every bundle was read, 90 MB a token). In RAM a neuron left out
    // saves only its gate row, but one rule serves both, so that a sidecar decodes the same tokens in RAM and under
    // a budget, and it is the one convert chooses predictor widths by.
    return pi2_predictor_bytes(L, n_embd) < (1.0 - L->pred_density) * (double) L->n_bundles * (double) L->bundle_size;
}

int pi2_predictor_prepare(struct pi2_predictor * P, struct pi2_sidecar_layer * L, uint32_t n_embd, bool keep,
                          uint64_t * kept, const char * path, uint32_t il, char * err, size_t errlen) {
    P->w1_type   = pi2_w1_type(L, n_embd);
    P->w1_stride = ggml_row_size(P->w1_type, n_embd);
    P->w2_type   = pi2_w2_type(L);
    P->w2_stride = ggml_row_size(P->w2_type, L->n_ff);
    P->pays      = pi2_predictor_pays(L, n_embd);
    if (!P->pays && !keep) {
        pi2_drop_f16(L); // under a budget every byte kept is a byte less of neuron cache (61 MB on Qwen2.5-1.5B)
        return 0;
    }
    // the F16 weights, from the sidecar file (sidecar.h: not read at open)
    const size_t w1_bytes = (size_t) L->rank * n_embd * sizeof(ggml_fp16_t);
    const size_t w2_bytes = (size_t) L->n_ff * L->rank * sizeof(ggml_fp16_t);
    L->pred_w1 = malloc(w1_bytes > 0 ? w1_bytes : 1);
    L->pred_w2 = malloc(w2_bytes > 0 ? w2_bytes : 1);
    const int fd = open(path, O_RDONLY | O_CLOEXEC);
    int rc = fd < 0 ? errno : L->pred_w1 == NULL || L->pred_w2 == NULL ? ENOMEM : 0;
    if (rc == 0) {
        rc = pi2_read_exact(fd, L->pred_w1, w1_bytes, L->pred_w1_offset);
    }
    if (rc == 0) {
        rc = pi2_read_exact(fd, L->pred_w2, w2_bytes, L->pred_w2_offset);
    }
    if (fd >= 0) {
        close(fd);
    }
    if (rc != 0) {
        pi2_drop_f16(L);
        snprintf(err, errlen, "sidecar %s: cannot read layer %u's predictor: %s", path, il,
                 rc == PI2_READ_EOF ? "the file ends early (changed since it was opened?)" : strerror(rc));
        return -1;
    }
    P->w1      = malloc((size_t) L->rank * P->w1_stride);
    P->w2      = malloc((size_t) L->rank * P->w2_stride);
    P->b2_slot = malloc((size_t) L->n_ff * sizeof(float));
    float * row = malloc((size_t) (n_embd > L->n_ff ? n_embd : L->n_ff) * sizeof(float));
    if (P->w1 == NULL || P->w2 == NULL || P->b2_slot == NULL || row == NULL) {
        free(row);
        snprintf(err, errlen, "sidecar %s: out of memory for layer %u predictor", path, il);
        return -1;
    }
    for (uint32_t j = 0; j < L->rank; ++j) {
        ggml_fp16_to_fp32_row(L->pred_w1 + (size_t) j * n_embd, row, n_embd);
        pi2_store_row(P->w1_type, row, P->w1 + (size_t) j * P->w1_stride, n_embd);
    }
    for (uint32_t k = 0; k < L->rank; ++k) { // the sidecar's w2 is [n_ff][rank] in neuron order
        for (uint32_t j = 0; j < L->n_ff; ++j) {
            row[j] = ggml_fp16_to_fp32(L->pred_w2[(size_t) L->order[j] * L->rank + k]); // order: a permutation
        }
        pi2_store_row(P->w2_type, row, P->w2 + (size_t) k * P->w2_stride, L->n_ff);
    }
    for (uint32_t j = 0; j < L->n_ff; ++j) {
        P->b2_slot[j] = L->pred_b2[L->order[j]];
    }
    free(row);
    pi2_drop_f16(L);
    *kept += (uint64_t) L->rank * (P->w1_stride + P->w2_stride) + (uint64_t) L->n_ff * sizeof(float);
    return 0;
}

void pi2_predictor_free(struct pi2_predictor * P) {
    free(P->w1);
    free(P->w2);
    free(P->b2_slot);
    P->w1 = P->w2 = NULL;
    P->b2_slot = NULL;
}

void pi2_predictor_hidden(struct pi2_sparse_plan * p, int ith, int nth) {
    const struct pi2_predictor * P = &p->B->pred;
    const int64_t r0 = p->rank * ith / nth, r1 = p->rank * (ith + 1) / nth;
    for (int64_t j = r0; j < r1; ++j) {
        float v = 0.0f;
        p->pred_dot((int) p->n_embd, &v, 0, P->w1 + (size_t) j * P->w1_stride, 0, p->xp, 0, 1);
        v += p->L->pred_b1[j];
        p->h[j] = v > 0.0f ? v : 0.0f;
    }
}

void pi2_predictor_scores(struct pi2_sparse_plan * p, int ith, int nth, int64_t * z0_out, int64_t * z1_out) {
    const struct pi2_predictor * P = &p->B->pred;
    const int64_t blk = ggml_blck_size(P->w2_type);
    const int64_t nb  = p->n_ff / blk;
    const int64_t z0 = nb * ith / nth * blk, z1 = nb * (ith + 1) / nth * blk;
    *z0_out = z0;
    *z1_out = z1;
    if (z1 == z0) {
        return;
    }
    const size_t off = ggml_row_size(P->w2_type, z0);
    float * z   = p->z + z0;
    float * tmp = p->tmp + (size_t) ith * p->tmp_stride;
    memcpy(z, P->b2_slot + z0, (size_t) (z1 - z0) * sizeof(float));
    struct pi2_column_sum sum = { .type = P->w2_type, .n = z1 - z0, .y = z, .tmp = tmp };
    for (int64_t k = 0; k < p->rank; ++k) {
        if (p->h[k] > 0.0f) {
            pi2_column_sum_add(&sum, p->h[k], P->w2 + (size_t) k * P->w2_stride + off);
        }
    }
    pi2_column_sum_finish(&sum);
}

size_t pi2_predictor_want_scratch(const struct pi2_sidecar_layer * L, const struct pi2_predictor * P, int64_t n_embd) {
    const enum ggml_type vdt = ggml_get_type_traits_cpu(P->w1_type)->vec_dot_type;
    return ggml_row_size(vdt, n_embd) + 64 + sizeof(float) * (size_t) (L->rank + L->n_ff + pi2_column_scratch(L->n_ff));
}

void pi2_predictor_want(const struct pi2_binding_layer * B, const struct pi2_sidecar_layer * L, const struct pi2_ffn_act * act,
                        int64_t n_embd, const float * x, void * scratch, uint8_t * want) {
    const struct ggml_type_traits_cpu * tp = ggml_get_type_traits_cpu(B->pred.w1_type);
    char * w = scratch;
    // the scratch's float arrays first (aligned as the allocation is), then the converted row
    struct pi2_sparse_plan q = {
        .act = *act, .L = L, .B = B, .n_embd = n_embd, .n_ff = L->n_ff, .rank = L->rank, .pred_dot = tp->vec_dot,
        .h = (float *) w, .z = (float *) w + L->rank, .tmp = (float *) w + L->rank + L->n_ff,
        .tmp_stride = pi2_column_scratch(L->n_ff), .nth = 1,
    };
    q.xp = w + sizeof(float) * (size_t) (L->rank + L->n_ff + q.tmp_stride);
    if (tp->vec_dot_type == GGML_TYPE_F32) {
        memcpy(q.xp, x, (size_t) n_embd * sizeof(float));
    } else {
        ggml_get_type_traits_cpu(tp->vec_dot_type)->from_float(x, q.xp, n_embd);
    }
    pi2_predictor_hidden(&q, 0, 1);
    int64_t z0 = 0, z1 = 0;
    pi2_predictor_scores(&q, 0, 1, &z0, &z1);
    for (int64_t s = 0; s < q.n_ff; ++s) {
        want[s] = pi2_plan_selects(&q, s);
    }
}
