#define _GNU_SOURCE // O_DIRECT
#include "flash/expert_file.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "core/pi2_context.h"
#include "flash/io_ring.h"
#include "model/gguf_file.h"

#define PI2_DIRECT_ALIGN 4096 // O_DIRECT's offset, length and buffer alignment (the largest logical block in use)
// Entries a dense model's streaming layers take turns in: one computing, two read ahead. With one read ahead the disk
// idled whenever the next layer landed before its turn (Qwen2.5-Coder-1.5B under 600 MB, in separate runs: 1.56 tok/s
// against 2.50, for one layer more read a token).
#define PI2_DENSE_STREAM 3

struct pi2_expert_layer {
    bool           present;
    int64_t        n_expert;
    uint64_t       off[3];    // file offset of expert 0's range of gate, up, down
    uint64_t       stride[3]; // bytes from one expert's range to the next one's
    uint64_t       len[3];    // bytes of one expert's range
    enum ggml_type type[3];
};

// one read request in flight: the span it reads part of, and which part
struct pi2_expert_req {
    uint32_t span;
    uint64_t start, len;
};

struct pi2_expert_file {
    int                       fd;        // O_DIRECT where the file system allows, else buffered
    int                       fd_plain;  // buffered, for a file system that refuses O_DIRECT reads
    uint64_t                  file_size;
    int                       n_layer;
    struct pi2_expert_layer * layer;     // [n_layer]
    uint64_t                  entry_bytes;
    uint32_t                  n_entries;
    uint8_t *                 mem;       // n_entries * entry_bytes, 4 KiB-aligned
    int32_t *                 tag_layer; // [n_entries] -1: empty
    int32_t *                 tag_expert;
    uint64_t *                last_use;  // [n_entries] tick of the last get
    // Entries are split evenly between the routed layers (entry k serves layer home[k]; all of them serve every layer
    // where there are fewer entries than routed layers): a token's experts of every layer take turns in one LRU pool,
    // which a pool smaller than a token's experts turns into a cycle where nothing is ever found (measured: 0% hits
    // with room for 49 of a token's 64 experts), while per layer the experts the next token routes to again stay.
    int32_t *                 home;      // [n_entries] the layer an entry serves, or -1: any
    // A dense model's layers (one expert each, every one used by every token): with fewer entries than layers an LRU
    // over the per-token sweep of layers never finds one (each is replaced before its turn comes again), so all but
    // PI2_DENSE_STREAM entries are each pinned to a layer, spread over the model, and the other layers stream through
    // those left, the next ones read while this one computes (pi2_expert_file_ahead).
    bool                      dense;
    int32_t *                 streamed_next; // [n_layer] dense: the next layer (wrapping) with no entry of its own, or -1
    uint8_t *                 ahead;     // [n_entries] read ahead: its miss was counted, its first want is no hit

    int32_t **                where;     // [n_layer][n_expert] entry holding the expert, or -1
    uint64_t                  tick;
    // batch reads: entries pinned for the batch (pin == epoch), and per span (entry * 3 + m) where its bytes come
    // from, how many of them must arrive, and whether a queued read of it failed (read again, synchronously, when
    // got). Entries queued for reading wait in want order in `fifo`; their spans go to the disk in requests of at
    // most chunk_max bytes, all at once as far as the ring takes them: only the computing thread takes completions
    // and submits, so a limit on the bytes in flight (as the bundles' I/O threads keep) leaves the disk with one
    // request while an expert computes (q3m: 6.7-7.6 tok/s with 2 MiB in flight, 9.5-11.0 without).
    struct pi2_ring *         ring;      // NULL: every read is synchronous
    uint32_t                  epoch;
    uint32_t *                pin;
    uint64_t *                span_lo, * span_n, * span_need; // [n_entries * 3]
    int8_t *                  span_bad;
    uint64_t *                unissued;  // [n_entries] bytes of the entry's spans not yet requested
    uint32_t *                pending;   // [n_entries] its requests in flight
    int32_t *                 fifo;      // [n_entries] ring buffer of entries with bytes unissued
    uint32_t                  fifo_head, fifo_n;
    uint64_t                  chunk_max;
    struct pi2_expert_req *   req;       // [depth] requests in flight by tag; free ones are listed in req_free
    uint32_t *                req_free;
    uint32_t                  n_req_free, depth;
    struct iovec *            iov;       // [depth] the iovecs of the requests queued and not yet submitted
    uint32_t                  in_flight, queued;
};

static uint64_t pi2_span(uint64_t off, uint64_t len) {
    const uint64_t lo = off / PI2_DIRECT_ALIGN * PI2_DIRECT_ALIGN;
    return (off + len + PI2_DIRECT_ALIGN - 1) / PI2_DIRECT_ALIGN * PI2_DIRECT_ALIGN - lo;
}

