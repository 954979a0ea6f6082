// Runs PI2's graph nodes across the threads llama gives the backend (OpenMP: the same thread team
// ggml-cpu uses, so PI2 and the CPU backend never spin against each other on a small machine).
// It splits work into spans and hands them to the kernels (dense_matmul.c, glu.c).
#pragma once

#include "ggml.h"
#include "pi2_context.h"

enum ggml_status pi2_exec_mul_mat(struct pi2_backend_ctx * ctx, struct ggml_tensor * node);
enum ggml_status pi2_exec_glu(struct pi2_backend_ctx * ctx, struct ggml_tensor * node);
