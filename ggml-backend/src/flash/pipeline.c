#include "flash/pipeline.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sparse/batch_ffn.h"
#include "flash/bundle_io.h"
#include "sparse/cluster_sched.h"
#include "flash/memory_budget.h"
#include "core/pi2_clock.h"
#include "core/pi2_log.h"
#include "sparse/predictor.h"

// One prefetch's requests, iovecs and tags (at most one per bundle of a layer) and its reads in flight.
// A set serves the request of one epoch (its key); there are two, so that the next layer's bundles can go
// out while the current layer's prefetched bundles are still being read.
struct pi2_pf_set {
    struct pi2_io_req * reqs;
    struct iovec *      iov;
    int32_t *           tags;
    uint32_t            n_req, n_iov; // used
    uint32_t            key;          // epoch of the request the bundles are read for
    atomic_int          outstanding;
    char                error[512];   // its first failed read
};

struct pi2_pipeline {
    const struct pi2_sidecar * sc;
    struct pi2_neuron_cache *  cache;
    struct pi2_bundle_file *   file;
    uint32_t                   gap;     // bundles a read may bridge between two misses (into the cache's scratch)
    uint32_t                   max_run; // bundles per request at most
    uint32_t                   max_n_bundles;
    size_t                     entry_size;
    struct pi2_io_req *        reqs;    // the current request's: [largest n_bundles] (a bundle at most once
    struct iovec *             iov;     // per layer), its requests' iovecs and tags carved in order
    int32_t *                  tags;
    struct pi2_pf_set          pf[2];
    // a batch's routed experts read ahead (pi2_pipeline_read_ahead), in turns: batch k's reads (and its guesses of
    // the next layer's experts, expert_speculate.h) go to set k % 2, so batch k + 1 starts without waiting for them
    struct pi2_pf_set          ahead[2];
    int                        ahead_at;  // the current batch's set
    uint32_t                   ahead_cap; // bundles a set holds at most: PI2_EXPERT_AHEAD experts' worth
    uint64_t                   ahead_bridged;  // bytes its reads bridged into the scratch, and its requests, not yet
    uint32_t                   ahead_requests; // counted by a request
    atomic_int                 outstanding; // requests of the current batch not finished
    pthread_mutex_t            err_lock;
    char                       error[512];
};

// an I/O thread finished request r: its entries ready or failed, its batch's count down, waiters woken
static void pi2_read_done(void * ctx, const struct pi2_io_req * r, int err, const char * why) {
    struct pi2_pipeline * pp = ctx;
    struct pi2_pf_set * set = NULL;
    for (int i = 0; i < 2; ++i) {
        if (pp->pf[i].reqs != NULL && r >= pp->pf[i].reqs && r < pp->pf[i].reqs + pp->max_n_bundles) {
            set = &pp->pf[i];
        }
    }
    for (int i = 0; i < 2; ++i) {
        if (pp->ahead[i].reqs != NULL && r >= pp->ahead[i].reqs && r < pp->ahead[i].reqs + pp->ahead_cap) {
            set = &pp->ahead[i];
        }
    }
    if (err != 0) { // a prefetch's error is the next layer's, once it finds the entries FAILED
        char * dst = set != NULL ? set->error : pp->error;
        pthread_mutex_lock(&pp->err_lock);
        if (dst[0] == '\0') {
            snprintf(dst, sizeof(pp->error), "%s", why);
        }
        pthread_mutex_unlock(&pp->err_lock);
    }
    for (int k = 0; k < r->n; ++k) {
        if (r->tag[k] >= 0) {
            pi2_cache_entry_done(pp->cache, r->tag[k], err == 0);
        }
    }
    atomic_fetch_sub(set != NULL ? &set->outstanding : &pp->outstanding, 1);
    pi2_cache_signal(pp->cache);
}

