// Fingerprints of FFN weight tensors and of a model (docs/FORMAT.md, "Fingerprint"): how a sidecar
// names the weights it was made from, computable from the bytes llama.cpp hands the backend.
#pragma once

#include <stddef.h>
#include <stdint.h>

// FNV-1a 64 of n bytes, continuing from h (start with PI2_FP_OFFSET_BASIS)
uint64_t pi2_fnv1a64(const void * data, size_t n, uint64_t h);

// A tensor's fingerprint without its data at hand: the header hash, then FNV-1a over sample k = 0..
// PI2_FP_SAMPLES-1 (len bytes at the returned offset) in order
uint64_t pi2_fingerprint_header(int type, int64_t ne0, int64_t ne1, size_t nbytes);
size_t   pi2_fingerprint_sample(size_t nbytes, int k, size_t * len);

// Also exported through ggml-pi2.h:
//   pi2_fingerprint_tensor: one tensor (type, ne0, ne1, nbytes, then 16 samples of its data)
//   pi2_fingerprint_model:  FNV-1a 64 over n tensor fingerprints as u64 little-endian
