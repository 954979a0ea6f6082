#define _DEFAULT_SOURCE // pread
#include "experts/expert_speculate.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "model/gguf_file.h"

void pi2_routers_free(struct pi2_routers * r) {
    if (r != NULL) {
        free(r->w);
        free(r);
    }
}

// the router of MoE layer il: found, [n_embd, n_expert], of the type of layer 0's (or *type unset), dot-able
static const struct ggml_tensor * pi2_router_tensor(const struct pi2_gguf_file * f, uint32_t il, uint32_t n_expert,
                                                    int64_t n_embd, enum ggml_type * type, int64_t * id) {
    char name[64];
    snprintf(name, sizeof(name), "blk.%u.ffn_gate_inp.weight", il);
    *id = gguf_find_tensor(f->gguf, name);
    const struct ggml_tensor * t = *id >= 0 ? ggml_get_tensor(f->meta, name) : NULL;
    if (t == NULL || ggml_n_dims(t) != 2 || t->ne[0] != n_embd || t->ne[1] != (int64_t) n_expert ||
        (*type != GGML_TYPE_COUNT && t->type != *type)) {
        return NULL;
    }
    const struct ggml_type_traits_cpu * tt = ggml_get_type_traits_cpu(t->type);
    if (tt == NULL || tt->vec_dot == NULL ||
        (tt->vec_dot_type != GGML_TYPE_F32 && ggml_get_type_traits_cpu(tt->vec_dot_type)->from_float == NULL)) {
        return NULL;
    }
    *type = t->type;
    return t;
}

int pi2_routers_open(const char * model_path, uint32_t n_layer, const uint8_t * routed, uint32_t n_expert, int64_t n_embd,
                     struct pi2_routers ** out, char * err, size_t errlen) {
    *out = NULL;
    if (n_layer == 0 || n_expert == 0) {
        return 0;
    }
    struct pi2_gguf_file f;
    if (pi2_gguf_file_open(&f, "model file", model_path, true, err, errlen) != 0) {
        pi2_gguf_file_close(&f);
        return -1;
    }
    enum ggml_type type = GGML_TYPE_COUNT; // the first router's
    int64_t id = -1;
    for (uint32_t il = 0; il < n_layer; ++il) {
        if (routed[il] && pi2_router_tensor(&f, il, n_expert, n_embd, &type, &id) == NULL) {
            pi2_gguf_file_close(&f);
            return 0;
        }
    }
    struct pi2_routers * r = calloc(1, sizeof(*r));
    const size_t row = ggml_row_size(type, n_embd);
    const size_t per_layer = row * n_expert;
    if (r == NULL || (r->w = malloc(per_layer * n_layer)) == NULL) {
        snprintf(err, errlen, "model file %.300s: out of memory for its %u routers", model_path, n_layer);
        pi2_routers_free(r);
        pi2_gguf_file_close(&f);
        return -1;
    }
    const struct ggml_type_traits_cpu * tt = ggml_get_type_traits_cpu(type);
    *r = (struct pi2_routers) {
        .n_layer = n_layer, .n_expert = n_expert, .n_embd = n_embd, .type = type, .row_size = row, .dot = tt->vec_dot,
        .to_vdt = tt->vec_dot_type != GGML_TYPE_F32 ? ggml_get_type_traits_cpu(tt->vec_dot_type)->from_float : NULL,
        .xq_size = ggml_row_size(tt->vec_dot_type, n_embd), .w = r->w,
    };
    const uint64_t data = gguf_get_data_offset(f.gguf);
    for (uint32_t il = 0; il < n_layer; ++il) {
        if (!routed[il]) { // a dense FFN layer: no router, nothing guessed for it
            memset(r->w + (size_t) il * per_layer, 0, per_layer);
            continue;
        }
        pi2_router_tensor(&f, il, n_expert, n_embd, &type, &id);
        // pi2_gguf_file_open checked that every tensor lies within the file
        uint64_t off = data + gguf_get_tensor_offset(f.gguf, id);
        uint8_t * dst = r->w + (size_t) il * per_layer;
        size_t left = per_layer;
        while (left > 0) {
            const ssize_t n = pread(f.fd, dst, left, (off_t) off);
            if (n <= 0) {
                snprintf(err, errlen, "model file %.300s: reading blk.%u.ffn_gate_inp.weight: %s", model_path, il,
                         n < 0 ? strerror(errno) : "the file ends early");
                pi2_routers_free(r);
                pi2_gguf_file_close(&f);
                return -1;
            }
            dst += n;
            off += (uint64_t) n;
            left -= (size_t) n;
        }
    }
    pi2_gguf_file_close(&f);
    *out = r;
    return 1;
}

