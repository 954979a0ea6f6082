// Whether the process that loads the plugin computes with the same copy of ggml the plugin is linked to.
#pragma once

#include <stdbool.h>
#include <stddef.h>

// caller: an address inside the code that called ggml_backend_init (ggml's backend loader). True when that
// code's object resolves ggml_init to the plugin's own ggml_init; otherwise false with err naming both.
bool pi2_host_shares_ggml(const void * caller, char * err, size_t errlen);
