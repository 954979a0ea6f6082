// A GGUF file opened for its header (sidecars and models alike): a regular file that starts with the
// GGUF magic, whose header ggml's reader accepts and whose every tensor lies within the file. Errors
// read "WHAT PATH: problem", WHAT naming the file's role ("sidecar", "model file").
#pragma once

#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "gguf.h"

struct pi2_gguf_file {
    int                   fd;
    uint64_t              file_size;
    struct gguf_context * gguf;
    struct ggml_context * meta; // tensor types and shapes, no data (when opened with_meta)
};

// 0, or -1 with err set; f is always left for pi2_gguf_file_close
int  pi2_gguf_file_open(struct pi2_gguf_file * f, const char * what, const char * path, bool with_meta, char * err,
                        size_t errlen);
void pi2_gguf_file_close(struct pi2_gguf_file * f);

// err = "WHAT PATH: " + the formatted problem; returns -1
int pi2_gguf_vfail(char * err, size_t errlen, const char * what, const char * path, const char * fmt, va_list ap);
int pi2_gguf_fail(char * err, size_t errlen, const char * what, const char * path, const char * fmt, ...);
