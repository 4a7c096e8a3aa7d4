/* A decode step's decoder layers in one call: the same kernels, in the same order, on the
 * same values as the model's modules call them one by one from Python (engines/builtin/
 * model.py; Python side: engines/builtin/decode_program.py). What it saves is the Python
 * between the kernels: ~0.5 ms a layer on a 2-core Zen 3, which at batch 1 is more than the
 * layer's matmuls on a model of SmolLM2-135M's size.
 *
 * Per layer, for T single-token decodes (x: the previous layer's MLP output; residual: the
 * residual stream, both [T, hidden]):
 *   h = rms_norm(residual += x); qkv = h Wqkv^T; rotary + K/V store; attention over the cache;
 *   x = attn Wo^T; h = rms_norm(residual += x); x = silu_and_mul(h Wgate_up^T) Wdown^T.
 * Each linear adds the LoRA deltas of the rows lora_slots gives an adapter (NULL: none).
 * With q/k norms (Qwen3: per head), each head of q and k is normed in place before RoPE.
 * A mixture-of-experts layer (experts > 0) replaces the MLP with its router, top-k and experts
 * as engines/builtin/moe.py runs them: logits = h Wrouter^T, the k largest per token weighted
 * by their softmax over all experts (renormalized with `normalize`), the (token, expert) pairs
 * grouped by expert in token order, and moe_experts_part's experts added into x.
 * The caller passes residual zeroed before the first layer (residual += embeddings is the
 * embeddings, bit for bit), and takes x and residual back for the final norm.
 *
 * The whole step is one parallel region: its threads go through every op together, each
 * taking its share (a linear's output rows, the attention's tasks, the norms' rows), with a
 * team barrier between dependent ops (team.h: spin, then sleep, `spin_ns` deciding how long).
 * One region instead of ~10 per layer: under OMP_WAIT_POLICY=PASSIVE each region woke a
 * sleeping thread, and at batch 1 on SmolLM2-135M that made 2 threads slower than 1
 * (issue 36). */

#define _POSIX_C_SOURCE 199309L /* clock_gettime */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kernels.h"
#include "team.h"

typedef struct {
    const float *input_norm, *post_attn_norm;
    LinearWeights qkv, o, gate_up, down;
    LoraWeights qkv_lora, o_lora, gate_up_lora, down_lora; /* .a NULL: no LoRA slots */
    void *k_cache, *v_cache; /* [blocks, block_size, kv_heads, head_dim] */
    int64_t kv_format;       /* KV_FLOAT32, or FP8 bytes */
    /* mixture of experts (experts 0: a dense MLP, gate_up and down above) */
    int64_t experts, top_k, normalize, expert_inter;
    LinearWeights router;                       /* dense panels, [experts, hidden] */
    const LinearWeights *expert_gate_up, *expert_down; /* [experts] each */
    int64_t *routing;   /* [experts]: the step's pairs per expert, written by the program */
    int64_t *expert_ns; /* [1]: the experts' time in the step (routing and grouping excluded) */
    const float *q_norm, *k_norm; /* Qwen3's per-head q/k RMSNorm weights [head_dim]; NULL: none */
} ProgramLayer;

typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, intermediate, block_size, window;
    float eps, scale;
    const float *rope_table; /* [positions, head_dim] (cos | sin halves) */
} ProgramShape;

/* One call's inputs and scratch, shared by the team. */
typedef struct {
    const ProgramShape *shape;
    const ProgramLayer *layers;
    int64_t L, T, bt_stride;
    float *x, *residual;
    const int64_t *positions, *slots;
    const int32_t *block_tables, *seq_lens;
    float *h, *qkv, *attn, *gate_up, *act; /* the ops' outputs */
    float *linear_shared;                  /* a linear's packed or quantized input */
    const int32_t *lora_slots;             /* each row's adapter slot (-1: none); NULL: none */
    float *lora_h;                         /* the LoRA shrink's output [T, parts * R] */
    float *own;                            /* per member: own_floats each (tile kernels) */
    int64_t own_floats;
    int64_t *attention_offsets;          /* [T + 1]: the sequences' attention tasks */
    float *attention_partials;           /* their partial results */
    _Atomic int64_t *attention_tasks;    /* [L]: each layer's attention hands out its tasks */
    _Atomic int64_t *attention_done;     /* [L][T]: and counts each sequence's finished ones */
    /* mixture of experts: router logits [T, E], each token's choices and weights [T, k], the
     * pairs grouped by expert (offsets [E + 1], rows and weights [T k]), the experts' scratch */
    float *logits, *choice_weights, *pair_weights;
    int64_t *choices, *expert_offsets, *pair_rows;
    float *experts_scratch;
    int64_t experts_shared;
} ProgramRun;

