// GLU kernels: y = act(x) * g over a span of one row.
// They reproduce ggml-cpu's numerics exactly (same SIMD expf, same fp16 GELU table), because a
// different silu (e.g. libm expf) flips near-ties in greedy decoding against stock llama.cpp.
// Kernels know nothing of threads: the caller hands each thread its own span.
#pragma once

#include <stdbool.h>
#include <stdint.h>

#include "graph/activation.h"
#include "ggml.h"

struct pi2_glu_tables {
    uint16_t gelu_f16[1 << 16]; // gelu(x) for every fp16 x, as ggml-cpu's ggml_table_gelu_f16
};

void pi2_glu_tables_init(struct pi2_glu_tables * t);

// true for the GLU ops these kernels implement
bool pi2_glu_supported(enum ggml_glu_op op);

// y[i] = act_gate(x[i]) * act_up(g[i]) for i in [0, n) (activation.h); false (y untouched) for one it does
// not implement. SiLU, GELU and ReGLU as ggml-cpu computes them; dReLU and FATReLU exactly.
bool pi2_glu_span(const struct pi2_glu_tables * t, const struct pi2_ffn_act * a, int n, float * y, const float * x, const float * g);

// SIMD width the kernels use: spans that start at a multiple of it give ggml's exact vector/tail split
#define PI2_GLU_SPAN_ALIGN 16