void pi2_pipeline_free(struct pi2_pipeline * pp) {
    if (pp == NULL) {
        return;
    }
    pi2_bundle_file_close(pp->file); // joins the I/O threads before their targets go away
    pi2_cache_free(pp->cache);
    free(pp->reqs);
    free(pp->iov);
    free(pp->tags);
    for (int i = 0; i < 2; ++i) {
        free(pp->pf[i].reqs);
        free(pp->pf[i].iov);
        free(pp->pf[i].tags);
        free(pp->ahead[i].reqs);
        free(pp->ahead[i].iov);
        free(pp->ahead[i].tags);
    }
    pthread_mutex_destroy(&pp->err_lock);
    free(pp);
}

struct pi2_pipeline * pi2_pipeline_create(const struct pi2_sidecar * sc, const struct pi2_cache_plan * plan,
                                          const struct pi2_io_params * io, char * err, size_t errlen) {
    struct pi2_pipeline * pp = calloc(1, sizeof(*pp));
    if (pp == NULL) {
        snprintf(err, errlen, "sidecar %s: out of memory for the neuron cache", sc->path);
        return NULL;
    }
    pthread_mutex_init(&pp->err_lock, NULL);
    pp->sc = sc;
    uint32_t max_n_bundles = 0;
    pp->entry_size = pi2_cache_entry_size(sc, &max_n_bundles);
    pp->max_n_bundles = max_n_bundles;
    // a miss within io->gap bytes of the run before it extends that run; requests up to io->max_bytes
    pp->gap     = pp->entry_size > 0 ? (uint32_t) (io->gap / pp->entry_size) : 0;
    pp->max_run = pp->entry_size > 0 ? (uint32_t) (io->max_bytes / pp->entry_size) : 1;
    pp->max_run = pp->max_run < 1 ? 1 : (pp->max_run > PI2_IO_MAX_RUN ? PI2_IO_MAX_RUN : pp->max_run);
    if (pp->gap > pp->max_run - 1) {
        pp->gap = pp->max_run - 1;
    }
    pp->reqs = calloc(max_n_bundles, sizeof(*pp->reqs));
    pp->iov  = calloc(max_n_bundles, sizeof(*pp->iov));
    pp->tags = calloc(max_n_bundles, sizeof(*pp->tags));
    bool ok = pp->reqs != NULL && pp->iov != NULL && pp->tags != NULL;
    for (int i = 0; i < 2 && plan->n_prefetch > 0; ++i) {
        pp->pf[i].reqs = calloc(max_n_bundles, sizeof(*pp->pf[i].reqs));
        pp->pf[i].iov  = calloc(max_n_bundles, sizeof(*pp->pf[i].iov));
        pp->pf[i].tags = calloc(max_n_bundles, sizeof(*pp->pf[i].tags));
        ok = ok && pp->pf[i].reqs != NULL && pp->pf[i].iov != NULL && pp->pf[i].tags != NULL;
    }
    if (sc->n_expert > 0 && io->ahead_pairs > 0) {
        pp->ahead_cap = (uint32_t) pi2_cache_ahead_bundles(sc, io->ahead_pairs);
        for (int i = 0; i < 2; ++i) {
            struct pi2_pf_set * S = &pp->ahead[i];
            S->reqs = calloc(pp->ahead_cap, sizeof(*S->reqs));
            S->iov  = calloc(pp->ahead_cap, sizeof(*S->iov));
            S->tags = calloc(pp->ahead_cap, sizeof(*S->tags));
            ok = ok && S->reqs != NULL && S->iov != NULL && S->tags != NULL;
        }
    }
    if (!ok) {
        snprintf(err, errlen, "sidecar %s: out of memory for the neuron cache", sc->path);
        pi2_pipeline_free(pp);
        return NULL;
    }
    // bridged bundles land in the cache's scratch (one gap's worth, shared: its contents are never used)
    pp->cache = pi2_cache_create(sc, plan, pp->gap, err, errlen);
    if (pp->cache == NULL ||
        pi2_bundle_file_open(&pp->file, sc->path, io->threads, io->ring, io->inflight_max, pi2_read_done, pp, err, errlen) != 0) {
        pi2_pipeline_free(pp);
        return NULL;
    }
    for (uint32_t il = 0; il < sc->n_layer; ++il) { // the hot segments: one sequential read per layer
        const struct pi2_sidecar_layer * L = &sc->layer[il];
        uint32_t hot_k = 0, hot_slots = 0;
        uint8_t * hot = pi2_cache_hot_segment(pp->cache, (int) il, &hot_k, &hot_slots);
        if (hot_k > 0 && pi2_bundle_file_read(pp->file, hot, (size_t) hot_k * L->bundle_size, L->bundles_offset, err, errlen) != 0) {
            pi2_pipeline_free(pp);
            return NULL;
        }
    }
    return pp;
}

