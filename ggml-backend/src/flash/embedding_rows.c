#define _DEFAULT_SOURCE // posix_fadvise, pread
#include "flash/embedding_rows.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "flash/bundle_io.h"
#include "model/model_binding.h"
#include "core/pi2_context.h"
#include "core/pi2_log.h"
#include "gguf.h"

int pi2_table_open(const char * model_path, const char * name, struct pi2_embedding ** out, char * err, size_t errlen) {
    *out = NULL;
    struct ggml_context * meta = NULL;
    struct gguf_init_params params = { /* .no_alloc = */ true, /* .ctx = */ &meta };
    struct gguf_context * g = gguf_init_from_file(model_path, params);
    if (g == NULL) {
        snprintf(err, errlen, "model %.300s: not a readable GGUF file", model_path);
        return -1;
    }
    const int64_t id = gguf_find_tensor(g, name);
    const struct ggml_tensor * t = id >= 0 ? ggml_get_tensor(meta, name) : NULL;
    int rc = 0;
    if (t != NULL && ggml_n_dims(t) == 2 &&
        (t->type == GGML_TYPE_F32 || ggml_get_type_traits(t->type)->to_float != NULL)) {
        struct pi2_embedding * e = calloc(1, sizeof(*e));
        if (e == NULL) {
            snprintf(err, errlen, "model %.300s: out of memory", model_path);
            rc = -1;
        } else {
            snprintf(e->path, sizeof(e->path), "%s", model_path);
            snprintf(e->name, sizeof(e->name), "%s", name);
            e->offset   = gguf_get_data_offset(g) + gguf_get_tensor_offset(g, id);
            e->type     = t->type;
            e->n_embd   = t->ne[0];
            e->n_rows   = t->ne[1];
            e->row_size = ggml_row_size(t->type, t->ne[0]);
            atomic_init(&e->checked, 0);
            struct stat st;
            e->fd = open(model_path, O_RDONLY | O_CLOEXEC);
            if (e->fd < 0 || fstat(e->fd, &st) != 0) {
                snprintf(err, errlen, "model %.300s: cannot open: %s", model_path, strerror(errno));
                pi2_embedding_free(e);
                rc = -1;
            } else if ((uint64_t) st.st_size < e->offset || (uint64_t) st.st_size - e->offset < e->row_size * (uint64_t) e->n_rows) {
                snprintf(err, errlen, "model %.300s is truncated: %s ends past the file's %" PRIu64 " bytes", model_path,
                         name, (uint64_t) st.st_size);
                pi2_embedding_free(e);
                rc = -1;
            } else {
                e->file_size = (uint64_t) st.st_size;
                e->mtime_ns  = (int64_t) st.st_mtim.tv_sec * 1000000000 + st.st_mtim.tv_nsec;
                *out = e;
                rc = 1;
            }
        }
    }
    gguf_free(g);
    ggml_free(meta);
    return rc;
}

int pi2_embedding_open(const char * model_path, struct pi2_embedding ** out, char * err, size_t errlen) {
    return pi2_table_open(model_path, PI2_EMBD_NAME, out, err, errlen);
}

void pi2_embedding_free(struct pi2_embedding * e) {
    if (e == NULL) {
        return;
    }
    if (e->fd >= 0) {
        close(e->fd);
    }
    free(e);
}

bool pi2_embedding_matches(const struct pi2_embedding * e, const struct ggml_tensor * t) {
    return e != NULL && t->type == e->type && t->ne[0] == e->n_embd && t->ne[1] == e->n_rows && t->ne[2] == 1 && t->ne[3] == 1 &&
           strcmp(t->name, e->name) == 0;
}

// a read of the table as an error text: a file that ends early shrank since it was opened
static const char * pi2_read_error(int e) {
    return e == PI2_READ_EOF ? "the file is shorter than when it was opened" : strerror(e);
}

void pi2_embedding_check_upload(struct pi2_embedding * e, const void * data, size_t offset, size_t size) {
    if (atomic_load(&e->checked) < 0) {
        return;
    }
    const size_t scratch_size = 1u << 20;
    void * scratch = malloc(scratch_size);
    if (scratch == NULL) {
        snprintf(e->error, sizeof(e->error), "out of memory checking %s", e->name);
        atomic_store(&e->checked, -1);
        return;
    }
    const uint64_t total = e->row_size * (uint64_t) e->n_rows;
    if (offset > total || size > total - offset) {
        snprintf(e->error, sizeof(e->error), "%s: llama uploaded bytes %zu..%zu of a %" PRIu64 "-byte table", e->name,
                 offset, offset + size, total);
        atomic_store(&e->checked, -1);
        free(scratch);
        return;
    }
    for (size_t done = 0; done < size;) {
        const size_t n = size - done < scratch_size ? size - done : scratch_size;
        const int r = pi2_read_exact(e->fd, scratch, n, e->offset + offset + done);
        if (r != 0) {
            snprintf(e->error, sizeof(e->error), "model %.300s: reading %s failed: %s", e->path, e->name, pi2_read_error(r));
        } else if (memcmp(scratch, (const char *) data + done, n) != 0) {
            snprintf(e->error, sizeof(e->error), "model %.300s: its %s differs from the one llama.cpp loaded (is it the model "
                     "being loaded?)", e->path, e->name);
        }
        if (e->error[0] != '\0') {
            atomic_store(&e->checked, -1);
            free(scratch);
            return;
        }
        done += n;
    }
    free(scratch);
    // the table is read row by row from now on; its pages need not stay cached
    (void) posix_fadvise(e->fd, (off_t) (e->offset + offset), (off_t) size, POSIX_FADV_DONTNEED);
    atomic_fetch_add(&e->checked, (long long) size);
}

