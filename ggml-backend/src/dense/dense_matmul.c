#include "dense/dense_matmul.h"

// Rows are processed in tiles so that a tile of weight rows stays in L1/L2 while every token of the
// batch is multiplied with it (prompt batches); for one token this degenerates to a row stream.
#define PI2_TILE_ROWS   16
#define PI2_TILE_TOKENS 16

void pi2_dense_rows(const struct pi2_dense_args * a, int64_t r0, int64_t r1) {
    for (int64_t rt = r0; rt < r1; rt += PI2_TILE_ROWS) {
        const int64_t re = rt + PI2_TILE_ROWS < r1 ? rt + PI2_TILE_ROWS : r1;
        for (int64_t tt = 0; tt < a->n_tokens; tt += PI2_TILE_TOKENS) {
            const int64_t te = tt + PI2_TILE_TOKENS < a->n_tokens ? tt + PI2_TILE_TOKENS : a->n_tokens;
            int64_t t = tt;
            if (a->dot_tokens != NULL) { // a row against PI2_DOT_TOKENS tokens a call: the row unpacked once for them
                for (; t + PI2_DOT_TOKENS <= te; t += PI2_DOT_TOKENS) {
                    const void * xs[PI2_DOT_TOKENS];
                    for (int k = 0; k < PI2_DOT_TOKENS; ++k) {
                        xs[k] = a->x + (size_t) (t + k) * a->x_stride;
                    }
                    for (int64_t r = rt; r < re; ++r) {
                        float s[PI2_DOT_TOKENS];
                        a->dot_tokens((int) a->k, s, a->w + (size_t) r * a->w_stride, xs);
                        for (int k = 0; k < PI2_DOT_TOKENS; ++k) {
                            a->dst[(t + k) * a->dst_stride + r] = s[k];
                        }
                    }
                }
            }
            for (; t < te; ++t) {
                const char * xt = a->x + (size_t) t * a->x_stride;
                float * d = a->dst + t * a->dst_stride;
                for (int64_t r = rt; r < re; ++r) {
                    a->vec_dot((int) a->k, d + r, 0, a->w + (size_t) r * a->w_stride, 0, xt, 0, 1);
                }
            }
        }
    }
}

void pi2_dense_quantize_tokens(const float * src, size_t src_stride, int64_t k, ggml_from_float_t from_float,
                               char * x, size_t x_stride, int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
        from_float((const float *) ((const char *) src + (size_t) t * src_stride), x + (size_t) t * x_stride, k);
    }
}