// the three ranges of layer il's experts (split gate/up/down, or ffn_gate_up_exps' halves and down), or with `dense`
// of its dense FFN as one expert (ffn_gate/up/down, or phi3's fused ffn_up's halves and down); 0 when the layer has
// none, 1 when it has, -1 with err
static int pi2_find_layer(const struct pi2_gguf_file * f, const char * path, int il, bool dense, struct pi2_expert_layer * L,
                          char * err, size_t errlen) {
    static const char * const names_exps[3]  = { "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps" };
    static const char * const names_dense[3] = { "ffn_gate", "ffn_up", "ffn_down" };
    const char * const * names = dense ? names_dense : names_exps;
    char name[GGML_MAX_NAME];
    const struct ggml_tensor * t[3] = { NULL, NULL, NULL };
    int64_t id[3] = { -1, -1, -1 };
    for (int m = 0; m < 3; ++m) {
        snprintf(name, sizeof(name), "blk.%d.%s.weight", il, names[m]);
        id[m] = gguf_find_tensor(f->gguf, name);
        t[m] = id[m] >= 0 ? ggml_get_tensor(f->meta, name) : NULL;
    }
    int64_t fused_id = -1;
    const struct ggml_tensor * fused = NULL;
    if (dense && t[0] == NULL && t[1] != NULL && t[2] != NULL && t[1]->ne[1] == 2 * t[2]->ne[0]) {
        fused_id = id[1]; // phi3: gate rows, then up rows, in one ffn_up
        fused    = t[1];
        t[1]     = NULL;
        snprintf(name, sizeof(name), "blk.%d.ffn_up.weight", il);
    } else if (!dense) {
        snprintf(name, sizeof(name), "blk.%d.ffn_gate_up_exps.weight", il);
        fused_id = gguf_find_tensor(f->gguf, name);
        fused = fused_id >= 0 ? ggml_get_tensor(f->meta, name) : NULL;
    }
    if (t[2] == NULL) {
        return 0;
    }
    const uint64_t data = gguf_get_data_offset(f->gguf);
    *L = (struct pi2_expert_layer) { .present = true, .n_expert = t[2]->ne[2] };
    if (fused != NULL && t[0] == NULL && t[1] == NULL) {
        if (fused->ne[1] % 2 != 0 || fused->ne[2] != t[2]->ne[2] || !ggml_is_contiguous(fused)) {
            return pi2_gguf_fail(err, errlen, "model file", path, "%s is not [n_embd, 2 n_ff, n_expert]", name);
        }
        const uint64_t half = (uint64_t) (fused->ne[1] / 2) * fused->nb[1];
        for (int m = 0; m < 2; ++m) {
            L->off[m]    = data + gguf_get_tensor_offset(f->gguf, fused_id) + (uint64_t) m * half;
            L->stride[m] = fused->nb[2];
            L->len[m]    = half;
            L->type[m]   = fused->type;
        }
    } else {
        for (int m = 0; m < 2; ++m) {
            if (t[m] == NULL) {
                return pi2_gguf_fail(err, errlen, "model file", path, "blk.%d has %s but no %s", il, names[2], names[m]);
            }
        }
    }
    for (int m = 0; m < 3; ++m) {
        if (t[m] == NULL) {
            continue; // the fused halves, set above
        }
        if (!ggml_is_contiguous(t[m]) || t[m]->ne[2] != L->n_expert || t[m]->ne[3] != 1) {
            return pi2_gguf_fail(err, errlen, "model file", path, "blk.%d.%s is not one contiguous matrix %s", il, names[m],
                                 dense ? "(2-D)" : "per expert");
        }
        L->off[m]    = data + gguf_get_tensor_offset(f->gguf, id[m]);
        L->stride[m] = t[m]->nb[2];
        L->len[m]    = t[m]->nb[2];
        L->type[m]   = t[m]->type;
    }
    for (int m = 0; m < 3; ++m) {
        const uint64_t end = L->off[m] + (uint64_t) (L->n_expert - 1) * L->stride[m] + L->len[m];
        if (end > f->file_size) {
            return pi2_gguf_fail(err, errlen, "model file", path, "is truncated: blk.%d.%s ends past its %" PRIu64 " bytes", il,
                                 names[m], f->file_size);
        }
    }
    return 1;
}

// where matrix m of expert e lies in the file, and the 4 KiB-aligned span an O_DIRECT read of it covers
struct pi2_expert_span {
    uint64_t off, lo, n, need; // the matrix's offset; the span's start and length; bytes of it that must arrive
};

static struct pi2_expert_span pi2_expert_span_of(const struct pi2_expert_layer * L, int64_t e, int m) {
    const uint64_t off = L->off[m] + (uint64_t) e * L->stride[m];
    const uint64_t lo  = off / PI2_DIRECT_ALIGN * PI2_DIRECT_ALIGN;
    return (struct pi2_expert_span) { .off = off, .lo = lo, .n = pi2_span(off, L->len[m]), .need = off + L->len[m] - lo };
}

static uint64_t pi2_layer_entry_bytes(const struct pi2_expert_layer * L) {
    uint64_t worst = 0;
    for (int64_t e = 0; e < L->n_expert; ++e) { // the slack depends on where each expert's ranges start
        uint64_t b = 0;
        for (int m = 0; m < 3; ++m) {
            b += pi2_expert_span_of(L, e, m).n;
        }
        worst = b > worst ? b : worst;
    }
    return worst;
}