bool pi2_embedding_verified(struct pi2_embedding * e) {
    const long long c = atomic_load(&e->checked);
    if (c >= 0 && (uint64_t) c != e->row_size * (uint64_t) e->n_rows) {
        snprintf(e->error, sizeof(e->error), "model %.300s: %s was not uploaded whole (%lld of %" PRIu64 " bytes), so it could "
                 "not be checked against the file", e->path, e->name, c, e->row_size * (uint64_t) e->n_rows);
        return false;
    }
    return c >= 0;
}

int pi2_table_unchanged(const struct pi2_embedding * e, char * err, size_t errlen) {
    struct stat st; // rewritten in place, the file would give another model's rows
    if (fstat(e->fd, &st) != 0 || (uint64_t) st.st_size != e->file_size ||
        (int64_t) st.st_mtim.tv_sec * 1000000000 + st.st_mtim.tv_nsec != e->mtime_ns) {
        snprintf(err, errlen, "model %.300s changed on disk while the model was running (its %s is read from it)", e->path,
                 e->name);
        return -1;
    }
    return 0;
}

int pi2_table_read_row(const struct pi2_embedding * e, int64_t id, void * dst, char * err, size_t errlen) {
    if (id < 0 || id >= e->n_rows) {
        snprintf(err, errlen, "%s: row %" PRId64 " is outside the table's %" PRId64 " rows", e->name, id, e->n_rows);
        return -1;
    }
    const int r = pi2_read_exact(e->fd, dst, e->row_size, e->offset + (uint64_t) id * e->row_size);
    if (r != 0) {
        snprintf(err, errlen, "model %.300s: reading %s row %" PRId64 " failed: %s", e->path, e->name, id, pi2_read_error(r));
        return -1;
    }
    return 0;
}

int pi2_embedding_rows(const struct pi2_embedding * e, const int32_t * ids, size_t id_stride, int64_t n, float * dst,
                       size_t dst_stride, void * scratch, char * err, size_t errlen) {
    const ggml_to_float_t to_float = ggml_get_type_traits(e->type)->to_float;
    if (pi2_table_unchanged(e, err, errlen) != 0) {
        return -1;
    }
    for (int64_t k = 0; k < n; ++k) {
        const int32_t id = *(const int32_t *) ((const char *) ids + (size_t) k * id_stride);
        if (pi2_table_read_row(e, id, scratch, err, errlen) != 0) {
            return -1;
        }
        float * row = (float *) ((char *) dst + (size_t) k * dst_stride);
        if (e->type == GGML_TYPE_F32) {
            memcpy(row, scratch, e->row_size);
        } else {
            to_float(scratch, row, e->n_embd);
        }
    }
    return 0;
}

// the embedding rows of a decode or prompt batch, read from the model file
enum ggml_status pi2_exec_embedding_rows(struct pi2_backend_ctx * ctx, struct pi2_binding * b, struct ggml_tensor * node) {
    if (b == NULL || b->embd == NULL) {
        PI2_LOG_ERROR("pi2: %s is not a token embedding PI2 reads from a file\n", node->src[0]->name);
        return GGML_STATUS_FAILED;
    }
    if (!pi2_embedding_verified(b->embd)) {
        snprintf(b->error, sizeof(b->error), "%s", b->embd->error);
        PI2_LOG_REFUSAL("pi2: %s\n", b->error);
        return GGML_STATUS_FAILED;
    }
    void * scratch = pi2_work_reserve(ctx, b->embd->row_size);
    if (scratch == NULL) {
        PI2_LOG_ERROR("pi2: out of memory for an embedding row (%zu bytes)\n", b->embd->row_size);
        return GGML_STATUS_ALLOC_FAILED;
    }
    const struct ggml_tensor * ids = node->src[1];
    char err[sizeof(b->error)];
    if (pi2_embedding_rows(b->embd, (const int32_t *) ids->data, ids->nb[0], ids->ne[0], (float *) node->data, node->nb[1], scratch,
                           err, sizeof(err)) != 0) {
        memcpy(b->error, err, sizeof(err));
        PI2_LOG_REFUSAL("pi2: %s\n", b->error);
        return GGML_STATUS_FAILED;
    }
    return GGML_STATUS_SUCCESS;
}
