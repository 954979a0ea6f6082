#include "sparse/column_axpy.h"

#include <math.h>
#include <stdbool.h>
#include <string.h>

#define GGML_COMMON_DECL_C
#include "ggml-common.h"
#include "ggml-cpu.h"

static inline float pi2_h2f(ggml_half h) {
    return ggml_fp16_to_fp32(h);
}

static void pi2_axpy_f32(int64_t n, float * restrict y, float a, const float * restrict x) {
    for (int64_t i = 0; i < n; ++i) {
        y[i] += a * x[i];
    }
}

static void pi2_axpy_f16(int64_t n, float * restrict y, float a, const ggml_fp16_t * restrict x, float * restrict tmp) {
    // ggml's row converter uses F16C where the CPU has it; chunks keep tmp in L1
    for (int64_t i = 0; i < n; i += 256) {
        const int64_t m = n - i < 256 ? n - i : 256;
        ggml_cpu_fp16_to_fp32(x + i, tmp, m);
        pi2_axpy_f32(m, y + i, a, tmp);
    }
}

static void pi2_axpy_q8_0(int64_t n, float * restrict y, float a, const block_q8_0 * restrict b) {
    for (int64_t i = 0; i < n / QK8_0; ++i) {
        const float s = a * pi2_h2f(b[i].d);
        float * restrict yb = y + i * QK8_0;
        for (int k = 0; k < QK8_0; ++k) {
            yb[k] += s * (float) b[i].qs[k];
        }
    }
}

