// The memory budget of a model whose FFN lives on flash: the neuron cache gets what the budget leaves
// once the model is loaded (the process's resident memory, llama's compute buffers still to come, the
// cache's tables and a margin), split into a hot segment (the most frequently active bundles over all
// layers, by one frequency cutoff) and a cold segment that can hold any one layer's other bundles, plus
// room to prefetch the next layer's first bundles.
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "model/model_binding.h"
#include "flash/neuron_cache.h"
#include "model/sidecar.h"

// Memory kept free of the cache for what the accounting cannot see (allocator slack, stacks). Measured: a process
// peaks ~3 MB above its plan (SmolLM2, tests/test_memory_budget.py), and 8 and 16 MB ran without OOM kills on
// Qwen2.5-1.5B under 600 MB (0 MB too), real8 under 360 MB and the 7B dReLU under 2080 MB, where on real8 each MB
// given to the cache reads less (docs/MEASUREMENTS.md, 2026-11-29, "The budget margin halved").
#define PI2_BUDGET_MARGIN (16ull << 20)

// Cache bytes below which some layer could not hold every neuron one token may need.
uint64_t pi2_cache_min_bytes(const struct pi2_sidecar * sc);
// Bytes the cache spends outside its segments (bundle maps, entry table, request buffers), with request
// buffers for ahead_pairs routed experts read ahead (an MoE sidecar).
uint64_t pi2_cache_overhead_bytes(const struct pi2_sidecar * sc, uint32_t ahead_pairs);
// Bundles the read-ahead of ahead_pairs routed experts may queue at once (0 for a sidecar without experts).
uint64_t pi2_cache_ahead_bundles(const struct pi2_sidecar * sc, uint32_t ahead_pairs);
// How `bytes` splits into hot and cold segments, with cold room for up to prefetch_bytes of prefetched
// bundles beyond one layer's need (less if the cache cannot spare it), and at most 1 - cold_share of the
// bytes hot; false if bytes hold fewer than one layer's bundles or memory runs out. skip ([n_layer], NULL: none): 1 for
// the layers that read no bundles (read whole from the model file), which get no hot bundles and need no cold room.
// Free with pi2_cache_plan_free.
bool pi2_cache_plan(const struct pi2_sidecar * sc, const uint8_t * skip, uint64_t bytes, uint64_t prefetch_bytes,
                    double cold_share, struct pi2_cache_plan * out);
void pi2_cache_plan_free(struct pi2_cache_plan * plan);

// Sizes and makes b's neuron cache (replacing one it had) from `budget` minus what the process holds now,
// minus `reserved` (memory the caller knows will be touched later: llama's compute buffers), the cache's
// tables and the margin, with b's settings (PI2_CACHE_MAX, PI2_COLD_SHARE, PI2_PREFETCH_BYTES, PI2_IO_*).
// Reads the hot segment. 0, or -1 with err naming the minimum budget.
int pi2_binding_size_cache(struct pi2_binding * b, uint64_t budget, uint64_t reserved, char * err, size_t errlen);
// PI2_MEMORY_BUDGET's model (frontends other than pi2_gguf, which set the budget themselves): its cache sized from
// the environment's budget, with a twentieth of it kept for llama's compute buffers, whose size the plugin cannot
// ask. 0, or -1 with b->error set (no budget was set, or it is too small).
int pi2_binding_size_env_cache(struct pi2_binding * b);
// whether the binding's neuron cache exists (sized by pi2_binding_size_cache)
bool pi2_binding_has_cache(struct pi2_binding * b);