struct pi2_neuron_cache * pi2_pipeline_cache(const struct pi2_pipeline * pp) {
    return pp->cache;
}

bool pi2_pipeline_io_ring(const struct pi2_pipeline * pp) {
    return pi2_bundle_file_ring(pp->file);
}

bool pi2_pipeline_direct_io(const struct pi2_pipeline * pp) {
    return pi2_bundle_file_direct(pp->file);
}

void pi2_pipeline_inject_fault(struct pi2_pipeline * pp, int64_t after, int err) {
    pi2_bundle_file_inject_fault(pp->file, after, err);
}

// wanted slots in bundle k of layer L
static uint32_t pi2_wanted(const struct pi2_sidecar_layer * L, const uint8_t * want, uint32_t k) {
    const uint32_t first = k * L->bundle_neurons;
    const uint32_t end   = first + L->bundle_neurons < L->n_ff ? first + L->bundle_neurons : L->n_ff;
    uint32_t n = 0;
    for (uint32_t s = first; s < end; ++s) {
        n += want[s] != 0;
    }
    return n;
}

// Reads being built over one layer's bundles, into a set of arrays (the request's, a prefetch set's, the
// read-ahead's): runs of bundles, one request (one preadv) each. A bundle within `gap` bundles after the
// current run's last extends it (the run stays within max_run), the bundles between read into the sink: one
// larger read costs far less than another request here, and kept in the cache the bridged bundles evicted
// entries worth keeping (measured: the cold segment's hits went to zero).
struct pi2_runs {
    struct pi2_io_req * reqs;
    struct iovec *      iov;
    int32_t *           tags;
    uint32_t            n_req, n_iov; // used
    uint32_t            gap, max_run; // bundles
    struct pi2_io_req * cur;          // the run `last` ended (NULL: none yet)
    int64_t             last;
};

static struct pi2_runs pi2_runs_of(struct pi2_io_req * reqs, struct iovec * iov, int32_t * tags, uint32_t n_req, uint32_t n_iov,
                                   uint32_t gap, uint32_t max_run) {
    return (struct pi2_runs) { .reqs = reqs, .iov = iov, .tags = tags, .n_req = n_req, .n_iov = n_iov, .gap = gap,
                               .max_run = max_run, .last = -1 };
}

// bundle k extends the current run: within `gap` bundles after its last, and the run stays within max_run
static bool pi2_runs_extend(const struct pi2_runs * R, uint32_t k) {
    return R->cur != NULL && (int64_t) k - R->last - 1 <= (int64_t) R->gap && R->cur->n + ((int64_t) k - R->last) <= (int64_t) R->max_run;
}

// the iovecs bundle k adds: itself and, extending the current run, the bundles between
static uint32_t pi2_runs_cost(const struct pi2_runs * R, uint32_t k) {
    return pi2_runs_extend(R, k) ? (uint32_t) ((int64_t) k - R->last) : 1;
}

