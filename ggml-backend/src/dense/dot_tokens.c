#include "dense/dot_tokens.h"

#include <math.h>
#include <stdint.h>
#include <string.h>

#define GGML_COMMON_DECL_C
#include "ggml-common.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define PI2_DOT_TOKENS_X86 1
#endif

#ifdef PI2_DOT_TOKENS_X86

// ggml-cpu's x86 quants.c hsum_float_8: the same adds in the same order
static inline float pi2_hsum_float_8(const __m256 x) {
    __m128 res = _mm256_extractf128_ps(x, 1);
    res = _mm_add_ps(res, _mm256_castps256_ps128(x));
    res = _mm_add_ps(res, _mm_movehl_ps(res, res));
    res = _mm_add_ss(res, _mm_movehdup_ps(res));
    return _mm_cvtss_f32(res);
}

// pairs of int16 products of the sub-block's scale added into sum: vec_dot's madd then add (VNNI does both in one
// instruction; integer sums, so the lanes are the same either way)
static inline __m256i pi2_add_scaled(__m256i sum, __m256i scale, __m256i p16) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpwssd_epi32(sum, scale, p16);
#elif defined(__AVXVNNI__)
    return _mm256_dpwssd_avx_epi32(sum, scale, p16);
#else
    return _mm256_add_epi32(sum, _mm256_madd_epi16(scale, p16));
#endif
}

// int16 lane pairs selecting sub-block scale i of the 8 in a 128-bit half (ggml's get_scale_shuffle_k4)
static inline __m256i pi2_scale_shuffle_k4(int i) {
    const __m128i pair = _mm_set1_epi16((short) ((2 * i) | ((2 * i + 1) << 8)));
    return _mm256_set_m128i(pair, pair);
}

// ggml_vec_dot_q4_K_q8_K's AVX2 path, for PI2_DOT_TOKENS tokens: per token the same sums, in the same order
static void pi2_dot_tokens_q4_K(int n, float * s, const void * row, const void * const * ys) {
    const block_q4_K * x = row;
    const block_q8_K * y[PI2_DOT_TOKENS];
    for (int t = 0; t < PI2_DOT_TOKENS; ++t) {
        y[t] = ys[t];
    }
    const int nb = n / QK_K;
    const uint32_t kmask1 = 0x3f3f3f3f, kmask2 = 0x0f0f0f0f, kmask3 = 0x03030303;
    const __m256i m4 = _mm256_set1_epi8(0xF);
    __m256 acc[PI2_DOT_TOKENS];
    __m128 acc_m[PI2_DOT_TOKENS];
    for (int t = 0; t < PI2_DOT_TOKENS; ++t) {
        acc[t]   = _mm256_setzero_ps();
        acc_m[t] = _mm_setzero_ps();
    }
    for (int i = 0; i < nb; ++i) {
        const float xd = _cvtsh_ss(x[i].d), xdmin = _cvtsh_ss(x[i].dmin);
        uint32_t utmp[4];
        memcpy(utmp, x[i].scales, 12);
        utmp[3] = ((utmp[2] >> 4) & kmask2) | (((utmp[1] >> 6) & kmask3) << 4);
        const uint32_t uaux = utmp[1] & kmask1;
        utmp[1] = (utmp[2] & kmask2) | (((utmp[0] >> 6) & kmask3) << 4);
        utmp[2] = uaux;
        utmp[0] &= kmask1;
        const __m256i mins_and_scales = _mm256_cvtepu8_epi16(_mm_set_epi32((int) utmp[3], (int) utmp[2], (int) utmp[1], (int) utmp[0]));
        const __m128i mins = _mm256_extracti128_si256(mins_and_scales, 1);
        const __m128i sc128 = _mm256_extracti128_si256(mins_and_scales, 0);
        const __m256i scales = _mm256_set_m128i(sc128, sc128);
        for (int t = 0; t < PI2_DOT_TOKENS; ++t) {
            const float dmin = -y[t][i].d * xdmin;
            const __m256i q8sums = _mm256_loadu_si256((const __m256i *) y[t][i].bsums);
            const __m128i q8s = _mm_hadd_epi16(_mm256_extracti128_si256(q8sums, 0), _mm256_extracti128_si256(q8sums, 1));
            const __m128i prod = _mm_madd_epi16(mins, q8s);
            acc_m[t] = _mm_fmadd_ps(_mm_set1_ps(dmin), _mm_cvtepi32_ps(prod), acc_m[t]);
        }
        __m256i sumi[PI2_DOT_TOKENS];
        for (int t = 0; t < PI2_DOT_TOKENS; ++t) {
            sumi[t] = _mm256_setzero_si256();
        }
        for (int j = 0; j < QK_K / 64; ++j) {
            const __m256i scale_l = _mm256_shuffle_epi8(scales, pi2_scale_shuffle_k4(2 * j + 0));
            const __m256i scale_h = _mm256_shuffle_epi8(scales, pi2_scale_shuffle_k4(2 * j + 1));
            const __m256i q4bits = _mm256_loadu_si256((const __m256i *) (x[i].qs + 32 * j));
            const __m256i q4l = _mm256_and_si256(q4bits, m4);
            const __m256i q4h = _mm256_and_si256(_mm256_srli_epi16(q4bits, 4), m4);
            for (int t = 0; t < PI2_DOT_TOKENS; ++t) {
                const int8_t * q8 = y[t][i].qs + 64 * j;
                const __m256i p16l = _mm256_maddubs_epi16(q4l, _mm256_loadu_si256((const __m256i *) q8));
                const __m256i p16h = _mm256_maddubs_epi16(q4h, _mm256_loadu_si256((const __m256i *) (q8 + 32)));
                sumi[t] = pi2_add_scaled(pi2_add_scaled(sumi[t], scale_l, p16l), scale_h, p16h);
            }
        }
        for (int t = 0; t < PI2_DOT_TOKENS; ++t) {
            const float d = y[t][i].d * xd;
            acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi[t]), acc[t]);
        }
    }
    for (int t = 0; t < PI2_DOT_TOKENS; ++t) {
        __m128 am = acc_m[t];
        am = _mm_add_ps(am, _mm_movehl_ps(am, am));
        am = _mm_add_ss(am, _mm_movehdup_ps(am));
        s[t] = pi2_hsum_float_8(acc[t]) + _mm_cvtss_f32(am);
    }
}

