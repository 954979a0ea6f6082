#define _DEFAULT_SOURCE // fdopen, dup
#include "model/gguf_file.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "flash/bundle_io.h"

int pi2_gguf_vfail(char * err, size_t errlen, const char * what, const char * path, const char * fmt, va_list ap) {
    if (err == NULL || errlen == 0) {
        return -1;
    }
    const int n = snprintf(err, errlen, "%s %s: ", what, path);
    if (n >= 0 && (size_t) n < errlen) {
        vsnprintf(err + n, errlen - (size_t) n, fmt, ap);
    }
    return -1;
}

int pi2_gguf_fail(char * err, size_t errlen, const char * what, const char * path, const char * fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    pi2_gguf_vfail(err, errlen, what, path, fmt, ap);
    va_end(ap);
    return -1;
}

// every tensor within the file
static int pi2_check_extents(const struct pi2_gguf_file * f, const char * what, const char * path, char * err, size_t errlen) {
    const uint64_t data = gguf_get_data_offset(f->gguf);
    const int64_t  n    = gguf_get_n_tensors(f->gguf);
    for (int64_t i = 0; i < n; ++i) {
        const uint64_t off  = data + gguf_get_tensor_offset(f->gguf, i);
        const uint64_t size = gguf_get_tensor_size(f->gguf, i);
        if (off < data || off > f->file_size || size > f->file_size - off) {
            return pi2_gguf_fail(err, errlen, what, path, "is truncated: tensor %s needs bytes up to %" PRIu64
                                 " but the file has %" PRIu64 " bytes", gguf_get_tensor_name(f->gguf, i), off + size, f->file_size);
        }
    }
    return 0;
}

int pi2_gguf_file_open(struct pi2_gguf_file * f, const char * what, const char * path, bool with_meta, char * err,
                       size_t errlen) {
    *f = (struct pi2_gguf_file) { .fd = -1 };
    f->fd = open(path, O_RDONLY | O_CLOEXEC);
    if (f->fd < 0) {
        return pi2_gguf_fail(err, errlen, what, path, "cannot open: %s", strerror(errno));
    }
    struct stat st;
    if (fstat(f->fd, &st) != 0) {
        return pi2_gguf_fail(err, errlen, what, path, "cannot stat: %s", strerror(errno));
    }
    if (!S_ISREG(st.st_mode)) {
        return pi2_gguf_fail(err, errlen, what, path, "is not a regular file");
    }
    f->file_size = (uint64_t) st.st_size;

    char magic[4] = { 0 };
    const int r = f->file_size < sizeof(magic) ? PI2_READ_EOF : pi2_read_exact(f->fd, magic, sizeof(magic), 0);
    if (r != 0 && r != PI2_READ_EOF) {
        return pi2_gguf_fail(err, errlen, what, path, "cannot read the GGUF magic: %s", strerror(r));
    }
    if (r != 0 || memcmp(magic, "GGUF", sizeof(magic)) != 0) {
        return pi2_gguf_fail(err, errlen, what, path, "is not a GGUF file (it does not start with the GGUF magic; %" PRIu64
                             " bytes)", f->file_size);
    }

    // ggml's reader on the same open file (pread above left the file position at 0)
    const int fd2 = dup(f->fd);
    FILE * fp = fd2 >= 0 ? fdopen(fd2, "rb") : NULL;
    if (fp == NULL) {
        const int e = errno;
        if (fd2 >= 0) {
            close(fd2);
        }
        return pi2_gguf_fail(err, errlen, what, path, "cannot open for reading: %s", strerror(e));
    }
    struct gguf_init_params params = { /* .no_alloc = */ true, /* .ctx = */ with_meta ? &f->meta : NULL };
    f->gguf = gguf_init_from_file_ptr(fp, params);
    fclose(fp);
    if (f->gguf == NULL) {
        return pi2_gguf_fail(err, errlen, what, path, "is not a readable GGUF file: its header is corrupt or truncated (%" PRIu64
                             " bytes; ggml's GGUF reader logged the detail)", f->file_size);
    }
    return pi2_check_extents(f, what, path, err, errlen);
}

void pi2_gguf_file_close(struct pi2_gguf_file * f) {
    gguf_free(f->gguf);
    if (f->meta != NULL) {
        ggml_free(f->meta);
    }
    if (f->fd >= 0) {
        close(f->fd);
    }
    *f = (struct pi2_gguf_file) { .fd = -1 };
}
