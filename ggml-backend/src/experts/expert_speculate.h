// Next-layer expert speculation (flash, MoE). The experts a layer routes to are known only once its router has
// run, after attention, so the disk sits idle from the last read of one layer's experts until the next layer's
// router. The residual stream changes little from one layer to the next: the next layer's router applied to this
// layer's FFN input ranks most of the experts that layer will choose (measured on the synthetic Qwen3-MoE-shaped
// model: 70% of the top-8; SmallThinker-shaped: 96% of the top-4; chance is 12.5%). So once a layer's own reads
// are queued, those experts' bundles are read ahead too, and the next layer finds them cached or in flight. Only
// reads are guessed: what is computed is always the routed experts', so a wrong guess costs bytes, never output.
// The routers are copied from the model file (llama keeps its own copy in ggml-cpu, which PI2 never sees).
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "ggml-cpu.h"

// guesses are read ahead only while at least this share of recent ones were right (expert_ffn.c)
#define PI2_GUESS_MIN_PRECISION 0.8f

struct pi2_routers {
    uint32_t          n_layer, n_expert; // MoE layers, and experts each
    int64_t           n_embd;
    enum ggml_type    type;              // the model's router type, kept as is
    size_t            row_size;          // one expert's row
    ggml_vec_dot_t    dot;
    ggml_from_float_t to_vdt;            // NULL: the dot takes f32
    size_t            xq_size;           // x in the dot's type
    uint8_t *         w;                 // [n_layer][n_expert] rows, blk.N.ffn_gate_inp.weight
};

// Reads blk.N.ffn_gate_inp.weight ([n_embd, n_expert]) of every layer N < n_layer where routed[N] (the others are
// dense FFN layers: no router) from the model file. 1 with *out set; 0 when some routed layer has no such router of
// the first's type and shape (nothing to guess with); -1 with err set when the file cannot be read.
int  pi2_routers_open(const char * model_path, uint32_t n_layer, const uint8_t * routed, uint32_t n_expert, int64_t n_embd,
                      struct pi2_routers ** out, char * err, size_t errlen);
void pi2_routers_free(struct pi2_routers * r);

// bytes of scratch pi2_routers_top needs
size_t pi2_routers_scratch(const struct pi2_routers * r);
// top[0..k): the k experts layer `layer`'s router scores highest for x (f32 [n_embd]), best first
void pi2_routers_top(const struct pi2_routers * r, uint32_t layer, const float * x, int k, int32_t * top, void * scratch);

// The guessing state of one model: its routers, the layer last guessed and which of its experts, and how often
// recent guesses were right. Routing's results (expert_ffn.c) and guessing read and write it; nothing else does.
struct pi2_expert_guess {
    struct pi2_routers * routers;   // NULL: no guessing (not opened, the model has none, or out of memory)
    bool                 tried;     // the routers were looked for
    int32_t              layer;     // the MoE layer whose experts were last guessed (-1: none pending)
    uint8_t *            set;       // [n_expert] 1: guessed, 2: guessed and read ahead
    float                precision; // running share of guessed experts that were routed to
};

void pi2_expert_guess_init(struct pi2_expert_guess * g);
void pi2_expert_guess_free(struct pi2_expert_guess * g);
// Reads the routers of the model's n_layer layers where routed[layer] once (before the resident memory is measured, which then
// counts them). Guessing is an optimization: a model without routers, or too little memory, goes without. 0, or
// -1 with err set when the model file cannot be read.
int  pi2_expert_guess_open(struct pi2_expert_guess * g, const char * model_path, uint32_t n_layer, const uint8_t * routed,
                           uint32_t n_expert, int64_t n_embd, char * err, size_t errlen);
// The layer guessed for was routed to `right` of the guessed experts (expert_speculate.c says what follows).
void pi2_expert_guess_scored(struct pi2_expert_guess * g, uint32_t n_expert, uint64_t right);