// the 6-bit scale and min of sub-block j of a Q4_K block (ggml-quants.c get_scale_min_k4)
static inline void pi2_q4_k_scale_min(int j, const uint8_t * q, uint8_t * sc, uint8_t * m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m  = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m  = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

static void pi2_axpy_q4_k(int64_t n, float * restrict y, float a, const block_q4_K * restrict b) {
    for (int64_t i = 0; i < n / QK_K; ++i) {
        const float d   = a * pi2_h2f(b[i].d);
        const float min = a * pi2_h2f(b[i].dmin);
        const uint8_t * restrict q = b[i].qs;
        float * restrict yb = y + i * QK_K;
        for (int j = 0; j < QK_K / 64; ++j) {
            uint8_t sc1, m1, sc2, m2;
            pi2_q4_k_scale_min(2 * j, b[i].scales, &sc1, &m1);
            pi2_q4_k_scale_min(2 * j + 1, b[i].scales, &sc2, &m2);
            const float d1 = d * sc1, o1 = min * m1;
            const float d2 = d * sc2, o2 = min * m2;
            for (int l = 0; l < 32; ++l) {
                yb[l] += d1 * (float) (q[l] & 0xF) - o1;
            }
            for (int l = 0; l < 32; ++l) {
                yb[l + 32] += d2 * (float) (q[l] >> 4) - o2;
            }
            q += 32;
            yb += 64;
        }
    }
}

static void pi2_axpy_q6_k(int64_t n, float * restrict y, float a, const block_q6_K * restrict b) {
    for (int64_t i = 0; i < n / QK_K; ++i) {
        const float d = a * pi2_h2f(b[i].d);
        const uint8_t * restrict ql = b[i].ql;
        const uint8_t * restrict qh = b[i].qh;
        const int8_t *  restrict sc = b[i].scales;
        float * restrict yb = y + i * QK_K;
        for (int half = 0; half < QK_K / 128; ++half) {
            for (int h = 0; h < 2; ++h) { // l in [16h, 16h + 16) shares its four scales
                const float s1 = d * sc[h + 0], s2 = d * sc[h + 2], s3 = d * sc[h + 4], s4 = d * sc[h + 6];
                for (int l = 16 * h; l < 16 * h + 16; ++l) {
                    const int q1 = (int) ((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
                    const int q2 = (int) ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
                    const int q3 = (int) ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                    const int q4 = (int) ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                    yb[l]      += s1 * (float) q1;
                    yb[l + 32] += s2 * (float) q2;
                    yb[l + 64] += s3 * (float) q3;
                    yb[l + 96] += s4 * (float) q4;
                }
            }
            yb += 128;
            ql += 64;
            qh += 32;
            sc += 8;
        }
    }
}

// the 16 6-bit scales of a Q3_K block, unpacked from its 12 bytes as ggml-quants.c dequantize_row_q3_K does
static inline void pi2_q3_k_scales(const uint8_t * packed, int8_t * sc) {
    const uint32_t kmask1 = 0x03030303, kmask2 = 0x0f0f0f0f;
    uint32_t aux[4];
    memcpy(aux, packed, 12);
    const uint32_t tmp = aux[2];
    aux[2] = ((aux[0] >> 4) & kmask2) | (((tmp >> 4) & kmask1) << 4);
    aux[3] = ((aux[1] >> 4) & kmask2) | (((tmp >> 6) & kmask1) << 4);
    aux[0] = (aux[0] & kmask2) | (((tmp >> 0) & kmask1) << 4);
    aux[1] = (aux[1] & kmask2) | (((tmp >> 2) & kmask1) << 4);
    memcpy(sc, aux, 16);
}

// Value 128h + 32j + l of a Q3_K block (h < 2, j < 4, l < 32) is d * (scale[8h + 2j + l / 16] - 32) * q, with
// q = ((qs[32h + l] >> 2j) & 3) - 4 + 4 * ((hmask[l] >> (4h + j)) & 1): ggml's dequantize_row_q3_K without its
// branch, so the loops vectorize (ggml's row converter took ~4 ns a value, the whole down pass of a Q3_K layer)
static void pi2_axpy_q3_k(int64_t n, float * restrict y, float a, const block_q3_K * restrict b) {
    for (int64_t i = 0; i < n / QK_K; ++i) {
        const float d = a * pi2_h2f(b[i].d);
        int8_t sc[16];
        pi2_q3_k_scales(b[i].scales, sc);
        const uint8_t * restrict hm = b[i].hmask;
        float * restrict yb = y + i * QK_K;
        for (int h = 0; h < 2; ++h) {
            const uint8_t * restrict q = b[i].qs + 32 * h;
            for (int j = 0; j < 4; ++j) {
                const int shift = 2 * j, hbit = 4 * h + j;
                const float s1 = d * (float) (sc[8 * h + 2 * j] - 32), s2 = d * (float) (sc[8 * h + 2 * j + 1] - 32);
                for (int l = 0; l < 16; ++l) {
                    yb[l] += s1 * (float) ((int) ((q[l] >> shift) & 3) + 4 * (int) ((hm[l] >> hbit) & 1) - 4);
                }
                for (int l = 16; l < 32; ++l) {
                    yb[l] += s2 * (float) ((int) ((q[l] >> shift) & 3) + 4 * (int) ((hm[l] >> hbit) & 1) - 4);
                }
                yb += 32;
            }
        }
    }
}

// y[t][o0..n) of pi2_columns_add4, one element at a time
static void pi2_columns_add4_scalar(int64_t o0, int64_t n, int n_cols, const float * restrict cols,
                                    const float * restrict a, float * const * y) {
    for (int t = 0; t < 4; ++t) {
        for (int64_t o = o0; o < n; ++o) {
            float v = y[t][o];
            for (int k = 0; k < n_cols; ++k) {
                v = fmaf(cols[(size_t) k * (size_t) n + (size_t) o], a[t * PI2_COLUMNS_MAX + k], v);
            }
            y[t][o] = v;
        }
    }
}

#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#include <immintrin.h>
#define PI2_AXPY4_SIMD 1

// The Q4_K and Q8_0 kernels below are written once over these helpers: 16 floats wide where the build
// has AVX-512 (Zen 4/5 and recent Intel run it at full width), else 8. Every element gets the same
// operations in the same order at either width, so the sums are identical.
#if defined(__AVX512F__)
#define PI2_VW 16
typedef __m512  pi2_vf;
typedef __m512i pi2_vi;
static inline pi2_vf pi2_vset1(float x) { return _mm512_set1_ps(x); }
static inline pi2_vf pi2_vload(const float * p) { return _mm512_loadu_ps(p); }
static inline void   pi2_vstore(float * p, pi2_vf v) { _mm512_storeu_ps(p, v); }
static inline pi2_vf pi2_vsub(pi2_vf a, pi2_vf b) { return _mm512_sub_ps(a, b); }
static inline pi2_vf pi2_vfma(pi2_vf a, pi2_vf b, pi2_vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline pi2_vi pi2_vload_u8(const uint8_t * p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *) p)); }
static inline pi2_vi pi2_vload_i8(const int8_t * p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *) p)); }
static inline pi2_vf pi2_vfloat(pi2_vi v) { return _mm512_cvtepi32_ps(v); }
static inline pi2_vf pi2_vlow4(pi2_vi v) { return _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(0xF))); }
static inline pi2_vf pi2_vhigh4(pi2_vi v) { return _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)); }
#else
#define PI2_VW 8
typedef __m256  pi2_vf;
typedef __m256i pi2_vi;
static inline pi2_vf pi2_vset1(float x) { return _mm256_set1_ps(x); }
static inline pi2_vf pi2_vload(const float * p) { return _mm256_loadu_ps(p); }
static inline void   pi2_vstore(float * p, pi2_vf v) { _mm256_storeu_ps(p, v); }
static inline pi2_vf pi2_vsub(pi2_vf a, pi2_vf b) { return _mm256_sub_ps(a, b); }
static inline pi2_vf pi2_vfma(pi2_vf a, pi2_vf b, pi2_vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline pi2_vi pi2_vload_u8(const uint8_t * p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *) p)); }
static inline pi2_vi pi2_vload_i8(const int8_t * p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *) p)); }
static inline pi2_vf pi2_vfloat(pi2_vi v) { return _mm256_cvtepi32_ps(v); }
static inline pi2_vf pi2_vlow4(pi2_vi v) { return _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(0xF))); }
static inline pi2_vf pi2_vhigh4(pi2_vi v) { return _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4)); }
#endif

