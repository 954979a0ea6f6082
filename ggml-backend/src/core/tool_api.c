// Entry points for tools and tests (ggml-pi2.h): the device's counters, build information, struct sizes
// for FFI checks, and the down-column kernels on their own.
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "core/build_info.h"
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