// the layers of the model file at path (f open with meta); -1 with err
static int pi2_scan(struct pi2_gguf_file * g, const char * path, bool dense, struct pi2_expert_layer ** out, int * n_layer,
                    uint64_t * entry, char * err, size_t errlen) {
    int n = 0;
    for (;; ++n) { // blk.N tensors run from 0 without gaps
        char name[GGML_MAX_NAME];
        snprintf(name, sizeof(name), "blk.%d.attn_norm.weight", n);
        if (gguf_find_tensor(g->gguf, name) < 0) {
            snprintf(name, sizeof(name), "blk.%d.ffn_down_exps.weight", n);
            if (gguf_find_tensor(g->gguf, name) < 0) {
                break;
            }
        }
    }
    struct pi2_expert_layer * L = calloc(n > 0 ? (size_t) n : 1, sizeof(*L));
    if (L == NULL) {
        return pi2_gguf_fail(err, errlen, "model file", path, "out of memory");
    }
    uint64_t worst = 0;
    int found = 0;
    for (int il = 0; il < n; ++il) {
        const int rc = pi2_find_layer(g, path, il, dense, &L[il], err, errlen);
        if (rc < 0) {
            free(L);
            return -1;
        }
        found += rc;
        if (rc > 0) {
            const uint64_t b = pi2_layer_entry_bytes(&L[il]);
            worst = b > worst ? b : worst;
        }
    }
    if (found == 0) {
        free(L);
        return pi2_gguf_fail(err, errlen, "model file", path, dense ? "has no dense FFN (blk.N.ffn_down.weight) to read whole"
                                                                     : "has no routed experts (blk.N.ffn_down_exps.weight) to read whole");
    }
    *out = L;
    *n_layer = n;
    *entry = worst;
    return 0;
}

// pi2_scan of the model file at path, opened and closed here (*L: NULL on failure); -1 with err
static int pi2_scan_path(const char * path, bool dense, struct pi2_expert_layer ** L, int * n, uint64_t * entry, char * err,
                         size_t errlen) {
    struct pi2_gguf_file g;
    *L = NULL;
    const int rc = pi2_gguf_file_open(&g, "model file", path, true, err, errlen) == 0
                 ? pi2_scan(&g, path, dense, L, n, entry, err, errlen) : -1;
    pi2_gguf_file_close(&g);
    return rc;
}

int pi2_expert_file_layers(const char * model_path, bool dense, struct pi2_expert_file_layer * out, int cap, char * err,
                           size_t errlen) {
    struct pi2_expert_layer * L = NULL;
    int n = 0;
    uint64_t entry = 0;
    if (pi2_scan_path(model_path, dense, &L, &n, &entry, err, errlen) != 0) {
        return -1;
    }
    for (int il = 0; il < n && il < cap; ++il) {
        out[il] = (struct pi2_expert_file_layer) { .present = L[il].present };
        if (L[il].present) {
            out[il].bytes = pi2_layer_entry_bytes(&L[il]);
            for (int m = 0; m < 3; ++m) {
                out[il].type[m] = L[il].type[m];
            }
        }
    }
    free(L);
    return n;
}

uint64_t pi2_expert_file_entry_bytes(const char * model_path, bool dense, char * err, size_t errlen) {
    struct pi2_expert_layer * L = NULL;
    int n = 0;
    uint64_t entry = 0;
    const int rc = pi2_scan_path(model_path, dense, &L, &n, &entry, err, errlen);
    free(L);
    return rc == 0 ? entry : 0;
}

void pi2_expert_file_free(struct pi2_expert_file * f) {
    if (f == NULL) {
        return;
    }
    if (f->fd >= 0) {
        close(f->fd);
    }
    if (f->fd_plain >= 0) {
        close(f->fd_plain);
    }
    for (int il = 0; f->where != NULL && il < f->n_layer; ++il) {
        free(f->where[il]);
    }
    free(f->where);
    free(f->layer);
    free(f->mem);
    free(f->tag_layer);
    free(f->tag_expert);
    free(f->last_use);
    free(f->home);
    free(f->streamed_next);
    free(f->ahead);
    free(f->pin);
    free(f->span_lo);
    free(f->span_n);
    free(f->span_need);
    free(f->span_bad);
    free(f->unissued);
    free(f->pending);
    free(f->fifo);
    free(f->req);
    free(f->req_free);
    free(f->iov);
    if (f->ring != NULL) {
        pi2_ring_close(f->ring);
    }
    free(f);
}

static struct pi2_expert_file * pi2_open(const char * model_path, bool dense, const uint8_t * only, int n_only, uint64_t bytes,
                                         uint64_t chunk_max, char * err, size_t errlen);

struct pi2_expert_file * pi2_expert_file_open(const char * model_path, bool dense, uint64_t bytes, uint64_t chunk_max,
                                               char * err, size_t errlen) {
    return pi2_open(model_path, dense, NULL, 0, bytes, chunk_max, err, errlen);
}

struct pi2_expert_file * pi2_expert_file_open_layers(const char * model_path, const uint8_t * only, int n_only, uint64_t bytes,
                                                      uint64_t chunk_max, char * err, size_t errlen) {
    return pi2_open(model_path, true, only, n_only, bytes, chunk_max, err, errlen);
}

