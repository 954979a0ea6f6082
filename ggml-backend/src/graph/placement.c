#include "graph/placement.h"

#include "ggml-pi2.h"
#include "model/model_binding.h"
#include "sparse/predictor.h"

// Costs per weight byte relative to ggml-cpu's repacked GEMV (Q4_K 8x8 on this machine, the type of the
// models measured), from the in-RAM profiles in docs/MEASUREMENTS.md: rows in the model's order through
// ggml's one-row vec_dot ("pi2 dense" 0.84-0.95x stock's default on whole models, the FFN about two
// thirds of the time: 2026-11-21), and scattered rows or columns of the active neurons (~6.5 GB/s of CPU
// time against the repacked GEMV's ~18 GB/s: 2026-11-25). Counting every type as repacked errs towards
// leaving a layer to ggml-cpu, which at worst gives stock's speed.
#define PI2_COST_ROWS_IN_ORDER 1.2
#define PI2_COST_SCATTERED     2.8

// Share of neurons whose up row is computed: the active ones, or for `product` those the looser |act(gate)|
// threshold admits (the converter's rule, pi2_gguf/converter/sparsity.py admit_density, at target 1 - d).
static double pi2_up_share(enum pi2_sparsity_method method, double d) {
    if (method != PI2_SPARSITY_METHOD_PRODUCT) {
        return d;
    }
    const double a = 1.0 - (1.0 - d) / 5.0;
    return a < 2.5 * d ? a : 2.5 * d;
}

double pi2_sparse_cost_ratio(const struct pi2_sidecar_layer * L, uint32_t n_embd, enum pi2_sparsity_method method,
                             double down_sparse_max, bool predictor_always) {
    if (L->whole) {
        return INFINITY; // a routed expert read whole from the model file: never sparse
    }
    const double n_ff  = (double) L->n_ff;
    const double gate  = n_ff * (double) ggml_row_size(L->gate_type, n_embd);
    const double up    = n_ff * (double) ggml_row_size(L->up_type, n_embd);
    const double down  = n_ff * (double) ggml_row_size(L->down_type, n_embd);
    const double d     = L->density;
    double t = 0.0;
    if (pi2_predictor_pays(L, n_embd) || predictor_always) {
        t += pi2_predictor_bytes(L, n_embd) * PI2_COST_ROWS_IN_ORDER + L->pred_density * gate * PI2_COST_SCATTERED;
    } else {
        t += gate * PI2_COST_ROWS_IN_ORDER; // every gate row, from the model's matrix in row order
    }
    t += pi2_up_share(method, d) * up * PI2_COST_SCATTERED;
    t += d <= down_sparse_max ? d * down * PI2_COST_SCATTERED : down * PI2_COST_ROWS_IN_ORDER;
    return t / (gate + up + down);
}

// The part of the rule that needs no cost estimate: 1 held, 0 left, -1 the layer's cost decides (predicted mode
// in RAM with a sidecar). own: the model's settings (NULL: none); b: its binding, NULL where no sidecar counts.
static int pi2_placement_forced(const struct pi2_settings * own, const struct pi2_binding * b, struct pi2_stated_act act,
                                const struct pi2_settings * defaults) {
    if (act.stated && pi2_act_relu_family(act.act.kind)) {
        return 1;
    }
    if (pi2_setting(own, defaults, PI2_SET_LAYERS) != 0.0) {
        return 1;
    }
    if (b == NULL) {
        return 0;
    }
    if (b->flash) {
        return 1;
    }
    const int mode = atomic_load(&b->mode);
    if (mode != PI2_MODE_PREDICTED) {
        return mode == PI2_MODE_ORACLE;
    }
    return -1;
}

double pi2_placement_layer_cost(const struct pi2_binding * b, const struct pi2_settings * defaults, uint32_t layer) {
    return pi2_sparse_cost_ratio(&b->sc->layer[layer], b->sc->n_embd, b->sc->sparsity_method,
                                 pi2_setting(&b->settings, defaults, PI2_SET_DOWN_SPARSE_MAX),
                                 pi2_setting(&b->settings, defaults, PI2_SET_PREDICTOR) != 0.0);
}

bool pi2_placement_holds(const struct pi2_binding * b, struct pi2_stated_act act, const struct pi2_settings * defaults,
                         int layer) {
    const int forced = pi2_placement_forced(b != NULL ? &b->settings : NULL, b, act, defaults);
    if (forced >= 0) {
        return forced == 1;
    }
    if (layer < 0 || (uint32_t) layer >= b->sc->n_layer) {
        return true; // not the sidecar's layer: held, so the weight check refuses the sidecar by name
    }
    return pi2_placement_layer_cost(b, defaults, (uint32_t) layer) < 1.0;
}

bool pi2_placement_holds_experts(const struct pi2_binding * b, struct pi2_stated_act act, const struct pi2_settings * defaults,
                                 int layer) {
    // a sidecar without experts cannot make the experts sparse: they follow the rule for no sidecar; an activation
    // llama.cpp's MoE graph computes itself (smallthinker's ReLU) needs no holding
    if (act.experts_native) {
        act.stated = false;
    }
    const int forced = pi2_placement_forced(b != NULL ? &b->settings : NULL, b != NULL && b->sc->n_expert > 0 ? b : NULL, act,
                                            defaults);
    if (forced >= 0) {
        return forced == 1;
    }
    const uint32_t n = b->sc->n_expert;
    if (pi2_sidecar_expert_layer(b->sc, layer, 0) < 0) {
        return true; // not the sidecar's layer: held, so the region's check refuses the sidecar by name
    }
    // the expected cost of a routed expert: the mean over the layer's experts (FORMAT.md, "MoE sidecars")
    double sum = 0.0;
    for (uint32_t e = 0; e < n; ++e) {
        sum += pi2_placement_layer_cost(b, defaults, (uint32_t) pi2_sidecar_expert_layer(b->sc, layer, e));
    }
    return sum / n < 1.0;
}

static const char * pi2_no_env(void * ctx, const char * name) {
    (void) ctx;
    (void) name;
    return NULL;
}

void pi2_sidecar_default_costs(const struct pi2_sidecar * sc, double * out, int cap) {
    struct pi2_config c; // the table's defaults: what a model loaded without settings plans with
    pi2_config_read(&c, pi2_no_env, NULL);
    const double down_sparse_max = pi2_setting(NULL, &c.defaults, PI2_SET_DOWN_SPARSE_MAX);
    const bool   always          = pi2_setting(NULL, &c.defaults, PI2_SET_PREDICTOR) != 0.0;
    for (uint32_t il = 0; il < sc->n_layer && (int) il < cap; ++il) {
        out[il] = pi2_sparse_cost_ratio(&sc->layer[il], sc->n_embd, sc->sparsity_method, down_sparse_max, always);
    }
}

int pi2_sidecar_sparse_cost(const char * path, double * out, int cap, char * err, size_t errlen) {
    struct pi2_sidecar * sc = NULL;
    if (pi2_sidecar_open(path, &sc, err, errlen) != 0) {
        return -1;
    }
    pi2_sidecar_default_costs(sc, out, cap);
    const int n = (int) sc->n_layer;
    pi2_sidecar_free(sc);
    return n;
}
