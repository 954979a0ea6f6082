// Fingerprints of FFN weight tensors and of a model (docs/FORMAT.md, "Fingerprint"): how a sidecar
// names the weights it was made from, computable from the bytes llama.cpp hands the backend.
#pragma once

#include <stddef.h>
#include <stdint.h>

// FNV-1a 64 of n bytes, continuing from h (start with PI2_FP_OFFSET_BASIS)
uint64_t pi2_fnv1a64(const void * data, size_t n, uint64_t h);

// Also exported through ggml-pi2.h:
//   pi2_fingerprint_tensor: one tensor (type, ne0, ne1, nbytes, then 16 samples of its data)
//   pi2_fingerprint_model:  FNV-1a 64 over n tensor fingerprints as u64 little-endian