void linear_scratch(const LinearWeights *l, int64_t T, int64_t *shared, int64_t *own) {
    if (l->kind == LINEAR_DENSE) {
        *shared = (T + ROW_BLOCK - 1) / ROW_BLOCK * ROW_BLOCK * l->in_features;
        *own = 0;
    } else {
        quant_linear_scratch(l, T, shared, own);
    }
}

void any_linear_part(const LinearWeights *l, const float *x, float *y, int64_t T,
                     float *shared, float *own, const Member *me) {
    if (l->kind == LINEAR_DENSE)
        linear_f32_part(x, l->weight, l->bias, y, shared, T, l->in_features, l->out_features, me);
    else
        quant_linear_part(l, x, y, T, 0, shared, own, me);
}

/* y = x W^T, plus the LoRA delta of the rows under an adapter (as the module path adds it:
 * lora_bgmv_f32 after the base linear); ends with the team's barrier. The shrink reads only x,
 * so it runs beside the base linear; the expand adds into y once y is whole. */
static void program_linear(const ProgramRun *run, const LinearWeights *l, const LoraWeights *lora,
                           const float *x, float *y, const Member *me) {
    const int with_lora = run->lora_slots != NULL && lora->a != NULL;
    if (with_lora) lora_shrink_part(lora, x, run->lora_slots, run->lora_h, run->T, me);
    any_linear_part(l, x, y, run->T, run->linear_shared, run->own + me->id * run->own_floats, me);
    team_barrier(me);
    if (with_lora) {
        lora_expand_part(lora, run->lora_h, run->lora_slots, y, run->T, me);
        team_barrier(me);
    }
}

/* Token t's k experts with the largest logits (ties: the lower index) and their softmax weights
 * over all E logits, renormalized over the k with `normalize` (moe.py: softmax, topk, w /=). */
static void route_token(const float *logits, int64_t E, int64_t k, int64_t normalize,
                        int64_t *choices, float *weights) {
    float mx = logits[0];
    for (int64_t e = 1; e < E; e++) mx = logits[e] > mx ? logits[e] : mx;
    float sum = 0.0f;
    for (int64_t e = 0; e < E; e++) sum += expf(logits[e] - mx);
    for (int64_t j = 0; j < k; j++) { /* selection: k is small */
        int64_t best = -1;
        for (int64_t e = 0; e < E; e++) {
            int taken = 0;
            for (int64_t i = 0; i < j; i++) taken |= choices[i] == e;
            if (!taken && (best < 0 || logits[e] > logits[best])) best = e;
        }
        choices[j] = best;
        weights[j] = expf(logits[best] - mx) / sum;
    }
    if (normalize) {
        float total = 0.0f;
        for (int64_t j = 0; j < k; j++) total += weights[j];
        for (int64_t j = 0; j < k; j++) weights[j] /= total;
    }
}

/* A mixture-of-experts layer on h, its output in x; ends with the team's barrier. */
static void program_moe(const ProgramRun *run, const ProgramLayer *layer, const Member *me,
                        int64_t t0, int64_t t1) {
    const int64_t T = run->T, E = layer->experts, k = layer->top_k;
    const ProgramShape *s = run->shape;
    any_linear_part(&layer->router, run->h, run->logits, T, run->linear_shared,
                    run->own + me->id * run->own_floats, me);
    team_barrier(me);
    for (int64_t t = t0; t < t1; t++) {
        route_token(run->logits + t * E, E, k, layer->normalize, run->choices + t * k,
                    run->choice_weights + t * k);
        memset(run->x + t * s->hidden, 0, sizeof(float) * s->hidden);
    }
    team_barrier(me);
    if (me->id == 0) { /* a counting sort of the T k pairs by expert, token order kept */
        int64_t *off = run->expert_offsets, *next = layer->routing;
        for (int64_t e = 0; e <= E; e++) off[e] = 0;
        for (int64_t p = 0; p < T * k; p++) off[run->choices[p] + 1]++;
        for (int64_t e = 0; e < E; e++) off[e + 1] += off[e];
        for (int64_t e = 0; e < E; e++) next[e] = off[e]; /* each expert's next free slot */
        for (int64_t p = 0; p < T * k; p++) {
            const int64_t at = next[run->choices[p]]++;
            run->pair_rows[at] = p / k;
            run->pair_weights[at] = run->choice_weights[p];
        }
        for (int64_t e = 0; e < E; e++) next[e] = off[e + 1] - off[e]; /* the routing */
    }
    team_barrier(me);
    ExpertsRun experts = {.gate_up = layer->expert_gate_up, .down = layer->expert_down,
                          .x = run->h, .weights = run->pair_weights, .offsets = run->expert_offsets,
                          .rows = run->pair_rows, .out = run->x, .E = E, .hidden = s->hidden,
                          .inter = layer->expert_inter, .own_floats = run->own_floats};
    moe_experts_bind(&experts, run->experts_scratch, T, run->experts_shared);
    experts.own = run->own; /* the program's per-member scratch, sized for the experts too */
    struct timespec began, ended;
    if (me->id == 0) clock_gettime(CLOCK_MONOTONIC, &began);
    moe_experts_part(&experts, me);
    team_barrier(me);
    if (me->id == 0) {
        clock_gettime(CLOCK_MONOTONIC, &ended);
        *layer->expert_ns = (ended.tv_sec - began.tv_sec) * 1000000000 + ended.tv_nsec -
                            began.tv_nsec;
    }
}