// y[l] += sum_c s_lo[c] * (low nibble of q[c][l]) - o_lo and y[l + half] likewise with the high nibbles, for l below
// half (32 for a Q4_K sub-block pair, 16 for a Q4_0/Q4_1 block): the four columns' nibbles of one run of bytes.
static inline void pi2_axpy4_nibbles(float * restrict yb, const uint8_t * const * q, const pi2_vf * s_lo,
                                     const pi2_vf * s_hi, float o_lo, float o_hi, int half) {
    const pi2_vf vo_lo = pi2_vset1(o_lo), vo_hi = pi2_vset1(o_hi);
    for (int l = 0; l < half; l += PI2_VW) {
        pi2_vf lo = pi2_vsub(pi2_vload(yb + l), vo_lo);
        pi2_vf hi = pi2_vsub(pi2_vload(yb + l + half), vo_hi);
        for (int c = 0; c < 4; ++c) {
            const pi2_vi v = pi2_vload_u8(q[c] + l);
            lo = pi2_vfma(pi2_vlow4(v), s_lo[c], lo);
            hi = pi2_vfma(pi2_vhigh4(v), s_hi[c], hi);
        }
        pi2_vstore(yb + l, lo);
        pi2_vstore(yb + l + half, hi);
    }
}

// Four columns per pass: y is loaded and stored once for four neurons instead of once each, which is
// what bounded the one-column loops. Offsets (the Q4_K mins) of the four are summed before touching y.
static void pi2_axpy4_q4_k(int64_t n, float * restrict y, const float * a, const void * const * cols) {
    const block_q4_K * b[4] = { cols[0], cols[1], cols[2], cols[3] };
    for (int64_t i = 0; i < n / QK_K; ++i) {
        float d[4], dm[4];
        const uint8_t * q[4];
        for (int c = 0; c < 4; ++c) {
            d[c]  = a[c] * _cvtsh_ss(b[c][i].d);
            dm[c] = a[c] * _cvtsh_ss(b[c][i].dmin);
            q[c]  = b[c][i].qs;
        }
        float * restrict yb = y + i * QK_K;
        for (int j = 0; j < QK_K / 64; ++j) {
            pi2_vf s1[4], s2[4];
            float o1 = 0.0f, o2 = 0.0f;
            for (int c = 0; c < 4; ++c) {
                uint8_t sc1, m1, sc2, m2;
                pi2_q4_k_scale_min(2 * j, b[c][i].scales, &sc1, &m1);
                pi2_q4_k_scale_min(2 * j + 1, b[c][i].scales, &sc2, &m2);
                s1[c] = pi2_vset1(d[c] * sc1);
                s2[c] = pi2_vset1(d[c] * sc2);
                o1 += dm[c] * m1;
                o2 += dm[c] * m2;
            }
            pi2_axpy4_nibbles(yb, q, s1, s2, o1, o2, 32);
            for (int c = 0; c < 4; ++c) {
                q[c] += 32;
            }
            yb += 64;
        }
    }
}

