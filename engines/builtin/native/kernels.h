/* What the engine's C kernels share (cpu_kernels.c: attention, norms, the float32 GEMM;
 * quant_kernels.c: the INT8/INT4 linear kernels; decode_layers.c: a decode step's layers):
 * the vector type of this build's widest registers and the GEMM's register block, the GEMM's
 * panel routine, which the quantized kernels run on weight tiles they dequantize, and the
 * kernels decode_layers.c chains. */
#ifndef INFERLAB_KERNELS_H
#define INFERLAB_KERNELS_H

#include <stdint.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h> /* what a function may use depends on the build's -march */
#endif

#include "team.h"

/* The GEMM's register block, per instruction set, chosen when the library is compiled
 * (-march=native; the cache key holds the CPU's flags). VEC floats fill one vector register;
 * the block is ROW_BLOCK input rows x PANEL output columns (PANEL_VECS vectors), kept in
 * ROW_BLOCK x PANEL_VECS registers that must leave room for the PANEL_VECS weight loads and
 * a broadcast:
 * - AVX-512 (32 registers of 16 floats): 8 x 32, 16 accumulators; per step of k 2 weight
 *   loads, 8 broadcasts and 16 fused multiply-adds. Written and tuned on Xeons (the figures
 *   in the comments below are theirs).
 * - AVX / AVX2 (16 registers of 8 floats): 6 x 16, 12 accumulators, 2 weight loads and a
 *   broadcast, 15 registers (the Haswell/Zen micro-kernel shape of BLIS and OpenBLAS). The
 *   8 x 32 block needs 32 of them there and spilled every step: on a 2-core Zen 3 EPYC the
 *   small preset's 49 matmuls took 2.4x oneDNN's time at 8 rows and 8-9x at 128-2,000.
 * - anything else (SSE, NEON: 4 floats, 16 or more registers): 4 x 8, 8 accumulators.
 * The packed layouts follow (panels of PANEL weight rows, input blocks of ROW_BLOCK rows);
 * Python reads them from linear_layout, so that the packing and its callers agree. */
#if defined(__AVX512F__)
#define KERNEL_ISA "avx512"
#define VEC 16
#define ROW_BLOCK 8
#define PANEL_VECS 2
#elif defined(__AVX__)
#if defined(__AVX2__) && defined(__FMA__)
#define KERNEL_ISA "avx2"
#else
#define KERNEL_ISA "avx"
#endif
#define VEC 8
#define ROW_BLOCK 6
#define PANEL_VECS 2
#else
#define KERNEL_ISA "portable"
#define VEC 4
#define ROW_BLOCK 4
#define PANEL_VECS 2
#endif
#define PANEL (PANEL_VECS * VEC)

/* VEC floats: GCC/clang vector extensions, one register of the widest kind the build has */
typedef float vec __attribute__((vector_size(VEC * 4)));
typedef float vec_unaligned __attribute__((vector_size(VEC * 4), aligned(4)));

static inline vec load_vec(const float *p) { return *(const vec_unaligned *)p; }

static inline void store_vec(float *p, vec v) { *(vec_unaligned *)p = v; }

/* *p in all lanes (a load that broadcasts: no shuffle taking an FMA port) */
static inline vec broadcast_vec(const float *p) {
    const float s = *p;
#if VEC == 16
    return (vec){s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s};
#elif VEC == 8
    return (vec){s, s, s, s, s, s, s, s};
#else
    return (vec){s, s, s, s};
#endif
}

/* a * b + c in one rounding. Spelled out because -std=c11 forbids the compiler to contract
 * a * b + c on its own (which rope_and_cache_f32 relies on). */
static inline vec fma_vec(vec a, vec b, vec c) {
#if defined(__AVX512F__)
    return (vec)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__)
    return (vec)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    return a * b + c;
#endif
}

/* y's rows ROW_BLOCK b0 .. min(ROW_BLOCK b1, M) - 1, columns n0 .. n0 + PANEL - 1 (those
 * below N), = the packed input's blocks [b0, b1) times `panel` ([K][PANEL], a weight tile of
 * PANEL rows transposed) (+ bias[n0 ..] when not NULL); `next`: the panel to prefetch while
 * this one runs (NULL: none). */
void gemm_panel(const float *xp, const float *panel, const float *next, const float *bias,
                float *y, int64_t M, int64_t K, int64_t N, int64_t n0, int64_t b0, int64_t b1);

/* x [M, K] -> xp, blocks of ROW_BLOCK rows [ceil(M / ROW_BLOCK)][K][ROW_BLOCK] (the last one
 * zero-padded), the layout gemm_panel reads: this member's share of the blocks (the caller
 * puts a team_barrier before anyone reads xp). */
void pack_gemm_input(const float *x, float *xp, int64_t M, int64_t K, const Member *me);

/* A linear layer's weights as the C kernels take them (decode_layers.c's programs; the
 * quantized kernels' entry points build one per call). engines/builtin/decode_program.py
 * mirrors it in ctypes. */