/* Everything one member of the team does, layer after layer. */
static void program_member(const ProgramRun *run, const Member *me) {
    const ProgramShape *s = run->shape;
    const int64_t T = run->T, q_size = s->heads * s->head_dim;
    const int64_t qkv_width = q_size + 2 * s->kv_heads * s->head_dim;
    int64_t t0, t1, i0, i1;
    team_share(T, me, &t0, &t1);
    team_share(s->intermediate, me, &i0, &i1);
    for (int64_t l = 0; l < run->L; l++) {
        const ProgramLayer *layer = run->layers + l;
        add_rms_norm_rows(run->x, run->residual, layer->input_norm, run->h, t0, t1, s->hidden,
                          s->eps);
        team_barrier(me);
        program_linear(run, &layer->qkv, &layer->qkv_lora, run->h, run->qkv, me);
        if (layer->q_norm != NULL) /* each head of this member's rows, in place, before RoPE */
            for (int64_t t = t0; t < t1; t++) {
                float *q = run->qkv + t * qkv_width, *k = q + q_size;
                add_rms_norm_rows(q, NULL, layer->q_norm, q, 0, s->heads, s->head_dim, s->eps);
                add_rms_norm_rows(k, NULL, layer->k_norm, k, 0, s->kv_heads, s->head_dim, s->eps);
            }
        rope_and_cache_rows(run->qkv, qkv_width, run->positions, s->rope_table, layer->k_cache,
                            layer->v_cache, layer->kv_format, run->slots, t0, t1, s->heads,
                            s->kv_heads, s->head_dim);
        team_barrier(me);
        decode_attention_part(run->qkv, qkv_width, layer->k_cache, layer->v_cache,
                              layer->kv_format, run->block_tables, run->bt_stride, run->seq_lens, T, s->heads,
                              s->kv_heads, s->head_dim, s->block_size, s->scale, s->window,
                              run->attn, run->attention_offsets, run->attention_partials,
                              run->attention_done + l * T, run->attention_tasks + l, me);
        team_barrier(me);
        program_linear(run, &layer->o, &layer->o_lora, run->attn, run->x, me);
        add_rms_norm_rows(run->x, run->residual, layer->post_attn_norm, run->h, t0, t1,
                          s->hidden, s->eps);
        team_barrier(me);
        if (layer->experts) {
            program_moe(run, layer, me, t0, t1);
            continue;
        }
        program_linear(run, &layer->gate_up, &layer->gate_up_lora, run->h, run->gate_up, me);
        silu_and_mul_cols(run->gate_up, run->act, T, s->intermediate, i0, i1);
        team_barrier(me);
        program_linear(run, &layer->down, &layer->down_lora, run->act, run->x, me);
    }
}

/* Returns 0, or -1 when the scratch could not be allocated (nothing computed). spin_ns: how
 * long a thread spins at a barrier before it sleeps (team.h; TEAM_SPIN_FOREVER, 0). */