static void pi2_axpy4_q8_0(int64_t n, float * restrict y, const float * a, const void * const * cols) {
    const block_q8_0 * b[4] = { cols[0], cols[1], cols[2], cols[3] };
    for (int64_t i = 0; i < n / QK8_0; ++i) {
        pi2_vf s[4];
        for (int c = 0; c < 4; ++c) {
            s[c] = pi2_vset1(a[c] * _cvtsh_ss(b[c][i].d));
        }
        float * restrict yb = y + i * QK8_0;
        for (int l = 0; l < QK8_0; l += PI2_VW) {
            pi2_vf acc = pi2_vload(yb + l);
            for (int c = 0; c < 4; ++c) {
                acc = pi2_vfma(pi2_vfloat(pi2_vload_i8(b[c][i].qs + l)), s[c], acc);
            }
            pi2_vstore(yb + l, acc);
        }
    }
}

// Q4_0 and Q4_1 (SmolLM2's type, and the columns of Q4_0 models): a block is 32 values, the low nibbles of its 16
// bytes the first 16, the high ones the last; value = d * q + offset, the offset -8 d (Q4_0) or m (Q4_1). The four
// columns' offsets are summed before touching y, as for Q4_K.
static void pi2_axpy4_q4_0(int64_t n, float * restrict y, const float * a, const void * const * cols) {
    const block_q4_0 * b[4] = { cols[0], cols[1], cols[2], cols[3] };
    for (int64_t i = 0; i < n / QK4_0; ++i) {
        pi2_vf s[4];
        const uint8_t * q[4];
        float o = 0.0f;
        for (int c = 0; c < 4; ++c) {
            const float d = a[c] * _cvtsh_ss(b[c][i].d);
            s[c] = pi2_vset1(d);
            q[c] = b[c][i].qs;
            o += 8.0f * d;
        }
        pi2_axpy4_nibbles(y + i * QK4_0, q, s, s, o, o, 16);
    }
}

static void pi2_axpy4_q4_1(int64_t n, float * restrict y, const float * a, const void * const * cols) {
    const block_q4_1 * b[4] = { cols[0], cols[1], cols[2], cols[3] };
    for (int64_t i = 0; i < n / QK4_1; ++i) {
        pi2_vf s[4];
        const uint8_t * q[4];
        float o = 0.0f;
        for (int c = 0; c < 4; ++c) {
            s[c] = pi2_vset1(a[c] * _cvtsh_ss(b[c][i].d));
            q[c] = b[c][i].qs;
            o -= a[c] * _cvtsh_ss(b[c][i].m);
        }
        pi2_axpy4_nibbles(y + i * QK4_1, q, s, s, o, o, 16);
    }
}