static struct pi2_expert_file * pi2_open(const char * model_path, bool dense, const uint8_t * only, int n_only, uint64_t bytes,
                                         uint64_t chunk_max, char * err, size_t errlen) {
    struct pi2_expert_file * f = calloc(1, sizeof(*f));
    if (f == NULL) {
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    f->fd = f->fd_plain = -1;
    struct pi2_gguf_file g;
    const int rc = pi2_gguf_file_open(&g, "model file", model_path, true, err, errlen) == 0
                 ? pi2_scan(&g, model_path, dense, &f->layer, &f->n_layer, &f->entry_bytes, err, errlen) : -1;
    f->file_size = g.file_size;
    pi2_gguf_file_close(&g);
    if (rc != 0) {
        pi2_expert_file_free(f);
        return NULL;
    }
    if (only != NULL) { // the layers kept: the others absent, and an entry the largest of those kept
        f->entry_bytes = 0;
        for (int il = 0; il < f->n_layer; ++il) {
            f->layer[il].present = f->layer[il].present && il < n_only && only[il] != 0;
            const uint64_t b = f->layer[il].present ? pi2_layer_entry_bytes(&f->layer[il]) : 0;
            f->entry_bytes = b > f->entry_bytes ? b : f->entry_bytes;
        }
        if (f->entry_bytes == 0) {
            pi2_gguf_fail(err, errlen, "model file", model_path, "has none of the dense FFN layers asked for");
            pi2_expert_file_free(f);
            return NULL;
        }
    }
    if (bytes < f->entry_bytes) {
        pi2_gguf_fail(err, errlen, "model file", model_path, "an expert cache of %" PRIu64 " bytes cannot hold one expert (%" PRIu64
                      " bytes)", bytes, f->entry_bytes);
        pi2_expert_file_free(f);
        return NULL;
    }
    const uint64_t n = bytes / f->entry_bytes;
    f->n_entries = n > UINT32_MAX ? UINT32_MAX : (uint32_t) n;
    f->fd_plain = open(model_path, O_RDONLY | O_CLOEXEC);
#if defined(O_DIRECT)
    f->fd = open(model_path, O_RDONLY | O_CLOEXEC | O_DIRECT);
#endif
    if (f->fd < 0) {
        f->fd = f->fd_plain >= 0 ? dup(f->fd_plain) : -1;
    }
    void * mem = NULL;
    f->tag_layer  = malloc(sizeof(int32_t) * f->n_entries);
    f->tag_expert = malloc(sizeof(int32_t) * f->n_entries);
    f->last_use   = calloc(f->n_entries, sizeof(uint64_t));
    f->where      = calloc((size_t) f->n_layer, sizeof(int32_t *));
    f->pin        = calloc(f->n_entries, sizeof(uint32_t));
    f->home       = malloc(sizeof(int32_t) * f->n_entries);
    f->dense      = dense;
    f->streamed_next = malloc(sizeof(int32_t) * (size_t) (f->n_layer > 0 ? f->n_layer : 1));
    f->ahead      = calloc(f->n_entries, 1);
    f->span_lo    = calloc((size_t) f->n_entries * 3, sizeof(uint64_t));
    f->span_n     = calloc((size_t) f->n_entries * 3, sizeof(uint64_t));
    f->span_need  = calloc((size_t) f->n_entries * 3, sizeof(uint64_t));
    f->span_bad   = calloc((size_t) f->n_entries * 3, sizeof(int8_t));
    f->unissued   = calloc(f->n_entries, sizeof(uint64_t));
    f->pending    = calloc(f->n_entries, sizeof(uint32_t));
    f->fifo       = calloc(f->n_entries, sizeof(int32_t));
    // requests of whole 4 KiB blocks; the ring holds every entry's requests, up to 1024
    f->chunk_max  = chunk_max < PI2_DIRECT_ALIGN ? PI2_DIRECT_ALIGN : chunk_max / PI2_DIRECT_ALIGN * PI2_DIRECT_ALIGN;
    const uint64_t all = (uint64_t) f->n_entries * (f->entry_bytes / f->chunk_max + 3); // an entry's requests at most
    f->depth      = (uint32_t) (all < 1024 ? all : 1024);
    f->req        = calloc(f->depth, sizeof(struct pi2_expert_req));
    f->req_free   = calloc(f->depth, sizeof(uint32_t));
    f->iov        = calloc(f->depth, sizeof(struct iovec));
    if (f->fd_plain < 0 || f->fd < 0) {
        pi2_gguf_fail(err, errlen, "model file", model_path, "cannot open: %s", strerror(errno));
        pi2_expert_file_free(f);
        return NULL;
    }
    if (posix_memalign(&mem, PI2_DIRECT_ALIGN, (size_t) f->n_entries * f->entry_bytes) != 0 || f->tag_layer == NULL ||
        f->tag_expert == NULL || f->last_use == NULL || f->where == NULL || f->pin == NULL || f->home == NULL ||
        f->streamed_next == NULL || f->ahead == NULL ||
        f->span_lo == NULL || f->span_n == NULL || f->span_need == NULL || f->span_bad == NULL || f->unissued == NULL ||
        f->pending == NULL || f->fifo == NULL || f->req == NULL || f->req_free == NULL || f->iov == NULL) {
        free(mem);
        snprintf(err, errlen, "out of memory for an expert cache of %" PRIu32 " entries", f->n_entries);
        pi2_expert_file_free(f);
        return NULL;
    }
    f->mem = mem;
    int n_routed = 0;
    for (int il = 0; il < f->n_layer; ++il) {
        n_routed += f->layer[il].present;
    }
    // a dense model with fewer entries than layers: all but PI2_DENSE_STREAM entries (two where the cache is that
    // small) pinned to layers spread over the model
    const uint32_t n_stream = f->n_entries > PI2_DENSE_STREAM ? PI2_DENSE_STREAM : 2;
    const uint32_t pinned = dense && f->n_entries < (uint32_t) n_routed && f->n_entries > n_stream ? f->n_entries - n_stream : 0;
    for (uint32_t k = 0; k < f->n_entries; ++k) {
        f->tag_layer[k] = f->tag_expert[k] = -1;
        f->home[k] = -1;
        int ri = -1; // the routed layer (counting present layers only) entry k serves
        if (pinned > 0) {
            ri = k < pinned ? (int) ((uint64_t) k * (uint64_t) n_routed / pinned) : -1;
        } else if (f->n_entries >= (uint32_t) n_routed) { // as the entries divide evenly
            ri = (int) ((uint64_t) k * (uint64_t) n_routed / f->n_entries);
        }
        for (int il = 0; ri >= 0 && il < f->n_layer; ++il) {
            if (f->layer[il].present && ri-- == 0) {
                f->home[k] = il;
                break;
            }
        }
    }
    for (int il = 0; il < f->n_layer; ++il) {
        f->streamed_next[il] = -1;
        for (int d = 1; dense && d <= f->n_layer; ++d) {
            const int j = (il + d) % f->n_layer;
            bool own = false;
            for (uint32_t k = 0; k < f->n_entries && !own; ++k) {
                own = f->home[k] == j;
            }
            if (f->layer[j].present && !own) {
                f->streamed_next[il] = j;
                break;
            }
        }
    }
    for (int il = 0; il < f->n_layer; ++il) {
        if (!f->layer[il].present) {
            continue;
        }
        f->where[il] = malloc(sizeof(int32_t) * (size_t) f->layer[il].n_expert);
        if (f->where[il] == NULL) {
            snprintf(err, errlen, "out of memory");
            pi2_expert_file_free(f);
            return NULL;
        }
        memset(f->where[il], 0xff, sizeof(int32_t) * (size_t) f->layer[il].n_expert);
    }
    char why[256];
    for (uint32_t j = 0; j < f->depth; ++j) {
        f->req_free[f->n_req_free++] = f->depth - 1 - j;
    }
    if (pi2_ring_open(&f->ring, f->depth, why, sizeof(why)) != 0) {
        f->ring = NULL; // reads are synchronous: slower, never wrong
    }
    return f;
}

void pi2_expert_read_count(struct pi2_counters * c, int layer, const struct pi2_expert_read_stats * st) {
    struct pi2_layer_counters * L = &c->layer[layer];
    pi2_count_layer_seen(c, layer);
    pi2_count(&L->misses, st->misses);
    pi2_count(&L->cold_hits, st->hits);
    pi2_count(&L->bytes_read, st->bytes_read);
    pi2_count(&L->io_requests, st->requests);
    pi2_count(&L->io_wait_ns, st->wait_ns);
}

bool pi2_expert_file_ring(const struct pi2_expert_file * f) {
    return f->ring != NULL;
}

bool pi2_expert_matrices_match(const struct pi2_expert_matrices * em, const struct ggml_tensor * const w[3],
                               const char * model_path, int layer, bool experts, char * err, size_t errlen) {
    const char * is = experts ? "are" : "is";
    for (int m = 0; m < 3; ++m) {
        if (em->type[m] != w[m]->type) {
            snprintf(err, errlen, "model file %s: layer %d's %s %s %s where the loaded model's %s %s", model_path, layer,
                     experts ? "experts" : "FFN", is, ggml_type_name(em->type[m]), is, ggml_type_name(w[m]->type));
            return false;
        }
    }
    return true;
}

uint32_t pi2_expert_file_entries(const struct pi2_expert_file * f) {
    return f->n_entries;
}

uint64_t pi2_expert_file_bytes(const struct pi2_expert_file * f) {
    return (uint64_t) f->n_entries * f->entry_bytes;
}

// n bytes (a multiple of the alignment) at off into dst, at least `need` of them; 0, or an errno (EIO: the file ends first)
static int pi2_read_span(struct pi2_expert_file * f, uint8_t * dst, uint64_t n, uint64_t off, uint64_t need) {
    uint64_t got = 0;
    int fd = f->fd;
    while (got < need) {
        const ssize_t r = pread(fd, dst + got, (size_t) (n - got), (off_t) (off + got));
        if (r < 0 && errno == EINTR) {
            continue;
        }
        if (r < 0 && errno == EINVAL && fd != f->fd_plain) { // a file system without O_DIRECT: buffered from now on
            close(f->fd);
            f->fd = dup(f->fd_plain);
            fd = f->fd >= 0 ? f->fd : f->fd_plain;
            continue;
        }
        if (r < 0) {
            return errno;
        }
        if (r == 0) {
            return EIO;
        }
        got += (uint64_t) r;
    }
    return 0;
}

static uint64_t pi2_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t) ts.tv_sec * 1000000000ull + (uint64_t) ts.tv_nsec;
}