enum {
    LINEAR_DENSE = 0,
    LINEAR_INT8 = 1,
    LINEAR_INT4 = 2,
    LINEAR_INT4_A8 = 3,
    LINEAR_INT8G = 4,
    LINEAR_INT8G_A8 = 5,
    LINEAR_INT8B = 6,
    LINEAR_INT8B_A8 = 7,
    LINEAR_INT5B = 8,
    LINEAR_INT5B_A8 = 9,
    LINEAR_FP8 = 10
};

typedef struct {
    int64_t kind;       /* LINEAR_* */
    const void *weight; /* dense: panels (pack_linear_weight_f32); int8(g), fp8: q; int4: nibbles */
    const float *scale; /* int8, fp8 [N]; int4, int8g [N][K / g]; int8b, int5b: float16 [N][K / 32] */
    const float *minv;  /* int4, int8g [N][K / g]; int5b: float16 [N][K / 32] */
    const float *bias;  /* [N] or NULL */
    int64_t in_features, out_features, group_size;
    int64_t rows_max; /* quantized: the most rows the rows kernels take (native/quant.py) */
    const uint32_t *bits; /* int5b: each block's fifth bits [N][K / 32] */
} LinearWeights;

/* A linear layer's LoRA slots (engines/builtin/lora/layer.py): a [S, parts * R, in], each
 * slot's parts packed at its adapter's own rank (part p's row j at p * r + j); b [S, R, out],
 * B transposed, part p's columns part_ends[p - 1] .. part_ends[p] - 1; ranks [S] (0: an empty
 * slot, or an adapter that skips the layer). a NULL: the layer has no slots. */
typedef struct {
    const float *a, *b;
    const int32_t *ranks;
    const int64_t *part_ends;
    int64_t parts, R, in_features, out_features;
} LoraWeights;

/* The kernels decode_layers.c chains (cpu_kernels.c, quant_kernels.c). Python calls the
 * *_f32 entry points, each one parallel region on `threads`; a decode program calls the
 * *_rows / *_cols / *_part pieces from inside its one region, each member doing its share
 * (rows t0 .. t1 - 1, columns i0 .. i1 - 1, or a share it takes itself). A *_part function
 * has every member of the team call it and ends without a barrier. */
void add_rms_norm_f32(const float *x, float *residual, const float *weight, float *out,
                      int64_t T, int64_t N, float eps, int64_t threads);
void add_rms_norm_rows(const float *x, float *residual, const float *weight, float *out,
                       int64_t t0, int64_t t1, int64_t N, float eps);
/* a KV cache's values: float32, or FP8 bytes (engine.kv_cache_dtype=fp8_e4m3 | fp8_e5m2) */
enum { KV_FLOAT32 = 0, KV_E4M3 = 1, KV_E5M2 = 2 };
/* every FP8 byte's value, [KV_E4M3 | KV_E5M2][byte] (cpu_kernels.c; the FP8 weights' kernels
 * read the e4m3 row too) */
extern float fp8_value[3][256];
void rope_and_cache_f32(float *qkv, int64_t qkv_stride, const int64_t *positions,
                        const float *table, void *k_cache, void *v_cache, int64_t kv_format,
                        const int64_t *slots, int64_t T, int64_t H, int64_t KVH, int64_t D,
                        int64_t threads);
void rope_and_cache_rows(float *qkv, int64_t qkv_stride, const int64_t *positions,
                         const float *table, void *k_cache, void *v_cache, int64_t kv_format,
                         const int64_t *slots, int64_t t0, int64_t t1, int64_t H, int64_t KVH,
                         int64_t D);
void decode_attention_f32(const float *q, int64_t q_stride, const void *k_cache,
                          const void *v_cache, int64_t kv_format,
                          const int32_t *block_tables, int64_t bt_stride,
                          const int32_t *seq_lens, int64_t B, int64_t H, int64_t KVH, int64_t D,
                          int64_t BS, float scale, int64_t window, int64_t threads,
                          float *out);
/* Decode attention as tasks (split-K runs of a sequence's positions): offsets [B + 1] filled,
 * the number of tasks returned; the floats of partial results they need beside the output. */
int64_t decode_attention_tasks(const int32_t *seq_lens, int64_t B, int64_t window,
                               int64_t *offsets);
int64_t decode_attention_scratch(int64_t tasks, int64_t B, int64_t H, int64_t D);
/* offsets from decode_attention_tasks; partials: decode_attention_scratch floats; done [B] and
 * next_task zero before the first member calls it (the members take tasks from next_task) */
void decode_attention_part(const float *q, int64_t q_stride, const void *k_cache,
                           const void *v_cache, int64_t kv_format,
                           const int32_t *block_tables, int64_t bt_stride,
                           const int32_t *seq_lens, int64_t B, int64_t H, int64_t KVH,
                           int64_t D, int64_t BS, float scale, int64_t window, float *out,
                           int64_t *offsets, float *partials, _Atomic int64_t *done,
                           _Atomic int64_t *next_task, const Member *me);
void silu_and_mul_f32(const float *gate_up, float *out, int64_t T, int64_t I, int64_t threads);
void lora_bgmv_f32(const LoraWeights *l, const float *x, float *y, const int32_t *slots,
                   float *h, int64_t T, int64_t threads);
