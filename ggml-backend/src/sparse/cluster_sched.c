#include "sparse/cluster_sched.h"

#include <string.h>

#include <omp.h>

#include "sparse/predictor.h"
#include "sparse/sparse_kernels.h"

// balanced assignment's weights for the clusters of slots [z0, z1) (whole clusters: W2's blocks are clusters)
static void pi2_cluster_weights(struct pi2_sparse_plan * p, int64_t z0, int64_t z1) {
    for (int64_t c = z0 / PI2_CLUSTER; c < z1 / PI2_CLUSTER; ++c) {
        int32_t w = 1;
        for (int64_t s = c * PI2_CLUSTER; s < (c + 1) * PI2_CLUSTER; ++s) {
            w += pi2_plan_selects(p, s);
        }
        p->weight[c] = w;
    }
}

// balanced split: thread ith's run [*c0, *c1) of clusters, cut where the running weight crosses
// ith/nth of the total (the same cut on every thread: the weights were written before a barrier)
static void pi2_balanced_range(const struct pi2_sparse_plan * p, int ith, int nth, int64_t * c0, int64_t * c1) {
    const int64_t n_clusters = p->n_clusters;
    int64_t total = 0;
    for (int64_t c = 0; c < n_clusters; ++c) {
        total += p->weight[c];
    }
    const int64_t lo = total * ith, hi = total * (ith + 1);
    int64_t run = 0, c = 0;
    for (; c < n_clusters && run * nth < lo; ++c) {
        run += p->weight[c];
    }
    *c0 = c;
    for (; c < n_clusters && run * nth < hi; ++c) {
        run += p->weight[c];
    }
    *c1 = ith == nth - 1 ? n_clusters : c;
}

// the slots of clusters [c0, c1) (every step-th) whose gate row is computed, in cluster order: s for a
// predicted slot, -1 - s for one computed only for the recall check. Returns their count.
static int64_t pi2_thread_candidates(const struct pi2_sparse_plan * p, int64_t c0, int64_t c1, int64_t step, int32_t * cand) {
    int64_t n = 0;
    for (int64_t c = c0; c < c1; c += step) {
        const int64_t s1 = (c + 1) * PI2_CLUSTER < p->n_ff ? (c + 1) * PI2_CLUSTER : p->n_ff;
        for (int64_t s = c * PI2_CLUSTER; s < s1; ++s) {
            bool pred = true;
            if (p->want != NULL) { // flash: what the request asked for
                if (p->want[s] == 0) {
                    continue;
                }
                pred = p->want[s] == 1;
            } else if (p->select != PI2_SELECT_ALL) {
                pred = pi2_plan_selects(p, s);
                if (!pred && p->select != PI2_SELECT_CHECKED) {
                    continue;
                }
            }
            cand[n++] = pred ? (int32_t) s : -1 - (int32_t) s;
        }
    }
    return n;
}

// phase 2 for thread ith: its clusters through gate, threshold and up
static void pi2_sched_clusters(struct pi2_sparse_plan * p, int ith, int nth, int64_t t) {
    struct pi2_token_rows r = pi2_token_rows(p, ith, t);
    if (p->source == PI2_SOURCE_MODEL_ROWS) {
        // whole chunks per thread: chunk c's active neurons are the down list's cluster c
        const int64_t f0 = p->n_clusters * ith / nth * PI2_CLUSTER;
        const int64_t f1 = ith == nth - 1 ? p->n_ff : p->n_clusters * (ith + 1) / nth * PI2_CLUSTER;
        pi2_kernel_gate_up_model_rows(p, &r, f0, f1);
        return;
    }
    int64_t c0 = ith, c1 = p->n_clusters, step = nth;
    if (p->assign == PI2_ASSIGN_BALANCED) {
        pi2_balanced_range(p, ith, nth, &c0, &c1);
        step = 1;
    }
    int32_t * cand = p->cand + (size_t) ith * p->n_ff;
    const int64_t n = pi2_thread_candidates(p, c0, c1, step, cand);
    pi2_kernel_gate_up(p, &r, cand, n);
}