static void pi2_axpy4_q6_k(int64_t n, float * restrict y, const float * a, const void * const * cols) {
    const block_q6_K * b[4] = { cols[0], cols[1], cols[2], cols[3] };
    const __m256i m4 = _mm256_set1_epi32(0xF), m3 = _mm256_set1_epi32(3), k32 = _mm256_set1_epi32(32);
    for (int64_t i = 0; i < n / QK_K; ++i) {
        float d[4];
        for (int c = 0; c < 4; ++c) {
            d[c] = a[c] * _cvtsh_ss(b[c][i].d);
        }
        float * restrict yb = y + i * QK_K;
        for (int half = 0; half < QK_K / 128; ++half) { // ggml's dequantize_row_q6_K, 8 values at a time
            for (int l = 0; l < 32; l += 8) {
                const int is = l / 16;
                __m256 y1 = _mm256_loadu_ps(yb + l), y2 = _mm256_loadu_ps(yb + l + 32);
                __m256 y3 = _mm256_loadu_ps(yb + l + 64), y4 = _mm256_loadu_ps(yb + l + 96);
                for (int c = 0; c < 4; ++c) {
                    const uint8_t * ql = b[c][i].ql + 64 * half;
                    const uint8_t * qh = b[c][i].qh + 32 * half;
                    const int8_t *  sc = b[c][i].scales + 8 * half;
                    const __m256i la = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *) (ql + l)));
                    const __m256i lb = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *) (ql + l + 32)));
                    const __m256i h  = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *) (qh + l)));
                    const __m256i q1 = _mm256_or_si256(_mm256_and_si256(la, m4),
                                                       _mm256_slli_epi32(_mm256_and_si256(h, m3), 4));
                    const __m256i q2 = _mm256_or_si256(_mm256_and_si256(lb, m4),
                                                       _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(h, 2), m3), 4));
                    const __m256i q3 = _mm256_or_si256(_mm256_srli_epi32(la, 4),
                                                       _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(h, 4), m3), 4));
                    const __m256i q4 = _mm256_or_si256(_mm256_srli_epi32(lb, 4),
                                                       _mm256_slli_epi32(_mm256_srli_epi32(h, 6), 4));
                    y1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(q1, k32)), _mm256_set1_ps(d[c] * sc[is + 0]), y1);
                    y2 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(q2, k32)), _mm256_set1_ps(d[c] * sc[is + 2]), y2);
                    y3 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(q3, k32)), _mm256_set1_ps(d[c] * sc[is + 4]), y3);
                    y4 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(q4, k32)), _mm256_set1_ps(d[c] * sc[is + 6]), y4);
                }
                _mm256_storeu_ps(yb + l, y1);
                _mm256_storeu_ps(yb + l + 32, y2);
                _mm256_storeu_ps(yb + l + 64, y3);
                _mm256_storeu_ps(yb + l + 96, y4);
            }
            yb += 128;
        }
    }
}

