// The binding registry: the pi2_load_* / pi2_binding_* API (ggml-pi2.h). A frontend opens a binding
// before llama loads a model (the sidecar checked, its mode set), every PI2 weight buffer of that load
// takes a reference, and the id addresses the model afterwards (mode, settings, budget, errors, cache).
// Other frontends get one binding from PI2_SIDECAR, bound by every load.
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/config.h"
#include "flash/expert_file.h"
#include "flash/memory_budget.h"
#include "model/model_binding.h"
#include "flash/pipeline.h"
#include "core/pi2_context.h"
#include "core/pi2_log.h"

// The activation a load computes: what llama.cpp computes for the model (model_file.c: its architecture's
// graph, else its statement; model_path may be NULL), never the sidecar's (may be NULL): a sidecar states the
// activation it was made for and is refused if the model means another. Without a model file (PI2_SIDECAR's
// loads, where the plugin is not told the model) the sidecar's source architecture stands for the model's: a
// ReLU-family record can only come from a model that states it (convert), any other is checked against the
// graph's GLU when a layer runs (sparse_ffn.c, expert_ffn.c). 0, or -1 with err set.
static int pi2_load_activation(const char * model_path, const struct pi2_sidecar * sc, struct pi2_stated_act * out,
                               char * err, size_t errlen) {
    *out = (struct pi2_stated_act) { 0 };
    const char * model_name = model_path;
    if (model_path != NULL) {
        struct pi2_model_summary m;
        if (pi2_model_summary(model_path, &m, err, errlen) != 0) {
            return -1;
        }
        *out = (struct pi2_stated_act) {
            .stated         = m.activation >= 0,
            .act            = { m.activation >= 0 ? (enum pi2_activation) m.activation : PI2_ACT_SILU, m.activation_threshold },
            .experts_native = m.experts_native != 0,
        };
    } else if (sc != NULL) {
        model_name = "(not named to the plugin)";
        const struct pi2_arch_act * built = pi2_arch_activation(sc->source_arch);
        if (built != NULL) {
            *out = (struct pi2_stated_act) { .stated = true, .act = { built->kind, 0.0f }, .experts_native = built->experts_native };
        } else if (pi2_act_relu_family(sc->activation.kind)) {
            *out = (struct pi2_stated_act) { .stated = true, .act = sc->activation };
        }
    }
    if (sc == NULL) {
        return 0;
    }
    if (out->stated && !pi2_act_equal(&out->act, &sc->activation)) {
        snprintf(err, errlen, "sidecar %s was made for FFN activation %s (threshold %g) but llama.cpp computes model %s (%s) "
                 "with %s (threshold %g); convert the model again", sc->path, pi2_activation_names[sc->activation.kind],
                 (double) sc->activation.threshold, model_name, sc->source_arch != NULL ? sc->source_arch : "?",
                 pi2_activation_names[out->act.kind], (double) out->act.threshold);
        return -1;
    }
    if (!out->stated && pi2_act_relu_family(sc->activation.kind)) {
        snprintf(err, errlen, "sidecar %s was made for FFN activation %s but model %s does not state one (llama.cpp "
                 "would run it as its architecture's default); convert the model again", sc->path,
                 pi2_activation_names[sc->activation.kind], model_name);
        return -1;
    }
    return 0;
}

