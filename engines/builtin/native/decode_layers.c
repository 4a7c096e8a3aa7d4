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
 * The caller passes residual zeroed before the first layer (residual += embeddings is the
 * embeddings, bit for bit), and takes x and residual back for the final norm. */

#include <stdlib.h>

#include "kernels.h"

enum { PROGRAM_DENSE = 0, PROGRAM_INT8 = 1, PROGRAM_INT4 = 2, PROGRAM_INT4_A8 = 3 };

typedef struct {
    int64_t kind;       /* PROGRAM_* */
    const void *weight; /* dense: panels (pack_linear_weight_f32); int8: q; int4: nibbles */
    const float *scale; /* int8 [N]; int4 [N][K / g] */
    const float *minv;  /* int4 [N][K / g] */
    const float *bias;  /* [N] or NULL */
    int64_t in_features, out_features, group_size;
    int64_t rows_max;   /* quantized: the most rows the rows kernels take (native/quant.py) */
} ProgramLinear;

typedef struct {
    const float *input_norm, *post_attn_norm;
    ProgramLinear qkv, o, gate_up, down;
    float *k_cache, *v_cache; /* [blocks, block_size, kv_heads, head_dim] */
} ProgramLayer;

typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, intermediate, block_size, window;
    float eps, scale;
    const float *rope_table; /* [positions, head_dim] (cos | sin halves) */
} ProgramShape;

static void program_linear(const ProgramLinear *l, const float *x, float *y, float *xp,
                           int64_t T, int64_t threads) {
    const int64_t K = l->in_features, N = l->out_features, g = l->group_size;
    const int64_t rows_max = l->rows_max;
    switch (l->kind) {
    case PROGRAM_DENSE: linear_f32(x, l->weight, l->bias, y, xp, T, K, N, threads); break;
    case PROGRAM_INT8:
        q8_linear_f32(x, l->weight, l->scale, l->bias, y, T, K, N, rows_max, 0, threads);
        break;
    case PROGRAM_INT4:
        q4_linear_f32(x, l->weight, l->scale, l->minv, l->bias, y, T, K, N, g, rows_max, 0,
                      threads);
        break;
    default:
        q4_linear_q8_f32(x, l->weight, l->scale, l->minv, l->bias, y, T, K, N, g, rows_max, 0,
                         threads);
    }
}

/* Returns 0, or -1 when the scratch could not be allocated (nothing computed). */
int64_t decode_layers_f32(const ProgramShape *s, const ProgramLayer *layers, int64_t L,
                          float *x, float *residual, int64_t T, const int64_t *positions,
                          const int64_t *slots, const int32_t *block_tables, int64_t bt_stride,
                          const int32_t *seq_lens, int64_t threads) {
    const int64_t q_size = s->heads * s->head_dim, kv_size = s->kv_heads * s->head_dim;
    const int64_t qkv_width = q_size + 2 * kv_size, widest_in =
        s->hidden > s->intermediate ? (s->hidden > q_size ? s->hidden : q_size)
                                    : (s->intermediate > q_size ? s->intermediate : q_size);
    const int64_t padded = (T + ROW_BLOCK - 1) / ROW_BLOCK * ROW_BLOCK;
    float *scratch = malloc(sizeof(float) * (T * (s->hidden + qkv_width + q_size +
                                                  3 * s->intermediate) +
                                              padded * widest_in));
    if (scratch == NULL) return -1;
    float *h = scratch, *qkv = h + T * s->hidden, *attn = qkv + T * qkv_width;
    float *gate_up = attn + T * q_size, *act = gate_up + T * 2 * s->intermediate;
    float *xp = act + T * s->intermediate;
    for (int64_t l = 0; l < L; l++) {
        const ProgramLayer *layer = layers + l;
        add_rms_norm_f32(x, residual, layer->input_norm, h, T, s->hidden, s->eps, threads);
        program_linear(&layer->qkv, h, qkv, xp, T, threads);
        rope_and_cache_f32(qkv, qkv_width, positions, s->rope_table, layer->k_cache,
                           layer->v_cache, slots, T, s->heads, s->kv_heads, s->head_dim,
                           threads);
        decode_attention_f32(qkv, qkv_width, layer->k_cache, layer->v_cache, block_tables,
                             bt_stride, seq_lens, T, s->heads, s->kv_heads, s->head_dim,
                             s->block_size, s->scale, s->window, threads, attn);
        program_linear(&layer->o, attn, x, xp, T, threads);
        add_rms_norm_f32(x, residual, layer->post_attn_norm, h, T, s->hidden, s->eps, threads);
        program_linear(&layer->gate_up, h, gate_up, xp, T, threads);
        silu_and_mul_f32(gate_up, act, T, s->intermediate, threads);
        program_linear(&layer->down, act, x, xp, T, threads);
    }
    free(scratch);
    return 0;
}