static void pi2_axpy4_q3_k(int64_t n, float * restrict y, const float * a, const void * const * cols) {
    const block_q3_K * b[4] = { cols[0], cols[1], cols[2], cols[3] };
    const __m256i m3 = _mm256_set1_epi32(3), one = _mm256_set1_epi32(1), k4 = _mm256_set1_epi32(4);
    for (int64_t i = 0; i < n / QK_K; ++i) {
        float  d[4];
        int8_t sc[4][16];
        for (int c = 0; c < 4; ++c) {
            d[c] = a[c] * _cvtsh_ss(b[c][i].d);
            pi2_q3_k_scales(b[c][i].scales, sc[c]);
        }
        float * restrict yb = y + i * QK_K;
        for (int h = 0; h < 2; ++h) { // pi2_axpy_q3_k's values, 8 at a time
            for (int j = 0; j < 4; ++j) {
                const __m128i shift = _mm_cvtsi32_si128(2 * j), hshift = _mm_cvtsi32_si128(4 * h + j);
                for (int l = 0; l < 32; l += 8) {
                    __m256 acc = _mm256_loadu_ps(yb + l);
                    for (int c = 0; c < 4; ++c) {
                        const __m256i qv = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *) (b[c][i].qs + 32 * h + l)));
                        const __m256i hv = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *) (b[c][i].hmask + l)));
                        const __m256i lo = _mm256_and_si256(_mm256_srl_epi32(qv, shift), m3);
                        const __m256i hi = _mm256_slli_epi32(_mm256_and_si256(_mm256_srl_epi32(hv, hshift), one), 2);
                        const __m256i q  = _mm256_sub_epi32(_mm256_add_epi32(lo, hi), k4);
                        const float   s  = d[c] * (float) (sc[c][8 * h + 2 * j + l / 16] - 32);
                        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), _mm256_set1_ps(s), acc);
                    }
                    _mm256_storeu_ps(yb + l, acc);
                }
                yb += 32;
            }
        }
    }
}
// Four tokens' rows, two vectors of outputs at a time: eight sums in registers while the columns stream past, so a
// column value loaded once feeds four FMAs (the one-token kernels above load y and a column for every FMA).
static void pi2_columns_add4_simd(int64_t n, int n_cols, const float * restrict cols, const float * restrict a,
                                  float * const * y) {
    int64_t o = 0;
    for (; o + 2 * PI2_VW <= n; o += 2 * PI2_VW) {
        pi2_vf s[4][2];
        for (int t = 0; t < 4; ++t) {
            s[t][0] = pi2_vload(y[t] + o);
            s[t][1] = pi2_vload(y[t] + o + PI2_VW);
        }
        for (int k = 0; k < n_cols; ++k) {
            const float * c = cols + (size_t) k * (size_t) n + (size_t) o;
            const pi2_vf c0 = pi2_vload(c), c1 = pi2_vload(c + PI2_VW);
            for (int t = 0; t < 4; ++t) {
                const pi2_vf at = pi2_vset1(a[t * PI2_COLUMNS_MAX + k]);
                s[t][0] = pi2_vfma(c0, at, s[t][0]);
                s[t][1] = pi2_vfma(c1, at, s[t][1]);
            }
        }
        for (int t = 0; t < 4; ++t) {
            pi2_vstore(y[t] + o, s[t][0]);
            pi2_vstore(y[t] + o + PI2_VW, s[t][1]);
        }
    }
    pi2_columns_add4_scalar(o, n, n_cols, cols, a, y); // the tail, in the same order per element
}
#endif

void pi2_column_axpy4(enum ggml_type type, int64_t n, float * y, const float * a, const void * const * cols,
                      float * tmp) {
#ifdef PI2_AXPY4_SIMD
    switch (type) {
        case GGML_TYPE_Q4_K: pi2_axpy4_q4_k(n, y, a, cols); return;
        case GGML_TYPE_Q8_0: pi2_axpy4_q8_0(n, y, a, cols); return;
        case GGML_TYPE_Q6_K: pi2_axpy4_q6_k(n, y, a, cols); return;
        case GGML_TYPE_Q3_K: pi2_axpy4_q3_k(n, y, a, cols); return;
        case GGML_TYPE_Q4_0: pi2_axpy4_q4_0(n, y, a, cols); return;
        case GGML_TYPE_Q4_1: pi2_axpy4_q4_1(n, y, a, cols); return;
        default: break;
    }
#endif
    for (int c = 0; c < 4; ++c) {
        pi2_column_axpy(type, n, y, a[c], cols[c], tmp);
    }
}