// Bundle k of L into cold entry e at dst, extending the current run (the bundles between go to the sink,
// pp's scratch) or starting one. Returns the bytes bridged.
static uint64_t pi2_runs_add(struct pi2_runs * R, const struct pi2_pipeline * pp, const struct pi2_sidecar_layer * L, uint32_t k,
                             uint8_t * dst, int64_t e) {
    const bool extend = pi2_runs_extend(R, k);
    const int64_t from = extend ? R->last + 1 : k;
    if (!extend) {
        R->cur         = &R->reqs[R->n_req++];
        R->cur->offset = L->bundles_offset + (uint64_t) k * L->bundle_size;
        R->cur->n      = 0;
        R->cur->iov    = R->iov + R->n_iov;
        R->cur->tag    = R->tags + R->n_iov;
    }
    uint8_t * sink = pi2_cache_scratch(pp->cache);
    for (int64_t g = from; g < k; ++g) {
        R->cur->iov[R->cur->n].iov_base = sink + (size_t) (g - from) * pp->entry_size;
        R->cur->iov[R->cur->n].iov_len  = L->bundle_size;
        R->cur->tag[R->cur->n++]        = -1;
    }
    R->cur->iov[R->cur->n].iov_base = dst;
    R->cur->iov[R->cur->n].iov_len  = L->bundle_size;
    R->cur->tag[R->cur->n++]        = (int32_t) e;
    R->n_iov += (uint32_t) (k - from) + 1;
    R->last = k;
    return (uint64_t) (k - from) * L->bundle_size;
}

// The runs R added to set S (its arrays) queued as reads; the number of requests queued.
static int pi2_set_submit(struct pi2_pipeline * pp, struct pi2_pf_set * S, const struct pi2_runs * R) {
    const uint32_t req0 = S->n_req;
    S->n_req = R->n_req;
    S->n_iov = R->n_iov;
    const int nreq = (int) (S->n_req - req0);
    if (nreq > 0) {
        atomic_fetch_add(&S->outstanding, nreq);
        pi2_bundle_file_submit(pp->file, S->reqs + req0, nreq);
    }
    return nreq;
}

// Queues reads of bundles of `layer` that are neither hot nor cached and returns without waiting; for a
// layer that will want every bundle (the engine knows which), the one after the current request's. Once
// the current request is queued (done false): at most the plan's prefetch entries, its first bundles,
// read after the current ones, so the disk reads on through this layer's last computations. Once the
// current request's computation has finished (done true; its entries are free then): the rest of the
// layer, read while the next attention (or the output layer and sampling, between tokens) runs. The
// request that uses the bundles takes them as they are (ready or still being read), counting them as
// misses and their bytes as read; pi2_cache_get reports a failed prefetch read.
static void pi2_prefetch(struct pi2_pipeline * pp, int layer, bool done) {
    const struct pi2_cache_plan * plan = pi2_cache_get_plan(pp->cache);
    if (plan->n_prefetch == 0) {
        return;
    }
    // the set of the next request (a second call adds to it), else the older one: the request it served
    // has taken its bundles, so its reads are done or nearly
    const uint32_t key = pi2_cache_epoch(pp->cache) + 1;
    struct pi2_pf_set * S = pp->pf[0].key == key ? &pp->pf[0] : pp->pf[1].key == key ? &pp->pf[1] : NULL;
    if (S == NULL) {
        S = (int32_t) (pp->pf[0].key - pp->pf[1].key) <= 0 ? &pp->pf[0] : &pp->pf[1];
        pi2_cache_wait_zero(pp->cache, &S->outstanding);
        S->n_req = S->n_iov = 0;
        S->key = key;
        S->error[0] = '\0';
    }
    const struct pi2_sidecar_layer * L = &pp->sc->layer[layer];
    uint32_t hot_k = 0, hot_slots = 0;
    pi2_cache_hot_segment(pp->cache, layer, &hot_k, &hot_slots);
    const uint32_t limit = done ? pp->max_n_bundles : plan->n_prefetch;
    // consecutive bundles only (no bridging: the whole layer is wanted)
    struct pi2_runs R = pi2_runs_of(S->reqs, S->iov, S->tags, S->n_req, S->n_iov, 0, pp->max_run);
    for (uint32_t k = hot_k, n = 0; k < L->n_bundles && n < limit && R.n_iov < pp->max_n_bundles; ++k) {
        if (!pi2_cache_should_prefetch(pp->cache, layer, k, key)) {
            continue;
        }
        uint8_t * dst = NULL;
        const int64_t e = pi2_cache_claim(pp->cache, layer, k, key, done, true, &dst);
        if (e < 0) {
            break;
        }
        pi2_runs_add(&R, pp, L, k, dst, e);
        ++n;
    }
    pi2_set_submit(pp, S, &R);
}