static bool pi2_expert_valid(const struct pi2_expert_file * f, int layer, int32_t e) {
    return layer >= 0 && layer < f->n_layer && f->layer[layer].present && e >= 0 && e < f->layer[layer].n_expert;
}

// the least recently used entry serving the layer, neither pinned for this batch nor being read (an empty one first);
// one read ahead and not yet used only with take_ahead, where no other is free; -1: none
static int32_t pi2_expert_free_entry(const struct pi2_expert_file * f, int layer, bool take_ahead) {
    int32_t k = -1;
    for (int pass = 0; pass < (take_ahead ? 2 : 1) && k < 0; ++pass) {
        for (uint32_t j = 0; j < f->n_entries; ++j) {
            if ((f->home[j] < 0 || f->home[j] == layer) && f->pin[j] != f->epoch && f->pending[j] == 0 &&
                f->unissued[j] == 0 && (pass == 1 || !f->ahead[j]) &&
                (k < 0 || f->last_use[j] < f->last_use[k])) {
                k = (int32_t) j;
            }
        }
    }
    return k;
}

// that entry (read-ahead ones last), emptied
static int32_t pi2_expert_victim(struct pi2_expert_file * f, int layer) {
    const int32_t k = pi2_expert_free_entry(f, layer, true);
    if (k >= 0 && f->tag_layer[k] >= 0) {
        f->where[f->tag_layer[k]][f->tag_expert[k]] = -1;
    }
    if (k >= 0) {
        f->tag_layer[k] = f->tag_expert[k] = -1;
        f->ahead[k] = 0;
    }
    return k;
}

