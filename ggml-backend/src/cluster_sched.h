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
#pragma once

#include "sparse_plan.h"

// Runs every token of the plan on up to nth threads (p->nth is set to the team's size).
void pi2_sched_run(struct pi2_sparse_plan * p, int nth);