// Looks up the slots with want[slot] != 0 of one layer and queues reads for the bundles missing, all at
// once. A miss within pp->gap bundles of the run before it extends that run, reading the bundles between
// too: one larger read costs far less than another request here. 0, or -1 with err (the file changed,
// or the cache cannot hold them).
static int pi2_request(struct pi2_pipeline * pp, int layer, const uint8_t * want, struct pi2_cache_token_stats * st,
                       char * err, size_t errlen) {
    pi2_cache_wait_zero(pp->cache, &pp->outstanding);
    if (pi2_bundle_file_check(pp->file, err, errlen) != 0) {
        return -1;
    }
    pp->error[0] = '\0';
    const uint32_t epoch = pi2_cache_begin_request(pp->cache);
    const struct pi2_sidecar_layer * L = &pp->sc->layer[layer];
    uint32_t hot_k = 0, hot_slots = 0;
    pi2_cache_hot_segment(pp->cache, layer, &hot_k, &hot_slots);
    for (uint32_t s = 0; s < hot_slots; ++s) {
        st->hot_hits += want[s] != 0;
    }
    st->bytes_read += pp->ahead_bridged; // read ahead (a routed expert's reads, bridging), counted by the next request
    st->requests += pp->ahead_requests;
    pp->ahead_bridged  = 0;
    pp->ahead_requests = 0;
    struct pi2_runs R = pi2_runs_of(pp->reqs, pp->iov, pp->tags, 0, 0, pp->gap, pp->max_run);
    bool failed = false;
    for (uint32_t k = hot_k; k < L->n_bundles; ++k) {
        const uint32_t wanted = pi2_wanted(L, want, k);
        if (wanted == 0) {
            continue;
        }
        const enum pi2_found found = pi2_cache_find(pp->cache, layer, k);
        if (found == PI2_FOUND_PREFETCHED) { // a miss and its bytes, not read again
            st->misses += wanted;
            st->prefetched += wanted;
            st->bytes_read += L->bundle_size;
            continue;
        }
        if (found == PI2_FOUND_CACHED) {
            st->cold_hits += wanted;
            continue;
        }
        st->misses += wanted;
        uint8_t * dst = NULL;
        int64_t ge;
        while ((ge = pi2_cache_claim(pp->cache, layer, k, epoch, false, false, &dst)) < 0 &&
               pi2_cache_wait_reading(pp->cache, false)) {
        }
        if (ge < 0) {
            snprintf(err, errlen, "neuron cache: no free entry among %u for layer %d (cache too small)",
                     pi2_cache_get_plan(pp->cache)->n_cold, layer);
            failed = true;
            break;
        }
        st->bytes_read += pi2_runs_add(&R, pp, L, k, dst, ge) + L->bundle_size;
    }
    const uint32_t nreq = R.n_req;
    st->requests += nreq;
    atomic_store(&pp->outstanding, (int) nreq);
    if (nreq > 0) {
        pi2_bundle_file_submit(pp->file, pp->reqs, (int) nreq);
    }
    return failed ? -1 : 0;
}

