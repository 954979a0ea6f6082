// Public interface of the PI2 ggml backend (pi2-gguf).
//
// The backend is loaded into stock llama.cpp with ggml_backend_load(); it registers one ACCEL device
// "PI2" that owns the FFN weights blk.N.ffn_{gate,up,down}.weight and the FFN GLU op.
// The functions below are extra entry points for tools (Python reads them through ctypes).
#pragma once

#include <stddef.h>
#include <stdint.h>

#include "ggml-backend.h"

#ifdef __cplusplus
extern "C" {
#endif

#define PI2_MAX_LAYERS 16384

// How a model with a sidecar decodes (batches above the sparse batch limit always run dense).
enum pi2_mode {
    PI2_MODE_DENSE     = 0, // every neuron, the model's own weights
    PI2_MODE_ORACLE    = 1, // the exact active set from the full gate (for testing)
    PI2_MODE_PREDICTED = 2, // the sidecar's predictor selects the neurons whose gate is computed
};

enum pi2_matrix {
    PI2_MATRIX_GATE = 0,
    PI2_MATRIX_UP   = 1,
    PI2_MATRIX_DOWN = 2,
    PI2_N_MATRIX    = 3,
};

// What one layer's FFN executed in PI2 since the last reset.
struct pi2_layer_counters {
    uint64_t matmul_calls[PI2_N_MATRIX];  // MUL_MAT nodes executed
    uint64_t matmul_tokens[PI2_N_MATRIX]; // tokens (src1 columns) multiplied
    uint64_t rows[PI2_N_MATRIX];          // weight rows dotted, summed over tokens
    uint64_t weight_bytes[PI2_N_MATRIX];  // weight bytes read by those dot products
    uint64_t glu_calls;                   // GLU nodes executed
    uint64_t glu_tokens;                  // tokens through the GLU
    // sparse decode (rows[] above then count the gate rows, up rows and dense down rows computed)
    uint64_t sparse_tokens;      // tokens decoded sparsely
    uint64_t neurons;            // n_ff summed over those tokens
    uint64_t predicted;          // neurons whose gate row was computed (predicted, or all in oracle mode)
    uint64_t active;             // of those, active under the layer threshold (up row and down column used)
    uint64_t down_sparse_tokens; // tokens whose down ran as a sum of active columns (else dense rows)
    uint64_t checked_tokens;     // tokens with the recall check on
    uint64_t missed;             // active neurons the predictor did not select (recall check only)
    // flash-resident FFN (a memory budget): bundles the tokens needed, by where they were found
    uint64_t hot_hits;           // in the pinned hot segment
    uint64_t cold_hits;          // in the cold segment
    uint64_t misses;             // read from the sidecar (or from the model file: dense layers read whole)
    uint64_t bytes_read;         // by those reads
    uint64_t io_requests;        // reads issued (consecutive bundles share one)
    uint64_t io_wait_ns;         // time the compute threads waited for bundles (per thread, on average)
    uint64_t prefetched;         // of the misses, read ahead while the layer before finished
    // routed experts (MUL_MAT_ID of blk.N.ffn_{gate,up,down}_exps.weight), counted at the gate product
    uint64_t expert_tokens;      // tokens through the layer's routed experts
    uint64_t experts_routed;     // (token, expert) pairs computed: n_expert_used per token
    uint64_t experts_loaded;     // distinct experts computed per batch, summed (each expert's rows read once a batch)
    uint64_t expert_neurons;     // n_ff summed over the pairs
    uint64_t expert_active;      // of those, neurons whose gate passed a ReLU-family cut (their up row computed)
    uint64_t expert_hits;        // flash: pairs whose wanted bundles were all in the neuron cache when routed
    uint64_t expert_misses;      // flash: pairs that read some from the sidecar
    uint64_t experts_guessed;    // flash: experts read ahead for this layer on the router's guess (PI2_EXPERT_GUESS)
    uint64_t experts_guessed_routed; // of the experts this layer's batches routed to (distinct a batch), those guessed
};

struct pi2_counters {
    uint64_t graph_computes;  // graph_compute calls received
    uint64_t nodes_computed;  // nodes executed (views excluded)
    uint32_t n_layers;        // highest layer index seen + 1
    struct pi2_layer_counters layer[PI2_MAX_LAYERS];
    // a sparse output layer (PI2_OUTPUT_ROWS under a memory budget): rows read from the model file, their bytes
    uint64_t output_rows;
    uint64_t output_bytes;
};

GGML_BACKEND_API ggml_backend_reg_t ggml_backend_pi2_reg(void);

// Process-wide counters of the PI2 device (all contexts add to them).
GGML_BACKEND_API void pi2_counters_read(struct pi2_counters * out);
GGML_BACKEND_API void pi2_counters_reset(void);

// "pi2 <version>; ggml api <GGML_BACKEND_API_VERSION>; llama-cpp-python <pinned version>"
GGML_BACKEND_API const char * pi2_build_info(void);

// Model loads. pi2_load_begin opens a sidecar (NULL: none) and makes it the binding of every PI2 weight
// buffer allocated until pi2_load_end; returns the binding id (> 0; 0 for no sidecar) or -1 with err.
// model_path (may be NULL) names the model file: the FFN activation it states (<arch>.ffn_activation) is
// what PI2 computes for it, whatever GLU llama's graph holds, and must agree with the sidecar's.
// Without these calls, PI2_SIDECAR and PI2_MODE (read when the backend registers) apply to every load.
GGML_BACKEND_API int  pi2_load_begin(const char * sidecar_path, const char * model_path, int mode, char * err, size_t errlen);
GGML_BACKEND_API void pi2_load_end(void);
// As pi2_load_begin, for a model whose FFN stays on flash: its weight buffers keep nothing (each upload is
// checked against the sidecar), and bundles are read through a neuron cache sized by pi2_binding_set_budget
// (or, without that call, from PI2_MEMORY_BUDGET at the first compute). Load with use_mmap off.
// model_path (may be NULL) names the model file: a token embedding apart from the output matrix then stays
// there, its rows read per token, and llama's upload of it is compared with the file.
GGML_BACKEND_API int  pi2_load_begin_flash(const char * sidecar_path, const char * model_path, int mode, char * err, size_t errlen);
// Sizes the neuron cache of a flash binding for a whole-process memory budget: budget minus this process's
// resident memory now, minus `reserved` (bytes the caller knows will be touched later, e.g. llama's
// compute buffers), minus the cache's tables and a margin. Reads the hot segment. 0, or -1 with err stating
// the minimum budget.
GGML_BACKEND_API int  pi2_binding_set_budget(int id, uint64_t budget, uint64_t reserved, char * err, size_t errlen);

struct pi2_cache_info {
    uint64_t fixed_bytes;   // predictors
    uint64_t hot_bytes, cold_bytes;
    uint64_t hot_neurons;   // summed over layers
    uint32_t n_cold;        // cold entries
    uint32_t direct_io;     // 1 when reads bypass the page cache (O_DIRECT)
    float    freq_cutoff;   // neurons at least this frequently active (profile) are hot
    uint32_t n_prefetch;    // of the cold entries, kept for the next layer's first bundles
    uint64_t ffn_ns;        // time in flash FFN layers since the cache was made
    uint64_t embd_bytes;    // token embedding left in the model file, its rows read per token (0: in RAM)
    uint32_t io_ring;       // 1 when bundle reads go through io_uring (PI2_IO_ENGINE), 0 on I/O threads
    uint32_t n_expert_entries; // PI2_EXPERT_READS=model: routed experts the expert cache holds (0: none)
    uint64_t expert_bytes;  // and its bytes
    // how the budget was spent when the cache was sized: the budget, the process's resident memory then (llama.cpp's
    // weights and KV cache, the predictors, the runtime), what the frontend reserved for later (llama's compute
    // buffers), the cache's tables and the margin; the cache got the rest
    uint64_t budget_bytes, resident_bytes, reserved_bytes, tables_bytes, margin_bytes;
    uint64_t output_copy_bytes; // of the resident memory: the output matrix's in-RAM copy (PI2_OUTPUT_ROWS; 0: none)
};
// -1 for an unknown id or a binding without a cache
GGML_BACKEND_API int  pi2_binding_cache_info(int id, struct pi2_cache_info * out);
// Testing: the request after `after` more bundle reads fails with errno err (0 disarms); with err
// PI2_INJECT_SHORT_READS, the next `after` requests are each read by preadv calls of at most 512 bytes
#define PI2_INJECT_SHORT_READS (-1)
GGML_BACKEND_API int  pi2_binding_inject_read_fault(int id, int64_t after, int err);
// -1 and the message when PI2_SIDECAR/PI2_MODE/PI2_SPARSE_BATCH/PI2_DOWN_SPARSE_MAX were refused at
// registration (every weight buffer allocation then fails); 0 otherwise
GGML_BACKEND_API int pi2_config_error(char * err, size_t errlen);
// Mode and recall check of a loaded model's binding; -1 for an unknown id or mode. set_mode returns -2 for
// a sparse mode other than the one the model was loaded in when that load left layers to ggml-cpu
// (PI2_LAYERS=auto): those layers cannot run it.
GGML_BACKEND_API int pi2_binding_set_mode(int id, int mode);
// The FFN layers of a loaded model that its load left to ggml-cpu (PI2_LAYERS=auto): their count, -1 for an
// unknown id; the first `cap` of them, ascending, in out.
GGML_BACKEND_API int pi2_binding_layers_left(int id, int32_t * out, int cap);
GGML_BACKEND_API int pi2_binding_set_check_recall(int id, int on);
// Why the last compute of a binding failed (empty if it did not); -1 for an unknown id
GGML_BACKEND_API int pi2_binding_error(int id, char * err, size_t errlen);
// Drops the registry's hold on a binding once its model is freed (the weight buffers hold their own)
GGML_BACKEND_API int pi2_binding_release(int id);
// Per-model settings by variable name (docs/SETTINGS.md: PI2_SPARSE_BATCH, PI2_DOWN_SPARSE_MAX, PI2_PROMPT,
// PI2_PREDICTOR, PI2_ROWS, PI2_IO_*, PI2_PREFETCH_BYTES, PI2_CACHE_MAX, PI2_COLD_SHARE): id > 0 sets it for
// that loaded model's binding only; id 0 sets the default every model without its own value follows (the
// environment gives the first defaults). Values are parsed as the environment's are. 0, or -1 with err
// naming the variable and the value ("PI2_DOWN_SPARSE_MAX=2 is not a fraction in 0..1"). PI2_PREDICTOR
// and the flash settings act when a model's cache is made; PI2_PROMPT at the next graph llama schedules.
GGML_BACKEND_API int pi2_config_set(int id, const char * name, const char * value, char * err, size_t errlen);
// Every PI2_* variable the plugin reads, comma-separated, into buf: 0, or -1 if size is too small.
GGML_BACKEND_API int pi2_config_names(char * buf, size_t size);
// "600MB" (10^6), "1GiB" (2^30), "1500000000" -> bytes: 0, or -1 if s is not a size
GGML_BACKEND_API int pi2_parse_size(const char * s, uint64_t * out);
// Resident memory of this process in bytes (/proc/self/statm, after returning freed heap); 0 if unreadable.
GGML_BACKEND_API uint64_t pi2_resident_bytes(void);
// The least memory a budget must give model_path with sidecar_path, judged before llama loads anything: this
// process now, the model's weights llama keeps in RAM under a budget (not the FFN; not the token embedding, which
// stays in the model file; a tied one counts once, as the output matmul's copy; with output rows the output matrix
// as its smaller copy), the smallest neuron cache (one layer's bundles) and the margin. The exact minimum, with
// the predictors, KV cache and compute buffers, comes from pi2_binding_set_budget once the model is loaded.
struct pi2_budget_floor {
    uint64_t need;      // the sum of the four below
    uint64_t resident;  // this process now
    uint64_t non_ffn;   // the model's resident weights other than the FFN
    uint64_t one_layer; // one layer's bundles: the smallest neuron cache
    uint64_t margin;    // kept free of the cache for what no accounting sees (allocator slack, stacks)
};
// output_rows: PI2_OUTPUT_ROWS as the load will have it, or -1 for the value the sidecar records (else 0)
GGML_BACKEND_API int pi2_budget_floor(const char * model_path, const char * sidecar_path, int64_t output_rows,
                                      struct pi2_budget_floor * out, char * err, size_t errlen);
// sizeof a public struct by name: "pi2_counters", "pi2_cache_info", "pi2_model_summary", "pi2_budget_floor"; 0 for
// other names
GGML_BACKEND_API size_t pi2_struct_size(const char * name);

// Testing the down-column kernels: y[0..n) += sum of a[c] * column c, columns in a ggml type (blocks
// along n), summed the way sparse decode sums its active neurons' columns. 0, or -1 for a type without
// a kernel or an n that is not a multiple of its block size.
GGML_BACKEND_API int pi2_columns_add(int type, int64_t n, float * y, int64_t n_cols, const float * a,
                                     const void * const * cols);

// The same for a batch of n_tokens tokens, as a prompt batch on flash sums its columns: y[t][0..n) += sum of
// a[t * n_cols + c] * column c (a NULL column is skipped), n_cols at most 32 (a cluster). 0, or -1 as above or
// for more columns.
GGML_BACKEND_API int pi2_columns_add_batch(int type, int64_t n, int64_t n_tokens, float * y, int64_t n_cols,
                                           const float * a, const void * const * cols);

// out[t * n_rows + r] = row r . token t, as a prompt batch computes gate and up rows: the n_rows rows of n values of
// a ggml type (rows: n_rows rows of its bytes) against n_tokens f32 tokens (x: [n_tokens][n], converted to the type's
// vec_dot_type here), with the several-token kernel where kernel != 0 and this build has one for the type, else
// ggml-cpu's vec_dot a token at a time. 1 if the kernel computed groups of tokens, 0 if vec_dot all, -1 for a type
// without a dot product or an n that is not whole blocks.
GGML_BACKEND_API int pi2_dot_rows_tokens(int type, int64_t n, int64_t n_rows, const void * rows, int64_t n_tokens,
                                         const float * x, float * out, int kernel);

// Planning (pi2-gguf plan): weight bytes a second of PI2's dense decode product (one token) on this machine, on
// n_rows random rows of k values of a ggml type with `threads` threads for about `seconds`. 0, or -1 for a type
// without a dot product or one that needs an importance matrix to quantize, or a k that is not whole blocks.
GGML_BACKEND_API int pi2_time_dense_rows(int type, int64_t k, int64_t n_rows, int threads, double seconds,
                                         double * bytes_per_s);

// The pi2 sidecar <model>.pi2.gguf (docs/FORMAT.md). Each returns 0 on success, or -1 with err set to
// "sidecar PATH: problem" (truncated to errlen; err may be NULL). Nothing here registers the backend.
GGML_BACKEND_API int pi2_sidecar_validate(const char * path, char * err, size_t errlen);
// Per layer, the estimated in-RAM sparse decode time of predicted mode over ggml-cpu's dense time, with the
// default settings (PI2_LAYERS=auto holds a layer where it is below 1): the first `cap` in out; returns
// n_layer, or -1 with err set.
GGML_BACKEND_API int pi2_sidecar_sparse_cost(const char * path, double * out, int cap, char * err, size_t errlen);
// The dense layers a memory budget whose caches get cache_bytes reads whole from the model file with default settings
// (PI2_DENSE_READS=auto, predicted mode: the rule flash/memory_budget.c applies when it sizes the cache): pick[il] = 1
// for those (up to cap layers), *whole_bytes the cache they take. Returns the sidecar's layer count, -1 with err.
GGML_BACKEND_API int pi2_dense_whole_layers(const char * model_path, const char * sidecar_path, uint64_t cache_bytes,
                                            uint8_t * pick, int cap, uint64_t * whole_bytes, char * err, size_t errlen);
// n_layer and pi2.source.fingerprint of a valid sidecar
GGML_BACKEND_API int pi2_sidecar_summary(const char * path, uint32_t * n_layer, uint64_t * fingerprint, char * err, size_t errlen);
// 0 if the weight blk.<layer>.ffn_{gate,up,down}.weight (matrix = enum pi2_matrix; type = enum ggml_type)
// with these bytes is the one the sidecar was made from; -1 explains what differs
GGML_BACKEND_API int pi2_sidecar_check_weight(const char * path, int layer, int matrix, int type, int64_t ne0, int64_t ne1,
                                              const void * data, size_t nbytes, char * err, size_t errlen);

// A model file as pi2 sees it before llama loads it (model_file.c): 0, or -1 with err set to "model file
// PATH: problem" (not GGUF, truncated, FFN tensors missing or of shapes that disagree).
struct pi2_model_summary {
    uint64_t fingerprint;     // of the gated FFN weights (FORMAT.md "Fingerprint"); 0 without FFN layers
    uint64_t ffn_bytes;       // blk.N.ffn_{gate,up,down}.weight, all layers
    uint64_t embedding_bytes; // token_embd.weight when output.weight is a tensor of its own, else 0
    uint64_t file_size;
    int64_t  n_tensors;
    uint32_t n_layer;         // gated FFN layers
    int32_t  activation;      // the FFN activation the model states (<arch>.ffn_activation: silu 0, gelu 1,
                              // gelu_erf 2, relu 3, drelu 4, fatrelu 5), or -1 when it states none
    float    activation_threshold; // <arch>.ffn_activation_threshold (FATReLU), else 0
    uint64_t output_bytes;      // the output matrix: output.weight, or a tied token_embd.weight (counted once)
    uint64_t output_copy_bytes; // the in-RAM copy PI2_OUTPUT_ROWS keeps of it instead (0: none would be smaller)
    int32_t  experts_native;    // 1: llama.cpp's MoE graph for this architecture computes the stated activation of the
                                // routed experts itself (smallthinker's ReLU experts), so PI2 need not hold them
};
GGML_BACKEND_API int pi2_model_summary(const char * path, struct pi2_model_summary * out, char * err, size_t errlen);

// The in-RAM copy of model_path's output matrix a memory budget computes every logit from (PI2_OUTPUT_ROWS > 0;
// small: PI2_OUTPUT_COPY=q2_k), as the load would make it, for convert to store in the sidecar (FORMAT.md,
// output.pi2_copy). Sets *type (enum ggml_type), *n_rows and *row_size; with dst not NULL also writes the copy there
// (n_rows rows of row_size bytes; dst_size must hold them). The output matrix is output.weight, else a tied
// token_embd.weight. 1, 0 where a load makes no copy (neither, or no smaller type), -1 with err set.
GGML_BACKEND_API int pi2_output_copy_make(const char * model_path, int small, int32_t * type, int64_t * n_rows,
                                          size_t * row_size, void * dst, size_t dst_size, char * err, size_t errlen);

// Fingerprint of one FFN weight tensor (FORMAT.md "Fingerprint"), and of a model from its 3 * n_layer
// tensor fingerprints (gate, up, down of layer 0, then layer 1, ...)
GGML_BACKEND_API uint64_t pi2_fingerprint_tensor(int type, int64_t ne0, int64_t ne1, const void * data, size_t nbytes);
GGML_BACKEND_API uint64_t pi2_fingerprint_model(const uint64_t * tensor_fps, size_t n);

#ifdef __cplusplus
}
#endif