// unsigned x signed bytes summed in fours, as floats: ggml's mul_sum_us8_pairs_float (VNNI where the CPU has it)
static inline __m256 pi2_mul_sum_us8_pairs_float(const __m256i ax, const __m256i sy) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(_mm256_setzero_si256(), ax, sy));
#elif defined(__AVXVNNI__)
    return _mm256_cvtepi32_ps(_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), ax, sy));
#else
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_set1_epi16(1), _mm256_maddubs_epi16(ax, sy)));
#endif
}

// ggml_vec_dot_q4_1_q8_1's AVX2 path, for PI2_DOT_TOKENS tokens (its `summs += m * s` compiled as one fused
// multiply-add, as GCC contracts it in ggml's GNU C: the agreement check says whether it was)
static void pi2_dot_tokens_q4_1(int n, float * s, const void * row, const void * const * ys) {
    const block_q4_1 * x = row;
    const block_q8_1 * y[PI2_DOT_TOKENS];
    __m256 acc[PI2_DOT_TOKENS];
    float summs[PI2_DOT_TOKENS];
    for (int t = 0; t < PI2_DOT_TOKENS; ++t) {
        y[t]     = ys[t];
        acc[t]   = _mm256_setzero_ps();
        summs[t] = 0.0f;
    }
    const __m256i low = _mm256_set1_epi8(0xF);
    for (int ib = 0; ib < n / QK8_1; ++ib) {
        const float d0 = _cvtsh_ss(x[ib].d), m0 = _cvtsh_ss(x[ib].m);
        const __m256 d0v = _mm256_set1_ps(d0);
        const __m128i tmp = _mm_loadu_si128((const __m128i *) x[ib].qs);
        const __m256i qx = _mm256_and_si256(low, _mm256_set_m128i(_mm_srli_epi16(tmp, 4), tmp));
        for (int t = 0; t < PI2_DOT_TOKENS; ++t) {
            summs[t] = fmaf(m0, _cvtsh_ss(y[t][ib].s), summs[t]);
            const __m256 d0d1 = _mm256_mul_ps(d0v, _mm256_set1_ps(_cvtsh_ss(y[t][ib].d)));
            const __m256 xy = pi2_mul_sum_us8_pairs_float(qx, _mm256_loadu_si256((const __m256i *) y[t][ib].qs));
            acc[t] = _mm256_fmadd_ps(d0d1, xy, acc[t]);
        }
    }
    for (int t = 0; t < PI2_DOT_TOKENS; ++t) {
        s[t] = pi2_hsum_float_8(acc[t]) + summs[t];
    }
}

