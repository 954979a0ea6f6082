// syscall() and MAP_ANONYMOUS are outside POSIX
#define _GNU_SOURCE
#include "neuron_cache.h"

#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "bundle_io.h"
#include "pi2_clock.h"

// a spin-wait hint to the core (x86 PAUSE, ARM YIELD); nothing elsewhere
static inline void pi2_cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__) || defined(__arm__)
    __asm__ __volatile__("yield");
#endif
}

enum { PI2_ENTRY_EMPTY, PI2_ENTRY_PENDING, PI2_ENTRY_READY, PI2_ENTRY_FAILED };

struct pi2_cold_entry {
    int32_t    layer, bundle; // what it holds (layer -1: nothing)
    uint32_t   pin;         // epoch of the request that needs it
    uint8_t    ref;         // CLOCK's second-chance bit
    uint8_t    prefetched;  // read by pi2_cache_prefetch, not yet counted by a request
    atomic_int state;
};

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

struct pi2_cache_layer {
    uint8_t * hot;       // hot_k bundles, in order
    uint32_t  hot_k;     // bundles
    uint32_t  hot_slots; // slots in them (min(hot_k * neurons, n_ff))
    uint32_t  n_ff, n_bundles, bsize, neurons;
    size_t    stride;    // from one neuron of a bundle to the next
    uint64_t  offset;    // of bundle 0 in the file
    int32_t * where;     // [n_bundles] cold entry holding the bundle, or -1
};

struct pi2_neuron_cache {
    struct pi2_cache_plan    plan;
    uint32_t                 n_layer;
    struct pi2_cache_layer * layer;
    uint8_t *                hot_mem;
    size_t                   hot_map;
    uint8_t *                cold;
    size_t                   cold_map, entry_size;
    struct pi2_cold_entry *  ent;
    uint32_t                 n_cold, hand, epoch;
    uint32_t                 gap; // bundles a read may bridge between two misses
    uint8_t *                sink; // where bridged bundles land: gap entries
    struct pi2_io_req *      reqs;
    struct iovec *           iov;  // [largest n_bundles] (a bundle at most once per layer): the requests'
    int32_t *                tags; // iovecs and tags, carved in order
    uint32_t                 max_run; // bundles per request at most
    uint32_t                 max_n_bundles;
    struct pi2_pf_set        pf[2];
    struct pi2_bundle_file * file;

    atomic_uint     completions; // futex word: bumped by every finished request
    atomic_int      waiters;
    atomic_int      outstanding; // requests of the current batch not finished
    pthread_mutex_t err_lock;
    char            error[512];
};

static void pi2_futex_wait(atomic_uint * addr, unsigned val) {
    syscall(SYS_futex, (unsigned *) addr, FUTEX_WAIT_PRIVATE, val, NULL, NULL, 0);
}

static void pi2_futex_wake(atomic_uint * addr) {
    syscall(SYS_futex, (unsigned *) addr, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
}

uint32_t pi2_cache_entry_size(const struct pi2_sidecar * sc, uint32_t * max_n_bundles) {
    uint32_t b = 0, n = 0;
    for (uint32_t il = 0; il < sc->n_layer; ++il) {
        b = sc->layer[il].bundle_size > b ? sc->layer[il].bundle_size : b;
        n = sc->layer[il].n_bundles > n ? sc->layer[il].n_bundles : n;
    }
    *max_n_bundles = n;
    return b;
}

size_t pi2_cache_entry_overhead(void) {
    return sizeof(struct pi2_cold_entry);
}

static void pi2_cache_done(void * ctx, const struct pi2_io_req * r, int err, const char * why) {
    struct pi2_neuron_cache * c = ctx;
    struct pi2_pf_set * set = NULL;
    for (int i = 0; i < 2; ++i) {
        if (c->pf[i].reqs != NULL && r >= c->pf[i].reqs && r < c->pf[i].reqs + c->max_n_bundles) {
            set = &c->pf[i];
        }
    }
    if (err != 0) { // a prefetch's error is the next layer's, once it finds the entries FAILED
        char * dst = set != NULL ? set->error : c->error;
        pthread_mutex_lock(&c->err_lock);
        if (dst[0] == '\0') {
            snprintf(dst, sizeof(c->error), "%s", why);
        }
        pthread_mutex_unlock(&c->err_lock);
    }
    for (int k = 0; k < r->n; ++k) {
        if (r->tag[k] >= 0) {
            atomic_store(&c->ent[r->tag[k]].state, err != 0 ? PI2_ENTRY_FAILED : PI2_ENTRY_READY);
        }
    }
    atomic_fetch_sub(set != NULL ? &set->outstanding : &c->outstanding, 1);
    atomic_fetch_add(&c->completions, 1);
    if (atomic_load(&c->waiters) > 0) {
        pi2_futex_wake(&c->completions);
    }
}

static void * pi2_map_anon(size_t n) {
    if (n == 0) {
        return NULL;
    }
    void * p = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
        return NULL;
    }
#if defined(MADV_HUGEPAGE)
    // direct reads pin every page of their destination: with 4 KiB pages the kernel's page pinning
    // took ~20% of the CPU under a budget. Advice only: where huge pages are off this changes nothing.
    (void) madvise(p, n, MADV_HUGEPAGE);
#endif
    return p;
}

