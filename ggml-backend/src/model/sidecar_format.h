// Names and constants of the pi2 sidecar GGUF, declared once for the C side (spec: docs/FORMAT.md).
// The Python writer declares the same in pi2_gguf/sidecar/format.py; tests/test_format.py checks both
// against FORMAT.md's tables, including the type written in the comment after each key and tensor.
#pragma once

#define PI2_FORMAT_VERSION 4
#define PI2_ARCHITECTURE   "pi2"
#define PI2_BUNDLE_ALIGN   4096 // general.alignment, and the largest pi2.bundle.align
#define PI2_BUNDLE_ALIGN_MIN 512 // the smallest pi2.bundle.align (a power of two in between)
#define PI2_NEURON_ALIGN   32   // a neuron's stride within a bundle is its parts rounded up to this
#define PI2_MAX_BUNDLE_NEURONS 16

// keys (type as in FORMAT.md's key table)
#define PI2_KEY_FORMAT_VERSION             "pi2.format_version"             // u32
#define PI2_KEY_SOURCE_ARCHITECTURE        "pi2.source.architecture"        // string
#define PI2_KEY_SOURCE_NAME                "pi2.source.name"                // string
#define PI2_KEY_SOURCE_FILE_SIZE           "pi2.source.file_size"           // u64
#define PI2_KEY_SOURCE_FINGERPRINT         "pi2.source.fingerprint"         // u64
#define PI2_KEY_SOURCE_TENSOR_FINGERPRINTS "pi2.source.tensor_fingerprints" // u64[3 * n_layer]
#define PI2_KEY_N_LAYER                    "pi2.n_layer"                    // u32
#define PI2_KEY_N_EMBD                     "pi2.n_embd"                     // u32
#define PI2_KEY_N_FF                       "pi2.n_ff"                       // u32[n_layer]
#define PI2_KEY_ACTIVATION                 "pi2.activation"                 // string
#define PI2_KEY_ACTIVATION_THRESHOLD       "pi2.activation_threshold"       // f32
#define PI2_KEY_SPARSITY_METHOD            "pi2.sparsity.method"            // string
#define PI2_KEY_SPARSITY_TARGET            "pi2.sparsity.target"            // f32
#define PI2_KEY_SPARSITY_THRESHOLDS        "pi2.sparsity.thresholds"        // f32[n_layer]
#define PI2_KEY_SPARSITY_PRODUCT_THRESHOLDS "pi2.sparsity.product_thresholds" // f32[n_layer]
#define PI2_KEY_SPARSITY_DENSITY           "pi2.sparsity.density"           // f32[n_layer]
#define PI2_KEY_PREDICTOR_RANK             "pi2.predictor.rank"             // u32[n_layer]
#define PI2_KEY_PREDICTOR_CUTOFF           "pi2.predictor.cutoff"           // f32[n_layer]
#define PI2_KEY_PREDICTOR_RECALL_TARGET    "pi2.predictor.recall_target"    // f32
#define PI2_KEY_PREDICTOR_RECALL           "pi2.predictor.recall"           // f32[n_layer]
#define PI2_KEY_PREDICTOR_PRECISION        "pi2.predictor.precision"        // f32[n_layer]
#define PI2_KEY_PREDICTOR_DENSITY          "pi2.predictor.density"          // f32[n_layer]
#define PI2_KEY_HOT_COUNT                  "pi2.hot_count"                  // u32[n_layer]
#define PI2_KEY_CALIB_CORPUS               "pi2.calib.corpus"               // string
#define PI2_KEY_CALIB_CORPUS_SHA256        "pi2.calib.corpus_sha256"        // string
#define PI2_KEY_CALIB_TOKENS               "pi2.calib.tokens"               // u64
#define PI2_KEY_CALIB_HELDOUT_TOKENS       "pi2.calib.heldout_tokens"       // u64
#define PI2_KEY_CALIB_DATE                 "pi2.calib.date"                 // string
#define PI2_KEY_BUNDLE_ALIGN               "pi2.bundle.align"               // u32
#define PI2_KEY_BUNDLE_SIZE                "pi2.bundle.size"                // u32[n_layer]
#define PI2_KEY_BUNDLE_NEURONS             "pi2.bundle.neurons"             // u32[n_layer]
#define PI2_KEY_BUNDLE_GATE_TYPE           "pi2.bundle.gate_type"           // u32[n_layer]
#define PI2_KEY_BUNDLE_UP_TYPE             "pi2.bundle.up_type"             // u32[n_layer]
#define PI2_KEY_BUNDLE_DOWN_TYPE           "pi2.bundle.down_type"           // u32[n_layer]
#define PI2_KEY_BUNDLE_DOWN_TOLERANCE      "pi2.bundle.down_tolerance"      // f32[n_layer]
#define PI2_KEY_BUNDLE_DOWN_ERROR          "pi2.bundle.down_error"          // f32[n_layer]
// optional: the PI2_OUTPUT_ROWS convert measured the sidecar's quality with (applied under a memory budget
// unless the environment or the model's own settings say otherwise)
#define PI2_KEY_BUDGET_OUTPUT_ROWS         "pi2.budget.output_rows"         // u32
#define PI2_KEY_BUDGET_OUTPUT_COPY         "pi2.budget.output_copy"         // string
#define PI2_KEY_MOE_EXPERT_COUNT           "pi2.moe.expert_count"           // u32
#define PI2_KEY_MOE_LAYER_EXPERTS          "pi2.moe.layer_experts"          // u32[]
#define PI2_KEY_MOE_EXPERT_READS           "pi2.moe.expert_reads"           // string
#define PI2_KEY_DENSE_READS                "pi2.dense_reads"                // string
// optional: the type decode holds each predictor's W2 in (PI2_W2_TYPE_* below; absent: q8_0, as before the key)
#define PI2_KEY_PREDICTOR_W2_TYPE          "pi2.predictor.w2_type"          // string
// values of pi2.predictor.w2_type
#define PI2_W2_TYPE_Q8_0 "q8_0"
#define PI2_W2_TYPE_Q4_0 "q4_0"
// values of pi2.moe.expert_reads and pi2.dense_reads
#define PI2_EXPERT_READS_BUNDLES "bundles"
#define PI2_EXPERT_READS_MODEL   "model"

