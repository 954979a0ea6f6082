// Which tensors PI2 owns: blk.N.ffn_{gate,up,down}.weight, the shared expert's blk.N.ffn_{gate,up,down}_shexp.weight
// beside routed experts (a 2-D FFN like a dense one: a layer has one or the other), and the routed experts'
// blk.N.ffn_{gate,up,down}_exps.weight, named as llama.cpp names them.
#pragma once

#include <stdbool.h>
#include <stddef.h>

#include "ggml-pi2.h"

// true and (layer, matrix) filled when name is a weight of a layer's 2-D FFN: its dense FFN, or its shared expert
// (*shared, where not NULL, says which)
bool pi2_ffn_weight_parse(const char * name, int * layer, enum pi2_matrix * matrix);
bool pi2_ffn_weight_parse_kind(const char * name, int * layer, enum pi2_matrix * matrix, bool * shared);
// true and (layer, matrix) filled when name is a routed-expert weight (blk.N.ffn_{gate,up,down}_exps.weight: one
// matrix per expert, stacked along ne[2]); blk.N.ffn_gate_up_exps.weight, the experts' gate and up fused (each
// expert's gate rows, then its up rows), counts as the gate (*fused, where not NULL, says so)
bool pi2_expert_weight_parse(const char * name, int * layer, enum pi2_matrix * matrix);
bool pi2_expert_weight_parse_fused(const char * name, int * layer, enum pi2_matrix * matrix, bool * fused);
// blk.<layer>.ffn_{gate,up,down}.weight, or with shared blk.<layer>.ffn_{gate,up,down}_shexp.weight, into buf
// (PI2_FFN_NAME_MAX bytes hold any of them)
#define PI2_FFN_NAME_MAX 64
void pi2_ffn_weight_name(int layer, enum pi2_matrix matrix, char * buf, size_t size);
void pi2_shexp_weight_name(int layer, enum pi2_matrix matrix, char * buf, size_t size);