void pi2_cache_free(struct pi2_neuron_cache * c) {
    if (c == NULL) {
        return;
    }
    pi2_bundle_file_close(c->file); // joins the I/O threads before their targets go away
    if (c->layer != NULL) {
        for (uint32_t il = 0; il < c->n_layer; ++il) {
            free(c->layer[il].where);
        }
    }
    free(c->layer);
    if (c->hot_mem != NULL) {
        munmap(c->hot_mem, c->hot_map);
    }
    if (c->cold != NULL) {
        munmap(c->cold, c->cold_map);
    }
    if (c->sink != NULL) {
        munmap(c->sink, (size_t) (c->gap > 0 ? c->gap : 1) * c->entry_size);
    }
    free(c->ent);
    free(c->reqs);
    free(c->iov);
    free(c->tags);
    for (int i = 0; i < 2; ++i) {
        free(c->pf[i].reqs);
        free(c->pf[i].iov);
        free(c->pf[i].tags);
    }
    pthread_mutex_destroy(&c->err_lock);
    free(c);
}

struct pi2_neuron_cache * pi2_cache_create(const struct pi2_sidecar * sc, const struct pi2_cache_plan * plan,
                                           const struct pi2_io_params * io, char * err, size_t errlen) {
    struct pi2_neuron_cache * c = calloc(1, sizeof(*c));
    if (c == NULL) {
        snprintf(err, errlen, "sidecar %s: out of memory for the neuron cache", sc->path);
        return NULL;
    }
    pthread_mutex_init(&c->err_lock, NULL);
    c->plan    = *plan;
    c->n_layer = sc->n_layer;
    uint32_t max_n_bundles = 0;
    c->entry_size = pi2_cache_entry_size(sc, &max_n_bundles);
    c->n_cold     = plan->n_cold;
    // a miss within io->gap bytes of the run before it extends that run; requests up to io->max_bytes
    c->gap     = c->entry_size > 0 ? (uint32_t) (io->gap / c->entry_size) : 0;
    c->max_run = c->entry_size > 0 ? (uint32_t) (io->max_bytes / c->entry_size) : 1;
    c->max_run = c->max_run < 1 ? 1 : (c->max_run > PI2_IO_MAX_RUN ? PI2_IO_MAX_RUN : c->max_run);
    if (c->gap > c->max_run - 1) {
        c->gap = c->max_run - 1;
    }
    c->layer = calloc(sc->n_layer, sizeof(*c->layer));
    c->ent   = calloc(c->n_cold > 0 ? c->n_cold : 1, sizeof(*c->ent));
    c->reqs  = calloc(max_n_bundles, sizeof(*c->reqs));
    c->iov   = calloc(max_n_bundles, sizeof(*c->iov));
    c->tags  = calloc(max_n_bundles, sizeof(*c->tags));
    c->max_n_bundles = max_n_bundles;
    bool pf_ok = true;
    for (int i = 0; i < 2 && plan->n_prefetch > 0; ++i) {
        c->pf[i].reqs = calloc(max_n_bundles, sizeof(*c->pf[i].reqs));
        c->pf[i].iov  = calloc(max_n_bundles, sizeof(*c->pf[i].iov));
        c->pf[i].tags = calloc(max_n_bundles, sizeof(*c->pf[i].tags));
        pf_ok = pf_ok && c->pf[i].reqs != NULL && c->pf[i].iov != NULL && c->pf[i].tags != NULL;
    }
    c->hot_map  = (plan->hot_bytes + 4095) & ~(size_t) 4095;
    c->cold_map = (plan->cold_bytes + 4095) & ~(size_t) 4095;
    c->hot_mem  = pi2_map_anon(c->hot_map);
    c->cold     = pi2_map_anon(c->cold_map);
    c->sink     = pi2_map_anon((size_t) (c->gap > 0 ? c->gap : 1) * c->entry_size);
    if (c->layer == NULL || c->ent == NULL || c->reqs == NULL || c->iov == NULL || c->tags == NULL || c->sink == NULL ||
        !pf_ok || (c->hot_map > 0 && c->hot_mem == NULL) ||
        (c->cold_map > 0 && c->cold == NULL)) {
        snprintf(err, errlen, "sidecar %s: out of memory for a neuron cache of %llu bytes", sc->path,
                 (unsigned long long) (plan->hot_bytes + plan->cold_bytes));
        pi2_cache_free(c);
        return NULL;
    }
    for (uint32_t e = 0; e < c->n_cold; ++e) {
        c->ent[e].layer = -1;
        atomic_init(&c->ent[e].state, PI2_ENTRY_EMPTY);
    }
    if (pi2_bundle_file_open(&c->file, sc->path, io->threads, io->inflight_max, pi2_cache_done, c, err, errlen) != 0) {
        pi2_cache_free(c);
        return NULL;
    }
    uint8_t * hot = c->hot_mem;
    for (uint32_t il = 0; il < sc->n_layer; ++il) {
        const struct pi2_sidecar_layer * L = &sc->layer[il];
        struct pi2_cache_layer * C = &c->layer[il];
        C->n_ff      = L->n_ff;
        C->n_bundles = L->n_bundles;
        C->neurons   = L->bundle_neurons;
        C->stride    = L->neuron_stride;
        C->bsize     = L->bundle_size;
        C->offset    = L->bundles_offset;
        C->where     = malloc(L->n_bundles * sizeof(int32_t));
        if (C->where == NULL) {
            snprintf(err, errlen, "sidecar %s: out of memory for the neuron cache", sc->path);
            pi2_cache_free(c);
            return NULL;
        }
        memset(C->where, 0xff, L->n_bundles * sizeof(int32_t));
        const uint32_t k = plan->hot_k[il];
        C->hot_k     = k;
        C->hot_slots = (uint64_t) k * L->bundle_neurons < L->n_ff ? k * L->bundle_neurons : L->n_ff;
        C->hot       = hot;
        // one sequential read per layer
        if (k > 0 && pi2_bundle_file_read(c->file, hot, (size_t) k * L->bundle_size, L->bundles_offset, err, errlen) != 0) {
            pi2_cache_free(c);
            return NULL;
        }
        hot += (size_t) k * L->bundle_size;
    }
    uint32_t need = 0; // cold entries the layer with the most non-hot bundles needs
    for (uint32_t il = 0; il < sc->n_layer; ++il) {
        need = c->layer[il].n_bundles - c->layer[il].hot_k > need ? c->layer[il].n_bundles - c->layer[il].hot_k : need;
    }
    if (need + plan->n_prefetch > c->n_cold) { // the plan's split leaves room; a plan made for another sidecar would not
        snprintf(err, errlen, "sidecar %s: neuron cache plan leaves %u cold entries for a layer needing %u", sc->path, c->n_cold, need);
        pi2_cache_free(c);
        return NULL;
    }
    return c;
}

