// One weight row dotted with several tokens at once: the row's unpacking (scales, nibbles) is shared by the tokens,
// which a prompt batch's rows x tokens loops otherwise repeat per token through ggml-cpu's vec_dot. Each token's
// result is vec_dot's bit for bit: the same integer sums, the same float operations in the same order.
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "ggml-cpu.h"
#include "ggml.h"

#define PI2_DOT_TOKENS 4 // tokens per call

// s[k] = row . ys[k] for k < PI2_DOT_TOKENS; n: the row's length; ys[k]: token k in the type's vec_dot_type
typedef void (*pi2_dot_tokens_t)(int n, float * s, const void * row, const void * const * ys);

// The kernel for rows of `type`, or NULL where this build has none for it, or where its results differ from vec_dot's
// (ggml-cpu's dot product for the type, built for another instruction set), checked on a few rows (~0.1 ms for Q4_K,
// whose reference quantizer makes them). checked: the caller's memo of that check for this type (0: not made yet; the
// outcome is stored there), or NULL to check now.
pi2_dot_tokens_t pi2_dot_tokens_for(enum ggml_type type, ggml_vec_dot_t vec_dot, int8_t * checked);

// out[k] = row . token idx[k] for k < m, the tokens x_stride bytes apart from x: the kernel for groups of
// PI2_DOT_TOKENS, vec_dot for the rest (kernel NULL: vec_dot for all)
void pi2_dot_listed(pi2_dot_tokens_t kernel, ggml_vec_dot_t vec_dot, int n, const void * row, const char * x,
                    size_t x_stride, const int32_t * idx, int64_t m, float * out);
