// The pi2 sidecar reader (docs/FORMAT.md). pi2_sidecar_open reads the file through ggml's GGUF reader,
// refuses anything FORMAT.md says readers must refuse, and keeps what decode needs in memory: per-layer
// metadata and the small tensors (predictor, frequencies, order). Bundles stay on disk; only their
// file offset is kept, for the bundle reader. A pi2_sidecar is immutable once opened, except that a model
// binding (model_binding.c), which owns its sidecar, drops the F16 predictor weights once it has its copies.
#pragma once

#include <stddef.h>
#include <stdint.h>

#include "graph/activation.h"
#include "ggml-pi2.h"
#include "ggml.h"

enum pi2_sparsity_method {
    PI2_SPARSITY_METHOD_CATS, // active iff |act(gate_i . x)| > threshold
    PI2_SPARSITY_METHOD_RELU, // active iff act(gate_i . x) > 0
    // admitted iff |act(gate_i . x)| > threshold; an admitted neuron is active iff
    // |act(gate_i . x) * (up_i . x)| > product_threshold
    PI2_SPARSITY_METHOD_PRODUCT,
};

struct pi2_sidecar_layer {
    // a routed expert of a sidecar whose experts are read whole from the model file (pi2.moe.expert_reads = model), or
    // a dense model's FFN layer read so (pi2.dense_reads = model): only n_ff, the types, density and fingerprints are set; no bundles, predictor or ranking (every pointer NULL)
    bool     whole;
    uint32_t n_ff;
    uint32_t rank;           // r, hidden width of the predictor
    uint32_t hot_count;      // bundle slots [0, hot_count) hold the hot neurons
    float    threshold;      // pi2.sparsity.thresholds
    float    product_threshold; // pi2.sparsity.product_thresholds (method product; else 0)
    float    cutoff;         // predicted active iff s(z_i) > cutoff: s = |act(z)| (cats) or z (relu)
    float    pred_density;   // fraction of neurons the predictor selects (held-out, pi2.predictor.density)
    float    density;        // fraction of neurons active (held-out, pi2.sparsity.density)
    enum ggml_type pred_w2_type; // what decode holds the predictor's W2 in where n_ff allows (pi2.predictor.w2_type)

    // bundle slot j (neuron order[j]) is neuron j % bundle_neurons of bundle j / bundle_neurons, at
    // bundles_offset + pi2_slot_offset(L, j) in the file
    uint32_t       bundle_size;    // bytes per bundle (the unit read from flash)
    uint32_t       bundle_neurons; // neurons per bundle
    uint32_t       n_bundles;
    size_t         neuron_stride;  // from one neuron of a bundle to the next
    enum ggml_type gate_type;
    enum ggml_type up_type;
    enum ggml_type down_type;
    size_t         up_offset;      // parts within a bundle: gate row at 0, then up row, then down column
    size_t         down_offset;
    size_t         data_end;       // end of a neuron's parts
    uint64_t       bundles_offset; // absolute file offset of blk.N.pi2_bundles, a multiple of PI2_BUNDLE_ALIGN

    uint64_t tensor_fp[PI2_N_MATRIX]; // fingerprints of the model's gate, up, down weights

    // small tensors, malloc'd, bytes as in the file. The predictor's F16 weights are read only where a binding keeps
    // its predictor (pi2_predictor_prepare, from their file offsets), one layer at a time: read whole at open they
    // were a transient of 117 MB for an MoE sidecar of 512 layers, which a memory budget's cgroup OOM-killed
    uint64_t      pred_w1_offset, pred_w2_offset;
    ggml_fp16_t * pred_w1; // [rank][n_embd], NULL until read
    float *       pred_b1; // [rank]
    ggml_fp16_t * pred_w2; // [n_ff][rank], NULL until read
    float *       pred_b2; // [n_ff]
    float *       freq;    // [n_ff]
    int32_t *     order;   // [n_ff], a permutation of 0..n_ff-1
};

// Byte offset of bundle slot j from the layer's first bundle.
static inline size_t pi2_slot_offset(const struct pi2_sidecar_layer * L, int64_t j) {
    if (L->bundle_neurons == 1) {
        return (size_t) j * L->bundle_size;
    }
    return (size_t) (j / L->bundle_neurons) * L->bundle_size + (size_t) (j % L->bundle_neurons) * L->neuron_stride;
}