// A CLOCK victim; `done`: the current request's computation has finished, so its entries are free too.
static int64_t pi2_victim(struct pi2_neuron_cache * c, bool done) {
    for (uint64_t step = 0; step < 2 * (uint64_t) c->n_cold + 1; ++step) {
        const uint32_t e = c->hand;
        c->hand = c->hand + 1 < c->n_cold ? c->hand + 1 : 0;
        struct pi2_cold_entry * E = &c->ent[e];
        // this request's, prefetched for the next, or still being read (a prefetch the request did not want)
        if ((E->pin == c->epoch && !done) || E->pin == c->epoch + 1 || atomic_load(&E->state) == PI2_ENTRY_PENDING) {
            continue;
        }
        if (E->ref) {
            E->ref = 0;
            continue;
        }
        return e;
    }
    return -1;
}

static void pi2_wait_for(struct pi2_neuron_cache * c, atomic_int * outstanding) {
    while (atomic_load(outstanding) > 0) {
        atomic_fetch_add(&c->waiters, 1);
        const unsigned g = atomic_load(&c->completions);
        if (atomic_load(outstanding) > 0) {
            pi2_futex_wait(&c->completions, g);
        }
        atomic_fetch_sub(&c->waiters, 1);
    }
}

static void pi2_wait_outstanding(struct pi2_neuron_cache * c) {
    pi2_wait_for(c, &c->outstanding);
}

