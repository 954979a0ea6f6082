// Runs PI2's graph nodes across the threads llama gives the backend (OpenMP: the same thread team
// ggml-cpu uses, so PI2 and the CPU backend never spin against each other on a small machine).
// It splits work into spans and hands them to the kernels (dense_matmul.c, glu.c).
#pragma once

#include "graph/ffn_region.h"
#include "ggml.h"
#include "core/pi2_context.h"

enum ggml_status pi2_exec_mul_mat(struct pi2_backend_ctx * ctx, struct ggml_tensor * node);
// node's product with rows of `type` at data, `stride` bytes apart, in place of its weight's (the in-RAM copy
// of a weight left in the model file, output_rows.h); not counted
enum ggml_status pi2_exec_mul_mat_with(struct pi2_backend_ctx * ctx, struct ggml_tensor * node, enum ggml_type type,
                                       const void * data, size_t stride);
// a GLU node alone (its products computed before), with the activation act
enum ggml_status pi2_exec_glu(struct pi2_backend_ctx * ctx, struct ggml_tensor * node, const struct pi2_ffn_act * act);

// an FFN region's gate, up and act(gate) * up in one pass over the threads: activations converted once,
// each span's activation computed right after its gate/up rows (no barrier between them)
enum ggml_status pi2_exec_gate_up_act(struct pi2_backend_ctx * ctx, const struct pi2_ffn_region * r);

// Planning (pi2-gguf plan): the weight bytes a second this machine's decode product streams, timed as
// pi2_exec_mul_mat runs it (one token, spans over `threads` threads) on n_rows random rows of k values of `type`
// for about `seconds`. 0 with *bytes_per_s set, or -1 (a type ggml-cpu cannot dot, k not a multiple of its block,
// out of memory).
int pi2_exec_time_rows(enum ggml_type type, int64_t k, int64_t n_rows, int threads, double seconds, double * bytes_per_s);
