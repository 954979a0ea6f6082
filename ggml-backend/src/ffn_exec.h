// Runs PI2's graph nodes across the threads llama gives the backend (OpenMP: the same thread team
// ggml-cpu uses, so PI2 and the CPU backend never spin against each other on a small machine).
// It splits work into spans and hands them to the kernels (dense_matmul.c, glu.c).
#pragma once

#include "ffn_region.h"
#include "ggml.h"
#include "pi2_context.h"

enum ggml_status pi2_exec_mul_mat(struct pi2_backend_ctx * ctx, struct ggml_tensor * node);
// a GLU node alone (its products computed before), with the activation act
enum ggml_status pi2_exec_glu(struct pi2_backend_ctx * ctx, struct ggml_tensor * node, const struct pi2_ffn_act * act);

// an FFN region's gate, up and act(gate) * up in one pass over the threads: activations converted once,
// each span's activation computed right after its gate/up rows (no barrier between them)
enum ggml_status pi2_exec_gate_up_act(struct pi2_backend_ctx * ctx, const struct pi2_ffn_region * r);