// values of the string keys pi2.activation and pi2.sparsity.method
#define PI2_ACTIVATION_SILU     "silu"
#define PI2_ACTIVATION_GELU     "gelu"
#define PI2_ACTIVATION_GELU_ERF "gelu_erf"
#define PI2_ACTIVATION_RELU     "relu"
#define PI2_ACTIVATION_DRELU    "drelu"
#define PI2_ACTIVATION_FATRELU  "fatrelu"
#define PI2_ACTIVATION_SWIGLU_OAI "swiglu_oai"
#define PI2_SPARSITY_CATS       "cats"
#define PI2_SPARSITY_PRODUCT    "product"
#define PI2_SPARSITY_RELU       "relu"

// per-layer tensors, named "blk.N." + suffix (type and shape (ne0, ne1) as in FORMAT.md's tensor table)
#define PI2_TENSOR_PRED_W1 "pi2_pred_w1" // F16 (n_embd, r)
#define PI2_TENSOR_PRED_B1 "pi2_pred_b1" // F32 (r)
#define PI2_TENSOR_PRED_W2 "pi2_pred_w2" // F16 (r, n_ff)
#define PI2_TENSOR_PRED_B2 "pi2_pred_b2" // F32 (n_ff)
#define PI2_TENSOR_FREQ    "pi2_freq"    // F32 (n_ff)
#define PI2_TENSOR_ORDER   "pi2_order"   // I32 (n_ff)
#define PI2_TENSOR_BUNDLES "pi2_bundles" // I8 (bundle size, n_bundles)

// the optional tensor (FORMAT.md, "Optional tensor"): the output matrix's in-RAM copy a memory budget computes
// every logit from (flash/output_rows.h), made by convert so that a load reads it instead of quantizing
#define PI2_OPTIONAL_TENSOR_OUTPUT_COPY "output.pi2_copy" // Q3_K|Q2_K|Q4_0 (n_embd, n_vocab)

// fingerprint (FORMAT.md "Fingerprint"): FNV-1a 64 over a header and 16 samples of the tensor's bytes
#define PI2_FP_OFFSET_BASIS  0xcbf29ce484222325ULL
#define PI2_FP_PRIME         0x100000001b3ULL
#define PI2_FP_SAMPLES       16
#define PI2_FP_SAMPLE_BYTES  256
