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
 * The caller passes residual zeroed before the first layer (residual += embeddings is the
 * embeddings, bit for bit), and takes x and residual back for the final norm.
 *
 * The whole step is one parallel region: its threads go through every op together, each
 * taking its share (a linear's output rows, the attention's tasks, the norms' rows), with a
 * team barrier between dependent ops (team.h: spin, then sleep, `spin_ns` deciding how long).
 * One region instead of ~10 per layer: under OMP_WAIT_POLICY=PASSIVE each region woke a
 * sleeping thread, and at batch 1 on SmolLM2-135M that made 2 threads slower than 1
 * (issue 36). */

#include <stdlib.h>

#include "kernels.h"
#include "team.h"

typedef struct {
    const float *input_norm, *post_attn_norm;
    LinearWeights qkv, o, gate_up, down;
    LoraWeights qkv_lora, o_lora, gate_up_lora, down_lora; /* .a NULL: no LoRA slots */
    float *k_cache, *v_cache; /* [blocks, block_size, kv_heads, head_dim] */
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
        rope_and_cache_rows(run->qkv, qkv_width, run->positions, s->rope_table, layer->k_cache,
                            layer->v_cache, run->slots, t0, t1, s->heads, s->kv_heads,
                            s->head_dim);
        team_barrier(me);
        decode_attention_part(run->qkv, qkv_width, layer->k_cache, layer->v_cache,
                              run->block_tables, run->bt_stride, run->seq_lens, T, s->heads,
                              s->kv_heads, s->head_dim, s->block_size, s->scale, s->window,
                              run->attn, run->attention_offsets, run->attention_partials,
                              run->attention_done + l * T, run->attention_tasks + l, me);
        team_barrier(me);
        program_linear(run, &layer->o, &layer->o_lora, run->attn, run->x, me);
        add_rms_norm_rows(run->x, run->residual, layer->post_attn_norm, run->h, t0, t1,
                          s->hidden, s->eps);
        team_barrier(me);
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
    if (offsets == NULL || scratch == NULL || counters == NULL) {
        free(offsets);
        free(scratch);
        free((void *)counters);
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
                            .attention_tasks = counters, .attention_done = counters + L};
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
    return 0;
}
