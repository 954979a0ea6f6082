#include "model/fingerprint.h"

#include "ggml-pi2.h"
#include "model/sidecar_format.h"

uint64_t pi2_fnv1a64(const void * data, size_t n, uint64_t h) {
    const unsigned char * p = data;
    for (size_t i = 0; i < n; ++i) {
        h = (h ^ p[i]) * PI2_FP_PRIME;
    }
    return h;
}

// v as n little-endian bytes, whatever the host's byte order
static uint64_t pi2_fnv1a64_le(uint64_t v, int n, uint64_t h) {
    unsigned char b[8];
    for (int i = 0; i < n; ++i) {
        b[i] = (unsigned char) (v >> (8 * i));
    }
    return pi2_fnv1a64(b, (size_t) n, h);
}

uint64_t pi2_fingerprint_header(int type, int64_t ne0, int64_t ne1, size_t nbytes) {
    uint64_t h = PI2_FP_OFFSET_BASIS;
    h = pi2_fnv1a64_le((uint32_t) type, 4, h);
    h = pi2_fnv1a64_le((uint64_t) ne0, 8, h);
    h = pi2_fnv1a64_le((uint64_t) ne1, 8, h);
    return pi2_fnv1a64_le((uint64_t) nbytes, 8, h);
}

size_t pi2_fingerprint_sample(size_t nbytes, int k, size_t * len) {
    const size_t s    = nbytes < PI2_FP_SAMPLE_BYTES ? nbytes : PI2_FP_SAMPLE_BYTES;
    const size_t span = nbytes - s;
    const size_t q = span / (PI2_FP_SAMPLES - 1);
    const size_t r = span % (PI2_FP_SAMPLES - 1);
    *len = s;
    // floor(k * span / 15) without overflowing k * span
    return (size_t) k * q + (size_t) k * r / (PI2_FP_SAMPLES - 1);
}

uint64_t pi2_fingerprint_tensor(int type, int64_t ne0, int64_t ne1, const void * data, size_t nbytes) {
    uint64_t h = pi2_fingerprint_header(type, ne0, ne1, nbytes);
    for (int k = 0; k < PI2_FP_SAMPLES; ++k) {
        size_t len = 0;
        const size_t off = pi2_fingerprint_sample(nbytes, k, &len);
        h = pi2_fnv1a64((const unsigned char *) data + off, len, h);
    }
    return h;
}

uint64_t pi2_fingerprint_model(const uint64_t * tensor_fps, size_t n) {
    uint64_t h = PI2_FP_OFFSET_BASIS;
    for (size_t i = 0; i < n; ++i) {
        h = pi2_fnv1a64_le(tensor_fps[i], 8, h);
    }
    return h;
}
