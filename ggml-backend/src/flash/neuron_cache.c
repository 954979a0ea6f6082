// syscall() and MAP_ANONYMOUS are outside POSIX
#define _GNU_SOURCE
#include "flash/neuron_cache.h"

#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "core/pi2_clock.h"

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
    uint8_t    prefetched;  // read ahead for a request, not yet counted by it
    atomic_int state;
};

struct pi2_cache_layer {
    uint8_t * hot;       // hot_k bundles, in order
    uint32_t  hot_k;     // bundles
    uint32_t  hot_slots; // slots in them (min(hot_k * neurons, n_ff))
    uint32_t  n_bundles, bsize, neurons;
    size_t    stride;    // from one neuron of a bundle to the next
    int32_t * where;     // [n_bundles] cold entry holding the bundle, or -1
};

struct pi2_neuron_cache {
    struct pi2_cache_plan    plan; // (hot_k: NULL, the plan's array was the creator's)
    uint32_t                 n_layer;
    struct pi2_cache_layer * layer;
    uint8_t *                hot_mem;
    size_t                   hot_map;
    uint8_t *                cold;
    size_t                   cold_map, entry_size;
    uint8_t *                scratch;
    size_t                   scratch_map;
    struct pi2_cold_entry *  ent;
    uint32_t                 n_cold, hand, epoch;
    uint32_t                 need; // cold entries the layer with the most non-hot bundles needs

