#include "sparse/batch_ffn.h"

#include <string.h>

#include <omp.h>

#include "sparse/column_axpy.h"
#include "sparse/predictor.h"
#include "sparse/sparse_kernels.h"

// From this many tokens a batch dequantizes a cluster's down columns once and adds them to four tokens at a time
// (pi2_columns_add_tokens), instead of unpacking each column again for every token that uses it.
#define PI2_BATCH_FLOAT_DOWN 4
_Static_assert(PI2_COLUMNS_MAX >= PI2_CLUSTER, "a cluster's columns fit one pi2_columns_add4 call");

// Thread ith owns clusters ith, ith + nth, ... (a fixed share, so a run is reproducible for a thread count): for each
// of its neurons in slot order, the gate and up rows are dotted with every token's input while they sit in L1, then
// each token adds the cluster's active down columns (in L2 by then) to the thread's partial sum of that token. The
// partial sums are added in thread order at the end.
//
// Workspace (sparse_ffn.c): p->y holds nth * n_tokens rows of n_embd, p->acts nth * n_tokens * PI2_CLUSTER values,
// p->tok and p->tok_vals nth * 2 * n_tokens (a neuron's tokens and their dot products).
static void pi2_batch_clusters(struct pi2_sparse_plan * p, int ith, int nth) {
    const struct pi2_sidecar_layer * L = p->L;
    const int64_t n_tokens = p->n_tokens, n_embd = p->n_embd;
    struct pi2_thread_stats * st = &p->stats[ith];
    float * y    = p->y + (size_t) ith * (size_t) n_tokens * (size_t) n_embd;
    float * acts = p->acts + (size_t) ith * (size_t) n_tokens * PI2_CLUSTER; // [n_tokens][PI2_CLUSTER]
    float * tmp  = p->tmp + (size_t) ith * p->tmp_stride;
    float * colf = p->colf + (size_t) ith * PI2_CLUSTER * (size_t) n_embd;
    int32_t * gate_tok = p->tok + (size_t) ith * 2 * (size_t) n_tokens, * up_tok = gate_tok + n_tokens;
    float * gate_val = p->tok_vals + (size_t) ith * 2 * (size_t) n_tokens, * up_val = gate_val + n_tokens;
    const uint8_t * bundle[PI2_CLUSTER];
    for (int64_t c = ith; c < p->n_clusters && !atomic_load_explicit(&p->failed, memory_order_relaxed); c += nth) {
        const int64_t s0 = c * PI2_CLUSTER, s1 = s0 + PI2_CLUSTER < p->n_ff ? s0 + PI2_CLUSTER : p->n_ff;
        for (int64_t s = s0; s < s1; ++s) {
            const int64_t j = s - s0;
            bundle[j] = NULL;
            for (int64_t t = 0; t < n_tokens; ++t) {
                acts[t * PI2_CLUSTER + j] = 0.0f;
            }
            if (p->want[s] == 0) { // no token's predictor chose it: not read, it adds nothing
                continue;
            }
            if ((bundle[j] = pi2_plan_bundle(p, s, st)) == NULL) {
                return;
            }
            if (s + 1 < s1 && p->want[s + 1] != 0) {
                const uint8_t * next = pi2_plan_bundle_peek(p, s + 1);
                if (next != NULL) {
                    pi2_prefetch_bytes(next, L->data_end);
                }
            }
            const uint8_t * gate_row = bundle[j], * up_row = bundle[j] + L->up_offset;
            const int32_t neuron = L->order[s];
            const uint8_t * token_want = p->token_want != NULL ? p->token_want + s : NULL;
            // the gate row against every token that computes it, then the up row against those whose gate fired:
            // several tokens a call where a kernel has them (pi2_dot_listed), each token's value as decode computes it
            int64_t n_gate = 0;
            for (int64_t t = 0; t < n_tokens; ++t) {
                if (token_want == NULL || token_want[t * p->n_ff] != 0) { // else not this token's: it adds nothing
                    gate_tok[n_gate++] = (int32_t) t;
                }
            }
            st->predicted += n_gate;
            pi2_dot_listed(p->gate_dot_tokens, p->gate_dot, (int) n_embd, gate_row, p->xq, p->xq_stride, gate_tok, n_gate,
                           gate_val);
            int64_t n_up = 0;
            for (int64_t k = 0; k < n_gate; ++k) {
                const int32_t t = gate_tok[k];
                const float g = pi2_plan_gate(p, gate_val[k], neuron);
                const float act = pi2_act_gate(&p->act, g);
                if (pi2_fires(p, g, act)) {
                    up_tok[n_up] = t;
                    gate_val[n_up++] = act; // n_up <= k: entries already read
                }
            }
            pi2_dot_listed(p->up_dot_tokens, p->up_dot, (int) n_embd, up_row, p->xq_up, p->xq_up_stride, up_tok, n_up,
                           up_val);
            st->admitted += n_up;
            for (int64_t k = 0; k < n_up; ++k) {
                const int32_t t = up_tok[k];
                const float u = pi2_plan_up(p, up_val[k], neuron);
                const float v = gate_val[k] * pi2_act_up(&p->act, u);
                if (pi2_active(p, v, u)) {
                    st->active++;
                    acts[t * PI2_CLUSTER + j] = v;
                }
            }
        }
        if (n_tokens >= PI2_BATCH_FLOAT_DOWN) {
            const void * cols[PI2_CLUSTER];
            for (int64_t j = 0; j < s1 - s0; ++j) {
                cols[j] = bundle[j] != NULL ? bundle[j] + L->down_offset : NULL;
            }
            pi2_columns_add_tokens(L->down_type, n_embd, n_tokens, y, (size_t) n_embd * sizeof(float), (int) (s1 - s0),
                                   acts, PI2_CLUSTER, cols, colf, tmp);
            continue;
        }
        for (int64_t t = 0; t < n_tokens; ++t) {
            struct pi2_column_sum sum = { .type = L->down_type, .n = n_embd, .y = y + (size_t) t * (size_t) n_embd, .tmp = tmp };
            for (int64_t j = 0; j < s1 - s0; ++j) {
                const float a = acts[t * PI2_CLUSTER + j];
                if (a != 0.0f) {
                    pi2_column_sum_add(&sum, a, bundle[j] + L->down_offset);
                }
            }
            pi2_column_sum_finish(&sum);
        }
    }
}

