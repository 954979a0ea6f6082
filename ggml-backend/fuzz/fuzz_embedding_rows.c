// Fuzz target: the token-embedding reader of a model under a memory budget (embedding_rows.c). An input
// is a model file followed by row ids and a last byte: its low 4 bits say how many little-endian int32
// ids precede it, the bytes before those are the file. pi2_embedding_open reads the file's header; an
// embedding it opens must lie within the file. The upload check (pi2_embedding_check_upload) is fed the
// file's own table in two parts, with its last byte changed if bit 4 of the last byte is set, only the
// first part if bit 5 is, and must accept exactly the whole unchanged table; then a part outside the
// table. pi2_embedding_rows reads the ids' rows and must refuse exactly the ids outside the table, F32
// rows coming back as the file holds them; with bit 6 the file shrinks by a byte after the open, and
// every read must be refused. (pi2_exec_embedding_rows, the graph node around pi2_embedding_rows, needs
// a backend context and a binding, and is not fuzzed.)
#include <stdbool.h>
#include <stdint.h>

#include "flash/embedding_rows.h"
#include "fuzz_common.h"

#define FUZZ_DST_MAX (64u << 20) // bytes of output rows at most

int LLVMFuzzerInitialize(int * argc, char *** argv) {
    (void) argc;
    (void) argv;
    fuzz_init();
    return 0;
}

static void fuzz_rows(const struct pi2_embedding * e, const uint8_t * file, const int32_t * ids, int64_t n) {
    const size_t dst_stride = (size_t) e->n_embd * sizeof(float);
    if (n == 0 || (dst_stride > 0 && (size_t) n > FUZZ_DST_MAX / dst_stride)) {
        return;
    }
    float * dst = malloc(dst_stride * (size_t) n + 1);
    void * scratch = malloc(e->row_size + 1);
    FUZZ_ASSERT(dst != NULL && scratch != NULL);
    bool in_range = true;
    for (int64_t k = 0; k < n; ++k) {
        in_range = in_range && ids[k] >= 0 && ids[k] < e->n_rows;
    }
    char err[512];
    const int rc = pi2_embedding_rows(e, ids, sizeof(int32_t), n, dst, dst_stride, scratch, err, sizeof(err));
    FUZZ_ASSERT(rc == (in_range ? 0 : -1));
    if (rc != 0) {
        fuzz_check_err(err, sizeof(err));
    } else if (e->type == GGML_TYPE_F32) {
        for (int64_t k = 0; k < n; ++k) {
            FUZZ_ASSERT(memcmp((const char *) dst + (size_t) k * dst_stride, file + e->offset + (uint64_t) ids[k] * e->row_size,
                               e->row_size) == 0);
        }
    }
    free(scratch);
    free(dst);
}

int LLVMFuzzerTestOneInput(const uint8_t * data, size_t size) {
    if (size == 0) {
        return 0;
    }
    const uint8_t flags = data[size - 1];
    int64_t n = flags % 16;
    if ((size_t) n * 4 > size - 1) {
        n = 0;
    }
    const size_t file_size = size - 1 - (size_t) n * 4;
    int32_t ids[16];
    memcpy(ids, data + file_size, (size_t) n * 4);

    const char * path = fuzz_file(data, file_size);
    char err[512];
    struct pi2_embedding * e = NULL;
    const int rc = pi2_embedding_open(path, &e, err, sizeof(err));
    FUZZ_ASSERT(rc >= -1 && rc <= 1 && (rc == 1) == (e != NULL));
    if (rc < 0) {
        fuzz_check_err(err, sizeof(err));
    }
    if (rc != 1) {
        return 0;
    }
    FUZZ_ASSERT(e->n_embd >= 0 && e->n_rows >= 0 && e->file_size == file_size);
    const uint64_t table = e->row_size * (uint64_t) e->n_rows;
    FUZZ_ASSERT(e->offset <= file_size && table <= file_size - e->offset);

    struct ggml_tensor t = { .type = e->type, .ne = { e->n_embd, e->n_rows, 1, 1 } };
    snprintf(t.name, sizeof(t.name), "%s", PI2_EMBD_NAME);
    FUZZ_ASSERT(pi2_embedding_matches(e, &t));

    // llama's upload, in two parts, of the bytes the file holds (the last one changed with bit 4)
    const bool change = (flags & 0x10) && table > 0, partial = (flags & 0x20) && table > 0;
    uint8_t * upload = malloc((size_t) table + 1);
    FUZZ_ASSERT(upload != NULL);
    memcpy(upload, data + e->offset, (size_t) table);
    if (change) {
        upload[table - 1] ^= 0x5a;
    }
    const size_t half = (size_t) (table / 2);
    pi2_embedding_check_upload(e, upload, 0, half);
    if (!partial) {
        pi2_embedding_check_upload(e, upload + half, half, (size_t) table - half);
    }
    free(upload);
    FUZZ_ASSERT(pi2_embedding_verified(e) == (!change && !partial));
    if (change || partial) {
        FUZZ_ASSERT(e->error[0] != '\0' && memchr(e->error, '\0', sizeof(e->error)) != NULL);
    }

    if (flags & 0x40) { // the file changes under the reader: every read is refused
        if (ftruncate(fuzz_fd, (off_t) file_size - (file_size > 0)) != 0 || file_size == 0) {
            pi2_embedding_free(e);
            return 0;
        }
        float row[1];
        uint8_t scratch[1];
        const int32_t id = 0;
        FUZZ_ASSERT(pi2_embedding_rows(e, &id, sizeof(id), 0, row, sizeof(row), scratch, err, sizeof(err)) == -1);
        fuzz_check_err(err, sizeof(err));
        pi2_embedding_free(e);
        return 0;
    }
    fuzz_rows(e, data, ids, n);

    // an upload past the table's end is refused
    pi2_embedding_check_upload(e, data, (size_t) table, 1);
    FUZZ_ASSERT(!pi2_embedding_verified(e) && e->error[0] != '\0');
    pi2_embedding_free(e);
    return 0;
}
