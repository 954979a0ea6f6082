#define _DEFAULT_SOURCE // posix_fadvise
#include "flash/output_rows.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "dense/ffn_exec.h"
#include "ggml-cpu.h"
#include "model/model_binding.h"
#include "core/pi2_context.h"
#include "core/pi2_log.h"
#include "flash/bundle_io.h"
#include "model/sidecar_format.h"

int pi2_output_open(const char * model_path, struct pi2_output ** out, char * err, size_t errlen) {
    *out = NULL;
    struct pi2_embedding * t = NULL;
    int rc = pi2_table_open(model_path, PI2_OUTPUT_NAME, &t, err, errlen);
    const bool tied = rc == 0; // no output.weight: llama multiplies by the token embedding's table
    if (tied) {
        rc = pi2_table_open(model_path, PI2_EMBD_NAME, &t, err, errlen);
    }
    if (rc <= 0) {
        return rc;
    }
    const struct ggml_type_traits_cpu * tt = ggml_get_type_traits_cpu(t->type);
    const enum ggml_type proxy = pi2_output_copy_type(t->type, t->n_embd, false);
    if (proxy == GGML_TYPE_COUNT || tt->vec_dot == NULL ||
        (tt->vec_dot_type != GGML_TYPE_F32 && ggml_get_type_traits_cpu(tt->vec_dot_type)->from_float == NULL)) {
        pi2_embedding_free(t);
        return 0;
    }
    struct pi2_output * o = calloc(1, sizeof(*o));
    if (o == NULL) {
        snprintf(err, errlen, "model %.300s: out of memory", model_path);
        pi2_embedding_free(t);
        return -1;
    }
    o->table          = t;
    o->tied           = tied;
    o->proxy_type     = proxy;
    o->proxy_row_size = ggml_row_size(proxy, t->n_embd);
    o->copy_fd        = -1;
    atomic_init(&o->built, 0);
    *out = o;
    return 1;
}

static void pi2_output_drop_sidecar_copy(struct pi2_output * o) {
    if (o->copy_fd >= 0) {
        close(o->copy_fd);
        o->copy_fd = -1;
    }
}

int pi2_output_use_sidecar_copy(struct pi2_output * o, const char * sidecar_path, uint64_t offset, enum ggml_type type,
                                int64_t n_rows, char * err, size_t errlen) {
    if (n_rows != o->table->n_rows) {
        snprintf(err, errlen, "sidecar %.300s: its %s has %" PRId64 " rows; the model's %s has %" PRId64 " (was it made for "
                 "another model?)", sidecar_path, PI2_OPTIONAL_TENSOR_OUTPUT_COPY, n_rows, o->table->name, o->table->n_rows);
        return -1;
    }
    pi2_output_drop_sidecar_copy(o);
    o->copy_fd = open(sidecar_path, O_RDONLY | O_CLOEXEC);
    if (o->copy_fd < 0) {
        snprintf(err, errlen, "sidecar %.300s: cannot open it: %s", sidecar_path, strerror(errno));
        return -1;
    }
    o->copy_offset = offset;
    o->copy_type   = type;
    snprintf(o->copy_path, sizeof(o->copy_path), "%s", sidecar_path);
    return 0;
}

void pi2_output_share_embedding(struct pi2_output * o, struct pi2_embedding * embd) {
    if (o->tied && !o->borrowed && embd != NULL && strcmp(embd->name, o->table->name) == 0) {
        pi2_embedding_free(o->table);
        o->table    = embd;
        o->borrowed = true;
    }
}

void pi2_output_free(struct pi2_output * o) {
    if (o == NULL) {
        return;
    }
    pi2_output_drop_sidecar_copy(o);
    if (!o->borrowed) {
        pi2_embedding_free(o->table);
    }
    free(o->proxy);
    free(o);
}

bool pi2_output_matches(const struct pi2_output * o, const struct ggml_tensor * t) {
    return o != NULL && pi2_embedding_matches(o->table, t);
}

static void pi2_output_fail(struct pi2_output * o, const char * what) {
    snprintf(o->error, sizeof(o->error), "%s", what);
    atomic_store(&o->built, -1);
}