// The neurons the batch computes (p->want): in predicted mode those the predictor selects for any of its tokens,
// else all. A batch reads no bundle that no token's predictor wants (for a routed expert with a few tokens, far fewer
// than all), and computes every wanted neuron for every token, or with p->token_want only for the tokens whose
// predictor selected it (each token then computes what its decode would).
static void pi2_batch_want(struct pi2_sparse_plan * p, int ith, int nth) {
    const int64_t n_ff = p->n_ff, f0 = n_ff * ith / nth, f1 = n_ff * (ith + 1) / nth;
    if (p->select == PI2_SELECT_ALL) {
        memset(p->want + f0, 1, (size_t) (f1 - f0));
        return;
    }
    memset(p->want + f0, 0, (size_t) (f1 - f0));
    for (int64_t t = 0; t < p->n_tokens; ++t) {
        if (ith == nth - 1) {
            pi2_convert_row(p->to_pred_vdt, (const float *) ((const char *) p->x->data + t * p->x->nb[1]), p->xp, p->n_embd);
        }
        #pragma omp barrier
        pi2_predictor_hidden(p, ith, nth);
        #pragma omp barrier
        int64_t z0 = 0, z1 = 0;
        pi2_predictor_scores(p, ith, nth, &z0, &z1);
        for (int64_t s = z0; s < z1; ++s) {
            const bool sel = pi2_plan_selects(p, s);
            p->want[s] |= sel;
            if (p->token_want != NULL) {
                p->token_want[t * n_ff + s] = sel;
            }
        }
        #pragma omp barrier // h, z and xp are the next token's
    }
}

void pi2_batch_run(struct pi2_sparse_plan * p, int nth) {
    #pragma omp parallel num_threads(nth)
    {
        #pragma omp single
        p->nth = omp_get_num_threads();
        const int ith = omp_get_thread_num(), n = p->nth;
        const int64_t n_tokens = p->n_tokens, n_embd = p->n_embd;
        // the neurons wanted and every token's input converted, a token to a thread; this thread's sums zeroed. The
        // region's gate, up and GLU tensors are not written: the region is computed whole and nothing outside it reads
        // them (an eval callback that asks for one splits the graph there, and PI2 then computes it alone). Written
        // token by token at each neuron's place, they were a cache miss per value (Qwen2.5-1.5B: 27 MB a layer
        // scattered over a chunk of 256 tokens)
        pi2_batch_want(p, ith, n);
        for (int64_t t = ith; t < n_tokens; t += n) {
            pi2_convert_token(p, t);
        }
        memset(p->y + (size_t) ith * (size_t) n_tokens * (size_t) n_embd, 0, (size_t) n_tokens * (size_t) n_embd * sizeof(float));
        // the wanted bundles, once, requested after every token's input is converted (llama's allocator may have placed
        // an output over the input)
        #pragma omp barrier
        if (ith == 0) {
            p->submit(p, n_tokens - 1);
        }
        #pragma omp barrier
        if (!atomic_load(&p->failed)) { // set before the barrier above, so seen alike
            pi2_batch_clusters(p, ith, n);
        }
        #pragma omp barrier
        if (!atomic_load(&p->failed)) {
            for (int64_t t = ith; t < n_tokens; t += n) {
                float * out = (float *) ((char *) p->down->data + t * p->down->nb[1]);
                for (int64_t o = 0; o < n_embd; ++o) {
                    float s = 0.0f;
                    for (int k = 0; k < n; ++k) {
                        s += p->y[((size_t) k * (size_t) n_tokens + (size_t) t) * (size_t) n_embd + (size_t) o];
                    }
                    out[o] = s;
                }
            }
        }
    }
    p->n_down_sparse = p->n_tokens;
}
