// A dense model's FFN layer read whole from the model file under a memory budget (a sidecar with pi2.dense_reads =
// model, which holds no copy of it): the layer's gate, up and down come from the expert cache (expert_file.h, where
// the layer is one expert: pinned to an entry of its own, or streamed with the next streaming layer read behind it),
// then the dense kernels compute from where they landed, as in RAM.
#pragma once

#include "ggml.h"
#include "graph/ffn_region.h"
#include "model/model_binding.h"
#include "core/pi2_context.h"

// Runs region r (r->layer: the sidecar's layer, a whole one) of model layer `layer` through b's expert cache.
// GGML_STATUS_FAILED with b->error set on a read error or a model file whose types are not the loaded model's.
enum ggml_status pi2_dense_whole_run(struct pi2_backend_ctx * ctx, struct pi2_binding * b, const struct pi2_ffn_region * r,
                                     int layer);
