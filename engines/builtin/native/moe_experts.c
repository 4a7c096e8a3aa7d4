/* A mixture-of-experts layer's experts in one call (engines/builtin/moe.py): for each expert
 * with tokens, in ascending order, gather its rows, y = silu_and_mul(rows Wgate_up^T) Wdown^T,
 * and out[row] += weight * y[row]. The same kernels on the same values as the module path
 * (index_select, the experts' Linear layers, silu_and_mul, index_add_), in the same order, so
 * the results are the same; what it saves is the Python and the ~7 torch calls per expert
 * between them, which at batch 1 cost more than a small expert's matmuls.
 *
 * One parallel region: the team goes through the experts together, each member taking its
 * share of the gather's rows, of each linear's output rows, of the activation's columns and of
 * the weighted add's columns (so each element of `out` is added to by one member, expert after
 * expert, in the module path's order); team barriers between dependent ops. */

#include <stdlib.h>

#include "kernels.h"
#include "team.h"

void moe_experts_part(const ExpertsRun *r, const Member *me) {
    int64_t c0, c1, i0, i1;
    team_share(r->hidden, me, &c0, &c1);
    team_share(r->inter, me, &i0, &i1);
    float *own = r->own + me->id * r->own_floats;
    for (int64_t e = 0; e < r->E; e++) {
        const int64_t first = r->offsets[e], n = r->offsets[e + 1] - first;
        if (n == 0) continue;
        int64_t t0, t1;
        team_share(n, me, &t0, &t1);
        for (int64_t t = t0; t < t1; t++) {
            const float *src = r->x + r->rows[first + t] * r->hidden;
            float *dst = r->xs + t * r->hidden;
            for (int64_t c = 0; c < r->hidden; c++) dst[c] = src[c];
        }
        team_barrier(me);
        any_linear_part(r->gate_up + e, r->xs, r->gu, n, r->shared, own, me);
        team_barrier(me);
        silu_and_mul_cols(r->gu, r->act, n, r->inter, i0, i1);
        team_barrier(me);
        any_linear_part(r->down + e, r->act, r->y, n, r->shared, own, me);
        team_barrier(me);
        for (int64_t t = 0; t < n; t++) { /* row after row: index_add_'s order */
            const float w = r->weights[first + t];
            float *dst = r->out + r->rows[first + t] * r->hidden;
            const float *src = r->y + t * r->hidden;
            for (int64_t c = c0; c < c1; c++) dst[c] += src[c] * w;
        }
        /* the next expert's gather overwrites xs, which this one's linears have read: the
         * barrier after its down projection covers that */
    }
}

void moe_experts_scratch(const LinearWeights *gate_up, const LinearWeights *down, int64_t E,
                         int64_t rows, int64_t hidden, int64_t inter, int64_t *outputs,
                         int64_t *shared, int64_t *own) {
    *outputs = rows * (2 * hidden + 3 * inter);
    *shared = *own = 0;
    for (int64_t e = 0; e < E; e++) {
        const LinearWeights *linears[2] = {gate_up + e, down + e};
        for (int i = 0; i < 2; i++) {
            int64_t need_shared, need_own;
            linear_scratch(linears[i], rows, &need_shared, &need_own);
            *shared = need_shared > *shared ? need_shared : *shared;
            *own = need_own > *own ? need_own : *own;
        }
    }
}

void moe_experts_bind(ExpertsRun *r, float *scratch, int64_t rows, int64_t shared) {
    r->xs = scratch;
    r->gu = r->xs + rows * r->hidden;
    r->act = r->gu + rows * 2 * r->inter;
    r->y = r->act + rows * r->inter;
    r->shared = r->y + rows * r->hidden;
    r->own = r->shared + shared;
}

/* offsets [E + 1]: expert e's (token, expert) pairs are offsets[e] .. offsets[e + 1] - 1, rows
 * [pairs] their token rows of x [T, hidden], weights [pairs] their routing weights; out
 * [T, hidden] is added to. Returns 0, or -1 when the scratch could not be allocated (nothing
 * computed). */
int64_t moe_experts_f32(const LinearWeights *gate_up, const LinearWeights *down, int64_t E,
                        const float *x, int64_t hidden, int64_t inter, const int64_t *offsets,
                        const int64_t *rows, const float *weights, float *out, int64_t threads,
                        int64_t spin_ns) {
    int64_t most = 0, outputs, shared, own;
    for (int64_t e = 0; e < E; e++) {
        const int64_t n = offsets[e + 1] - offsets[e];
        most = n > most ? n : most;
    }
    if (most == 0) return 0;
    moe_experts_scratch(gate_up, down, E, most, hidden, inter, &outputs, &shared, &own);
    if (threads < 1) threads = 1;
    float *scratch = malloc(sizeof(float) * (outputs + shared + threads * own));
    if (scratch == NULL) return -1;
    ExpertsRun run = {.gate_up = gate_up, .down = down, .x = x, .weights = weights,
                      .offsets = offsets, .rows = rows, .out = out, .E = E, .hidden = hidden,
                      .inter = inter, .own_floats = own};
    moe_experts_bind(&run, scratch, most, shared);
    Team team = {.spin_ns = spin_ns};
    if (threads == 1) {
        const Member me = {&team, 0, 1};
        moe_experts_part(&run, &me);
    } else {
#pragma omp parallel num_threads(threads)
        {
            const Member me = team_member(&team);
            moe_experts_part(&run, &me);
        }
    }
    free(scratch);
    return 0;
}
