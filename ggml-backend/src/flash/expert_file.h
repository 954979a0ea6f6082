// Routed experts read whole from the model file under a memory budget (PI2_EXPERT_READS=model): no second copy.
// An expert's gate, up and down are each one contiguous range of the model's stacked *_exps tensors (its slice
// along ne[2]; with ffn_gate_up_exps its gate and up rows are one range). A miss reads the 4 KiB-aligned span
// covering each range with O_DIRECT straight into a cache entry, and the matrices are used where they landed
// inside it (no bounce copy). Entries hold one expert each and are replaced least recently used first, so a
// layer's experts that routing reuses stay; the dense kernels compute from the entry as from RAM. A dense model's FFN
// layers (pi2.dense_reads = model) are read the same way, each layer one expert (ffn_gate/up/down, or phi3's fused
// ffn_up as its two halves): entries pinned to layers, the rest streamed (pi2_expert_file_ahead).
// Not thread-safe: the binding's cache lock serializes its users (one FFN at a time per model).
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "ggml.h"

struct pi2_expert_file;

// What the model file holds for one layer's routed experts, as found when the cache is made.
struct pi2_expert_matrices {
    const void *   data[3];  // gate, up, down of the expert, inside its cache entry
    enum ggml_type type[3];
};

// Opens the model file and finds every routed-expert layer's tensors (dense: every dense FFN layer's, each layer one
// expert 0), with an expert cache of `bytes` (at least one entry: pi2_expert_file_entry_bytes); reads go to the disk
// in requests of at most chunk_max bytes (PI2_IO_MAX_BYTES). NULL with err on failure (naming the file and the tensor).
struct pi2_expert_file * pi2_expert_file_open(const char * model_path, bool dense, uint64_t bytes, uint64_t chunk_max,
                                               char * err, size_t errlen);
// The same for the dense layers il with only[il] != 0 (il < n_only) alone: the others are not the file's to read, and an
// entry holds the largest of those kept
struct pi2_expert_file * pi2_expert_file_open_layers(const char * model_path, const uint8_t * only, int n_only, uint64_t bytes,
                                                      uint64_t chunk_max, char * err, size_t errlen);
void pi2_expert_file_free(struct pi2_expert_file * f);

// Bytes one entry takes (the largest expert of any layer, with its alignment slack); 0 with err where the model
// has no routed experts or its file cannot be read.
uint64_t pi2_expert_file_entry_bytes(const char * model_path, bool dense, char * err, size_t errlen);
// What the model file holds for one layer (a dense FFN, or its routed experts)
struct pi2_expert_file_layer {
    bool           present; // the layer has such FFNs
    uint64_t       bytes;   // an entry holding the layer's largest expert (a dense layer: the layer) with its alignment slack
    enum ggml_type type[3]; // gate, up, down
};
// The layers of the model file (out[0 .. cap)), as pi2_expert_file_open would find them: how many the model has, or -1
// with err
int pi2_expert_file_layers(const char * model_path, bool dense, struct pi2_expert_file_layer * out, int cap, char * err,
                           size_t errlen);

// The cache's entries (each one expert) and their bytes
uint32_t pi2_expert_file_entries(const struct pi2_expert_file * f);
uint64_t pi2_expert_file_bytes(const struct pi2_expert_file * f);

// What one get found or read
struct pi2_expert_read_stats {
    uint64_t hits, misses, bytes_read, requests, wait_ns;
};

struct pi2_counters;
// Adds st to layer `layer`'s flash counters (hits count as cold hits: an expert cache has no hot segment).
void pi2_expert_read_count(struct pi2_counters * c, int layer, const struct pi2_expert_read_stats * st);

// A batch's experts of one layer, before any computes, in the order they will be got: those cached are pinned for
// the batch, then the others' reads queued into free entries (none left: queued as entries free), in this order,
// and submitted at once (io_uring where the kernel allows), so the disk has them all while those that arrived
// compute. The entries of the batch before are no longer pinned. cached[i]: 1 where experts[i] was in
// the cache already.
void pi2_expert_file_want(struct pi2_expert_file * f, int layer, const int32_t * experts, int n, uint8_t * cached,
                          struct pi2_expert_read_stats * st);
// Whether each of the n experts wanted has an entry (cached, or its read queued into one): then none of them needs an
// entry when got, and they may be computed side by side, each pinned until done.
bool pi2_expert_file_all_placed(const struct pi2_expert_file * f, int layer, const int32_t * experts, int n);
// Of the n wanted experts not yet done (done[i] == 0), the index of one that is in memory (read, or cached), taking the
// completions that arrived (and requesting the next reads); waits for the next completion while none is, and returns
// one whose read was not queued (it is read when got) when nothing is in flight. -1 when every one is done.
int pi2_expert_file_next(struct pi2_expert_file * f, int layer, const int32_t * experts, const uint8_t * done, int n,
                         struct pi2_expert_read_stats * st);

// A dense model's layer `layer` is wanted (pi2_expert_file_want): the next layer that streams (has no entry of its own)
// is queued for reading into a free entry behind it, so the disk reads it while this one and the pinned layers between
// compute. Nothing for a routed-expert cache, a cache where every layer has its entry, or synchronous reads.
void pi2_expert_file_ahead(struct pi2_expert_file * f, int layer, struct pi2_expert_read_stats * st);

// Expert e has computed: its entry may be replaced (least recently used first) by an expert still to come.
void pi2_expert_file_done(struct pi2_expert_file * f, int layer, int32_t e);

// Expert e of model layer `layer`: its matrices once read (waiting for reads queued for it, or reading it now), valid
// until the batch ends. 0, or -1 with err (a read failed, or the model has no such expert).
int pi2_expert_file_get(struct pi2_expert_file * f, int layer, int32_t e, struct pi2_expert_matrices * out,
                        struct pi2_expert_read_stats * st, char * err, size_t errlen);

// whether reads go through io_uring (else each expert is read when it is got)
bool pi2_expert_file_ring(const struct pi2_expert_file * f);

// Whether matrices got from the model file have the types of the loaded model's weights w (gate, up, down): a file
// changed since the model loaded would otherwise be computed as another type. False with err naming the layer (its
// routed experts, or a dense layer's FFN) and both types.
bool pi2_expert_matrices_match(const struct pi2_expert_matrices * em, const struct ggml_tensor * const w[3],
                               const char * model_path, int layer, bool experts, char * err, size_t errlen);