// Reads ahead the bundles of `layer` that want[] marks for the request `later` requests from now, as
// pi2_request would read them (neighbours merged, small gaps bridged into the scratch), pinning their
// entries for it; cached ones are pinned for it too. Called between requests, when no computation holds
// entries. At most max_pin entries are pinned; returns how many were.
static uint32_t pi2_read_ahead(struct pi2_pipeline * pp, int layer, const uint8_t * want, uint32_t later, uint32_t max_pin) {
    struct pi2_pf_set * S = &pp->ahead[pp->ahead_at];
    const uint32_t pin = pi2_cache_epoch(pp->cache) + later;
    const struct pi2_sidecar_layer * L = &pp->sc->layer[layer];
    uint32_t hot_k = 0, hot_slots = 0;
    pi2_cache_hot_segment(pp->cache, layer, &hot_k, &hot_slots);
    struct pi2_runs R = pi2_runs_of(S->reqs, S->iov, S->tags, S->n_req, S->n_iov, pp->gap, pp->max_run);
    uint32_t n = 0;
    for (uint32_t k = hot_k; k < L->n_bundles && n < max_pin; ++k) {
        if (pi2_wanted(L, want, k) == 0) {
            continue;
        }
        if (!pi2_cache_should_prefetch(pp->cache, layer, k, pin)) { // cached, or being read
            n += pi2_cache_pin_ahead(pp->cache, layer, k, pin);
            continue;
        }
        if (R.n_iov + pi2_runs_cost(&R, k) > pp->ahead_cap) {
            break;
        }
        uint8_t * dst = NULL;
        const int64_t e = pi2_cache_claim(pp->cache, layer, k, pin, true, true, &dst);
        if (e < 0) {
            break;
        }
        pp->ahead_bridged += pi2_runs_add(&R, pp, L, k, dst, e);
        ++n;
    }
    const int nreq = pi2_set_submit(pp, S, &R);
    pp->ahead_requests += (uint32_t) nreq;
    return n;
}

uint32_t pi2_pipeline_read_ahead(struct pi2_binding * b, int layer, const uint8_t * want, uint32_t later, uint32_t max_pin,
                                 bool first) {
    pthread_mutex_lock(&b->cache_lock);
    struct pi2_pipeline * pp = b->pipe;
    uint32_t n = 0;
    if (pp != NULL && pp->ahead[0].reqs != NULL) {
        if (first) { // the set of the batch before that one: its reads are long done, or nearly
            pp->ahead_at ^= 1;
            struct pi2_pf_set * S = &pp->ahead[pp->ahead_at];
            pi2_cache_wait_zero(pp->cache, &S->outstanding);
            S->error[0] = '\0';
        }
        struct pi2_pf_set * S = &pp->ahead[pp->ahead_at];
        if (atomic_load(&S->outstanding) == 0) { // no read in flight uses the arrays
            S->n_req = S->n_iov = 0;
        }
        n = pi2_read_ahead(pp, layer, want, later, max_pin);
    }
    pthread_mutex_unlock(&b->cache_lock);
    return n;
}

uint32_t pi2_pipeline_ahead_room(struct pi2_binding * b) {
    pthread_mutex_lock(&b->cache_lock);
    const uint32_t room = b->pipe != NULL && b->pipe->ahead[0].reqs != NULL ? pi2_cache_ahead_room(b->pipe->cache) : 0;
    pthread_mutex_unlock(&b->cache_lock);
    return room;
}

// Waits for every queued read (after an error, before entries may be reused), then checks that the file
// did not change while they ran. 0, or -1 with err.
static int pi2_finish(struct pi2_pipeline * pp, char * err, size_t errlen) {
    pi2_cache_wait_zero(pp->cache, &pp->outstanding);
    if (pp->error[0] != '\0') {
        snprintf(err, errlen, "%s", pp->error);
        return -1;
    }
    return pi2_bundle_file_check(pp->file, err, errlen);
}

// the first read error since the last request, or ""
static const char * pi2_read_error(const struct pi2_pipeline * pp) {
    if (pp->error[0] != '\0') {
        return pp->error;
    }
    // the prefetch read for this request first (a set's reads are done before it is used again)
    const uint32_t epoch = pi2_cache_epoch(pp->cache);
    const struct pi2_pf_set * a = pp->pf[0].key == epoch ? &pp->pf[0] : &pp->pf[1];
    const struct pi2_pf_set * b = a == &pp->pf[0] ? &pp->pf[1] : &pp->pf[0];
    return a->error[0] != '\0' ? a->error : b->error[0] != '\0' ? b->error
         : pp->ahead[pp->ahead_at].error[0] != '\0' ? pp->ahead[pp->ahead_at].error : pp->ahead[pp->ahead_at ^ 1].error;
}

