// A batch of several tokens through the neuron cache (a prompt on flash): the neurons any of its tokens needs are
// requested once, and each cluster of them is computed for every token of the batch while its rows are in the CPU's
// caches. Token by token, each token requested its own predicted neurons, and the gaps bridged between them went to
// scratch and were read again for the next token (a 32-token dReLU prompt read 2.5x the layer, in 70,000 requests).
// The neurons wanted are every neuron in oracle and dense modes, in predicted mode those the predictor selects for
// some token of the batch; each token computes every wanted neuron's gate and applies the mode's rule, as the
// engine does token by token (dense mode: every neuron, as llama.cpp computes a prompt in RAM; oracle mode on a
// ReLU-family model: exactly the neurons that fire).
#pragma once

#include "sparse/sparse_plan.h"

// Runs every token of the plan on up to nth threads: p->want is marked here, p->submit queues its reads.
void pi2_batch_run(struct pi2_sparse_plan * p, int nth);