bool pi2_column_axpy_is_fast(enum ggml_type type) {
    switch (type) {
        case GGML_TYPE_F32:
        case GGML_TYPE_F16:
        case GGML_TYPE_Q8_0:
        case GGML_TYPE_Q4_K:
        case GGML_TYPE_Q6_K:
        case GGML_TYPE_Q3_K:
            return true;
        default:
            return false;
    }
}

bool pi2_column_type_usable(enum ggml_type type) {
    return pi2_column_axpy_is_fast(type) || ggml_get_type_traits(type)->to_float != NULL;
}

void pi2_column_axpy(enum ggml_type type, int64_t n, float * y, float a, const void * column, float * tmp) {
    switch (type) {
        case GGML_TYPE_F32:  pi2_axpy_f32(n, y, a, column); return;
        case GGML_TYPE_F16:  pi2_axpy_f16(n, y, a, column, tmp); return;
        case GGML_TYPE_Q8_0: pi2_axpy_q8_0(n, y, a, column); return;
        case GGML_TYPE_Q4_K: pi2_axpy_q4_k(n, y, a, column); return;
        case GGML_TYPE_Q6_K: pi2_axpy_q6_k(n, y, a, column); return;
        case GGML_TYPE_Q3_K: pi2_axpy_q3_k(n, y, a, column); return;
        default:
            ggml_get_type_traits(type)->to_float(column, tmp, n);
            pi2_axpy_f32(n, y, a, tmp);
            return;
    }
}

void pi2_column_sum_finish(struct pi2_column_sum * s) {
    for (int c = 0; c < s->k; ++c) {
        pi2_column_axpy(s->type, s->n, s->y, s->a[c], s->col[c], s->tmp);
    }
    s->k = 0;
}

void pi2_column_to_float(enum ggml_type type, int64_t n, float * dst, const void * column, float * tmp) {
    if (type == GGML_TYPE_F32) {
        memcpy(dst, column, (size_t) n * sizeof(float));
        return;
    }
    memset(dst, 0, (size_t) n * sizeof(float));
    pi2_column_axpy(type, n, dst, 1.0f, column, tmp);
}

void pi2_columns_add4(int64_t n, int n_cols, const float * cols, const float * a, float * const * y) {
#ifdef PI2_AXPY4_SIMD
    pi2_columns_add4_simd(n, n_cols, cols, a, y);
#else
    pi2_columns_add4_scalar(0, n, n_cols, cols, a, y);
#endif
}

void pi2_columns_add_tokens(enum ggml_type type, int64_t n, int64_t n_tokens, float * y, size_t y_stride, int n_cols,
                            const float * a, int64_t lda, const void * const * cols, float * colf, float * tmp) {
    float b[4 * PI2_COLUMNS_MAX];
    int   used[PI2_COLUMNS_MAX];
    int   n_used = 0;
    for (int c = 0; c < n_cols && c < PI2_COLUMNS_MAX; ++c) {
        bool any = false;
        for (int64_t t = 0; t < n_tokens && !any && cols[c] != NULL; ++t) {
            any = a[t * lda + c] != 0.0f;
        }
        if (any) { // a column no token uses is neither dequantized nor added
            pi2_column_to_float(type, n, colf + (size_t) n_used * (size_t) n, cols[c], tmp);
            used[n_used++] = c;
        }
    }
    if (n_used == 0) {
        return;
    }
    for (int64_t t0 = 0; t0 < n_tokens; t0 += 4) {
        float * rows[4];
        for (int k = 0; k < 4; ++k) {
            const int64_t t = t0 + k;
            // past the last token: a scratch row (tmp, free once the columns are floats) with weights 0
            rows[k] = t < n_tokens ? (float *) ((char *) y + (size_t) t * y_stride) : tmp;
            for (int c = 0; c < n_used; ++c) {
                b[k * PI2_COLUMNS_MAX + c] = t < n_tokens ? a[t * lda + used[c]] : 0.0f;
            }
        }
        pi2_columns_add4(n, n_used, colf, b, rows);
    }
}
