#include "core/config.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "ggml-pi2.h"

enum pi2_kind {
    PI2_KIND_COUNT,    // an integer in [min, max]
    PI2_KIND_FRACTION, // a real number in [min, max]
    PI2_KIND_SIZE,     // bytes, with a unit suffix, in [min, max]
    PI2_KIND_SWITCH,   // on (value 1) or off (value 0)
};

struct pi2_setting_def {
    const char *  name;
    enum pi2_kind kind;
    double        min, max, dflt;
    const char *  what; // "a number of tokens", or for a switch the on value
    const char *  off;  // a switch's off value
};

// The one table of per-model settings (docs/SETTINGS.md says why each default is what it is).
static const struct pi2_setting_def pi2_defs[PI2_N_SETTINGS] = {
    [PI2_SET_SPARSE_BATCH]      = { "PI2_SPARSE_BATCH", PI2_KIND_COUNT, 0, 64, 4, "a number of tokens", NULL },
    [PI2_SET_DOWN_SPARSE_MAX]   = { "PI2_DOWN_SPARSE_MAX", PI2_KIND_FRACTION, 0, 1, 0.2, "a fraction", NULL },
    [PI2_SET_PROMPT]            = { "PI2_PROMPT", PI2_KIND_SWITCH, 0, 1, 1, "cpu", "pi2" },
    [PI2_SET_PREDICTOR]         = { "PI2_PREDICTOR", PI2_KIND_SWITCH, 0, 1, 0, "always", "auto" },
    [PI2_SET_ROWS]              = { "PI2_ROWS", PI2_KIND_SWITCH, 0, 1, 1, "model", "bundles" },
    [PI2_SET_LAYERS]            = { "PI2_LAYERS", PI2_KIND_SWITCH, 0, 1, 0, "all", "auto" },
    [PI2_SET_IO_THREADS]        = { "PI2_IO_THREADS", PI2_KIND_COUNT, 1, 64, 32, "a number of threads", NULL },
    [PI2_SET_IO_ENGINE]         = { "PI2_IO_ENGINE", PI2_KIND_SWITCH, 0, 1, 1, "uring", "threads" },
    [PI2_SET_IO_INFLIGHT_BYTES] = { "PI2_IO_INFLIGHT_BYTES", PI2_KIND_SIZE, 0, 0x1p40, 2 << 20, NULL, NULL },
    [PI2_SET_IO_MAX_BYTES]      = { "PI2_IO_MAX_BYTES", PI2_KIND_SIZE, 4096, 0x1p30, 1 << 20, NULL, NULL },
    [PI2_SET_IO_GAP]            = { "PI2_IO_GAP", PI2_KIND_SIZE, 0, 0x1p30, 32768, NULL, NULL },
    [PI2_SET_PREFETCH_BYTES]    = { "PI2_PREFETCH_BYTES", PI2_KIND_SIZE, 0, 0x1p40, 8 << 20, NULL, NULL },
    [PI2_SET_CACHE_MAX]         = { "PI2_CACHE_MAX", PI2_KIND_SIZE, 0, 0x1p50, 0, NULL, NULL },
    [PI2_SET_COLD_SHARE]        = { "PI2_COLD_SHARE", PI2_KIND_FRACTION, 0, 0.9, 0, "a fraction", NULL },
    [PI2_SET_OUTPUT_ROWS]       = { "PI2_OUTPUT_ROWS", PI2_KIND_COUNT, 0, 4096, 0, "a number of rows", NULL },
    [PI2_SET_OUTPUT_COPY]       = { "PI2_OUTPUT_COPY", PI2_KIND_SWITCH, 0, 1, 0, "q2_k", "q3_k" },
    [PI2_SET_EXPERT_AHEAD]      = { "PI2_EXPERT_AHEAD", PI2_KIND_COUNT, 0, 64, 16, "a number of routed experts", NULL },
    [PI2_SET_EXPERT_GUESS]      = { "PI2_EXPERT_GUESS", PI2_KIND_SWITCH, 0, 1, 1, "router", "off" },
    [PI2_SET_EXPERT_READS]      = { "PI2_EXPERT_READS", PI2_KIND_SWITCH, 0, 1, 0, "model", "bundles" },
    [PI2_SET_BATCH_NEURONS]     = { "PI2_BATCH_NEURONS", PI2_KIND_SWITCH, 0, 1, 0, "token", "union" },
    [PI2_SET_DENSE_READS]       = { "PI2_DENSE_READS", PI2_KIND_SWITCH, 0, 1, 0, "bundles", "auto" },
};