// Bundle k of layer L into a cold entry (allocated if it has none), pinned for the request of epoch `pin`
// and pending. -1 if no entry is free.
static int64_t pi2_claim(struct pi2_neuron_cache * c, int layer, uint32_t k, uint32_t pin, bool done) {
    struct pi2_cache_layer * L = &c->layer[layer];
    int64_t e = L->where[k];
    if (e < 0) {
        e = pi2_victim(c, done);
        if (e < 0) {
            return -1;
        }
        struct pi2_cold_entry * E = &c->ent[e];
        if (E->layer >= 0) {
            c->layer[E->layer].where[E->bundle] = -1;
        }
        E->layer  = layer;
        E->bundle = (int32_t) k;
        L->where[k] = (int32_t) e;
    }
    struct pi2_cold_entry * E = &c->ent[e];
    E->ref        = 1;
    E->pin        = pin;
    E->prefetched = 0;
    atomic_store(&E->state, PI2_ENTRY_PENDING);
    return e;
}

// wanted slots in bundle k
static uint32_t pi2_wanted(const struct pi2_cache_layer * L, const uint8_t * want, uint32_t k) {
    const uint32_t first = k * L->neurons;
    const uint32_t end   = first + L->neurons < L->n_ff ? first + L->neurons : L->n_ff;
    uint32_t n = 0;
    for (uint32_t s = first; s < end; ++s) {
        n += want[s] != 0;
    }
    return n;
}

void pi2_cache_prefetch(struct pi2_neuron_cache * c, int layer, bool done) {
    if (c->plan.n_prefetch == 0) {
        return;
    }
    // the set of the next request (a second call adds to it), else the older one: the request it served
    // has taken its bundles, so its reads are done or nearly
    const uint32_t key = c->epoch + 1;
    struct pi2_pf_set * S = c->pf[0].key == key ? &c->pf[0] : c->pf[1].key == key ? &c->pf[1] : NULL;
    if (S == NULL) {
        S = (int32_t) (c->pf[0].key - c->pf[1].key) <= 0 ? &c->pf[0] : &c->pf[1];
        pi2_wait_for(c, &S->outstanding);
        S->n_req = S->n_iov = 0;
        S->key = key;
        S->error[0] = '\0';
    }
    struct pi2_cache_layer * L = &c->layer[layer];
    const uint32_t limit = done ? c->max_n_bundles : c->plan.n_prefetch;
    const uint32_t req0 = S->n_req;
    struct pi2_io_req * cur = NULL;
    for (uint32_t k = L->hot_k, n = 0; k < L->n_bundles && n < limit && S->n_iov < c->max_n_bundles; ++k) {
        const int64_t e0 = L->where[k];
        if (e0 >= 0 && (atomic_load(&c->ent[e0].state) != PI2_ENTRY_FAILED || (c->ent[e0].prefetched && c->ent[e0].pin == key))) {
            continue; // cached or being read (the request checks that it is ready); a failed read for the same
                      // request is left for it to report
        }
        const int64_t e = pi2_claim(c, layer, k, key, done);
        if (e < 0) {
            break;
        }
        c->ent[e].prefetched = 1;
        if (cur == NULL || cur->n >= (int) c->max_run || cur->offset + (uint64_t) cur->n * L->bsize != L->offset + (uint64_t) k * L->bsize) {
            cur         = &S->reqs[S->n_req++];
            cur->offset = L->offset + (uint64_t) k * L->bsize;
            cur->n      = 0;
            cur->iov    = S->iov + S->n_iov;
            cur->tag    = S->tags + S->n_iov;
        }
        cur->iov[cur->n].iov_base = c->cold + (size_t) e * c->entry_size;
        cur->iov[cur->n].iov_len  = L->bsize;
        cur->tag[cur->n++]        = (int32_t) e;
        ++S->n_iov;
        ++n;
    }
    const int nreq = (int) (S->n_req - req0);
    if (nreq > 0) {
        atomic_fetch_add(&S->outstanding, nreq);
        pi2_bundle_file_submit(c->file, S->reqs + req0, nreq);
    }
}