void pi2_expert_file_done(struct pi2_expert_file * f, int layer, int32_t e) {
    const int32_t k = pi2_expert_valid(f, layer, e) ? f->where[layer][e] : -1;
    if (k >= 0 && f->pin[k] == f->epoch) {
        f->pin[k] = 0;
    }
}

static bool pi2_expert_take(struct pi2_expert_file * f, bool wait, struct pi2_expert_read_stats * st);

// queues the reads of expert e of the layer (not cached) into a free entry, behind the entries queued before;
// false when none is free
static bool pi2_expert_queue(struct pi2_expert_file * f, int layer, int32_t e, struct pi2_expert_read_stats * st) {
    const int32_t k = pi2_expert_victim(f, layer);
    if (k < 0) {
        return false;
    }
    st->misses++;
    const struct pi2_expert_layer * L = &f->layer[layer];
    f->unissued[k] = 0;
    for (int m = 0; m < 3; ++m) {
        const size_t s = (size_t) k * 3 + (size_t) m;
        const struct pi2_expert_span sp = pi2_expert_span_of(L, e, m);
        f->span_lo[s]   = sp.lo;
        f->span_n[s]    = sp.n;
        f->span_need[s] = sp.need;
        f->span_bad[s]  = 0;
        f->unissued[k] += sp.n;
        st->bytes_read += sp.n;
    }
    f->fifo[(f->fifo_head + f->fifo_n++) % f->n_entries] = k;
    f->tag_layer[k] = layer;
    f->tag_expert[k] = e;
    f->where[layer][e] = k;
    f->pin[k] = f->epoch;
    f->last_use[k] = ++f->tick;
    return true;
}

// the spans of entry k not yet requested are read when got (the ring cannot take them)
static void pi2_expert_unqueue(struct pi2_expert_file * f, int32_t k) {
    uint64_t left = f->unissued[k];
    for (int m = 2; m >= 0 && left > 0; --m) { // the unissued bytes are the spans' last ones
        const size_t s = (size_t) k * 3 + (size_t) m;
        f->span_bad[s] = 1;
        left -= left < f->span_n[s] ? left : f->span_n[s];
    }
    f->unissued[k] = 0;
}

// Requests the queued entries' next spans, in order, while the ring has room, and submits them; a ring that fails
// leaves every entry still queued to be read when got.
static void pi2_expert_pump(struct pi2_expert_file * f, struct pi2_expert_read_stats * st) {
    while (f->ring != NULL && f->fifo_n > 0 && f->n_req_free > 0 && f->queued < f->depth) {
        const int32_t k = f->fifo[f->fifo_head];
        if (f->unissued[k] == 0) {
            f->fifo_head = (f->fifo_head + 1) % f->n_entries;
            f->fifo_n--;
            continue;
        }
        // the span and the place in it where the unissued bytes start
        const size_t s0 = (size_t) k * 3;
        uint64_t at = 0, total = f->span_n[s0] + f->span_n[s0 + 1] + f->span_n[s0 + 2];
        uint64_t pos = total - f->unissued[k];
        int m = 0;
        while (pos >= f->span_n[s0 + (size_t) m]) {
            pos -= f->span_n[s0 + (size_t) m];
            at += f->span_n[s0 + (size_t) m];
            m++;
        }
        const size_t s = s0 + (size_t) m;
        const uint64_t len = f->span_n[s] - pos < f->chunk_max ? f->span_n[s] - pos : f->chunk_max;
        const uint32_t slot = f->req_free[f->n_req_free - 1];
        f->iov[f->queued] = (struct iovec) { .iov_base = f->mem + (size_t) k * f->entry_bytes + at + pos, .iov_len = (size_t) len };
        if (!pi2_ring_readv(f->ring, f->fd, &f->iov[f->queued], 1, f->span_lo[s] + pos, slot)) {
            break; // the ring is full: more after completions
        }
        f->n_req_free--;
        f->req[slot] = (struct pi2_expert_req) { .span = (uint32_t) s, .start = pos, .len = len };
        f->queued++;
        f->pending[k]++;
        f->unissued[k] -= len;
        st->requests++;
    }
    if (f->queued == 0) {
        return;
    }
    if (pi2_ring_enter(f->ring, true, 0) == 0) {
        f->in_flight += f->queued;
        f->queued = 0;
        return;
    }
    // the kernel took none of them (it fails a call only then): from now on every read is synchronous. The reads
    // in flight land first (they write into entries), then every entry not fully read is read again when got.
    f->queued = 0;
    while (f->in_flight > 0 && pi2_expert_take(f, true, NULL)) {
    }
    pi2_ring_close(f->ring);
    f->ring = NULL;
    for (uint32_t k = 0; k < f->n_entries; ++k) {
        if (f->pending[k] > 0 || f->unissued[k] > 0) {
            f->span_bad[(size_t) k * 3] = f->span_bad[(size_t) k * 3 + 1] = f->span_bad[(size_t) k * 3 + 2] = 1;
        }
        f->pending[k] = 0;
        f->unissued[k] = 0;
    }
    f->fifo_n = 0;
    f->in_flight = 0;
}