// rows [0, n) of src (the matrix's rows, in the model's type) into n rows of `type` at dst, on every core: the copy as
// ggml's quantizer makes it (at load ~20 ns a value for Q3_K, 57 for Q2_K here). false when out of memory.
static bool pi2_output_quantize(const struct pi2_embedding * t, const void * src, int64_t n, enum ggml_type type, uint8_t * dst) {
    const ggml_to_float_t   to_float   = ggml_get_type_traits(t->type)->to_float;
    const ggml_from_float_t from_float = ggml_get_type_traits_cpu(type)->from_float;
    const size_t dst_row = ggml_row_size(type, t->n_embd);
    bool oom = false;
    #pragma omp parallel if (n > 1)
    {
        float * row = malloc((size_t) t->n_embd * sizeof(float));
        if (row == NULL) {
            #pragma omp atomic write
            oom = true;
        } else {
            #pragma omp for schedule(static)
            for (int64_t r = 0; r < n; ++r) {
                const char * s = (const char *) src + (size_t) r * t->row_size;
                if (t->type == GGML_TYPE_F32) {
                    memcpy(row, s, t->row_size);
                } else {
                    to_float(s, row, t->n_embd);
                }
                from_float(row, dst + (size_t) r * dst_row, t->n_embd);
            }
            free(row);
        }
    }
    return !oom;
}

// bytes of the sidecar's copy at its offset + off into dst; 0, or -1 with o's error set naming the sidecar
static int pi2_output_pread_copy(struct pi2_output * o, void * dst, size_t bytes, uint64_t off) {
    const int e = pi2_read_exact(o->copy_fd, dst, bytes, o->copy_offset + off);
    if (e != 0) {
        char msg[sizeof(o->error)];
        snprintf(msg, sizeof(msg), "sidecar %.300s: reading %s failed: %s", o->copy_path, PI2_OPTIONAL_TENSOR_OUTPUT_COPY,
                 e == PI2_READ_EOF ? "the file is shorter than when it was opened" : strerror(e));
        pi2_output_fail(o, msg);
        return -1;
    }
    return 0;
}

// a few rows of the upload r0 .. r0 + n (every n_rows / 64th and the last) quantized and compared with the sidecar's
// copy of them; the copy itself is read later (pi2_output_finish), once llama's staging of the upload is gone, so a
// load never holds both. 0; 1 where one differs (another quantizer made the copy: the caller quantizes instead); -1
// with o's error set where a read fails.
static int pi2_output_check_copy(struct pi2_output * o, int64_t r0, int64_t n, const void * data) {
    const struct pi2_embedding * t = o->table;
    uint8_t * mine = malloc(2 * o->proxy_row_size);
    if (mine == NULL) {
        pi2_output_fail(o, "out of memory checking the sidecar's output matrix copy");
        return -1;
    }
    uint8_t * theirs = mine + o->proxy_row_size;
    const int64_t stride = t->n_rows / 64 > 1 ? t->n_rows / 64 : 1;
    int rc = 0;
    for (int64_t r = r0; rc == 0 && r < r0 + n; ++r) {
        if (r % stride != 0 && r != r0 + n - 1) {
            continue;
        }
        if (pi2_output_pread_copy(o, theirs, o->proxy_row_size, (uint64_t) r * o->proxy_row_size) != 0) {
            rc = -1;
        } else if (!pi2_output_quantize(t, (const char *) data + (size_t) (r - r0) * t->row_size, 1, o->proxy_type, mine)) {
            pi2_output_fail(o, "out of memory checking the sidecar's output matrix copy");
            rc = -1;
        } else if (memcmp(mine, theirs, o->proxy_row_size) != 0) {
            PI2_LOG_WARN("pi2: sidecar %s: row %" PRId64 " of its %s differs from ggml's %s of the model's %s (made by "
                         "another build?): quantizing the matrix at load instead\n", o->copy_path, r,
                         PI2_OPTIONAL_TENSOR_OUTPUT_COPY, ggml_type_name(o->proxy_type), t->name);
            rc = 1;
        }
    }
    free(mine);
    return rc;
}