int64_t decode_layers_f32(const ProgramShape *s, const ProgramLayer *layers, int64_t L,
                          float *x, float *residual, int64_t T, const int64_t *positions,
                          const int64_t *slots, const int32_t *block_tables, int64_t bt_stride,
                          const int32_t *seq_lens, const int32_t *lora_slots, int64_t threads,
                          int64_t spin_ns) {
    const int64_t q_size = s->heads * s->head_dim, kv_size = s->kv_heads * s->head_dim;
    const int64_t qkv_width = q_size + 2 * kv_size;
    int64_t shared = 0, own = 0, lora_width = 0;
    for (int64_t l = 0; l < L; l++) {
        const LinearWeights *linears[4] = {&layers[l].qkv, &layers[l].o, &layers[l].gate_up,
                                           &layers[l].down};
        const LoraWeights *loras[4] = {&layers[l].qkv_lora, &layers[l].o_lora,
                                       &layers[l].gate_up_lora, &layers[l].down_lora};
        for (int i = 0; i < 4; i++) {
            int64_t need_shared, need_own;
            linear_scratch(linears[i], T, &need_shared, &need_own);
            shared = need_shared > shared ? need_shared : shared;
            own = need_own > own ? need_own : own;
            const int64_t width = loras[i]->a == NULL ? 0 : loras[i]->parts * loras[i]->R;
            lora_width = width > lora_width ? width : lora_width;
        }
    }
    /* mixture-of-experts layers: the router's scratch, the experts' (up to T pairs each) */
    int64_t most_experts = 0, most_k = 0, experts_floats = 0, experts_shared = 0;
    for (int64_t l = 0; l < L; l++) {
        const ProgramLayer *layer = layers + l;
        if (!layer->experts) continue;
        int64_t outputs_e, shared_e, own_e, need_shared, need_own;
        linear_scratch(&layer->router, T, &need_shared, &need_own);
        shared = need_shared > shared ? need_shared : shared;
        own = need_own > own ? need_own : own;
        moe_experts_scratch(layer->expert_gate_up, layer->expert_down, layer->experts, T,
                            s->hidden, layer->expert_inter, &outputs_e, &shared_e, &own_e);
        own = own_e > own ? own_e : own;
        experts_shared = shared_e > experts_shared ? shared_e : experts_shared;
        experts_floats = outputs_e > experts_floats ? outputs_e : experts_floats;
        most_experts = layer->experts > most_experts ? layer->experts : most_experts;
        most_k = layer->top_k > most_k ? layer->top_k : most_k;
    }
    experts_floats += experts_shared;
    if (lora_slots == NULL) lora_width = 0;
    if (threads < 1) threads = 1;
    const int64_t outputs = T * (s->hidden + qkv_width + q_size + 3 * s->intermediate);
    int64_t *offsets = malloc(sizeof(int64_t) * (T + 1));
    const int64_t attention_tasks =
        offsets == NULL ? 0 : decode_attention_tasks(seq_lens, T, s->window, offsets);
    const int64_t partials = decode_attention_scratch(attention_tasks, T, s->heads, s->head_dim);
    const int64_t lora_h = T * lora_width;
    float *scratch =
        malloc(sizeof(float) * (outputs + shared + threads * own + partials + lora_h));
    /* per layer: its task counter, then each sequence's finished tasks */
    _Atomic int64_t *counters = calloc((size_t)(L * (T + 1) + 1), sizeof(_Atomic int64_t));
    const int64_t pairs = T * most_k;
    float *moe_floats = malloc(sizeof(float) * (T * most_experts + 2 * pairs + experts_floats + 1));
    int64_t *moe_ints = malloc(sizeof(int64_t) * (2 * pairs + most_experts + 1));
    if (offsets == NULL || scratch == NULL || counters == NULL || moe_floats == NULL ||
        moe_ints == NULL) {
        free(offsets);
        free(scratch);
        free((void *)counters);
        free(moe_floats);
        free(moe_ints);
        return -1;
    }
    float *h = scratch, *qkv = h + T * s->hidden, *attn = qkv + T * qkv_width;
    float *gate_up = attn + T * q_size, *act = gate_up + T * 2 * s->intermediate;
    float *linear_shared = act + T * s->intermediate, *own_scratch = linear_shared + shared;
    const ProgramRun run = {.shape = s, .layers = layers, .L = L, .T = T, .bt_stride = bt_stride,
                            .x = x, .residual = residual, .positions = positions, .slots = slots,
                            .block_tables = block_tables, .seq_lens = seq_lens, .h = h,
                            .qkv = qkv, .attn = attn, .gate_up = gate_up, .act = act,
                            .linear_shared = linear_shared, .lora_slots = lora_slots,
                            .lora_h = own_scratch + threads * own + partials,
                            .own = own_scratch,
                            .own_floats = own, .attention_offsets = offsets,
                            .attention_partials = own_scratch + threads * own,
                            .attention_tasks = counters, .attention_done = counters + L,
                            .logits = moe_floats,
                            .choice_weights = moe_floats + T * most_experts,
                            .pair_weights = moe_floats + T * most_experts + pairs,
                            .experts_scratch = moe_floats + T * most_experts + 2 * pairs,
                            .experts_shared = experts_shared, .choices = moe_ints,
                            .pair_rows = moe_ints + pairs, .expert_offsets = moe_ints + 2 * pairs};
    Team team = {.spin_ns = spin_ns};
    if (threads == 1) {
        const Member me = {&team, 0, 1};
        program_member(&run, &me);
    } else {
#pragma omp parallel num_threads(threads)
        {
            const Member me = team_member(&team);
            program_member(&run, &me);
        }
    }
    free(offsets);
    free(scratch);
    free((void *)counters);
    free(moe_floats);
    free(moe_ints);
    return 0;
}
