#include "dense/glu.h"

#include <math.h>

#if defined(__AVX2__) || defined(__AVX512F__) || defined(__SSE2__)
#include <immintrin.h>
#endif

// Constants and vector expf from ggml-cpu (vec.h, MIT, "adapted from arm limited optimized routine").
static const float PI2_GELU_COEF_A    = 0.044715f;
static const float PI2_SQRT_2_OVER_PI = 0.79788456080286535587989211986876f;
static const float PI2_SQRT_2_INV     = 0.70710678118654752440084436210484f;

static inline float pi2_gelu_f32(float x) {
    return 0.5f*x*(1.0f + tanhf(PI2_SQRT_2_OVER_PI*x*(1.0f + PI2_GELU_COEF_A*x*x)));
}

static inline float pi2_silu_f32(float x) {
    return x/(1.0f + expf(-x));
}

#if defined(__AVX512F__) && defined(__AVX512DQ__)
#define PI2_VEC 16
static inline __m512 pi2_v_expf(__m512 x) {
    const __m512 r = _mm512_set1_ps(0x1.8p23f);
    const __m512 z = _mm512_fmadd_ps(x, _mm512_set1_ps(0x1.715476p+0f), r);
    const __m512 n = _mm512_sub_ps(z, r);
    const __m512 b = _mm512_fnmadd_ps(n, _mm512_set1_ps(0x1.7f7d1cp-20f),
                                      _mm512_fnmadd_ps(n, _mm512_set1_ps(0x1.62e4p-1f), x));
    const __mmask16 d = _mm512_cmp_ps_mask(_mm512_abs_ps(n), _mm512_set1_ps(192), _CMP_GT_OQ);
    const __m512 u = _mm512_mul_ps(b, b);
    const __m512 j = _mm512_fmadd_ps(
        _mm512_fmadd_ps(_mm512_fmadd_ps(_mm512_set1_ps(0x1.0e4020p-7f), b, _mm512_set1_ps(0x1.573e2ep-5f)), u,
                        _mm512_fmadd_ps(_mm512_set1_ps(0x1.555e66p-3f), b, _mm512_set1_ps(0x1.fffdb6p-2f))),
        u, _mm512_fmadd_ps(_mm512_set1_ps(0x1.ffffecp-1f), b, _mm512_set1_ps(1.0F)));
    const __m512 res = _mm512_scalef_ps(j, n);
    if (_mm512_kortestz(d, d)) {
        return res;
    }
    const __m512 zero = _mm512_setzero_ps();
    const __m512 alt = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(n, zero, _CMP_LE_OQ), _mm512_set1_ps(INFINITY), zero);
    return _mm512_mask_blend_ps(d, res, alt);
}
static inline __m512 pi2_v_silu(__m512 x) {
    const __m512 neg_x = _mm512_sub_ps(_mm512_setzero_ps(), x);
    return _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1), pi2_v_expf(neg_x)));
}
static int pi2_swiglu_vec(int n, float * y, const float * x, const float * g) {
    int i = 0;
    for (; i + 15 < n; i += 16) {
        _mm512_storeu_ps(y + i, _mm512_mul_ps(pi2_v_silu(_mm512_loadu_ps(x + i)), _mm512_loadu_ps(g + i)));
    }
    return i;
}
#elif defined(__AVX2__) && defined(__FMA__)
#define PI2_VEC 8
static inline __m256 pi2_v_expf(__m256 x) {
    const __m256 r = _mm256_set1_ps(0x1.8p23f);
    const __m256 z = _mm256_fmadd_ps(x, _mm256_set1_ps(0x1.715476p+0f), r);
    const __m256 n = _mm256_sub_ps(z, r);
    const __m256 b = _mm256_fnmadd_ps(n, _mm256_set1_ps(0x1.7f7d1cp-20f),
                                      _mm256_fnmadd_ps(n, _mm256_set1_ps(0x1.62e4p-1f), x));
    const __m256i e = _mm256_slli_epi32(_mm256_castps_si256(z), 23);
    const __m256 k = _mm256_castsi256_ps(_mm256_add_epi32(e, _mm256_castps_si256(_mm256_set1_ps(1))));
    const __m256i c = _mm256_castps_si256(
        _mm256_cmp_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.f), n), _mm256_set1_ps(126), _CMP_GT_OQ));
    const __m256 u = _mm256_mul_ps(b, b);
    const __m256 j = _mm256_fmadd_ps(
        _mm256_fmadd_ps(_mm256_fmadd_ps(_mm256_set1_ps(0x1.0e4020p-7f), b, _mm256_set1_ps(0x1.573e2ep-5f)), u,
                        _mm256_fmadd_ps(_mm256_set1_ps(0x1.555e66p-3f), b, _mm256_set1_ps(0x1.fffdb6p-2f))),
        u, _mm256_mul_ps(_mm256_set1_ps(0x1.ffffecp-1f), b));
    if (!_mm256_movemask_ps(_mm256_castsi256_ps(c))) {
        return _mm256_fmadd_ps(j, k, k);
    }
    const __m256i gg = _mm256_and_si256(_mm256_castps_si256(_mm256_cmp_ps(n, _mm256_setzero_ps(), _CMP_LE_OQ)),
                                        _mm256_set1_epi32((int) 0x82000000u));
    const __m256 s1 = _mm256_castsi256_ps(_mm256_add_epi32(gg, _mm256_set1_epi32(0x7f000000)));
    const __m256 s2 = _mm256_castsi256_ps(_mm256_sub_epi32(e, gg));
    const __m256i d = _mm256_castps_si256(
        _mm256_cmp_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.f), n), _mm256_set1_ps(192), _CMP_GT_OQ));
    return _mm256_or_ps(
        _mm256_and_ps(_mm256_castsi256_ps(d), _mm256_mul_ps(s1, s1)),
        _mm256_andnot_ps(_mm256_castsi256_ps(d),
                         _mm256_or_ps(_mm256_and_ps(_mm256_castsi256_ps(c), _mm256_mul_ps(_mm256_fmadd_ps(s2, j, s2), s1)),
                                      _mm256_andnot_ps(_mm256_castsi256_ps(c), _mm256_fmadd_ps(k, j, k)))));
}
static inline __m256 pi2_v_silu(__m256 x) {
    const __m256 neg_x = _mm256_sub_ps(_mm256_setzero_ps(), x);
    return _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1), pi2_v_expf(neg_x)));
}
static int pi2_swiglu_vec(int n, float * y, const float * x, const float * g) {
    int i = 0;
    for (; i + 7 < n; i += 8) {
        _mm256_storeu_ps(y + i, _mm256_mul_ps(pi2_v_silu(_mm256_loadu_ps(x + i)), _mm256_loadu_ps(g + i)));
    }
    return i;
}
#else
// No vector silu: ggml-cpu on SSE2-only / other ISAs has its own variants we do not replicate;
// results then differ from stock in the last ulp (documented in docs/BACKEND.md).
static int pi2_swiglu_vec(int n, float * y, const float * x, const float * g) {
    (void) n; (void) y; (void) x; (void) g;
    return 0;
}
#endif

