// The FFN activation PI2 computes per neuron: glu_i = act_gate(gate_i . x) * act_up(up_i . x).
// A model states it in GGUF metadata ("<arch>.ffn_activation", and "<arch>.ffn_activation_threshold" for
// FATReLU); the sidecar repeats it. PI2 computes the stated activation whatever GLU llama's graph holds, so
// a ReLU-family model is right on an unmodified llama.cpp (which builds every llama/qwen2 FFN as SwiGLU).
// A model that states nothing runs the GLU its graph has.
#pragma once

#include <math.h>
#include <stdbool.h>
#include <string.h>

#include "ggml.h"
#include "model/sidecar_format.h"

enum pi2_activation {
    PI2_ACT_SILU,
    PI2_ACT_GELU,
    PI2_ACT_GELU_ERF,
    PI2_ACT_RELU,    // ReGLU: relu(gate) * up
    PI2_ACT_DRELU,   // relu(gate) * relu(up) (TurboSparse, Bamboo)
    PI2_ACT_FATRELU, // (gate > t ? gate : 0) * up (ProSparse)
    // gpt-oss: g = min(gate, limit), g sigmoid(alpha g) * (clamp(up, -limit, limit) + 1), gate and up with the
    // experts' biases added (llama.cpp's graph fixes alpha 1.702 and limit 7 and puts them in the GLU node)
    PI2_ACT_SWIGLU_OAI,
    PI2_ACT_COUNT,
};

struct pi2_ffn_act {
    enum pi2_activation kind;
    float               threshold; // FATReLU's t; 0 for the others
    float               alpha, limit; // SwiGLU-OAI's, from the graph's GLU node (a sidecar names the kind only)
};

// What a model states: its activation, or nothing (stated false: the GLU its graph holds applies).
struct pi2_stated_act {
    bool               stated;
    struct pi2_ffn_act act;
    bool               experts_native; // llama.cpp's MoE graph computes it for the routed experts itself
};

// names as the GGUF keys write them (sidecar pi2.activation, model <arch>.ffn_activation); "reglu" is
// accepted for relu when reading a model
static const char * const pi2_activation_names[PI2_ACT_COUNT] = {
    [PI2_ACT_SILU] = PI2_ACTIVATION_SILU, [PI2_ACT_GELU] = PI2_ACTIVATION_GELU, [PI2_ACT_GELU_ERF] = PI2_ACTIVATION_GELU_ERF,
    [PI2_ACT_RELU] = PI2_ACTIVATION_RELU, [PI2_ACT_DRELU] = PI2_ACTIVATION_DRELU, [PI2_ACT_FATRELU] = PI2_ACTIVATION_FATRELU,
    [PI2_ACT_SWIGLU_OAI] = PI2_ACTIVATION_SWIGLU_OAI,
};

// the activation named s, or PI2_ACT_COUNT
static inline enum pi2_activation pi2_activation_parse(const char * s) {
    if (s != NULL && strcmp(s, "reglu") == 0) {
        return PI2_ACT_RELU;
    }
    for (int k = 0; k < PI2_ACT_COUNT; ++k) {
        if (s != NULL && strcmp(s, pi2_activation_names[k]) == 0) {
            return (enum pi2_activation) k;
        }
    }
    return PI2_ACT_COUNT;
}

// exact sparsity: a neuron whose gate does not pass act_gate's cut contributes nothing
static inline bool pi2_act_relu_family(enum pi2_activation a) {
    return a == PI2_ACT_RELU || a == PI2_ACT_DRELU || a == PI2_ACT_FATRELU;
}

static inline bool pi2_act_equal(const struct pi2_ffn_act * a, const struct pi2_ffn_act * b) {
    return a->kind == b->kind && a->threshold == b->threshold;
}

static inline float pi2_act_gate(const struct pi2_ffn_act * a, float g) {
    switch (a->kind) {
        case PI2_ACT_SWIGLU_OAI: { // as ggml-cpu's swiglu_oai, operation for operation
            const float x = g < a->limit ? g : a->limit;
            return x / (1.f + expf(a->alpha * (-x)));
        }
        case PI2_ACT_SILU:     return g / (1.0f + expf(-g));
        case PI2_ACT_GELU:     return 0.5f * g * (1.0f + tanhf(0.7978845608f * (g + 0.044715f * g * g * g)));
        case PI2_ACT_GELU_ERF: return 0.5f * g * (1.0f + erff(g * 0.70710678f));
        case PI2_ACT_RELU:
        case PI2_ACT_DRELU:    return g > 0.0f ? g : 0.0f;
        case PI2_ACT_FATRELU:  return g > a->threshold ? g : 0.0f;
        default:               return 0.0f;
    }
}

static inline float pi2_act_up(const struct pi2_ffn_act * a, float u) {
    if (a->kind == PI2_ACT_SWIGLU_OAI) {
        return (u < -a->limit ? -a->limit : (u > a->limit ? a->limit : u)) + 1.f;
    }
    return a->kind == PI2_ACT_DRELU ? (u > 0.0f ? u : 0.0f) : u;
}