// every thread: which slots this token needs (thread ith's clusters; a batch marks its own, batch_ffn.h)
static void pi2_pipeline_mark(struct pi2_sparse_plan * p, int ith, int nth) {
    const bool predicted = p->select != PI2_SELECT_ALL;
    for (int64_t c = ith; c < p->n_clusters; c += nth) {
        const int64_t s0 = c * PI2_CLUSTER;
        const int64_t s1 = s0 + PI2_CLUSTER < p->n_ff ? s0 + PI2_CLUSTER : p->n_ff;
        for (int64_t s = s0; s < s1; ++s) {
            const bool selected = !predicted || pi2_plan_selects(p, s);
            p->want[s] = selected ? 1 : (p->select == PI2_SELECT_CHECKED ? 2 : 0);
        }
    }
}

// one thread, after every thread marked: the reads of token t's wanted bundles queued
static void pi2_pipeline_submit(struct pi2_sparse_plan * p, int64_t t) {
    if (pi2_request(p->pipe, p->layer, p->want, &p->io, p->error, sizeof(p->error)) != 0) {
        atomic_store(&p->failed, 1);
    } else if (p->prefetch_layer >= 0 && t == p->n_tokens - 1) {
        // the next layer's first bundles queue behind this one's (the last token of a batch: the others
        // request this layer again)
        pi2_prefetch(p->pipe, p->prefetch_layer, false);
    }
}

enum ggml_status pi2_pipeline_run(struct pi2_binding * b, struct pi2_sparse_plan * p, int n_threads) {
    pthread_mutex_lock(&b->cache_lock);
    if (b->pipe == NULL) {
        pthread_mutex_unlock(&b->cache_lock);
        if (pi2_binding_size_env_cache(b) != 0) {
            PI2_LOG_REFUSAL("pi2: %s\n", b->error);
            return GGML_STATUS_FAILED;
        }
        pthread_mutex_lock(&b->cache_lock);
    }
    p->source      = PI2_SOURCE_CACHE;
    p->pipe        = b->pipe;
    p->cache       = pi2_pipeline_cache(b->pipe);
    p->mark        = pi2_pipeline_mark;
    p->submit      = pi2_pipeline_submit;
    // llama runs the layers in order, the last one followed by the first of the next token; an MoE sidecar's next
    // layer is another expert, which the router may not choose: no prefetch there
    const int next = (p->layer + 1) % (int) b->sc->n_layer;
    const bool always = pi2_setting(&b->settings, b->defaults, PI2_SET_PREDICTOR) != 0.0;
    if (b->sc->n_expert == 0 && !b->layer[next].read_whole &&
        !pi2_predictor_runs(&b->layer[next].pred, atomic_load(&b->mode) == PI2_MODE_PREDICTED, always)) {
        p->prefetch_layer = next;
    }
    const uint64_t t0 = pi2_now_ns();
    if (p->batch) {
        pi2_batch_run(p, n_threads);
    } else {
        pi2_sched_run(p, n_threads);
    }
    // every read done (also after a failure, before entries are reused); the file unchanged meanwhile
    char err[sizeof(p->error)] = "";
    const int finished = pi2_finish(p->pipe, err, sizeof(err));
    const bool ok = !atomic_load(&p->failed) && finished == 0;
    if (!ok) { // the request's own error first, then a read error or a changed file
        snprintf(b->error, sizeof(b->error), "%s",
                 p->error[0] != '\0' ? p->error : err[0] != '\0' ? err : pi2_read_error(p->pipe));
        pi2_cache_unpin(p->cache);
    }
    if (ok && p->prefetch_layer >= 0) { // this layer's entries are free now: the rest of the next layer
        pi2_prefetch(p->pipe, p->prefetch_layer, true);
    }
    b->ffn_ns += pi2_now_ns() - t0;
    pthread_mutex_unlock(&b->cache_lock);
    if (!ok) {
        PI2_LOG_REFUSAL("pi2: %s\n", b->error);
        return GGML_STATUS_FAILED;
    }
    return GGML_STATUS_SUCCESS;
}