// rows [0, n) of the copy from the sidecar into o->proxy (allocated here if not yet); 0, or -1 with o's error set
static int pi2_output_read_copy(struct pi2_output * o, int64_t n) {
    if (o->proxy == NULL && (o->proxy = malloc((size_t) o->table->n_rows * o->proxy_row_size)) == NULL) {
        pi2_output_fail(o, "out of memory for the output matrix's in-RAM copy");
        return -1;
    }
    const size_t bytes = (size_t) n * o->proxy_row_size;
    if (pi2_output_pread_copy(o, o->proxy, bytes, 0) != 0) {
        return -1;
    }
    // held in RAM from now on: its pages need not stay cached
    (void) posix_fadvise(o->copy_fd, (off_t) o->copy_offset, (off_t) bytes, POSIX_FADV_DONTNEED);
    return 0;
}

int pi2_output_finish(struct pi2_output * o) {
    const long long built = atomic_load(&o->built);
    if (built < 0) {
        return -1;
    }
    if (o->copy_fd >= 0 && o->proxy == NULL && built > 0) { // every row (an upload left short fails ready's count)
        if (pi2_output_read_copy(o, o->table->n_rows) != 0) {
            return -1;
        }
        pi2_output_drop_sidecar_copy(o);
    }
    return 0;
}

void pi2_output_upload(struct pi2_output * o, int64_t n_exact, bool small, const void * data, size_t offset, size_t size) {
    const struct pi2_embedding * t = o->table;
    if (atomic_load(&o->built) < 0) {
        return;
    }
    pi2_embedding_check_upload(o->table, data, offset, size);
    if (atomic_load(&o->table->checked) < 0) {
        pi2_output_fail(o, o->table->error);
        return;
    }
    if (offset % t->row_size != 0 || size % t->row_size != 0) {
        char msg[256];
        snprintf(msg, sizeof(msg), "%s: llama uploaded bytes %zu..%zu, not whole rows of %zu bytes", t->name, offset,
                 offset + size, t->row_size);
        pi2_output_fail(o, msg);
        return;
    }
    if (atomic_load(&o->built) == 0 && o->proxy == NULL) { // the first upload fixes the copy's type
        const enum ggml_type proxy = pi2_output_copy_type(t->type, t->n_embd, small);
        if (proxy != GGML_TYPE_COUNT) {
            o->proxy_type     = proxy;
            o->proxy_row_size = ggml_row_size(proxy, t->n_embd);
        }
        if (o->copy_fd >= 0 && o->copy_type != o->proxy_type) { // PI2_OUTPUT_COPY asks for another type than convert's
            PI2_LOG_INFO("pi2: the sidecar's %s is %s, the copy %s: quantizing the output matrix at load\n",
                         PI2_OPTIONAL_TENSOR_OUTPUT_COPY, ggml_type_name(o->copy_type), ggml_type_name(o->proxy_type));
            pi2_output_drop_sidecar_copy(o);
        }
    }
    o->n_exact = n_exact < t->n_rows ? n_exact : t->n_rows;
    const int64_t r0 = (int64_t) (offset / t->row_size), n = (int64_t) (size / t->row_size);
    const int from_sidecar = o->copy_fd >= 0 ? pi2_output_check_copy(o, r0, n, data) : 1;
    if (from_sidecar < 0) {
        return;
    }
    if (from_sidecar > 0) {
        // rows accepted from the sidecar before this upload (in whatever order llama sent them) are read now, with
        // the whole copy; this upload's and later ones' rows are made from the uploads over it
        if (o->copy_fd >= 0 && atomic_load(&o->built) > 0 && pi2_output_read_copy(o, t->n_rows) != 0) {
            return;
        }
        pi2_output_drop_sidecar_copy(o);
        if (o->proxy == NULL && (o->proxy = malloc((size_t) t->n_rows * o->proxy_row_size)) == NULL) {
            pi2_output_fail(o, "out of memory for the output matrix's in-RAM copy");
            return;
        }
        if (!pi2_output_quantize(t, data, n, o->proxy_type, o->proxy + (size_t) r0 * o->proxy_row_size)) {
            pi2_output_fail(o, "out of memory making the output matrix's in-RAM copy");
            return;
        }
    }
    atomic_fetch_add(&o->built, (long long) n);
}