    atomic_uint completions; // futex word: bumped by every finished read (pi2_cache_signal)
    atomic_int  waiters;
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

static size_t pi2_page_round(size_t n) {
    return (n + 4095) & ~(size_t) 4095;
}

void pi2_cache_free(struct pi2_neuron_cache * c) {
    if (c == NULL) {
        return;
    }
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
    if (c->scratch != NULL) {
        munmap(c->scratch, c->scratch_map);
    }
    free(c->ent);
    free(c);
}

struct pi2_neuron_cache * pi2_cache_create(const struct pi2_sidecar * sc, const struct pi2_cache_plan * plan,
                                           uint32_t scratch_entries, char * err, size_t errlen) {
    struct pi2_neuron_cache * c = calloc(1, sizeof(*c));
    if (c == NULL) {
        snprintf(err, errlen, "sidecar %s: out of memory for the neuron cache", sc->path);
        return NULL;
    }
    c->plan       = *plan;
    c->plan.hot_k = NULL;
    c->plan.skip  = NULL;
    c->n_layer    = sc->n_layer;
    uint32_t max_n_bundles = 0;
    c->entry_size  = pi2_cache_entry_size(sc, &max_n_bundles);
    c->n_cold      = plan->n_cold;
    c->layer       = calloc(sc->n_layer, sizeof(*c->layer));
    c->ent         = calloc(c->n_cold > 0 ? c->n_cold : 1, sizeof(*c->ent));
    c->hot_map     = pi2_page_round(plan->hot_bytes);
    c->cold_map    = pi2_page_round(plan->cold_bytes);
    // at least a page: a sidecar of routed experts read whole has no bundles (entry size 0)
    c->scratch_map = pi2_page_round((size_t) (scratch_entries > 0 ? scratch_entries : 1) * (c->entry_size > 0 ? c->entry_size : 1));
    c->hot_mem     = pi2_map_anon(c->hot_map);
    c->cold        = pi2_map_anon(c->cold_map);
    c->scratch     = pi2_map_anon(c->scratch_map);
    if (c->layer == NULL || c->ent == NULL || c->scratch == NULL || (c->hot_map > 0 && c->hot_mem == NULL) ||
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
    uint8_t * hot = c->hot_mem;
    uint32_t need = 0; // cold entries the layer with the most non-hot bundles needs
    for (uint32_t il = 0; il < sc->n_layer; ++il) {
        const struct pi2_sidecar_layer * L = &sc->layer[il];
        struct pi2_cache_layer * C = &c->layer[il];
        C->n_bundles = L->n_bundles;
        C->neurons   = L->bundle_neurons;
        C->stride    = L->neuron_stride;
        C->bsize     = L->bundle_size;
        C->where     = malloc((L->n_bundles > 0 ? L->n_bundles : 1) * sizeof(int32_t)); // none: an expert read whole
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
        hot += (size_t) k * L->bundle_size;
        const uint32_t rest = plan->skip != NULL && plan->skip[il] ? 0 : L->n_bundles - k; // a layer read whole: none
        need = rest > need ? rest : need;
    }
    if (need + plan->n_prefetch > c->n_cold) { // the plan's split leaves room; a plan made for another sidecar would not
        snprintf(err, errlen, "sidecar %s: neuron cache plan leaves %u cold entries for a layer needing %u", sc->path, c->n_cold, need);
        pi2_cache_free(c);
        return NULL;
    }
    c->need = need;
    return c;
}

uint32_t pi2_cache_ahead_room(const struct pi2_neuron_cache * c) {
    return c->n_cold - c->need;
}

uint8_t * pi2_cache_hot_segment(struct pi2_neuron_cache * c, int layer, uint32_t * hot_k, uint32_t * hot_slots) {
    *hot_k     = c->layer[layer].hot_k;
    *hot_slots = c->layer[layer].hot_slots;
    return c->layer[layer].hot;
}

uint8_t * pi2_cache_scratch(struct pi2_neuron_cache * c) {
    return c->scratch;
}

void pi2_cache_unpin(struct pi2_neuron_cache * c) {
    for (uint32_t e = 0; e < c->n_cold; ++e) {
        struct pi2_cold_entry * E = &c->ent[e];
        if ((int32_t) (E->pin - c->epoch) >= 0) {
            E->pin = c->epoch - 1;
        }
    }
}

uint32_t pi2_cache_begin_request(struct pi2_neuron_cache * c) {
    return ++c->epoch;
}

uint32_t pi2_cache_epoch(const struct pi2_neuron_cache * c) {
    return c->epoch;
}

// A CLOCK victim; `done`: the current request's computation has finished, so its entries are free too.
static int64_t pi2_victim(struct pi2_neuron_cache * c, bool done) {
    for (uint64_t step = 0; step < 2 * (uint64_t) c->n_cold + 1; ++step) {
        const uint32_t e = c->hand;
        c->hand = c->hand + 1 < c->n_cold ? c->hand + 1 : 0;
        struct pi2_cold_entry * E = &c->ent[e];
        // this request's, read ahead for a later one (the next layer's, or a routed expert's further on), or
        // still being read (a prefetch the request did not want)
        if ((E->pin == c->epoch && !done) || (int32_t) (E->pin - c->epoch) > 0 || atomic_load(&E->state) == PI2_ENTRY_PENDING) {
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

int64_t pi2_cache_claim(struct pi2_neuron_cache * c, int layer, uint32_t k, uint32_t pin, bool done, bool prefetched,
                        uint8_t ** dst) {
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
    E->prefetched = prefetched;
    atomic_store(&E->state, PI2_ENTRY_PENDING);
    *dst = c->cold + (size_t) e * c->entry_size;
    return e;
}

enum pi2_found pi2_cache_find(struct pi2_neuron_cache * c, int layer, uint32_t k) {
    const struct pi2_cache_layer * L = &c->layer[layer];
    if (k < L->hot_k) {
        return PI2_FOUND_HOT;
    }
    const int64_t e = L->where[k];
    if (e < 0) {
        return PI2_FOUND_MISSING;
    }
    struct pi2_cold_entry * E = &c->ent[e];
    // (a failed prefetch for an earlier request that did not want it is read again, as a miss)
    if (E->prefetched && (E->pin == c->epoch || atomic_load(&E->state) != PI2_ENTRY_FAILED)) {
        // read (or being read) for this request ahead of it; if its read failed, pi2_cache_get says so
        E->ref        = 1;
        E->pin        = c->epoch;
        E->prefetched = 0;
        return PI2_FOUND_PREFETCHED;
    }
    if (atomic_load(&E->state) == PI2_ENTRY_READY) {
        E->ref = 1;
        E->pin = c->epoch;
        return PI2_FOUND_CACHED;
    }
    return PI2_FOUND_MISSING;
}

bool pi2_cache_should_prefetch(const struct pi2_neuron_cache * c, int layer, uint32_t k, uint32_t key) {
    const int64_t e = c->layer[layer].where[k];
    if (e < 0) {
        return true;
    }
    // cached or being read (the request checks that it is ready); a failed read for the same request is
    // left for it to report
    const struct pi2_cold_entry * E = &c->ent[e];
    return atomic_load(&E->state) == PI2_ENTRY_FAILED && !(E->prefetched && E->pin == key);
}

bool pi2_cache_pin_ahead(struct pi2_neuron_cache * c, int layer, uint32_t k, uint32_t pin) {
    const int64_t e = c->layer[layer].where[k];
    if (e < 0) {
        return false;
    }
    struct pi2_cold_entry * E = &c->ent[e];
    if (atomic_load(&E->state) != PI2_ENTRY_READY || (int32_t) (pin - E->pin) <= 0) {
        return false;
    }
    E->ref = 1;
    E->pin = pin;
    return true;
}

void pi2_cache_entry_done(struct pi2_neuron_cache * c, int64_t e, bool ok) {
    atomic_store(&c->ent[e].state, ok ? PI2_ENTRY_READY : PI2_ENTRY_FAILED);
}

void pi2_cache_signal(struct pi2_neuron_cache * c) {
    atomic_fetch_add(&c->completions, 1);
    if (atomic_load(&c->waiters) > 0) {
        pi2_futex_wake(&c->completions);
    }
}

void pi2_cache_wait_zero(struct pi2_neuron_cache * c, atomic_int * n) {
    while (atomic_load(n) > 0) {
        atomic_fetch_add(&c->waiters, 1);
        const unsigned g = atomic_load(&c->completions);
        if (atomic_load(n) > 0) {
            pi2_futex_wait(&c->completions, g);
        }
        atomic_fetch_sub(&c->waiters, 1);
    }
}

bool pi2_cache_wait_reading(struct pi2_neuron_cache * c, bool done) {
    atomic_fetch_add(&c->waiters, 1);
    const unsigned g = atomic_load(&c->completions); // before the scan: a read finishing after it ends the wait
    bool reading = false;
    for (uint32_t e = 0; e < c->n_cold && !reading; ++e) {
        const struct pi2_cold_entry * E = &c->ent[e];
        const bool pinned = (E->pin == c->epoch && !done) || (int32_t) (E->pin - c->epoch) > 0;
        reading = !pinned && atomic_load(&E->state) == PI2_ENTRY_PENDING;
    }
    if (reading) {
        pi2_futex_wait(&c->completions, g);
    }
    atomic_fetch_sub(&c->waiters, 1);
    return reading;
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

const struct pi2_cache_plan * pi2_cache_get_plan(const struct pi2_neuron_cache * c) {
    return &c->plan;
}
