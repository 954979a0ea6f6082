// Entry points for tools and tests (ggml-pi2.h): the device's counters, build information, struct sizes
// for FFI checks, and the down-column kernels on their own.
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core/build_info.h"
#include "dense/dot_tokens.h"
#include "dense/ffn_exec.h"
#include "sparse/column_axpy.h"
#include "ggml-pi2.h"
#include "core/pi2_context.h"

#define PI2_STR_(x) #x
#define PI2_STR(x)  PI2_STR_(x)

// The counters hold PI2_MAX_LAYERS layers (6 MB), of which a model uses n_layers: reads and resets touch those
// (and the fields around the array) only, so neither side makes the rest resident. Layers past n_layers are
// zero: a layer is marked seen (pi2_count_layer_seen) before it is counted.
static uint32_t pi2_counters_used(const struct pi2_counters * c) {
    return c->n_layers < PI2_MAX_LAYERS ? c->n_layers : PI2_MAX_LAYERS;
}

static const size_t pi2_counters_tail = offsetof(struct pi2_counters, output_rows); // the fields after the array

void pi2_counters_read(struct pi2_counters * out) {
    // counters are atomically incremented; a snapshot may straddle one node, which readers tolerate. The
    // caller's layers past n_layers are left as they are (zero in a fresh buffer).
    const struct pi2_counters * c = &pi2_device_ctx()->counters;
    memcpy(out, c, offsetof(struct pi2_counters, layer));
    memcpy(out->layer, c->layer, (size_t) pi2_counters_used(c) * sizeof(c->layer[0]));
    memcpy((char *) out + pi2_counters_tail, (const char *) c + pi2_counters_tail, sizeof(*out) - pi2_counters_tail);
}

void pi2_counters_reset(void) {
    struct pi2_counters * c = &pi2_device_ctx()->counters;
    memset(c->layer, 0, (size_t) pi2_counters_used(c) * sizeof(c->layer[0]));
    memset(c, 0, offsetof(struct pi2_counters, layer));
    memset((char *) c + pi2_counters_tail, 0, sizeof(*c) - pi2_counters_tail);
}

int pi2_columns_add(int type, int64_t n, float * y, int64_t n_cols, const float * a, const void * const * cols) {
    if (type < 0 || type >= GGML_TYPE_COUNT || !pi2_column_type_usable((enum ggml_type) type) || n <= 0 ||
        n % ggml_blck_size((enum ggml_type) type) != 0) {
        return -1;
    }
    float * tmp = malloc((size_t) pi2_column_scratch(n) * sizeof(float));
    if (tmp == NULL) {
        return -1;
    }
    struct pi2_column_sum sum = { .type = (enum ggml_type) type, .n = n, .y = y, .tmp = tmp };
    for (int64_t c = 0; c < n_cols; ++c) {
        pi2_column_sum_add(&sum, a[c], cols[c]);
    }
    pi2_column_sum_finish(&sum);
    free(tmp);
    return 0;
}

int pi2_columns_add_batch(int type, int64_t n, int64_t n_tokens, float * y, int64_t n_cols, const float * a,
                          const void * const * cols) {
    if (type < 0 || type >= GGML_TYPE_COUNT || !pi2_column_type_usable((enum ggml_type) type) || n <= 0 ||
        n % ggml_blck_size((enum ggml_type) type) != 0 || n_tokens < 0 || n_cols < 0 || n_cols > PI2_COLUMNS_MAX) {
        return -1;
    }
    float * tmp  = malloc((size_t) pi2_column_scratch(n) * sizeof(float));
    float * colf = malloc((size_t) PI2_COLUMNS_MAX * (size_t) n * sizeof(float));
    const int rc = tmp != NULL && colf != NULL ? 0 : -1;
    if (rc == 0) {
        pi2_columns_add_tokens((enum ggml_type) type, n, n_tokens, y, (size_t) n * sizeof(float), (int) n_cols, a,
                               n_cols, cols, colf, tmp);
    }
    free(colf);
    free(tmp);
    return rc;
}