void pi2_registry_init(struct pi2_device_ctx * d) {
    struct pi2_config * c = &d->config;
    if (c->error[0] != '\0' || c->sidecar[0] == '\0') {
        return;
    }
    const char * path = c->sidecar;
    char err[sizeof(c->error) - 16];
    // llama.cpp's tools do not name the model file to the plugin: PI2_MODEL does, else MODEL.gguf beside a sidecar
    // MODEL.pi2.gguf is taken (llama's upload is compared with that file, so a wrong file fails the load). Under a
    // budget the token embedding and the output matrix are read from it, and routed experts read whole.
    char model[PI2_PATH_MAX] = "";
    const size_t n = strlen(path);
    const char * suffix = ".pi2.gguf";
    if (c->model[0] != '\0') {
        if (access(c->model, R_OK) != 0) {
            snprintf(c->error, sizeof(c->error), "PI2_MODEL=%.400s: cannot read it (%s)", c->model, strerror(errno));
            return;
        }
        snprintf(model, sizeof(model), "%s", c->model);
    } else if (n > strlen(suffix) && n < sizeof(model) && strcmp(path + n - strlen(suffix), suffix) == 0) {
        snprintf(model, sizeof(model), "%.*s.gguf", (int) (n - strlen(suffix)), path);
    }
    bool beside = model[0] != '\0' && access(model, R_OK) == 0;
    if (beside) { // the file the sidecar was made for (its FFN fingerprint), or a wrong file named or guessed
        struct pi2_model_summary m;
        uint32_t n_layer = 0;
        uint64_t fp = 0;
        char why[512] = "";
        // (an unreadable sidecar is refused by name when the binding opens it below)
        if (pi2_sidecar_summary(path, &n_layer, &fp, why, sizeof(why)) == 0 &&
            (pi2_model_summary(model, &m, why, sizeof(why)) != 0 || m.fingerprint != fp)) {
            if (c->model[0] != '\0') {
                snprintf(c->error, sizeof(c->error), "PI2_MODEL=%.150s is not the model sidecar %.150s was made for%s%.100s",
                         model, path, why[0] != '\0' ? ": " : " (its FFN weights differ)", why);
                return;
            }
            beside = false;
        }
    }
    if (!beside && c->memory_budget > 0) {
        PI2_LOG_WARN("pi2: PI2_MEMORY_BUDGET: the model file is not known to the plugin, so the token embedding and "
                     "the output matrix stay in RAM, out of the neuron cache's share of the budget (and routed experts "
                     "cannot be read whole): set PI2_MODEL=MODEL.gguf, or name the sidecar MODEL.pi2.gguf beside it\n");
    }
    d->env_binding = pi2_binding_create(0, path, (enum pi2_mode) c->mode, c->memory_budget > 0, beside ? model : NULL, c,
                                        err, sizeof(err));
    if (d->env_binding == NULL) {
        snprintf(c->error, sizeof(c->error), "PI2_SIDECAR: %s", err);
        return;
    }
    d->env_binding->env_budget = c->memory_budget;
    if (pi2_load_activation(beside ? model : NULL, d->env_binding->sc, &d->env_act, err, sizeof(err)) != 0) {
        snprintf(c->error, sizeof(c->error), "PI2_SIDECAR: %s", err);
        return;
    }
    d->pending     = d->env_binding;
    d->pending_act = d->env_act;
}

// pi2_load_begin..pi2_load_end brackets one model load: the weights allocated meanwhile belong to its binding
#define PI2_CONCURRENT_LOAD "another model is being loaded with PI2 in this process (pi2_load_begin without " \
                            "pi2_load_end); load models one at a time"

static int pi2_load_begin_impl(const char * sidecar_path, int mode, bool flash, const char * model_path, char * err, size_t errlen) {
    struct pi2_device_ctx * d = pi2_device_ctx();
    if (mode != PI2_MODE_DENSE && mode != PI2_MODE_ORACLE && mode != PI2_MODE_PREDICTED) {
        snprintf(err, errlen, "mode %d is not dense (0), oracle (1) or predicted (2)", mode);
        return -1;
    }
    if (sidecar_path == NULL) {
        if (flash) {
            snprintf(err, errlen, "a memory budget needs a sidecar (pi2-gguf convert MODEL.gguf writes MODEL.pi2.gguf)");
            return -1;
        }
        if (mode != PI2_MODE_DENSE) {
            snprintf(err, errlen, "mode %s needs a sidecar", mode == PI2_MODE_ORACLE ? "oracle" : "predicted");
            return -1;
        }
        struct pi2_stated_act act;
        if (pi2_load_activation(model_path, NULL, &act, err, errlen) != 0) {
            return -1;
        }
        pthread_mutex_lock(&d->lock);
        if (d->frontend_load) { // the load in progress would take this one's weights, or this one its
            pthread_mutex_unlock(&d->lock);
            snprintf(err, errlen, "%s", PI2_CONCURRENT_LOAD);
            return -1;
        }
        d->pending       = NULL;
        d->pending_act   = act;
        d->frontend_load = true;
        pthread_mutex_unlock(&d->lock);
        return 0;
    }
    pthread_mutex_lock(&d->lock);
    const int id = d->next_binding_id;
    int slot = -1;
    for (int k = 0; k < PI2_MAX_BINDINGS && slot < 0; ++k) {
        if (d->bindings[k] == NULL) {
            slot = k;
        }
    }
    if (slot >= 0) {
        d->next_binding_id++;
    }
    pthread_mutex_unlock(&d->lock);
    if (slot < 0) {
        snprintf(err, errlen, "more than %d models with sidecars are loaded", PI2_MAX_BINDINGS);
        return -1;
    }
    struct pi2_binding * b = pi2_binding_create(id, sidecar_path, (enum pi2_mode) mode, flash, model_path, &d->config,
                                                err, errlen);
    if (b == NULL) {
        return -1;
    }
    struct pi2_stated_act act;
    if (pi2_load_activation(model_path, b->sc, &act, err, errlen) != 0) {
        pi2_binding_unref(b);
        return -1;
    }
    pthread_mutex_lock(&d->lock);
    if (d->bindings[slot] != NULL || d->frontend_load) { // a concurrent load took the slot, or is in progress
        pthread_mutex_unlock(&d->lock);
        pi2_binding_unref(b);
        snprintf(err, errlen, "%s", PI2_CONCURRENT_LOAD);
        return -1;
    }
    d->bindings[slot] = b; // the registry's reference
    pi2_binding_ref(b);
    d->pending = b;         // the pending reference, dropped by pi2_load_end
    d->pending_act = act;
    d->frontend_load = true;
    pthread_mutex_unlock(&d->lock);
    return id;
}

