// Dense matrix-vector / matrix-matrix kernel over ggml-cpu's per-type dot products.
// dst[t][r] = dot(W[r], x[t]) for a span of weight rows r and all tokens t. The activations x must
// already be converted to the weight type's vec_dot_type (see pi2_dense_quantize_tokens).
// Kernels know nothing of threads: the scheduler (ffn_exec.c) hands out row spans.
#pragma once

#include <stddef.h>
#include <stdint.h>

#include "ggml-cpu.h"
#include "dense/dot_tokens.h"

struct pi2_dense_args {
    const char *   w;          // weight rows
    size_t         w_stride;   // bytes between weight rows
    int64_t        k;          // row length (elements)
    const char *   x;          // tokens in vec_dot_type
    size_t         x_stride;   // bytes between tokens
    int64_t        n_tokens;
    float *        dst;        // dst[t*dst_stride + r]
    int64_t        dst_stride; // floats between tokens in dst
    ggml_vec_dot_t vec_dot;
    pi2_dot_tokens_t dot_tokens; // several tokens a call (pi2_dot_tokens_for), or NULL: vec_dot alone
};

void pi2_dense_rows(const struct pi2_dense_args * a, int64_t r0, int64_t r1);

// converts tokens [t0, t1) of f32 src (src_stride bytes apart) into vec_dot_type rows of x_stride bytes
void pi2_dense_quantize_tokens(const float * src, size_t src_stride, int64_t k, ggml_from_float_t from_float,
                               char * x, size_t x_stride, int64_t t0, int64_t t1);
