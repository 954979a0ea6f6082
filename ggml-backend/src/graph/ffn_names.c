#include "graph/ffn_names.h"

#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char * const pi2_ffn_suffix[PI2_N_MATRIX] = {
    [PI2_MATRIX_GATE] = "ffn_gate.weight",
    [PI2_MATRIX_UP]   = "ffn_up.weight",
    [PI2_MATRIX_DOWN] = "ffn_down.weight",
};

static const char * const pi2_shexp_suffix[PI2_N_MATRIX] = {
    [PI2_MATRIX_GATE] = "ffn_gate_shexp.weight",
    [PI2_MATRIX_UP]   = "ffn_up_shexp.weight",
    [PI2_MATRIX_DOWN] = "ffn_down_shexp.weight",
};

static const char * const pi2_expert_suffix[PI2_N_MATRIX] = {
    [PI2_MATRIX_GATE] = "ffn_gate_exps.weight",
    [PI2_MATRIX_UP]   = "ffn_up_exps.weight",
    [PI2_MATRIX_DOWN] = "ffn_down_exps.weight",
};

static bool pi2_weight_parse(const char * name, const char * const suffix[PI2_N_MATRIX], int * layer, enum pi2_matrix * matrix) {
    if (name == NULL || strncmp(name, "blk.", 4) != 0) {
        return false;
    }
    // the layer as llama writes it, digits without leading zeros: strtol alone took "blk.0512.", "blk.+1." and
    // "blk. 1." for the FFN weights of layers 512 and 1 (found by fuzz_config)
    if (!isdigit((unsigned char) name[4]) || (name[4] == '0' && isdigit((unsigned char) name[5]))) {
        return false;
    }
    char * end = NULL;
    const long il = strtol(name + 4, &end, 10);
    if (end == name + 4 || *end != '.' || il < 0 || il >= PI2_MAX_LAYERS) {
        return false;
    }
    for (int m = 0; m < PI2_N_MATRIX; ++m) {
        if (suffix[m] != NULL && strcmp(end + 1, suffix[m]) == 0) {
            *layer  = (int) il;
            *matrix = (enum pi2_matrix) m;
            return true;
        }
    }
    return false;
}

bool pi2_ffn_weight_parse_kind(const char * name, int * layer, enum pi2_matrix * matrix, bool * shared) {
    const bool dense = pi2_weight_parse(name, pi2_ffn_suffix, layer, matrix);
    const bool shexp = !dense && pi2_weight_parse(name, pi2_shexp_suffix, layer, matrix);
    if (shared != NULL) {
        *shared = shexp;
    }
    return dense || shexp;
}

bool pi2_ffn_weight_parse(const char * name, int * layer, enum pi2_matrix * matrix) {
    return pi2_ffn_weight_parse_kind(name, layer, matrix, NULL);
}

// NULL: no such matrix
static const char * const pi2_fused_expert_suffix[PI2_N_MATRIX] = { [PI2_MATRIX_GATE] = "ffn_gate_up_exps.weight" };

bool pi2_expert_weight_parse_fused(const char * name, int * layer, enum pi2_matrix * matrix, bool * fused) {
    const bool split = pi2_weight_parse(name, pi2_expert_suffix, layer, matrix);
    const bool one   = !split && pi2_weight_parse(name, pi2_fused_expert_suffix, layer, matrix);
    if (fused != NULL) {
        *fused = one;
    }
    return split || one;
}

bool pi2_expert_weight_parse(const char * name, int * layer, enum pi2_matrix * matrix) {
    return pi2_expert_weight_parse_fused(name, layer, matrix, NULL);
}

void pi2_ffn_weight_name(int layer, enum pi2_matrix matrix, char * buf, size_t size) {
    snprintf(buf, size, "blk.%d.%s", layer, pi2_ffn_suffix[matrix]);
}

void pi2_shexp_weight_name(int layer, enum pi2_matrix matrix, char * buf, size_t size) {
    snprintf(buf, size, "blk.%d.%s", layer, pi2_shexp_suffix[matrix]);
}