int pi2_cache_request(struct pi2_neuron_cache * c, int layer, const uint8_t * want, struct pi2_cache_token_stats * st,
                      char * err, size_t errlen) {
    pi2_wait_outstanding(c);
    if (pi2_bundle_file_check(c->file, err, errlen) != 0) {
        return -1;
    }
    c->error[0] = '\0';
    c->epoch++;
    struct pi2_cache_layer * L = &c->layer[layer];
    for (uint32_t s = 0; s < L->hot_slots; ++s) {
        st->hot_hits += want[s] != 0;
    }
    // A miss within c->gap bundles of the run before it extends that run, reading the bundles between too:
    // one larger read costs far less than another request here. Hits and misses count neurons; a bundle is
    // read when any of its neurons is wanted.
    uint32_t nreq = 0, n_iov = 0;
    bool failed = false;
    struct pi2_io_req * cur = NULL;
    int64_t last = -1; // last bundle in cur
    for (uint32_t k = L->hot_k; k < L->n_bundles && !failed; ++k) {
        const uint32_t wanted = pi2_wanted(L, want, k);
        if (wanted == 0) {
            continue;
        }
        const int64_t e = L->where[k];
        // (a failed prefetch for an earlier request that did not want it is read again, as a miss)
        if (e >= 0 && c->ent[e].prefetched &&
            (c->ent[e].pin == c->epoch || atomic_load(&c->ent[e].state) != PI2_ENTRY_FAILED)) {
            // read (or being read) for this request ahead of it: a miss and its bytes, not read again; if
            // its read failed, pi2_cache_get says so
            struct pi2_cold_entry * E = &c->ent[e];
            E->ref        = 1;
            E->pin        = c->epoch;
            E->prefetched = 0;
            st->misses += wanted;
            st->prefetched += wanted;
            st->bytes_read += L->bsize;
            continue;
        }
        if (e >= 0 && atomic_load(&c->ent[e].state) == PI2_ENTRY_READY) {
            c->ent[e].ref = 1;
            c->ent[e].pin = c->epoch;
            st->cold_hits += wanted;
            continue;
        }
        st->misses += wanted;
        // (a miss right after the run extends it too: from == k with extend set)
        const bool extend = cur != NULL && (int64_t) k - last - 1 <= (int64_t) c->gap &&
                            cur->n + ((int64_t) k - last) <= (int64_t) c->max_run;
        const int64_t from = extend ? last + 1 : k;
        if (!extend) {
            cur = &c->reqs[nreq++];
            cur->offset = L->offset + (uint64_t) k * L->bsize;
            cur->n      = 0;
            cur->iov    = c->iov + n_iov;
            cur->tag    = c->tags + n_iov;
        }
        n_iov += (uint32_t) (k - from) + 1;
        // the bundles between go to a sink (one gap's worth, shared: its contents are never used); kept in
        // the cache they evicted entries worth keeping (measured: the cold segment's hits went to zero)
        for (int64_t g = from; g < k; ++g) {
            cur->iov[cur->n].iov_base = c->sink + (size_t) (g - from) * c->entry_size;
            cur->iov[cur->n].iov_len  = L->bsize;
            cur->tag[cur->n++]        = -1;
            st->bytes_read += L->bsize;
        }
        const int64_t ge = pi2_claim(c, layer, k, c->epoch, false);
        if (ge < 0) {
            snprintf(err, errlen, "neuron cache: no free entry among %u for layer %d (cache too small)", c->n_cold, layer);
            failed = true;
            break;
        }
        cur->iov[cur->n].iov_base = c->cold + (size_t) ge * c->entry_size;
        cur->iov[cur->n].iov_len  = L->bsize;
        cur->tag[cur->n++]        = (int32_t) ge;
        st->bytes_read += L->bsize;
        last = k;
    }
    if (cur != NULL && cur->n == 0) { // a run that failed before its first bundle
        nreq--;
    }
    st->requests += nreq;
    atomic_store(&c->outstanding, (int) nreq);
    if (nreq > 0) {
        pi2_bundle_file_submit(c->file, c->reqs, (int) nreq);
    }
    return failed ? -1 : 0;
}

