// The FFN activations PI2 computes per neuron, as ggml's GLU ops define them.
#pragma once

#include <math.h>

#include "ggml.h"
#include "sidecar.h"

static inline float pi2_act(enum ggml_glu_op op, float g) {
    switch (op) {
        case GGML_GLU_OP_REGLU:     return g > 0.0f ? g : 0.0f;
        case GGML_GLU_OP_SWIGLU:    return g / (1.0f + expf(-g));
        case GGML_GLU_OP_GEGLU:     return 0.5f * g * (1.0f + tanhf(0.7978845608f * (g + 0.044715f * g * g * g)));
        case GGML_GLU_OP_GEGLU_ERF: return 0.5f * g * (1.0f + erff(g * 0.70710678f));
        default:                    return 0.0f;
    }
}

// the graph's GLU for the activation a sidecar's thresholds were measured with; GGML_GLU_OP_COUNT if none
static inline enum ggml_glu_op pi2_glu_for(enum pi2_activation a) {
    switch (a) {
        case PI2_ACT_SILU:     return GGML_GLU_OP_SWIGLU;
        case PI2_ACT_GELU:     return GGML_GLU_OP_GEGLU;
        case PI2_ACT_GELU_ERF: return GGML_GLU_OP_GEGLU_ERF;
        case PI2_ACT_RELU:     return GGML_GLU_OP_REGLU;
        default:               return GGML_GLU_OP_COUNT;
    }
}
