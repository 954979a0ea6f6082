// Which tensors PI2 owns: blk.N.ffn_{gate,up,down}.weight and the routed experts' blk.N.ffn_{gate,up,down}_exps.weight,
// named as llama.cpp names them.
#pragma once

#include <stdbool.h>
#include <stddef.h>

#include "ggml-pi2.h"

// true and (layer, matrix) filled when name is an FFN weight of a dense (non-expert) layer
bool pi2_ffn_weight_parse(const char * name, int * layer, enum pi2_matrix * matrix);
// true and (layer, matrix) filled when name is a routed-expert weight (blk.N.ffn_{gate,up,down}_exps.weight: one
// matrix per expert, stacked along ne[2])
bool pi2_expert_weight_parse(const char * name, int * layer, enum pi2_matrix * matrix);
// blk.<layer>.ffn_{gate,up,down}.weight into buf (PI2_FFN_NAME_MAX bytes hold any of them)
#define PI2_FFN_NAME_MAX 64
void pi2_ffn_weight_name(int layer, enum pi2_matrix matrix, char * buf, size_t size);