// Takes one completion if any arrived (wait: waits for one), then requests more (st NULL: not); false when none was
// taken.
static bool pi2_expert_take(struct pi2_expert_file * f, bool wait, struct pi2_expert_read_stats * st) {
    uint64_t user = 0;
    int32_t  res  = 0;
    if (f->ring == NULL || f->in_flight == 0) {
        return false;
    }
    while (!pi2_ring_complete(f->ring, &user, &res)) {
        if (!wait || pi2_ring_enter(f->ring, false, 1) != 0) {
            return false;
        }
    }
    if (user < f->depth) {
        const struct pi2_expert_req q = f->req[user];
        const uint32_t k = q.span / 3;
        f->req_free[f->n_req_free++] = (uint32_t) user;
        f->in_flight--;
        if (f->pending[k] > 0) {
            f->pending[k]--;
        }
        // the bytes of this part that must arrive: the file may end inside an aligned span
        const uint64_t need = f->span_need[q.span] > q.start ? f->span_need[q.span] - q.start : 0;
        if (res < 0 || (uint64_t) res < (need < q.len ? need : q.len)) {
            f->span_bad[q.span] = 1;
        }
    }
    if (st != NULL) {
        pi2_expert_pump(f, st);
    }
    return true;
}

// Queues, in order, the reads of the experts not done (done NULL: all) that are neither cached nor being read, while
// free entries last (the rest wait until computed experts free theirs), and submits them.
static void pi2_expert_queue_missing(struct pi2_expert_file * f, int layer, const int32_t * experts, const uint8_t * done,
                                     int n, struct pi2_expert_read_stats * st) {
    for (int i = 0; f->ring != NULL && i < n; ++i) {
        if ((done == NULL || !done[i]) && pi2_expert_valid(f, layer, experts[i]) && f->where[layer][experts[i]] < 0 &&
            !pi2_expert_queue(f, layer, experts[i], st)) {
            break;
        }
    }
    pi2_expert_pump(f, st);
}

void pi2_expert_file_want(struct pi2_expert_file * f, int layer, const int32_t * experts, int n, uint8_t * cached,
                          struct pi2_expert_read_stats * st) {
    f->epoch = f->epoch + 1 == 0 ? 1 : f->epoch + 1; // a new batch (0 is none's)
    for (int i = 0; i < n; ++i) { // the cached ones first, so that no read replaces one of them
        const int32_t k = pi2_expert_valid(f, layer, experts[i]) ? f->where[layer][experts[i]] : -1;
        cached[i] = k >= 0 && !f->ahead[k];
        if (k >= 0 && f->pin[k] != f->epoch) {
            st->hits += f->ahead[k] ? 0 : 1;
            f->pin[k] = f->epoch;
        }
        if (k >= 0) {
            f->ahead[k] = 0;
        }
    }
    pi2_expert_queue_missing(f, layer, experts, NULL, n, st);
}

void pi2_expert_file_ahead(struct pi2_expert_file * f, int layer, struct pi2_expert_read_stats * st) {
    if (!f->dense || layer < 0 || layer >= f->n_layer || f->ring == NULL) {
        return; // a routed-expert cache, or reads are synchronous
    }
    // the streaming layers after this one, as many as free entries take (one read ahead and not yet used stays)
    bool queued = false;
    for (int j = f->streamed_next[layer], n = 0; j >= 0 && j != layer && n < f->n_layer; j = f->streamed_next[j], ++n) {
        if (f->where[j][0] >= 0) {
            continue; // cached, or on its way already
        }
        if (pi2_expert_free_entry(f, j, false) < 0 || !pi2_expert_queue(f, j, 0, st)) {
            break; // no entry free but those read ahead for nearer layers
        }
        f->ahead[f->where[j][0]] = 1;
        queued = true;
    }
    if (queued) {
        pi2_expert_pump(f, st);
    }
}

bool pi2_expert_file_all_placed(const struct pi2_expert_file * f, int layer, const int32_t * experts, int n) {
    for (int i = 0; i < n; ++i) {
        if (!pi2_expert_valid(f, layer, experts[i]) || f->where[layer][experts[i]] < 0) {
            return false;
        }
    }
    return true;
}

