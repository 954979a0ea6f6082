// Which tensors PI2 owns: blk.N.ffn_{gate,up,down}.weight, named as llama.cpp names them.
#pragma once

#include <stdbool.h>

#include "ggml-pi2.h"

// true and (layer, matrix) filled when name is an FFN weight of a dense (non-expert) layer
bool pi2_ffn_weight_parse(const char * name, int * layer, enum pi2_matrix * matrix);