size_t pi2_routers_scratch(const struct pi2_routers * r) {
    return r->xq_size + sizeof(float) * r->n_expert + 64;
}

void pi2_routers_top(const struct pi2_routers * r, uint32_t layer, const float * x, int k, int32_t * top, void * scratch) {
    float * score = scratch;
    char * xq = (char *) scratch + sizeof(float) * r->n_expert;
    if (r->to_vdt != NULL) {
        r->to_vdt(x, xq, r->n_embd);
    } else {
        memcpy(xq, x, (size_t) r->n_embd * sizeof(float));
    }
    const uint8_t * w = r->w + (size_t) layer * r->n_expert * r->row_size;
    for (uint32_t e = 0; e < r->n_expert; ++e) {
        r->dot((int) r->n_embd, &score[e], 0, w + (size_t) e * r->row_size, 0, xq, 0, 1);
    }
    // k is small (n_expert_used): selection by repeated maximum
    for (int j = 0; j < k; ++j) {
        int32_t best = -1;
        for (uint32_t e = 0; e < r->n_expert; ++e) {
            bool taken = false;
            for (int q = 0; q < j; ++q) {
                taken |= top[q] == (int32_t) e;
            }
            if (!taken && (best < 0 || score[e] > score[best])) {
                best = (int32_t) e;
            }
        }
        top[j] = best;
    }
}

void pi2_expert_guess_init(struct pi2_expert_guess * g) {
    *g = (struct pi2_expert_guess) { .layer = -1, .precision = 1.0f }; // guesses are read until found wrong too often
}

void pi2_expert_guess_free(struct pi2_expert_guess * g) {
    pi2_routers_free(g->routers);
    free(g->set);
    g->routers = NULL;
    g->set     = NULL;
}

int pi2_expert_guess_open(struct pi2_expert_guess * g, const char * model_path, uint32_t n_layer, const uint8_t * routed,
                          uint32_t n_expert, int64_t n_embd, char * err, size_t errlen) {
    if (g->tried) {
        return 0;
    }
    if (pi2_routers_open(model_path, n_layer, routed, n_expert, n_embd, &g->routers, err, errlen) < 0) {
        return -1;
    }
    g->layer = -1;
    if (g->routers != NULL && (g->set = calloc(n_expert, 1)) == NULL) {
        pi2_routers_free(g->routers); // guessing is an optimization: go without
        g->routers = NULL;
    }
    g->tried = true;
    return 0;
}

// The next layer routed to `right` of the experts guessed for it: the running share of guesses that were right
// (a batch's share, averaged over the last ~16 batches) decides whether the next guesses are read. A right guess
// saves a read's wait only where the disk would have idled; a wrong one costs a read and cache room whether or not
// it did, so guesses are read only while at least PI2_GUESS_MIN_PRECISION were right (measured: at 96% right the
// SmallThinker-shaped model gained 8%; at 70% the Qwen3-shaped one lost 9%, 2026-11-26).
void pi2_expert_guess_scored(struct pi2_expert_guess * g, uint32_t n_expert, uint64_t right) {
    uint64_t n = 0;
    for (uint32_t e = 0; e < n_expert; ++e) {
        n += g->set[e] != 0;
    }
    if (n > 0) {
        g->precision += ((float) right / (float) n - g->precision) / 16.0f;
    }
    g->layer = -1;
}
