// Shared by the fuzz targets: each input is written to a memfd and handed to the reader as
// /proc/self/fd/N, so the readers open, stat and pread it as they would a model or sidecar file.
// ggml's log is silenced (its GGUF reader logs every refusal) unless PI2_FUZZ_VERBOSE is set.
#pragma once

#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "ggml.h"

static int  fuzz_fd = -1;
static char fuzz_path[64];

static inline void fuzz_quiet_log(enum ggml_log_level level, const char * text, void * user) {
    (void) level;
    (void) text;
    (void) user;
}

static inline void fuzz_die(const char * what) {
    fprintf(stderr, "fuzz harness: %s: %s\n", what, strerror(errno));
    abort();
}

static inline void fuzz_init(void) {
    if (getenv("PI2_FUZZ_VERBOSE") == NULL) {
        ggml_log_set(fuzz_quiet_log, NULL);
    }
    fuzz_fd = memfd_create("pi2-fuzz-input", MFD_CLOEXEC);
    if (fuzz_fd < 0) {
        fuzz_die("memfd_create");
    }
    snprintf(fuzz_path, sizeof(fuzz_path), "/proc/self/fd/%d", fuzz_fd);
}

// the file's contents become data[0..size); returns its path
static inline const char * fuzz_file(const uint8_t * data, size_t size) {
    if (ftruncate(fuzz_fd, 0) != 0) {
        fuzz_die("ftruncate");
    }
    for (size_t done = 0; done < size;) {
        const ssize_t n = pwrite(fuzz_fd, data + done, size - done, (off_t) done);
        if (n < 0 && errno == EINTR) {
            continue;
        }
        if (n <= 0) {
            fuzz_die("pwrite");
        }
        done += (size_t) n;
    }
    return fuzz_path;
}

// an error message the reader filled: non-empty and terminated within its buffer
static inline void fuzz_check_err(const char * err, size_t errlen) {
    if (memchr(err, '\0', errlen) == NULL || err[0] == '\0') {
        fprintf(stderr, "fuzz harness: a refusal without a terminated message\n");
        abort();
    }
}

#define FUZZ_ASSERT(cond)                                                              \
    do {                                                                               \
        if (!(cond)) {                                                                 \
            fprintf(stderr, "fuzz harness: %s:%d: %s does not hold\n", __FILE__, __LINE__, #cond); \
            abort();                                                                   \
        }                                                                              \
    } while (0)