// The process settings, read by pi2_config_from_env (the per-model ones are the table above).
enum { PI2_VAR_MODE, PI2_VAR_MEMORY_BUDGET, PI2_VAR_SIDECAR, PI2_VAR_MODEL, PI2_N_PROCESS_VARS };
static const char * const pi2_process_vars[PI2_N_PROCESS_VARS] = {
    [PI2_VAR_MODE] = "PI2_MODE", [PI2_VAR_MEMORY_BUDGET] = "PI2_MEMORY_BUDGET", [PI2_VAR_SIDECAR] = "PI2_SIDECAR",
    [PI2_VAR_MODEL] = "PI2_MODEL",
};

int pi2_parse_size(const char * s, uint64_t * out) {
    if (s == NULL) {
        return -1;
    }
    char * end = NULL;
    errno = 0;
    const double v = strtod(s, &end);
    if (end == s || errno != 0 || !(v >= 0.0) || !isfinite(v)) {
        return -1;
    }
    while (*end == ' ') {
        end++;
    }
    static const struct { const char * unit; double mul; } units[] = {
        { "", 1.0 }, { "B", 1.0 }, { "K", 1e3 }, { "KB", 1e3 }, { "KiB", 1024.0 }, { "M", 1e6 }, { "MB", 1e6 },
        { "MiB", 1048576.0 }, { "G", 1e9 }, { "GB", 1e9 }, { "GiB", 1073741824.0 }, { "T", 1e12 }, { "TB", 1e12 },
        { "TiB", 1099511627776.0 },
    };
    for (size_t k = 0; k < sizeof(units) / sizeof(units[0]); ++k) {
        if (strcasecmp(end, units[k].unit) == 0) {
            const double bytes = v * units[k].mul;
            if (bytes >= 0x1p63) {
                return -1;
            }
            *out = (uint64_t) bytes;
            return 0;
        }
    }
    return -1;
}

static int pi2_refuse(char * err, size_t errlen, const struct pi2_setting_def * d, const char * value) {
    switch (d->kind) {
        case PI2_KIND_SWITCH:
            snprintf(err, errlen, "%s=%s is not %s or %s", d->name, value, d->what, d->off);
            break;
        case PI2_KIND_SIZE:
            snprintf(err, errlen, "%s=%s is not a size in %.0f..%.0f bytes (e.g. 600MB, 1GiB, 1500000000)", d->name, value,
                     d->min, d->max);
            break;
        default:
            snprintf(err, errlen, "%s=%s is not %s in %g..%g", d->name, value, d->what, d->min, d->max);
            break;
    }
    return -1;
}

int pi2_setting_parse(const char * name, const char * value, enum pi2_setting * which, double * out, char * err,
                      size_t errlen) {
    int k = 0;
    while (k < PI2_N_SETTINGS && (name == NULL || strcmp(pi2_defs[k].name, name) != 0)) {
        ++k;
    }
    if (k == PI2_N_SETTINGS) {
        snprintf(err, errlen, "%s is not a per-model PI2 setting (docs/SETTINGS.md lists them)", name != NULL ? name : "(null)");
        return -1;
    }
    const struct pi2_setting_def * d = &pi2_defs[k];
    if (value == NULL) {
        return pi2_refuse(err, errlen, d, "(null)");
    }
    double v = 0.0;
    char * end = NULL;
    switch (d->kind) {
        case PI2_KIND_SWITCH:
            if (strcmp(value, d->what) != 0 && strcmp(value, d->off) != 0) {
                return pi2_refuse(err, errlen, d, value);
            }
            v = strcmp(value, d->what) == 0 ? 1.0 : 0.0;
            break;
        case PI2_KIND_SIZE: {
            uint64_t bytes = 0;
            if (pi2_parse_size(value, &bytes) != 0) {
                return pi2_refuse(err, errlen, d, value);
            }
            v = (double) bytes;
            break;
        }
        case PI2_KIND_COUNT: {
            errno = 0;
            const long long n = strtoll(value, &end, 10);
            if (end == value || *end != '\0' || errno != 0) {
                return pi2_refuse(err, errlen, d, value);
            }
            v = (double) n;
            break;
        }
        case PI2_KIND_FRACTION:
            errno = 0;
            v = strtod(value, &end);
            if (end == value || *end != '\0' || errno != 0 || !isfinite(v)) {
                return pi2_refuse(err, errlen, d, value);
            }
            break;
    }
    if (!(v >= d->min && v <= d->max)) {
        return pi2_refuse(err, errlen, d, value);
    }
    *which = (enum pi2_setting) k;
    *out   = v;
    return 0;
}

void pi2_settings_unset(struct pi2_settings * s) {
    for (int k = 0; k < PI2_N_SETTINGS; ++k) {
        atomic_init(&s->v[k], NAN);
    }
}

double pi2_setting(const struct pi2_settings * own, const struct pi2_settings * defaults, enum pi2_setting k) {
    if (own != NULL) {
        const double v = atomic_load_explicit(&own->v[k], memory_order_relaxed);
        if (!isnan(v)) {
            return v;
        }
    }
    return atomic_load_explicit(&defaults->v[k], memory_order_relaxed);
}

