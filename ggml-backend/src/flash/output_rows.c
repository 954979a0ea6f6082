#define _DEFAULT_SOURCE // posix_fadvise
#include "flash/output_rows.h"

#include <fcntl.h>
#include <inttypes.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dense/ffn_exec.h"
#include "ggml-cpu.h"
#include "model/model_binding.h"
#include "core/pi2_context.h"
#include "core/pi2_log.h"

int pi2_output_open(const char * model_path, struct pi2_output ** out, char * err, size_t errlen) {
    *out = NULL;
    struct pi2_embedding * t = NULL;
    const int rc = pi2_table_open(model_path, PI2_OUTPUT_NAME, &t, err, errlen);
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
    o->proxy_type     = proxy;
    o->proxy_row_size = ggml_row_size(proxy, t->n_embd);
    atomic_init(&o->built, 0);
    *out = o;
    return 1;
}

void pi2_output_free(struct pi2_output * o) {
    if (o == NULL) {
        return;
    }
    pi2_embedding_free(o->table);
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
    if (o->proxy == NULL) {
        const enum ggml_type proxy = pi2_output_copy_type(t->type, t->n_embd, small);
        if (proxy != GGML_TYPE_COUNT) {
            o->proxy_type     = proxy;
            o->proxy_row_size = ggml_row_size(proxy, t->n_embd);
        }
        o->proxy = malloc((size_t) t->n_rows * o->proxy_row_size);
        if (o->proxy == NULL) {
            pi2_output_fail(o, "out of memory for the output matrix's in-RAM copy");
            return;
        }
    }
    o->n_exact = n_exact < t->n_rows ? n_exact : t->n_rows;
    const int64_t r0 = (int64_t) (offset / t->row_size), n = (int64_t) (size / t->row_size);
    const ggml_to_float_t   to_float   = ggml_get_type_traits(t->type)->to_float;
    const ggml_from_float_t from_float = ggml_get_type_traits_cpu(o->proxy_type)->from_float;
    bool oom = false;
    // at load, on every core: Q3_K quantization takes ~20 ns a value (3 s for Qwen2.5-1.5B's matrix here)
    #pragma omp parallel
    {
        float * row = malloc((size_t) t->n_embd * sizeof(float));
        if (row == NULL) {
            #pragma omp atomic write
            oom = true;
        } else {
            #pragma omp for schedule(static)
            for (int64_t r = 0; r < n; ++r) {
                const char * src = (const char *) data + (size_t) r * t->row_size;
                if (t->type == GGML_TYPE_F32) {
                    memcpy(row, src, t->row_size);
                } else {
                    to_float(src, row, t->n_embd);
                }
                from_float(row, o->proxy + (size_t) (r0 + r) * o->proxy_row_size, t->n_embd);
            }
            free(row);
        }
    }
    if (oom) {
        pi2_output_fail(o, "out of memory making the output matrix's in-RAM copy");
        return;
    }
    atomic_fetch_add(&o->built, (long long) n);
}

bool pi2_output_ready(struct pi2_output * o) {
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
