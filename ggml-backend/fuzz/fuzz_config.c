// Fuzz target: the configuration parsers (config.c) and the FFN tensor-name parser (ffn_names.c, which
// reads names out of model files). An input is lines NAME=VALUE (up to 32; a line ends at '\n' or NUL).
// Each line goes through pi2_setting_parse, pi2_mode_parse, pi2_parse_size and pi2_ffn_weight_parse; then
// pi2_config_read (what pi2_config_from_env runs on getenv) reads the lines as the environment, the first
// line of a name winning. Results must be in range, refusals must say why, and a parsed FFN name must be
// the name pi2_ffn_weight_name writes.
#include <math.h>
#include <stdbool.h>
#include <stdint.h>

#include "core/config.h"
#include "graph/ffn_names.h"
#include "fuzz_common.h"
#include "ggml-pi2.h"

#define FUZZ_LINES 32

struct fuzz_env {
    int    n;
    char * name[FUZZ_LINES];
    char * value[FUZZ_LINES];
};

static const char * fuzz_lookup(void * ctx, const char * name) {
    const struct fuzz_env * env = ctx;
    for (int i = 0; i < env->n; ++i) {
        if (strcmp(env->name[i], name) == 0) {
            return env->value[i];
        }
    }
    return NULL;
}

int LLVMFuzzerInitialize(int * argc, char *** argv) {
    (void) argc;
    (void) argv;
    fuzz_init();
    return 0;
}

static void fuzz_line(const char * name, const char * value) {
    char err[256];
    enum pi2_setting which = PI2_N_SETTINGS;
    double v = NAN;
    if (pi2_setting_parse(name, value, &which, &v, err, sizeof(err)) == 0) {
        FUZZ_ASSERT(which < PI2_N_SETTINGS && isfinite(v) && v >= 0.0);
    } else {
        fuzz_check_err(err, sizeof(err));
    }
    const int mode = pi2_mode_parse(value);
    FUZZ_ASSERT(mode >= -1 && mode <= PI2_MODE_PREDICTED);
    uint64_t bytes = 0;
    if (pi2_parse_size(value, &bytes) == 0) {
        FUZZ_ASSERT(bytes < (1ull << 63));
    }
    int layer = -1;
    enum pi2_matrix matrix = PI2_N_MATRIX;
    bool shared = false;
    if (pi2_ffn_weight_parse_kind(value, &layer, &matrix, &shared)) {
        FUZZ_ASSERT(layer >= 0 && layer < PI2_MAX_LAYERS && matrix >= 0 && matrix < PI2_N_MATRIX);
        char back[PI2_FFN_NAME_MAX];
        (shared ? pi2_shexp_weight_name : pi2_ffn_weight_name)(layer, matrix, back, sizeof(back));
        FUZZ_ASSERT(strcmp(back, value) == 0);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t * data, size_t size) {
    char * text = malloc(size + 1);
    FUZZ_ASSERT(text != NULL);
    memcpy(text, data, size);
    text[size] = '\0';

    struct fuzz_env env = { 0 };
    for (char * line = text; env.n < FUZZ_LINES && line < text + size;) {
        char * end = line + strlen(line); // a NUL ends the line, as it would end an environment string
        char * nl = strchr(line, '\n');
        if (nl != NULL && nl < end) {
            end = nl;
        }
        char * next = end < text + size ? end + 1 : end;
        *end = '\0';
        char * eq = strchr(line, '=');
        env.name[env.n] = line;
        env.value[env.n] = eq != NULL ? eq + 1 : end;
        if (eq != NULL) {
            *eq = '\0';
        }
        fuzz_line(env.name[env.n], env.value[env.n]);
        env.n++;
        line = next;
    }

    struct pi2_config cfg;
    pi2_config_read(&cfg, fuzz_lookup, &env);
    FUZZ_ASSERT(memchr(cfg.error, '\0', sizeof(cfg.error)) != NULL && memchr(cfg.sidecar, '\0', sizeof(cfg.sidecar)) != NULL);
    if (cfg.error[0] == '\0') {
        FUZZ_ASSERT(cfg.mode >= PI2_MODE_DENSE && cfg.mode <= PI2_MODE_PREDICTED);
        FUZZ_ASSERT(cfg.memory_budget == 0 || cfg.sidecar[0] != '\0');
        for (int k = 0; k < PI2_N_SETTINGS; ++k) {
            const double v = pi2_setting(NULL, &cfg.defaults, (enum pi2_setting) k);
            FUZZ_ASSERT(isfinite(v) && v >= 0.0);
        }
    }
    free(text);
    return 0;
}