// Architectures whose llama.cpp graph builds the FFN activation itself, whatever the model file states
// (src/models/<arch>.cpp; patches/ makes only llama and qwen2 read <arch>.ffn_activation): such a model means
// that activation, stated or not, and a sidecar must have been made for it. pi2_gguf/converter/model_ffn.py's
// ARCH_ACTIVATION is the same table (tests/test_architectures.py checks that they agree).
struct pi2_arch_act {
    const char *        arch;
    enum pi2_activation kind;
    bool                experts_native; // the graph's MoE computes it for the routed experts itself
};
static const struct pi2_arch_act pi2_arch_activations[] = {
    { "smallthinker", PI2_ACT_RELU, true  }, // build_moe_ffn(..., LLM_FFN_RELU, ...): ReGLU experts
    { "gemma",        PI2_ACT_GELU, false }, // build_ffn(..., LLM_FFN_GELU, LLM_FFN_PAR): GEGLU
    { "gemma2",       PI2_ACT_GELU, false },
    { "gemma3",       PI2_ACT_GELU, false },
    { "gemma3n",      PI2_ACT_GELU, false },
    { "gemma4",       PI2_ACT_GELU, false },
    { "gemma-embedding", PI2_ACT_GELU, false },
    { "gpt-oss",      PI2_ACT_SWIGLU_OAI, true }, // build_moe_ffn(..., LLM_FFN_SWIGLU_OAI_MOE, ...), biased experts
};

// the activation architecture arch's graph builds, or NULL when the graph's GLU (or a statement) decides
static inline const struct pi2_arch_act * pi2_arch_activation(const char * arch) {
    for (size_t k = 0; arch != NULL && k < sizeof(pi2_arch_activations) / sizeof(pi2_arch_activations[0]); ++k) {
        if (strcmp(arch, pi2_arch_activations[k].arch) == 0) {
            return &pi2_arch_activations[k];
        }
    }
    return NULL;
}

// the activation a graph's GLU node computes; false for ops PI2 does not compute
static inline bool pi2_act_from_glu(const struct ggml_tensor * glu, struct pi2_ffn_act * out) {
    switch (ggml_get_glu_op(glu)) {
        case GGML_GLU_OP_REGLU:     *out = (struct pi2_ffn_act) { PI2_ACT_RELU, 0.0f, 0.0f, 0.0f };     return true;
        case GGML_GLU_OP_SWIGLU:    *out = (struct pi2_ffn_act) { PI2_ACT_SILU, 0.0f, 0.0f, 0.0f };     return true;
        case GGML_GLU_OP_GEGLU:     *out = (struct pi2_ffn_act) { PI2_ACT_GELU, 0.0f, 0.0f, 0.0f };     return true;
        case GGML_GLU_OP_GEGLU_ERF: *out = (struct pi2_ffn_act) { PI2_ACT_GELU_ERF, 0.0f, 0.0f, 0.0f }; return true;
        case GGML_GLU_OP_SWIGLU_OAI: {
            float p[2];
            memcpy(p, (const char *) glu->op_params + 2 * sizeof(int32_t), sizeof(p)); // ggml_swiglu_oai's slots 2, 3
            *out = (struct pi2_ffn_act) { PI2_ACT_SWIGLU_OAI, 0.0f, p[0], p[1] };
            return isfinite(p[0]) && isfinite(p[1]) && p[1] > 0.0f;
        }
        default:                    return false;
    }
}

// The one rule for what PI2 computes at a GLU node op of a model that states sa: a ReLU-family statement (which an
// unmodified llama.cpp's graph cannot spell, so it holds a SwiGLU there) is the model's activation; otherwise
// exactly the GLU the graph holds, never a sidecar's or a statement's other name for it. False where PI2 does not
// compute that op (swiglu with a clamp): the region is left to ggml-cpu, which computes it right.
static inline bool pi2_act_overrides_glu(const struct pi2_stated_act * sa) {
    return sa->stated && pi2_act_relu_family(sa->act.kind);
}

static inline bool pi2_act_for_glu(const struct pi2_stated_act * sa, const struct ggml_tensor * glu, struct pi2_ffn_act * out) {
    if (pi2_act_overrides_glu(sa)) {
        *out = sa->act;
        return true;
    }
    return pi2_act_from_glu(glu, out);
}

// the GLU op of ggml that computes a (ggml's own numerics), GGML_GLU_OP_COUNT for dReLU and FATReLU
static inline enum ggml_glu_op pi2_act_glu_op(const struct pi2_ffn_act * a) {
    switch (a->kind) {
        case PI2_ACT_SILU:     return GGML_GLU_OP_SWIGLU;
        case PI2_ACT_GELU:     return GGML_GLU_OP_GEGLU;
        case PI2_ACT_GELU_ERF: return GGML_GLU_OP_GEGLU_ERF;
        case PI2_ACT_RELU:     return GGML_GLU_OP_REGLU;
        default:               return GGML_GLU_OP_COUNT;
    }
}