int pi2_output_copy_make(const char * model_path, int small, int32_t * type, int64_t * n_rows, size_t * row_size,
                         void * dst, size_t dst_size, char * err, size_t errlen) {
    char buf[512];
    if (err == NULL || errlen == 0) {
        err = buf;
        errlen = sizeof(buf);
    }
    struct pi2_output * o = NULL;
    const int rc = pi2_output_open(model_path, &o, err, errlen);
    if (rc <= 0) {
        return rc;
    }
    const struct pi2_embedding * t = o->table;
    const enum ggml_type copy = pi2_output_copy_type(t->type, t->n_embd, small != 0);
    if (copy == GGML_TYPE_COUNT) {
        pi2_output_free(o);
        return 0;
    }
    *type     = (int32_t) copy;
    *n_rows   = t->n_rows;
    *row_size = ggml_row_size(copy, t->n_embd);
    if (dst == NULL) {
        pi2_output_free(o);
        return 1;
    }
    if (dst_size / *row_size < (size_t) t->n_rows) {
        snprintf(err, errlen, "model %.300s: its output matrix's copy takes %" PRId64 " rows of %zu bytes, more than the "
                 "%zu given", model_path, t->n_rows, *row_size, dst_size);
        pi2_output_free(o);
        return -1;
    }
    // in slices of the file's rows, each quantized on every core (the same routine as a load)
    const int64_t step = (int64_t) ((16u << 20) / t->row_size) + 1;
    void * rows = malloc((size_t) step * t->row_size);
    int ret = rows != NULL ? 1 : -1;
    if (rows == NULL) {
        snprintf(err, errlen, "model %.300s: out of memory reading its output matrix", model_path);
    }
    for (int64_t r0 = 0; ret > 0 && r0 < t->n_rows; r0 += step) {
        const int64_t n = t->n_rows - r0 < step ? t->n_rows - r0 : step;
        const int e = pi2_read_exact(t->fd, rows, (size_t) n * t->row_size, t->offset + (uint64_t) r0 * t->row_size);
        if (e != 0) {
            snprintf(err, errlen, "model %.300s: reading %s failed: %s", model_path, t->name,
                     e == PI2_READ_EOF ? "the file is shorter than its header says" : strerror(e));
            ret = -1;
        } else if (!pi2_output_quantize(t, rows, n, copy, (uint8_t *) dst + (size_t) r0 * *row_size)) {
            snprintf(err, errlen, "model %.300s: out of memory quantizing its output matrix", model_path);
            ret = -1;
        }
    }
    free(rows);
    pi2_output_free(o);
    return ret;
}

bool pi2_output_ready(struct pi2_output * o) {
    if (pi2_output_finish(o) != 0) {
        return false;
    }
    const long long built = atomic_load(&o->built);
    if (built < 0) {
        return false;
    }
    if (!pi2_embedding_verified(o->table)) {
        snprintf(o->error, sizeof(o->error), "%s", o->table->error);
        return false;
    }
    if (built != o->table->n_rows) {
        snprintf(o->error, sizeof(o->error), "%s: %lld of %" PRId64 " rows of its in-RAM copy were made", o->table->name, built,
                 o->table->n_rows);
        return false;
    }
    return true;
}

// the k largest values of v[0..n) as ids, by a min-heap of k (k <= n)
static void pi2_top_k(const float * v, int64_t n, int64_t k, int32_t * ids) {
    int64_t m = 0;
    for (int64_t i = 0; i < n; ++i) {
        if (m == k && !(v[i] > v[ids[0]])) {
            continue;
        }
        int64_t j;
        if (m < k) { // sift up
            j = m++;
            while (j > 0 && v[ids[(j - 1) / 2]] > v[i]) {
                ids[j] = ids[(j - 1) / 2];
                j = (j - 1) / 2;
            }
        } else { // replace the smallest, sift down
            j = 0;
            for (;;) {
                int64_t c = 2 * j + 1;
                if (c >= m) {
                    break;
                }
                if (c + 1 < m && v[ids[c + 1]] < v[ids[c]]) {
                    ++c;
                }
                if (!(v[ids[c]] < v[i])) {
                    break;
                }
                ids[j] = ids[c];
                j = c;
            }
        }
        ids[j] = (int32_t) i;
    }
}