int pi2_load_begin(const char * sidecar_path, const char * model_path, int mode, char * err, size_t errlen) {
    return pi2_load_begin_impl(sidecar_path, mode, false, model_path, err, errlen);
}

int pi2_load_begin_flash(const char * sidecar_path, const char * model_path, int mode, char * err, size_t errlen) {
    return pi2_load_begin_impl(sidecar_path, mode, true, model_path, err, errlen);
}

int pi2_config_error(char * err, size_t errlen) {
    struct pi2_device_ctx * d = pi2_device_ctx();
    pthread_mutex_lock(&d->lock);
    snprintf(err, errlen, "%s", d->config.error);
    pthread_mutex_unlock(&d->lock);
    return d->config.error[0] != '\0' ? -1 : 0;
}

// The layers a load left to ggml-cpu (placement.h): their count, the first `cap` of them in out (may be NULL)
static int pi2_layers_left_of(const struct pi2_binding * b, int32_t * out, int cap) {
    int n = 0;
    for (uint32_t il = 0; il < b->sc->n_layer; ++il) {
        if (atomic_load(&b->layer[il].left)) {
            if (out != NULL && n < cap) {
                out[n] = (int32_t) il;
            }
            ++n;
        }
    }
    return n;
}

void pi2_load_end(void) {
    struct pi2_device_ctx * d = pi2_device_ctx();
    pthread_mutex_lock(&d->lock);
    struct pi2_binding * old = d->pending;
    if (old != NULL && old != d->env_binding) {
        const int left = pi2_layers_left_of(old, NULL, 0);
        if (left > 0) {
            PI2_LOG_INFO("pi2: sidecar %s: %d of %u FFN layers left to ggml-cpu, where sparse decode in mode %s would "
                         "not be faster than its kernels (PI2_LAYERS=all holds them all)\n", old->sc->path, left,
                         old->sc->n_layer, old->load_mode == PI2_MODE_PREDICTED ? "predicted" : "dense");
        }
    }
    d->pending       = d->env_binding;
    d->pending_act   = d->env_act;
    d->frontend_load = false;
    pthread_mutex_unlock(&d->lock);
    if (old != NULL && old != d->env_binding) {
        pi2_binding_unref(old);
    }
}

// the registry slot of the binding with this id, or -1 (d->lock held)
static int pi2_binding_slot(const struct pi2_device_ctx * d, int id) {
    for (int k = 0; k < PI2_MAX_BINDINGS; ++k) {
        if (d->bindings[k] != NULL && d->bindings[k]->id == id) {
            return k;
        }
    }
    return -1;
}

// the registered binding with this id, referenced (caller unrefs), or NULL
static struct pi2_binding * pi2_binding_find(int id) {
    struct pi2_device_ctx * d = pi2_device_ctx();
    pthread_mutex_lock(&d->lock);
    const int k = pi2_binding_slot(d, id);
    struct pi2_binding * found = k >= 0 ? d->bindings[k] : NULL;
    if (found != NULL) {
        pi2_binding_ref(found);
    }
    pthread_mutex_unlock(&d->lock);
    return found;
}

int pi2_binding_set_mode(int id, int mode) {
    if (mode != PI2_MODE_DENSE && mode != PI2_MODE_ORACLE && mode != PI2_MODE_PREDICTED) {
        return -1;
    }
    struct pi2_binding * b = pi2_binding_find(id);
    if (b == NULL) {
        return -1;
    }
    int rc = 0;
    if (mode != PI2_MODE_DENSE && mode != b->load_mode && pi2_layers_left_of(b, NULL, 0) > 0) {
        rc = -2;
    } else {
        atomic_store(&b->mode, mode);
    }
    pi2_binding_unref(b);
    return rc;
}

int pi2_binding_layers_left(int id, int32_t * out, int cap) {
    struct pi2_binding * b = pi2_binding_find(id);
    if (b == NULL) {
        return -1;
    }
    const int n = pi2_layers_left_of(b, out, cap);
    pi2_binding_unref(b);
    return n;
}

int pi2_binding_set_check_recall(int id, int on) {
    struct pi2_binding * b = pi2_binding_find(id);
    if (b == NULL) {
        return -1;
    }
    atomic_store(&b->check_recall, on != 0);
    pi2_binding_unref(b);
    return 0;
}

int pi2_binding_error(int id, char * err, size_t errlen) {
    struct pi2_binding * b = pi2_binding_find(id);
    if (b == NULL) {
        return -1;
    }
    snprintf(err, errlen, "%s", b->error);
    pi2_binding_unref(b);
    return 0;
}

