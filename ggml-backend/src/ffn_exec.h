// Runs PI2's graph nodes across the threads llama gives the backend (OpenMP: the same thread team
// ggml-cpu uses, so PI2 and the CPU backend never spin against each other on a small machine).
// It splits work into spans and hands them to the kernels (dense_matmul.c, glu.c).
#pragma once

#include "ggml.h"
#include "pi2_context.h"

enum ggml_status pi2_exec_mul_mat(struct pi2_backend_ctx * ctx, struct ggml_tensor * node);
enum ggml_status pi2_exec_glu(struct pi2_backend_ctx * ctx, struct ggml_tensor * node);

// true when nodes a, b, glu are one layer's up and gate matmuls (either order) and their GLU
bool pi2_ffn_fusable(const struct ggml_tensor * a, const struct ggml_tensor * b, const struct ggml_tensor * glu);

// gate, up and GLU in one pass over the threads: activations converted once, each span's GLU
// computed right after its gate/up rows (no barrier between the three ops)
enum ggml_status pi2_exec_gate_up_glu(struct pi2_backend_ctx * ctx, struct ggml_tensor * glu);