int pi2_dot_rows_tokens(int type, int64_t n, int64_t n_rows, const void * rows, int64_t n_tokens, const float * x,
                        float * out, int kernel) {
    if (type < 0 || type >= GGML_TYPE_COUNT || n <= 0 || n > INT32_MAX || n_rows < 0 || n_tokens < 0 ||
        n_tokens > INT32_MAX || n % ggml_blck_size((enum ggml_type) type) != 0) {
        return -1;
    }
    ggml_cpu_init(); // ggml-cpu's conversion tables, where no llama.cpp backend has made them yet (idempotent)
    const struct ggml_type_traits_cpu * tt = ggml_get_type_traits_cpu((enum ggml_type) type);
    const struct ggml_type_traits_cpu * tv = ggml_get_type_traits_cpu(tt->vec_dot_type);
    if (tt->vec_dot == NULL || (tt->vec_dot_type != GGML_TYPE_F32 && tv->from_float == NULL)) {
        return -1;
    }
    const size_t row = ggml_row_size((enum ggml_type) type, n), xrow = ggml_row_size(tt->vec_dot_type, n);
    char * xq = malloc(xrow * (size_t) (n_tokens > 0 ? n_tokens : 1));
    int32_t * idx = malloc(sizeof(int32_t) * (size_t) (n_tokens > 0 ? n_tokens : 1));
    float * s = malloc(sizeof(float) * (size_t) (n_tokens > 0 ? n_tokens : 1));
    int rc = xq != NULL && idx != NULL && s != NULL ? 0 : -1;
    const pi2_dot_tokens_t k = rc == 0 && kernel ? pi2_dot_tokens_for((enum ggml_type) type, tt->vec_dot, NULL) : NULL;
    for (int64_t t = 0; rc == 0 && t < n_tokens; ++t) {
        if (tt->vec_dot_type == GGML_TYPE_F32) {
            memcpy(xq + (size_t) t * xrow, x + t * n, xrow);
        } else {
            tv->from_float(x + t * n, xq + (size_t) t * xrow, n);
        }
        idx[t] = (int32_t) t;
    }
    for (int64_t r = 0; rc == 0 && r < n_rows; ++r) {
        pi2_dot_listed(k, tt->vec_dot, (int) n, (const char *) rows + (size_t) r * row, xq, xrow, idx, n_tokens, s);
        for (int64_t t = 0; t < n_tokens; ++t) {
            out[t * n_rows + r] = s[t];
        }
    }
    free(s);
    free(idx);
    free(xq);
    return rc < 0 ? rc : k != NULL && n_tokens >= PI2_DOT_TOKENS ? 1 : 0;
}

int pi2_time_dense_rows(int type, int64_t k, int64_t n_rows, int threads, double seconds, double * bytes_per_s) {
    if (type < 0 || type >= GGML_TYPE_COUNT || !(seconds > 0.0 && seconds < 60.0)) {
        return -1;
    }
    return pi2_exec_time_rows((enum ggml_type) type, k, n_rows, threads, seconds, bytes_per_s);
}

const char * pi2_build_info(void) {
    return "pi2 " PI2_VERSION "; ggml api " PI2_STR(GGML_BACKEND_API_VERSION) "; llama-cpp-python " PI2_LLAMA_CPP_PYTHON_VERSION;
}

size_t pi2_struct_size(const char * name) {
    if (name == NULL) {
        return 0;
    }
    if (strcmp(name, "pi2_counters") == 0) {
        return sizeof(struct pi2_counters);
    }
    if (strcmp(name, "pi2_cache_info") == 0) {
        return sizeof(struct pi2_cache_info);
    }
    if (strcmp(name, "pi2_model_summary") == 0) {
        return sizeof(struct pi2_model_summary);
    }
    if (strcmp(name, "pi2_budget_floor") == 0) {
        return sizeof(struct pi2_budget_floor);
    }
    return 0;
}
