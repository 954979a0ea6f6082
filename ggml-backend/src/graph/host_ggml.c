// One copy of ggml per process. A tool that links ggml statically (or a second libggml-base under another
// name) and loads the plugin ends up with two copies: the plugin's calls go to the shared libggml-base the
// plugin is linked to, whose tables ggml_init never filled in, and the output is garbage with no error.
// The loader that calls ggml_backend_init belongs to the host's copy; if the object it lives in does not
// resolve ggml_init to the function the plugin calls, the copies differ and the plugin refuses to load.
#define _GNU_SOURCE
#include "graph/host_ggml.h"

#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

#include "ggml.h"

bool pi2_host_shares_ggml(const void * caller, char * err, size_t errlen) {
    Dl_info host, own;
    if (caller == NULL || dladdr(caller, &host) == 0 || host.dli_fname == NULL) {
        return true; // nothing to compare with (no loader frame): assume the common case
    }
    void * ours = (void *) &ggml_init;
    const char * own_name = dladdr(ours, &own) != 0 && own.dli_fname != NULL ? own.dli_fname : "?";
    // the host's object and what it depends on, searched as its own code would resolve ggml_init; the main
    // program has no name of its own to dlopen by, and NULL opens the global scope that starts with it
    void * h = host.dli_fname[0] != '\0' ? dlopen(host.dli_fname, RTLD_LAZY | RTLD_NOLOAD) : NULL;
    if (h == NULL) {
        h = dlopen(NULL, RTLD_LAZY);
    }
    void * theirs = h != NULL ? dlsym(h, "ggml_init") : NULL;
    if (h != NULL) {
        dlclose(h);
    }
    if (theirs == ours) {
        return true;
    }
    snprintf(err, errlen, "%s loaded the PI2 plugin with its own copy of ggml, not the libggml-base the plugin uses (%s): "
             "two copies of ggml in one process compute wrong results. Build the tool with shared ggml libraries "
             "(BUILD_SHARED_LIBS=ON) and run it on the same libggml-base.so as the plugin (pi2-gguf's tools: make tools)",
             host.dli_fname[0] != '\0' ? host.dli_fname : "the program", own_name);
    return false;
}
