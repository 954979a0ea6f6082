// The activation predictor of one layer: a low-rank MLP z = W2 relu(W1 x + b1) + b2 over the layer's
// neurons, trained or fitted by the converter and stored in the sidecar. This file owns its weights as
// decode reads them (prepared once per model), the rule that decides in which layers it pays, and its
// scores for a token. A slot is predicted active iff its score passes the layer's cutoff.
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "graph/activation.h"
#include "ggml.h"
#include "model/sidecar.h"

struct pi2_sparse_plan;

struct pi2_predictor {
    // Q8_0 where the widths allow (ggml's F16 dot measured ~5x slower than its Q8_0 dot here), else F16.
    // W2 is stored transposed, one row per hidden unit over the slots: relu leaves about half of the
    // hidden units at zero, and only the others' rows are read (added into the scores as columns), half
    // the bytes of one dot product per slot.
    enum ggml_type w1_type, w2_type;
    char *         w1;      // [rank] rows of n_embd; NULL once dropped (flash, where it does not pay)
    char *         w2;      // [rank] rows of n_ff, slot order
    size_t         w1_stride, w2_stride;
    float *        b2_slot; // [n_ff]
    // it pays where its bytes are below those it saves (pi2_predictor_pays); elsewhere every gate row is
    // computed (as in oracle mode)
    bool           pays;
};

// Decides where the predictor pays and, if it does or `keep` is set, converts the sidecar layer's F16
// weights into decode's layout (they are freed either way). Adds the bytes kept to *kept. 0, or -1 with err.
int  pi2_predictor_prepare(struct pi2_predictor * P, struct pi2_sidecar_layer * L, uint32_t n_embd, bool keep,
                           uint64_t * kept, const char * path, uint32_t il, char * err, size_t errlen);
void pi2_predictor_free(struct pi2_predictor * P);

// Bytes the layer's predictor reads per token at most (W1, and all of W2), in decode's layout.
double pi2_predictor_bytes(const struct pi2_sidecar_layer * L, uint32_t n_embd);
// The rule: it pays where those bytes are below the bundles it saves, (1 - predicted density) times the layer's
// bundles, in RAM and under a memory budget alike.
bool   pi2_predictor_pays(const struct pi2_sidecar_layer * L, uint32_t n_embd);

// The predictor runs in predicted mode where it pays, everywhere with `always` (to measure it).
static inline bool pi2_predictor_runs(const struct pi2_predictor * P, bool predicted_mode, bool always) {
    return predicted_mode && P->w1 != NULL && (P->pays || always);
}

// A slot is predicted active: its score z past the cutoff, the score being z itself on ReLU-family models
// and |act(z)| on others.
static inline bool pi2_predictor_selects(float z, float cutoff, const struct pi2_ffn_act * a) {
    const float score = pi2_act_relu_family(a->kind) ? z : fabsf(pi2_act_gate(a, z));
    return score > cutoff;
}

struct pi2_binding_layer;

// The slots the predictor of B selects for the f32 row x (want[s] = 1, else 0), on the calling thread alone:
// which bundles a routed expert will read, known before it computes. scratch: pi2_predictor_want_scratch
// bytes, 4-byte aligned.
size_t pi2_predictor_want_scratch(const struct pi2_sidecar_layer * L, const struct pi2_predictor * P, int64_t n_embd);
void   pi2_predictor_want(const struct pi2_binding_layer * B, const struct pi2_sidecar_layer * L, const struct pi2_ffn_act * act,
                          int64_t n_embd, const float * x, void * scratch, uint8_t * want);

// Token phase 1, thread ith of nth: the hidden units h = relu(W1 x + b1) of its share of the rank.
void pi2_predictor_hidden(struct pi2_sparse_plan * p, int ith, int nth);
// After a barrier: the scores z = b2 + W2 h of its share of the slots, [*z0, *z1) (whole W2 blocks), as the
// W2 columns of the hidden units that fired added four at a time (a fixed order: z does not depend on the
// thread count).
void pi2_predictor_scores(struct pi2_sparse_plan * p, int ith, int nth, int64_t * z0, int64_t * z1);