static int pi2_id_cmp(const void * a, const void * b) {
    const int32_t x = *(const int32_t *) a, y = *(const int32_t *) b;
    return (x > y) - (x < y);
}

enum ggml_status pi2_exec_output(struct pi2_backend_ctx * ctx, struct pi2_binding * b, struct ggml_tensor * node) {
    struct pi2_output * o = b != NULL ? b->output : NULL;
    if (o == NULL) {
        PI2_LOG_ERROR("pi2: %s is not an output matrix PI2 reads from a file\n", node->src[0]->name);
        return GGML_STATUS_FAILED;
    }
    if (!pi2_output_ready(o)) {
        snprintf(b->error, sizeof(b->error), "%s", o->error);
        PI2_LOG_REFUSAL("pi2: %s\n", b->error);
        return GGML_STATUS_FAILED;
    }
    const struct pi2_embedding * t = o->table;
    const struct ggml_tensor * x = node->src[1];
    // every logit from the copy
    enum ggml_status st = pi2_exec_mul_mat_with(ctx, node, o->proxy_type, o->proxy, o->proxy_row_size);
    if (st != GGML_STATUS_SUCCESS) {
        return st;
    }
    const int64_t k = o->n_exact;
    if (k <= 0) {
        return GGML_STATUS_SUCCESS;
    }
    char err[sizeof(b->error)];
    if (pi2_table_unchanged(t, err, sizeof(err)) != 0) {
        memcpy(b->error, err, sizeof(err));
        PI2_LOG_REFUSAL("pi2: %s\n", b->error);
        return GGML_STATUS_FAILED;
    }
    // the largest: rows from the file, in the model's type, against the activation in its vec_dot type
    const struct ggml_type_traits_cpu * tt = ggml_get_type_traits_cpu(t->type);
    const size_t xq_size = tt->vec_dot_type == GGML_TYPE_F32 ? 0 : ggml_row_size(tt->vec_dot_type, t->n_embd);
    const size_t rows_size = (size_t) k * t->row_size;
    char * w = pi2_work_reserve(ctx, rows_size + xq_size + (size_t) k * sizeof(int32_t));
    if (w == NULL) {
        PI2_LOG_ERROR("pi2: out of memory for %lld output rows\n", (long long) k);
        return GGML_STATUS_ALLOC_FAILED;
    }
    char * rows = w, * xq = w + rows_size;
    int32_t * ids = (int32_t *) (w + rows_size + xq_size);
    for (int64_t j = 0; j < x->ne[1]; ++j) {
        float * logits = (float *) ((char *) node->data + j * node->nb[1]);
        const float * xj = (const float *) ((const char *) x->data + j * x->nb[1]);
        pi2_top_k(logits, t->n_rows, k, ids);
        qsort(ids, (size_t) k, sizeof(*ids), pi2_id_cmp); // in file order
        // the reads go out together: the kernel starts them all before the first pread waits
        for (int64_t i = 0; i < k; ++i) {
            (void) posix_fadvise(t->fd, (off_t) (t->offset + (uint64_t) ids[i] * t->row_size), (off_t) t->row_size,
                                 POSIX_FADV_WILLNEED);
        }
        for (int64_t i = 0; i < k; ++i) {
            if (pi2_table_read_row(t, ids[i], rows + (size_t) i * t->row_size, err, sizeof(err)) != 0) {
                memcpy(b->error, err, sizeof(err));
                PI2_LOG_REFUSAL("pi2: %s\n", b->error);
                return GGML_STATUS_FAILED;
            }
        }
        const void * xv = xj;
        if (xq_size > 0) {
            ggml_get_type_traits_cpu(tt->vec_dot_type)->from_float(xj, xq, t->n_embd);
            xv = xq;
        }
        for (int64_t i = 0; i < k; ++i) {
            float v = 0.0f;
            tt->vec_dot((int) t->n_embd, &v, 0, rows + (size_t) i * t->row_size, 0, xv, 0, 1);
            logits[ids[i]] = v;
        }
    }
    pi2_count(&ctx->dev->counters.output_rows, (uint64_t) (k * x->ne[1]));
    pi2_count(&ctx->dev->counters.output_bytes, (uint64_t) (k * x->ne[1]) * t->row_size);
    return GGML_STATUS_SUCCESS;
}
