// Logging through ggml's logger, so messages reach llama.cpp's log callback like ggml's own.
#pragma once

#include "ggml.h"

// exported by libggml-base; declared here because its header (ggml-impl.h) is internal to ggml
GGML_API void ggml_log_internal(enum ggml_log_level level, const char * format, ...);

#define PI2_LOG_ERROR(...) ggml_log_internal(GGML_LOG_LEVEL_ERROR, __VA_ARGS__)
#define PI2_LOG_WARN(...)  ggml_log_internal(GGML_LOG_LEVEL_WARN, __VA_ARGS__)
#define PI2_LOG_INFO(...)  ggml_log_internal(GGML_LOG_LEVEL_INFO, __VA_ARGS__)

// A refusal the user must see (a sidecar made for another model, a bad PI2_* setting): written to stderr
// as well, because apps often silence llama.cpp's log (llama-cpp-python's verbose=False) and would
// otherwise get only "llama_decode returned -3".
#include <stdio.h>
#define PI2_LOG_REFUSAL(...) do { ggml_log_internal(GGML_LOG_LEVEL_ERROR, __VA_ARGS__); fprintf(stderr, __VA_ARGS__); } while (0)
