// The neuron-cluster scheduler: runs one layer's sparse decode across the threads llama gives the
// backend (OpenMP: the same thread team ggml-cpu uses, so PI2 and the CPU backend never spin against each
// other), token by token, in phases separated by barriers:
//   0. outputs cleared, activations converted once per token;
//   1. the predictor's hidden layer, then its scores (predicted layers);
//   2. the clusters: each thread's share of candidate slots through gate, threshold and up (on flash, the
//      pipeline's request hook first queues the bundles they need);
//   3. down, as a sum of the active neurons' columns split evenly over the threads, or by dense rows.
// Clusters go to threads interleaved (every nth, so hot ones come first on each) or, where the
// predictor's scores show the work, in balanced contiguous runs. A run is reproducible for a thread count.
//
// The barrier contract (batch_ffn.c keeps the same for a prompt batch): this scheduler starts the thread team and
// owns every barrier of a token; nothing it calls (the predictor, the kernels, the pipeline's mark and submit
// hooks, the bundle accessor) waits at a barrier or starts threads. Every thread takes the same branches between
// two barriers: a flag that changes them (p->failed) is set before a barrier and read after it. Kernels get bundle
// bytes only through pi2_plan_bundle (sparse_plan.h), which may wait for one entry's read, never for a thread.
#pragma once

#include "sparse/sparse_plan.h"

// Runs every token of the plan on up to nth threads (p->nth is set to the team's size).
void pi2_sched_run(struct pi2_sparse_plan * p, int nth);