int pi2_binding_set_budget(int id, uint64_t budget, uint64_t reserved, char * err, size_t errlen) {
    struct pi2_binding * b = pi2_binding_find(id);
    if (b == NULL) {
        snprintf(err, errlen, "no model binding %d", id);
        return -1;
    }
    char msg[1024];
    const int r = pi2_binding_size_cache(b, budget, reserved, msg, sizeof(msg));
    if (r != 0) {
        snprintf(err, errlen, "%s", msg);
    }
    pi2_binding_unref(b);
    return r;
}

int pi2_binding_cache_info(int id, struct pi2_cache_info * out) {
    struct pi2_binding * b = pi2_binding_find(id);
    if (b == NULL) {
        return -1;
    }
    int r = -1;
    memset(out, 0, sizeof(*out));
    pthread_mutex_lock(&b->cache_lock);
    if (b->pipe != NULL) {
        const struct pi2_cache_plan * plan = pi2_cache_get_plan(pi2_pipeline_cache(b->pipe));
        out->fixed_bytes = b->fixed_bytes;
        out->hot_bytes   = plan->hot_bytes;
        out->cold_bytes  = plan->cold_bytes;
        out->hot_neurons = plan->hot_neurons;
        out->n_cold      = plan->n_cold;
        out->n_prefetch  = plan->n_prefetch;
        out->freq_cutoff = plan->freq_cutoff;
        out->direct_io   = pi2_pipeline_direct_io(b->pipe);
        out->io_ring     = pi2_pipeline_io_ring(b->pipe);
        out->ffn_ns      = b->ffn_ns;
        out->embd_bytes  = b->embd != NULL ? b->embd->row_size * (uint64_t) b->embd->n_rows : 0;
        out->n_expert_entries = b->experts != NULL ? pi2_expert_file_entries(b->experts) : 0;
        out->expert_bytes     = b->experts != NULL ? pi2_expert_file_bytes(b->experts) : 0;
        out->budget_bytes     = b->budget_use.budget;
        out->resident_bytes   = b->budget_use.resident;
        out->reserved_bytes   = b->budget_use.reserved;
        out->tables_bytes     = b->budget_use.tables;
        out->margin_bytes     = b->budget_use.margin;
        out->output_copy_bytes = b->output != NULL && b->output->proxy != NULL
                                     ? b->output->proxy_row_size * (uint64_t) b->output->table->n_rows : 0;
        r = 0;
    }
    pthread_mutex_unlock(&b->cache_lock);
    pi2_binding_unref(b);
    return r;
}

int pi2_binding_inject_read_fault(int id, int64_t after, int err) {
    struct pi2_binding * b = pi2_binding_find(id);
    if (b == NULL) {
        return -1;
    }
    pthread_mutex_lock(&b->cache_lock);
    const int r = b->pipe != NULL ? 0 : -1;
    if (b->pipe != NULL) {
        pi2_pipeline_inject_fault(b->pipe, after, err);
    }
    pthread_mutex_unlock(&b->cache_lock);
    pi2_binding_unref(b);
    return r;
}

int pi2_binding_release(int id) {
    struct pi2_device_ctx * d = pi2_device_ctx();
    pthread_mutex_lock(&d->lock);
    const int k = pi2_binding_slot(d, id);
    struct pi2_binding * found = k >= 0 ? d->bindings[k] : NULL;
    if (k >= 0) {
        d->bindings[k] = NULL;
    }
    pthread_mutex_unlock(&d->lock);
    if (found == NULL) {
        return -1;
    }
    pi2_binding_unref(found); // the weight buffers keep theirs until llama frees the model
    return 0;
}

// the settings a config_set with this id changes: a binding's own, or the defaults (id 0); NULL, referenced
// binding in *held (caller unrefs), for an unknown id
static struct pi2_settings * pi2_settings_of(int id, struct pi2_binding ** held) {
    *held = NULL;
    if (id == 0) {
        return &pi2_device_ctx()->config.defaults;
    }
    *held = pi2_binding_find(id);
    return *held != NULL ? &(*held)->settings : NULL;
}

int pi2_config_set(int id, const char * name, const char * value, char * err, size_t errlen) {
    enum pi2_setting k;
    double v = 0.0;
    if (pi2_setting_parse(name, value, &k, &v, err, errlen) != 0) {
        return -1;
    }
    struct pi2_binding * held = NULL;
    struct pi2_settings * s = pi2_settings_of(id, &held);
    if (s == NULL) {
        snprintf(err, errlen, "%s=%s: no loaded model has PI2 binding %d", name, value, id);
        return -1;
    }
    atomic_store(&s->v[k], v);
    pi2_binding_unref(held);
    return 0;
}