static void pi2_sched_token(struct pi2_sparse_plan * p, int ith, int nth, int64_t t) {
    // the flag is only set before a barrier, so every thread takes the same branch here
    if (atomic_load(&p->failed)) {
        return;
    }
    const int64_t n_ff   = p->n_ff;
    const int64_t n_embd = p->n_embd;
    const float * xt     = (const float *) ((const char *) p->x->data + t * p->x->nb[1]);
    const bool predicted = p->select != PI2_SELECT_ALL;

    // phase 0: outputs cleared, activations converted once for every dot product of this token
    const int64_t f0 = n_ff * ith / nth, f1 = n_ff * (ith + 1) / nth;
    memset((char *) p->gate->data + t * p->gate->nb[1] + f0 * sizeof(float), 0, (size_t) (f1 - f0) * sizeof(float));
    memset((char *) p->up->data + t * p->up->nb[1] + f0 * sizeof(float), 0, (size_t) (f1 - f0) * sizeof(float));
    memset((char *) p->glu->data + t * p->glu->nb[1] + f0 * sizeof(float), 0, (size_t) (f1 - f0) * sizeof(float));
    const int64_t n_clusters = p->n_clusters;
    const int64_t k0 = n_clusters * ith / nth, k1 = n_clusters * (ith + 1) / nth;
    memset(p->n_act + k0, 0, (size_t) (k1 - k0) * sizeof(int32_t)); // clusters a failed read skipped stay empty
    if (ith == 0) {
        pi2_convert_token(p, t);
    }
    if (predicted && ith == nth - 1) {
        pi2_convert_row(p->to_pred_vdt, xt, p->xp, n_embd);
    }
    #pragma omp barrier

    // phase 1: predictor hidden layer, then the scores
    if (predicted) {
        pi2_predictor_hidden(p, ith, nth);
        #pragma omp barrier
        int64_t z0 = 0, z1 = 0;
        pi2_predictor_scores(p, ith, nth, &z0, &z1);
        if (p->assign == PI2_ASSIGN_BALANCED) {
            pi2_cluster_weights(p, z0, z1);
        }
        #pragma omp barrier
    }

    // phase 2: on flash the token's bundles requested first (every thread marks its clusters' slots, one
    // queues the reads), then the clusters, through score, gate, threshold, up
    if (p->submit != NULL) {
        p->mark(p, ith, nth);
        #pragma omp barrier
        if (ith == 0) {
            p->submit(p, t);
            p->request_failed = atomic_load(&p->failed);
        }
        #pragma omp barrier
        // not failed itself: a thread past this check may set it in its clusters (a read failed) while another has
        // yet to look, and returned alone, it would leave the other waiting at the barrier below for good
        if (p->request_failed) {
            return;
        }
    }
    pi2_sched_clusters(p, ith, nth, t);
    #pragma omp barrier

    // phase 3: down. Every thread sums the same counts, so all take the same branch.
    if (atomic_load(&p->failed)) { // set before the barrier above, so seen alike
        return;
    }
    int64_t n_active = 0;
    for (int64_t c = 0; c < n_clusters; ++c) {
        n_active += p->n_act[c];
    }
    float * out = (float *) ((char *) p->down->data + t * p->down->nb[1]);
    // flash has no down rows in memory: always by columns
    const bool sparse_down = p->source == PI2_SOURCE_CACHE || (float) n_active <= p->down_sparse_max * (float) n_ff;
    if (ith == 0) {
        p->n_down_sparse += sparse_down;
    }
    if (sparse_down) {
        for (int k = ith; k < p->n_split; k += nth) {
            pi2_kernel_down_columns(p, k, p->n_split, n_active);
        }
        #pragma omp barrier
        for (int k = ith; k < p->n_split; k += nth) {
            pi2_kernel_down_reduce(p, k, p->n_split, out);
        }
    } else {
        // many active neurons: the model's own down rows beat the columns (and give dense's numerics)
        if (ith == 0) {
            const float * glu_t = (const float *) ((const char *) p->glu->data + t * p->glu->nb[1]);
            pi2_convert_row(p->to_down_vdt, glu_t, p->gluq, n_ff);
        }
        #pragma omp barrier
        pi2_kernel_down_rows(p, ith, nth, out);
    }
    #pragma omp barrier // buffers are reused by the next token
}

void pi2_sched_run(struct pi2_sparse_plan * p, int nth) {
    #pragma omp parallel num_threads(nth)
    {
        // the runtime may give fewer threads than asked; the workspace fits any count up to nth
        #pragma omp single
        p->nth = omp_get_num_threads();
        const int ith = omp_get_thread_num();
        for (int64_t t = 0; t < p->n_tokens; ++t) {
            pi2_sched_token(p, ith, p->nth, t);
        }
    }
}
