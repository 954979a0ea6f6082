// A weight table of a model under a memory budget left in the model file, read row by row with pread: the
// token embedding, whose decode step needs only the rows of its tokens (GET_ROWS), so the table (131 MB on
// Qwen2.5-1.5B) need not be resident, and the output matrix's exact rows (output_rows.h). A tied embedding
// too: PI2 does not claim the output matmul of a tied table, so llama places that weight in one of ggml-cpu's
// buffer types, a second copy of the same tensor, and leaving the GET_ROWS copy in the file frees its whole size.
#pragma once

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "ggml.h"

#define PI2_EMBD_NAME "token_embd.weight"

struct pi2_embedding {
    char           path[4096];
    char           name[64]; // the tensor
    int            fd;
    uint64_t       offset;   // of row 0 in the file
    uint64_t       file_size;
    int64_t        mtime_ns; // a file rewritten since it was opened is refused
    enum ggml_type type;
    int64_t        n_embd, n_rows;
    size_t         row_size;
    // llama's upload is compared with the file: bytes that matched so far, or -1 after a mismatch
    atomic_llong   checked;
    char           error[512];
};

// Opens model_path's 2-D tensor `name`. 1 with *out set; 0 when the model has no such tensor, -1 with err set
// when the file cannot be read as a GGUF model or is truncated.
int  pi2_table_open(const char * model_path, const char * name, struct pi2_embedding ** out, char * err, size_t errlen);
// pi2_table_open of the token embedding, tied or not.
int  pi2_embedding_open(const char * model_path, struct pi2_embedding ** out, char * err, size_t errlen);
void pi2_embedding_free(struct pi2_embedding * e);

// The tensor llama holds is this embedding (type and shape).
bool pi2_embedding_matches(const struct pi2_embedding * e, const struct ggml_tensor * t);

// llama uploads part of the table: compared with the file, then dropped.
void pi2_embedding_check_upload(struct pi2_embedding * e, const void * data, size_t offset, size_t size);

// The whole table was uploaded and matched the file; otherwise false with e->error set.
bool pi2_embedding_verified(struct pi2_embedding * e);

// 0 while the file has the size and mtime it had when opened; else -1 with err set.
int pi2_table_unchanged(const struct pi2_embedding * e, char * err, size_t errlen);
// Row id's bytes (row_size) into dst; 0, or -1 with err set (an id out of range, a failed or short read).
int pi2_table_read_row(const struct pi2_embedding * e, int64_t id, void * dst, char * err, size_t errlen);

// dst row k (f32, n_embd values, rows dst_stride bytes apart) = row ids[k] of the table; scratch holds one
// row (row_size bytes). 0, or -1 with err set (an id out of range, a failed or short read).
int pi2_embedding_rows(const struct pi2_embedding * e, const int32_t * ids, size_t id_stride, int64_t n, float * dst,
                       size_t dst_stride, void * scratch, char * err, size_t errlen);

struct pi2_backend_ctx;
struct pi2_binding;
// The GET_ROWS node of a decode or prompt batch on the embedding b left in the model file; fails (logged,
// b->error set) when the upload did not match the file or a read fails.
enum ggml_status pi2_exec_embedding_rows(struct pi2_backend_ctx * ctx, struct pi2_binding * b, struct ggml_tensor * node);