struct pi2_sidecar {
    char *   path;
    uint64_t file_size;
    uint32_t n_layer;
    uint32_t n_embd;
    uint64_t fingerprint; // pi2.source.fingerprint
    uint32_t bundle_align; // pi2.bundle.align: bundle sizes, and so their file offsets, are multiples of it
    char *   source_arch;
    char *   source_name;
    int32_t  output_rows; // pi2.budget.output_rows, -1 where the sidecar records none
    int32_t  output_copy; // pi2.budget.output_copy as PI2_OUTPUT_COPY's value (1: q2_k, 0: q3_k), -1 where none
    // output.pi2_copy (FORMAT.md, "Optional tensor"): its type (GGML_TYPE_COUNT where the sidecar has none), rows and
    // absolute file offset; which output matrix it copies is checked where the model's is known (model_binding.c)
    enum ggml_type out_copy_type;
    int64_t        out_copy_rows;
    uint64_t       out_copy_offset;
    uint32_t n_expert;    // pi2.moe.expert_count: layers are (MoE layer, expert) and dense FFN layers; 0: dense
    bool     experts_whole; // pi2.moe.expert_reads = model: routed experts are read whole from the model file
    bool     dense_whole;   // pi2.dense_reads = model: a dense model's FFN layers are read whole from the model file
    enum ggml_type pred_w2_type; // pi2.predictor.w2_type: Q8_0 (also where absent) or Q4_0
    // model layer il's FFN is sidecar layers first[il] .. first[il + 1] - 1: one for a dense FFN, n_expert for
    // routed experts, n_expert + 1 for routed experts and their shared expert (pi2.moe.layer_experts; FORMAT.md,
    // "MoE sidecars"); use the functions below
    uint32_t   n_model_layer;
    uint32_t * first;  // [n_model_layer + 1]
    uint8_t *  routed; // [n_model_layer] 1: routed experts, 0: a dense FFN

    struct pi2_ffn_act       activation;
    enum pi2_sparsity_method sparsity_method;

    struct pi2_sidecar_layer * layer; // [n_layer]
};

// The sidecar layer of model layer il's 2-D FFN: its dense FFN, or the shared expert beside its routed ones
// (blk.il.ffn_*.weight or blk.il.ffn_*_shexp.weight: a layer has one or the other); -1 where it has none.
static inline int pi2_sidecar_dense_layer(const struct pi2_sidecar * sc, int il) {
    if (il < 0 || (uint32_t) il >= sc->n_model_layer) {
        return -1;
    }
    if (!sc->routed[il]) {
        return (int) sc->first[il];
    }
    return sc->first[il + 1] - sc->first[il] == sc->n_expert + 1 ? (int) (sc->first[il] + sc->n_expert) : -1;
}

// The sidecar layer of expert e of model layer il's routed experts, or -1 where the layer has none.
static inline int pi2_sidecar_expert_layer(const struct pi2_sidecar * sc, int il, int64_t e) {
    return il >= 0 && (uint32_t) il < sc->n_model_layer && sc->routed[il] && e >= 0 && e < (int64_t) sc->n_expert
               ? (int) (sc->first[il] + (uint32_t) e) : -1;
}

// Whether sidecar layer v is a routed expert (not a dense FFN or a shared expert).
static inline bool pi2_sidecar_layer_routed(const struct pi2_sidecar * sc, uint32_t v) {
    for (uint32_t il = 0; il < sc->n_model_layer; ++il) {
        if (v >= sc->first[il] && v < sc->first[il + 1]) {
            return sc->routed[il] && v < sc->first[il] + sc->n_expert;
        }
    }
    return false;
}

// 0 and *out set on success; -1 with err filled ("sidecar PATH: problem") otherwise. err may be NULL.
int  pi2_sidecar_open(const char * path, struct pi2_sidecar ** out, char * err, size_t errlen);
void pi2_sidecar_free(struct pi2_sidecar * sc);

// 0 if the model's weight blk.<layer>.ffn_{gate,up,down}.weight (matrix = enum pi2_matrix) is the one
// the sidecar was made from; -1 with err explaining which tensor differs otherwise.
int pi2_sidecar_check_tensor(const struct pi2_sidecar * sc, int layer, int matrix, enum ggml_type type,
                             int64_t ne0, int64_t ne1, const void * data, size_t nbytes, char * err, size_t errlen);