void lora_shrink_part(const LoraWeights *l, const float *x, const int32_t *slots, float *h,
                      int64_t T, const Member *me);
void lora_expand_part(const LoraWeights *l, const float *h, const int32_t *slots, float *y,
                      int64_t T, const Member *me);
void silu_and_mul_cols(const float *gate_up, float *out, int64_t T, int64_t I, int64_t i0,
                       int64_t i1);
void linear_f32(const float *x, const float *panels, const float *bias, float *y, float *xp,
                int64_t M, int64_t K, int64_t N, int64_t threads);
void linear_f32_part(const float *x, const float *panels, const float *bias, float *y,
                     float *xp, int64_t M, int64_t K, int64_t N, const Member *me);
void q8_linear_f32(const float *x, const int8_t *q, const float *scale, const float *bias,
                   float *y, int64_t M, int64_t K, int64_t N, int64_t rows_max, int64_t path,
                   int64_t threads);
void q4_linear_f32(const float *x, const uint8_t *nib, const float *scale, const float *minv,
                   const float *bias, float *y, int64_t M, int64_t K, int64_t N, int64_t g,
                   int64_t rows_max, int64_t path, int64_t threads);
void q4_linear_q8_f32(const float *x, const uint8_t *nib, const float *scale, const float *minv,
                      const float *bias, float *y, int64_t M, int64_t K, int64_t N, int64_t g,
                      int64_t rows_max, int64_t path, int64_t threads);
void g8_linear_f32(const float *x, const uint8_t *q, const float *scale, const float *minv,
                   const float *bias, float *y, int64_t M, int64_t K, int64_t N, int64_t g,
                   int64_t rows_max, int64_t path, int64_t threads);
void g8_linear_q8_f32(const float *x, const uint8_t *q, const float *scale, const float *minv,
                      const float *bias, float *y, int64_t M, int64_t K, int64_t N, int64_t g,
                      int64_t rows_max, int64_t path, int64_t threads);
void f8_linear_f32(const float *x, const uint8_t *q, const float *scale, const float *bias,
                   float *y, int64_t M, int64_t K, int64_t N, int64_t rows_max, int64_t path,
                   int64_t threads);
void b8_linear_f32(const float *x, const int8_t *q, const uint16_t *d, const float *bias,
                   float *y, int64_t M, int64_t K, int64_t N, int64_t rows_max, int64_t path,
                   int64_t threads);
void b8_linear_q8_f32(const float *x, const int8_t *q, const uint16_t *d, const float *bias,
                      float *y, int64_t M, int64_t K, int64_t N, int64_t rows_max, int64_t path,
                      int64_t threads);
void q5_linear_f32(const float *x, const uint8_t *nib, const uint32_t *high, const uint16_t *d,
                   const uint16_t *m, const float *bias, float *y, int64_t M, int64_t K,
                   int64_t N, int64_t rows_max, int64_t path, int64_t activations_int8,
                   int64_t threads);
/* floats of scratch any linear (dense panels or quantized) of M rows needs (decode_layers.c) */
void linear_scratch(const LinearWeights *l, int64_t M, int64_t *shared, int64_t *own);
/* any linear of M rows, each member its share, no barrier at the end (decode_layers.c) */
void any_linear_part(const LinearWeights *l, const float *x, float *y, int64_t M,
                     float *shared, float *own, const Member *me);
/* A mixture-of-experts layer's experts (moe_experts.c): expert e's (token, expert) pairs are
 * offsets[e] .. offsets[e + 1] - 1, rows their rows of x [., hidden], weights their routing
 * weights; out += each pair's weight x its expert's SiLU MLP of its row. */
typedef struct {
    const LinearWeights *gate_up, *down; /* [E] each */
    const float *x, *weights;
    const int64_t *offsets, *rows;
    float *out;
    int64_t E, hidden, inter;
    float *xs, *gu, *act, *y, *shared, *own; /* scratch: moe_experts_bind */
    int64_t own_floats;
} ExpertsRun;
/* floats of scratch for up to `rows` pairs an expert: outputs and shared by the team, own per
 * member; moe_experts_bind points the run's scratch into `scratch` (outputs + shared + own) */
void moe_experts_scratch(const LinearWeights *gate_up, const LinearWeights *down, int64_t E,
                         int64_t rows, int64_t hidden, int64_t inter, int64_t *outputs,
                         int64_t *shared, int64_t *own);
void moe_experts_bind(ExpertsRun *r, float *scratch, int64_t rows, int64_t shared);
/* every member of the team calls it; ends after a barrier-free add (callers barrier) */
void moe_experts_part(const ExpertsRun *r, const Member *me);
/* floats of scratch a quantized linear of M rows needs: `shared` by the team, `own` per member */
void quant_linear_scratch(const LinearWeights *l, int64_t M, int64_t *shared, int64_t *own);
/* a quantized (LINEAR_INT8, FP8, INT4, INT8G, INT8B, INT5B and their _A8) linear; path as the entry points' (0: widest) */
void quant_linear_part(const LinearWeights *l, const float *x, float *y, int64_t M,
                       int64_t path, float *shared, float *own, const Member *me);

#endif
