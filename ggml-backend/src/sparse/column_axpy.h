// Down-projection kernels for sparse decode: y += a * column, where column is one neuron's down column
// stored as a row of n values in a ggml type (the sidecar's bundle layout, docs/FORMAT.md).
// ggml has dot products for every type but no axpy; dequantizing with ggml's to_float and then adding
// measured 6-60x slower than vec_dot here, so the common down types get fused dequantize-and-add loops
// written for the compiler's vectorizer. Kernels know nothing of threads.
#pragma once

#include <stdbool.h>
#include <stdint.h>

#include "ggml.h"

// true for the types with a fused kernel (F32, F16, Q8_0, Q4_K, Q6_K, Q3_K); the others go through to_float
bool pi2_column_axpy_is_fast(enum ggml_type type);

// true when the type can be a down column at all (a fused kernel or ggml's to_float)
bool pi2_column_type_usable(enum ggml_type type);

// Scratch floats for columns of up to n values: the to_float fallback dequantizes a whole column, the F16
// kernel converts 256 values at a time (so a short tmp is enough for a long F16 column)
static inline int64_t pi2_column_scratch(int64_t n) {
    return n > 256 ? n : 256;
}

// y[0..n) += a * column; tmp: pi2_column_scratch(n) floats (at least min(n, 256) for F16 columns).
// n must be a multiple of the type's block size (the sidecar reader checks this for down columns).
void pi2_column_axpy(enum ggml_type type, int64_t n, float * y, float a, const void * column, float * tmp);

// y[0..n) += a[0] * cols[0] + ... + a[3] * cols[3]: four neurons in one pass over y (SIMD kernels for Q4_K,
// Q6_K and Q8_0, the down types of the sparse models here; others run the one-column kernel four times).
// The sum's rounding differs from four one-column calls.
void pi2_column_axpy4(enum ggml_type type, int64_t n, float * y, const float * a, const void * const * cols,
                      float * tmp);

// Columns dequantized once and added for several tokens (a batch's down, where one column serves many tokens):
// dst[0..n) = column as floats.
void pi2_column_to_float(enum ggml_type type, int64_t n, float * dst, const void * column, float * tmp);

#define PI2_COLUMNS_MAX 32 // columns per pi2_columns_add4 call (a cluster's)
// For four tokens t: y[t][0..n) += sum_k a[t * PI2_COLUMNS_MAX + k] * cols[k * n ..], k < n_cols <= PI2_COLUMNS_MAX,
// each element's sum in column order (one rounding per FMA, the same at every SIMD width).
void pi2_columns_add4(int64_t n, int n_cols, const float * cols, const float * a, float * const * y);

// A batch's down for one group of up to PI2_COLUMNS_MAX columns: for n_tokens tokens t,
// y[t] (y_stride bytes apart) += sum_c a[t * lda + c] * column c. The columns some token uses (a non-zero weight; a NULL
// column is skipped) are dequantized once into colf ([PI2_COLUMNS_MAX][n] floats), then added four tokens at a time
// (pi2_columns_add4). tmp: pi2_column_scratch(n) floats. Each element's sum is taken in column order, with one rounding
// per FMA; it differs from pi2_column_sum's by the rounding of the dequantized values.
void pi2_columns_add_tokens(enum ggml_type type, int64_t n, int64_t n_tokens, float * y, size_t y_stride, int n_cols,
                            const float * a, int64_t lda, const void * const * cols, float * colf, float * tmp);

// A running sum of columns into y, four per kernel call: add columns one by one, then finish once.
// The grouping depends only on the order the columns come in, so the sum is reproducible.
struct pi2_column_sum {
    enum ggml_type type;
    int64_t        n;
    float *        y;
    float *        tmp;
    int            k;
    float          a[4];
    const void *   col[4];
};

static inline void pi2_column_sum_add(struct pi2_column_sum * s, float a, const void * column) {
    s->a[s->k]     = a;
    s->col[s->k++] = column;
    if (s->k == 4) {
        pi2_column_axpy4(s->type, s->n, s->y, s->a, s->col, s->tmp);
        s->k = 0;
    }
}

void pi2_column_sum_finish(struct pi2_column_sum * s);