void pi2_glu_tables_init(struct pi2_glu_tables * t) {
    for (int i = 0; i < (1 << 16); ++i) {
        const float f = ggml_fp16_to_fp32((ggml_fp16_t) i);
        t->gelu_f16[i] = ggml_fp32_to_fp16(pi2_gelu_f32(f));
    }
}

bool pi2_glu_supported(enum ggml_glu_op op) {
    switch (op) {
        case GGML_GLU_OP_REGLU:
        case GGML_GLU_OP_GEGLU:
        case GGML_GLU_OP_SWIGLU:
        case GGML_GLU_OP_GEGLU_ERF:
        case GGML_GLU_OP_SWIGLU_OAI:
            return true;
        default:
            return false;
    }
}

bool pi2_glu_span(const struct pi2_glu_tables * t, const struct pi2_ffn_act * a, int n, float * y, const float * x, const float * g) {
    if (a->kind == PI2_ACT_DRELU) {
        for (int i = 0; i < n; ++i) {
            y[i] = (x[i] > 0.f && g[i] > 0.f) ? x[i] * g[i] : 0.f;
        }
        return true;
    }
    if (a->kind == PI2_ACT_FATRELU) {
        const float th = a->threshold;
        for (int i = 0; i < n; ++i) {
            y[i] = x[i] > th ? x[i] * g[i] : 0.f;
        }
        return true;
    }
    if (a->kind == PI2_ACT_SWIGLU_OAI) { // ggml-cpu's scalar loop (ops.cpp, swiglu_oai)
        for (int i = 0; i < n; ++i) {
            y[i] = pi2_act_gate(a, x[i]) * pi2_act_up(a, g[i]);
        }
        return true;
    }
    switch (pi2_act_glu_op(a)) {
        case GGML_GLU_OP_SWIGLU: {
            int i = pi2_swiglu_vec(n, y, x, g);
            for (; i < n; ++i) {
                y[i] = pi2_silu_f32(x[i]) * g[i];
            }
        } break;
        case GGML_GLU_OP_GEGLU:
            // ggml-cpu is built with GGML_GELU_FP16: gelu through an fp16 table, clamped outside +-10
            for (int i = 0; i < n; ++i) {
                if (x[i] <= -10.0f) {
                    y[i] = 0.0f;
                } else if (x[i] >= 10.0f) {
                    y[i] = x[i] * g[i];
                } else {
                    const uint16_t h = (uint16_t) ggml_fp32_to_fp16(x[i]);
                    y[i] = ggml_fp16_to_fp32((ggml_fp16_t) t->gelu_f16[h]) * g[i];
                }
            }
            break;
        case GGML_GLU_OP_GEGLU_ERF:
            for (int i = 0; i < n; ++i) {
                y[i] = 0.5f * x[i] * (1.0f + erff(x[i]*PI2_SQRT_2_INV)) * g[i];
            }
            break;
        case GGML_GLU_OP_REGLU:
            for (int i = 0; i < n; ++i) {
                y[i] = (x[i] > 0.f) ? x[i] * g[i] : 0.f;
            }
            break;
        default:
            return false;
    }
    return true;
}