#endif // PI2_DOT_TOKENS_X86

// The kernel against vec_dot on rows and tokens of varied magnitudes, bit for bit.
static bool pi2_dot_tokens_agree(enum ggml_type type, pi2_dot_tokens_t kernel, ggml_vec_dot_t vec_dot) {
    enum { N = 2 * QK_K, ROWS = 3 };
    const struct ggml_type_traits_cpu * tt = ggml_get_type_traits_cpu(type);
    const struct ggml_type_traits_cpu * tv = ggml_get_type_traits_cpu(tt->vec_dot_type);
    if (tv->from_float == NULL || ggml_row_size(type, N) > 1024 || ggml_row_size(tt->vec_dot_type, N) > 1024) {
        return false;
    }
    float f[N];
    _Alignas(64) uint8_t w[ROWS][1024];
    _Alignas(64) uint8_t y[PI2_DOT_TOKENS][1024];
    uint32_t seed = 0x9e3779b9u;
    for (int r = 0; r < ROWS + PI2_DOT_TOKENS; ++r) {
        for (int k = 0; k < N; ++k) {
            seed ^= seed << 13;
            seed ^= seed >> 17;
            seed ^= seed << 5;
            f[k] = ((float) (seed >> 8) / (float) (1u << 24) - 0.5f) * (float) (1 + (k * 7 + r) % 13);
        }
        if (r < ROWS) {
            ggml_quantize_chunk(type, f, w[r], 0, 1, N, NULL);
        } else {
            tv->from_float(f, y[r - ROWS], N);
        }
    }
    const void * ys[PI2_DOT_TOKENS];
    for (int t = 0; t < PI2_DOT_TOKENS; ++t) {
        ys[t] = y[t];
    }
    for (int r = 0; r < ROWS; ++r) {
        float got[PI2_DOT_TOKENS], want;
        kernel(N, got, w[r], ys);
        for (int t = 0; t < PI2_DOT_TOKENS; ++t) {
            vec_dot(N, &want, 0, w[r], 0, y[t], 0, 1);
            if (memcmp(&got[t], &want, sizeof(float)) != 0) {
                return false;
            }
        }
    }
    return true;
}

pi2_dot_tokens_t pi2_dot_tokens_for(enum ggml_type type, ggml_vec_dot_t vec_dot, int8_t * checked) {
    pi2_dot_tokens_t kernel = NULL;
#ifdef PI2_DOT_TOKENS_X86
    if (type == GGML_TYPE_Q4_K) {
        kernel = pi2_dot_tokens_q4_K;
    } else if (type == GGML_TYPE_Q4_1) {
        kernel = pi2_dot_tokens_q4_1;
    }
#endif
    if (kernel == NULL || vec_dot == NULL) {
        return NULL;
    }
    if (checked == NULL || *checked == 0) {
        const bool agree = pi2_dot_tokens_agree(type, kernel, vec_dot);
        if (checked == NULL) {
            return agree ? kernel : NULL;
        }
        *checked = agree ? 1 : -1;
    }
    return *checked > 0 ? kernel : NULL;
}

void pi2_dot_listed(pi2_dot_tokens_t kernel, ggml_vec_dot_t vec_dot, int n, const void * row, const char * x,
                    size_t x_stride, const int32_t * idx, int64_t m, float * out) {
    int64_t k = 0;
    if (kernel != NULL) {
        for (; k + PI2_DOT_TOKENS <= m; k += PI2_DOT_TOKENS) {
            const void * ys[PI2_DOT_TOKENS];
            for (int q = 0; q < PI2_DOT_TOKENS; ++q) {
                ys[q] = x + (size_t) idx[k + q] * x_stride;
            }
            kernel(n, out + k, row, ys);
        }
    }
    for (; k < m; ++k) {
        vec_dot(n, out + k, 0, row, 0, x + (size_t) idx[k] * x_stride, 0, 1);
    }
}
