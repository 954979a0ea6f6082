// A flash weight buffer: the weights of a model loaded for a memory budget. Its address range is reserved
// PROT_NONE (tensors get addresses, any stray access faults), and each weight llama uploads is checked against
// the sidecar, which holds its bytes as bundles, or is a table the model file keeps (embedding, output matrix),
// and is not kept.
#pragma once

#include <stddef.h>

#include "ggml.h"
#include "model/weight_buffer.h"

// size bytes of address space reserved (rounded up to pages into *reserved); NULL (logged) when refused, or for 0
void * pi2_flash_reserve(size_t size, size_t * reserved);
void pi2_flash_release(void * data, size_t reserved);

// llama uploads size bytes of tensor at offset: checked, not kept
void pi2_flash_set_tensor(const struct pi2_buffer_ctx * bc, struct ggml_tensor * tensor, const void * data, size_t offset,
                          size_t size);