// an unset or empty variable is NULL
static const char * pi2_env(pi2_config_lookup lookup, void * ctx, const char * name) {
    const char * v = lookup(ctx, name);
    return v != NULL && v[0] != '\0' ? v : NULL;
}

static const char * pi2_getenv(void * ctx, const char * name) {
    (void) ctx;
    return getenv(name);
}

int pi2_mode_parse(const char * s) {
    static const char * const names[] = { [PI2_MODE_DENSE] = "dense", [PI2_MODE_ORACLE] = "oracle", [PI2_MODE_PREDICTED] = "predicted" };
    for (int m = 0; m < 3; ++m) {
        if (strcmp(s, names[m]) == 0) {
            return m;
        }
    }
    return -1;
}

void pi2_config_read(struct pi2_config * out, pi2_config_lookup lookup, void * ctx) {
    memset(out, 0, sizeof(*out));
    out->mode = PI2_MODE_PREDICTED;
    for (int k = 0; k < PI2_N_SETTINGS; ++k) {
        atomic_init(&out->defaults.v[k], pi2_defs[k].dflt);
    }
    char * err = out->error;
    const size_t errlen = sizeof(out->error);
    for (int k = 0; k < PI2_N_SETTINGS; ++k) {
        const char * v = pi2_env(lookup, ctx, pi2_defs[k].name);
        enum pi2_setting which;
        double x = 0.0;
        if (v != NULL) {
            if (pi2_setting_parse(pi2_defs[k].name, v, &which, &x, err, errlen) != 0) {
                return;
            }
            atomic_store(&out->defaults.v[which], x);
            out->set[which] = true;
        }
    }
    const char * mode = pi2_env(lookup, ctx, pi2_process_vars[PI2_VAR_MODE]);
    if (mode != NULL) {
        out->mode = pi2_mode_parse(mode);
        out->mode_set = true;
        if (out->mode < 0) {
            snprintf(err, errlen, "PI2_MODE=%s is not dense, oracle or predicted", mode);
            return;
        }
    }
    const char * budget = pi2_env(lookup, ctx, pi2_process_vars[PI2_VAR_MEMORY_BUDGET]);
    if (budget != NULL && (pi2_parse_size(budget, &out->memory_budget) != 0 || out->memory_budget == 0)) {
        snprintf(err, errlen, "PI2_MEMORY_BUDGET=%s is not a size (e.g. 600MB, 2GiB, 1500000000)", budget);
        return;
    }
    const char * sidecar = pi2_env(lookup, ctx, pi2_process_vars[PI2_VAR_SIDECAR]);
    if (sidecar != NULL && strlen(sidecar) >= sizeof(out->sidecar)) {
        snprintf(err, errlen, "PI2_SIDECAR=%.64s... is longer than %d bytes", sidecar, PI2_PATH_MAX - 1);
        return;
    }
    const char * model = pi2_env(lookup, ctx, pi2_process_vars[PI2_VAR_MODEL]);
    if (model != NULL && strlen(model) >= sizeof(out->model)) {
        snprintf(err, errlen, "PI2_MODEL=%.64s... is longer than %d bytes", model, PI2_PATH_MAX - 1);
        return;
    }
    if (model != NULL && sidecar == NULL) {
        snprintf(err, errlen, "PI2_MODEL=%.400s names the model file for a sidecar: set PI2_SIDECAR too", model);
        return;
    }
    if (model != NULL) {
        snprintf(out->model, sizeof(out->model), "%s", model);
    }
    if (sidecar == NULL) {
        const char * need = budget != NULL ? "PI2_MEMORY_BUDGET" : out->mode_set && out->mode != PI2_MODE_DENSE ? "PI2_MODE" : NULL;
        if (need != NULL) {
            snprintf(err, errlen, "%s=%s needs a sidecar: set PI2_SIDECAR (pi2-gguf convert MODEL.gguf writes MODEL.pi2.gguf)",
                     need, budget != NULL ? budget : mode);
        }
        return;
    }
    snprintf(out->sidecar, sizeof(out->sidecar), "%s", sidecar);
}

void pi2_config_from_env(struct pi2_config * out) {
    pi2_config_read(out, pi2_getenv, NULL);
}

int pi2_config_names(char * buf, size_t size) {
    // the per-model table, then the process settings pi2_config_from_env reads
    size_t used = 0;
    for (int k = 0; k < PI2_N_SETTINGS + PI2_N_PROCESS_VARS; ++k) {
        const char * name = k < PI2_N_SETTINGS ? pi2_defs[k].name : pi2_process_vars[k - PI2_N_SETTINGS];
        const int n = snprintf(used < size ? buf + used : NULL, used < size ? size - used : 0, "%s%s", k > 0 ? "," : "", name);
        used += (size_t) n;
    }
    return used < size ? 0 : -1;
}