const uint8_t * pi2_cache_peek(const struct pi2_neuron_cache * c, int layer, int64_t slot) {
    const struct pi2_cache_layer * L = &c->layer[layer];
    const int64_t k      = slot / L->neurons;
    const size_t  within = (size_t) (slot % L->neurons) * L->stride;
    if (k < L->hot_k) {
        return L->hot + (size_t) k * L->bsize + within;
    }
    const int32_t e = L->where[k];
    if (e < 0 || atomic_load_explicit(&c->ent[e].state, memory_order_acquire) != PI2_ENTRY_READY) {
        return NULL;
    }
    return c->cold + (size_t) e * c->entry_size + within;
}

const uint8_t * pi2_cache_get(struct pi2_neuron_cache * c, int layer, int64_t slot, uint64_t * wait_ns) {
    const uint8_t * ready = pi2_cache_peek(c, layer, slot);
    if (ready != NULL) {
        return ready;
    }
    const struct pi2_cache_layer * L = &c->layer[layer];
    const int32_t e = L->where[slot / L->neurons];
    if (e < 0) {
        return NULL;
    }
    struct pi2_cold_entry * E = &c->ent[e];
    int s = atomic_load_explicit(&E->state, memory_order_acquire);
    // not ready: its read is pending (or just finished, or failed)
    const uint64_t t0 = pi2_now_ns();
    for (int spin = 0; s == PI2_ENTRY_PENDING; ++spin) {
        if (spin < 100) {
            pi2_cpu_relax();
        } else {
            atomic_fetch_add(&c->waiters, 1);
            const unsigned g = atomic_load(&c->completions);
            if (atomic_load(&E->state) == PI2_ENTRY_PENDING) {
                pi2_futex_wait(&c->completions, g);
            }
            atomic_fetch_sub(&c->waiters, 1);
        }
        s = atomic_load_explicit(&E->state, memory_order_acquire);
    }
    *wait_ns += pi2_now_ns() - t0;
    if (s != PI2_ENTRY_READY) {
        return NULL;
    }
    return c->cold + (size_t) e * c->entry_size + (size_t) (slot % L->neurons) * L->stride;
}

int pi2_cache_finish(struct pi2_neuron_cache * c, char * err, size_t errlen) {
    pi2_wait_outstanding(c);
    if (c->error[0] != '\0') {
        snprintf(err, errlen, "%s", c->error);
        return -1;
    }
    return pi2_bundle_file_check(c->file, err, errlen);
}

const char * pi2_cache_error(struct pi2_neuron_cache * c) {
    if (c->error[0] != '\0') {
        return c->error;
    }
    // the prefetch read for this request first (a set's reads are done before it is used again)
    const struct pi2_pf_set * a = c->pf[0].key == c->epoch ? &c->pf[0] : &c->pf[1];
    const struct pi2_pf_set * b = a == &c->pf[0] ? &c->pf[1] : &c->pf[0];
    return a->error[0] != '\0' ? a->error : b->error;
}

void pi2_cache_inject_fault(struct pi2_neuron_cache * c, int64_t after, int err) {
    pi2_bundle_file_inject_fault(c->file, after, err);
}

bool pi2_cache_direct_io(const struct pi2_neuron_cache * c) {
    return pi2_bundle_file_direct(c->file);
}

const struct pi2_cache_plan * pi2_cache_get_plan(const struct pi2_neuron_cache * c) {
    return &c->plan;
}
