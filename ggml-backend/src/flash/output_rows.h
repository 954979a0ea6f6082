// A sparse output layer for a model under a memory budget: its output matrix (output.weight, 191 MB of
// Q6_K on Qwen2.5-1.5B, the largest tensor left in RAM once the FFN is on flash) stays in the model file.
// Every logit is still computed each token, from an in-RAM copy of the matrix in a smaller type (Q3_K,
// 100 MB there: the rest goes to the neuron cache); then the n_exact rows with the largest logits are read
// from the file and computed in the model's own type, so those logits are exactly the full matrix's and
// the others are the copy's. Greedy decoding and top-k sampling (k <= n_exact) see exact values.
// Under PI2_OUTPUT_ROWS > 0. A tied embedding too (no output.weight: the output MUL_MAT multiplies by a duplicate of
// token_embd.weight, which llama makes the table itself where both are placed here): then the matrix read row by row
// is the token embedding's table.
#pragma once

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "flash/embedding_rows.h"
#include "ggml-backend.h"
#include "ggml.h"

#define PI2_OUTPUT_NAME "output.weight"

// The type of the in-RAM copy of an output matrix of `type` with rows of n_embd: Q3_K (3.44 bits a weight,
// 15% relative error on random rows), or Q2_K (2.63 bits) where `small` (PI2_OUTPUT_COPY=q2_k), where a row
// holds whole 256-value blocks, else Q4_0 (4.5 bits); GGML_TYPE_COUNT when that would not be smaller than the
// matrix (nothing to gain).
static inline enum ggml_type pi2_output_copy_type(enum ggml_type type, int64_t n_embd, bool small) {
    const enum ggml_type k = small ? GGML_TYPE_Q2_K : GGML_TYPE_Q3_K;
    const enum ggml_type t = n_embd % 256 == 0 ? k : n_embd % 32 == 0 ? GGML_TYPE_Q4_0 : GGML_TYPE_COUNT;
    return t != GGML_TYPE_COUNT && ggml_row_size(t, n_embd) < ggml_row_size(type, n_embd) ? t : GGML_TYPE_COUNT;
}

struct pi2_output {
    struct pi2_embedding * table;      // output.weight in the model file (read row by row), or token_embd.weight if tied
    bool                   tied;       // the table is the token embedding's (the model has no output.weight)
    bool                   borrowed;   // the table is the binding's token embedding (pi2_output_share_embedding): not freed here
    enum ggml_type         proxy_type; // of the in-RAM copy
    size_t                 proxy_row_size;
    uint8_t *              proxy;      // [n_rows] rows of proxy_type, made from llama's upload
    int64_t                n_exact;    // rows per token read and computed in the model's type
    atomic_llong           built;      // rows of the copy made so far; -1 after an upload that could not be used
    // the sidecar's copy (output.pi2_copy), read instead of quantizing the upload where it has the copy's type
    int                    copy_fd;    // -1: none, or no longer needed
    uint64_t               copy_offset;
    enum ggml_type         copy_type;
    char                   copy_path[1024];
    char                   error[512];
};

// Opens model_path's output matrix: output.weight, else a tied token_embd.weight. 1 with *out set; 0 when the model
// has neither or no smaller type fits its rows (nothing to gain); -1 with err set when the file cannot be read.
int  pi2_output_open(const char * model_path, struct pi2_output ** out, char * err, size_t errlen);
void pi2_output_free(struct pi2_output * o);

// The sidecar's copy of the matrix (output.pi2_copy: type, n_rows, its file offset): where its type is the one the
// first upload picks, the copy's rows are read from the sidecar instead of quantized from the upload (a few rows of
// each upload are quantized and compared; where they differ, the upload is quantized). 0, or -1 with err set where it
// copies another matrix (its rows) or the sidecar cannot be opened.
int pi2_output_use_sidecar_copy(struct pi2_output * o, const char * sidecar_path, uint64_t offset, enum ggml_type type,
                                int64_t n_rows, char * err, size_t errlen);

// A tied output matrix takes the binding's token embedding embd (the same tensor of the same file) as its table, so that
// the one upload llama makes of it is checked against the file once, by pi2_output_upload. Nothing where not tied.
void pi2_output_share_embedding(struct pi2_output * o, struct pi2_embedding * embd);

// The tensor llama holds is this output matrix (name, type and shape).
bool pi2_output_matches(const struct pi2_output * o, const struct ggml_tensor * t);

// llama uploads whole rows of the matrix: compared with the file, then turned into the in-RAM copy (or checked
// against the sidecar's) and dropped. n_exact: this model's PI2_OUTPUT_ROWS; small: its PI2_OUTPUT_COPY (the copy's type is fixed by the
// first upload).
void pi2_output_upload(struct pi2_output * o, int64_t n_exact, bool small, const void * data, size_t offset, size_t size);

// Reads the copy's rows the uploads accepted from the sidecar into RAM, if not yet: after the load (a budget's cache
// is sized after it), so that llama's staging of the upload and the copy are never held at once. 0, or -1 with
// o->error set.
int pi2_output_finish(struct pi2_output * o);

// The whole matrix was uploaded, matched the file and has its copy; otherwise false with o->error set.
bool pi2_output_ready(struct pi2_output * o);

struct pi2_backend_ctx;
struct pi2_binding;
// The output MUL_MAT of a decode or prompt batch: every logit from the copy, the n_exact largest of each
// token from the file's rows. Fails (logged, b->error set) when the upload did not match or a read fails.
enum ggml_status pi2_exec_output(struct pi2_backend_ctx * ctx, struct pi2_binding * b, struct ggml_tensor * node);