// whether entry k's reads are all done (or failed, to be read again when got)
static bool pi2_expert_landed(const struct pi2_expert_file * f, int32_t k) {
    return f->pending[k] == 0 && f->unissued[k] == 0;
}

// waits until entry k's reads are done, taking every completion that arrives meanwhile
static void pi2_expert_wait(struct pi2_expert_file * f, int32_t k, struct pi2_expert_read_stats * st) {
    while (!pi2_expert_landed(f, k)) {
        if (f->in_flight == 0) {
            pi2_expert_pump(f, st);
        }
        if (!pi2_expert_take(f, true, st)) {
            break;
        }
    }
    if (!pi2_expert_landed(f, k)) { // nothing arrives (the ring failed): read here what is missing
        pi2_expert_unqueue(f, k);
        for (int m = 0; f->pending[k] > 0 && m < 3; ++m) {
            f->span_bad[(size_t) k * 3 + (size_t) m] = 1;
        }
        f->pending[k] = 0;
    }
}

int pi2_expert_file_next(struct pi2_expert_file * f, int layer, const int32_t * experts, const uint8_t * done, int n,
                         struct pi2_expert_read_stats * st) {
    for (;;) {
        while (pi2_expert_take(f, false, st)) {
        }
        // experts that found no free entry when wanted take those freed since (experts computed), so that their reads
        // too are queued, not made one at a time when got
        pi2_expert_queue_missing(f, layer, experts, done, n, st);
        int unqueued = -1;
        for (int i = 0; i < n; ++i) {
            if (done[i]) {
                continue;
            }
            const int32_t k = pi2_expert_valid(f, layer, experts[i]) ? f->where[layer][experts[i]] : -1;
            if (k >= 0 && pi2_expert_landed(f, k)) {
                return i;
            }
            if (k < 0 && unqueued < 0) {
                unqueued = i;
            }
        }
        if (f->in_flight == 0) {
            pi2_expert_pump(f, st);
        }
        const uint64_t t0 = pi2_now_ns();
        const bool took = f->in_flight > 0 && pi2_expert_take(f, true, st);
        st->wait_ns += pi2_now_ns() - t0;
        if (!took) {
            // nothing more arrives: one not queued is read when got, else a queued one (its reads redone when got)
            for (int i = 0; i < n; ++i) {
                if (!done[i] && unqueued < 0) {
                    unqueued = i;
                }
            }
            return unqueued;
        }
    }
}

int pi2_expert_file_get(struct pi2_expert_file * f, int layer, int32_t e, struct pi2_expert_matrices * out,
                        struct pi2_expert_read_stats * st, char * err, size_t errlen) {
    if (!pi2_expert_valid(f, layer, e)) {
        snprintf(err, errlen, "the model file has no routed expert %d in layer %d", e, layer);
        return -1;
    }
    const struct pi2_expert_layer * L = &f->layer[layer];
    int32_t k = f->where[layer][e];
    const uint64_t t0 = pi2_now_ns();
    bool waited = false;
    if (k >= 0 && f->pin[k] == f->epoch) { // wanted for this batch (counted then): read ahead, maybe in flight, or cached
        waited = !pi2_expert_landed(f, k);
        pi2_expert_wait(f, k, st);
    } else if (k >= 0) {
        st->hits += f->ahead[k] ? 0 : 1;
        f->ahead[k] = 0;
    } else {
        st->misses++;
        if ((k = pi2_expert_victim(f, layer)) < 0) {
            snprintf(err, errlen, "the expert cache has no entry free for expert %d of layer %d", e, layer);
            return -1;
        }
        for (int m = 0; m < 3; ++m) {
            f->span_bad[(size_t) k * 3 + (size_t) m] = 1; // read below
        }
    }
    const bool read_now = f->span_bad[(size_t) k * 3] || f->span_bad[(size_t) k * 3 + 1] || f->span_bad[(size_t) k * 3 + 2];
    uint8_t * entry = f->mem + (size_t) k * f->entry_bytes;
    uint64_t at = 0;
    for (int m = 0; m < 3; ++m) {
        const size_t s = (size_t) k * 3 + (size_t) m;
        const struct pi2_expert_span sp = pi2_expert_span_of(L, e, m);
        if (f->span_bad[s]) {
            const int rc = pi2_read_span(f, entry + at, sp.n, sp.lo, sp.need);
            if (rc != 0) {
                f->where[layer][e] = -1; // the entry holds nothing usable
                f->tag_layer[k] = f->tag_expert[k] = -1;
                f->last_use[k] = 0;
                snprintf(err, errlen, "reading expert %d of layer %d from the model file: %s", e, layer,
                         rc == EIO ? "the file is shorter than when it was opened" : strerror(rc));
                return -1;
            }
            f->span_bad[s] = 0;
            st->bytes_read += sp.n;
            st->requests++;
        }
        out->data[m] = entry + at + (sp.off - sp.lo);
        out->type[m] = L->type[m];
        at += sp.n;
    }
    if (read_now || waited) {
        st->wait_ns += pi2_now_ns() - t0;
    }
    f->tag_layer[k] = layer;
    f->tag_expert[k] = e;
    f->where[layer][e] = k;
    f->pin[k] = f->epoch;
    f->last_use[k] = ++f->tick;
    return 0;
}
