/* CPU kernels the engine compiles once per machine (engines/builtin/native/__init__.py) and
 * calls through ctypes with raw pointers. Each has a torch reference it is tested against
 * (tests/test_native_kernels.py). Parallel loops use OpenMP; the library links the libgomp
 * torch has already loaded, so torch and these kernels share one thread pool. */

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "team.h"

/* e^x for x in float32, vectorizable (libm's expf is a call per element): Cody-Waite range
 * reduction x = k ln2 + r, |r| <= ln2/2, Cephes' degree-6 polynomial for e^r (within about
 * 1 ulp, as torch's own vectorized exp), and 2^k put into the exponent bits. */
static inline float exp_f32(float x) {
    x = x > -87.0f ? x : -87.0f; /* written so NaN becomes -87: a NaN reaching the integer */
    x = x < 88.0f ? x : 88.0f;   /* conversion below would be undefined (silu stays NaN) */
    const float round = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
    const float k = (x * 1.44269504088896341f + round) - round;
    float r = x - k * 0.693359375f;
    r = r - k * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { int32_t i; float f; } scale = {.i = ((int32_t)k + 127) << 23};
    return p * scale.f;
}

/* FP8 K/V (engine.kv_cache_dtype=fp8_e4m3 | fp8_e5m2; KV_FLOAT32 the plain cache): each byte's
 * value (a table, filled once), and a float rounded to the nearest FP8 value, ties to even,
 * past the largest finite value clamped to it, as torch's clamp-then-convert writes the cache
 * (engines/builtin/kv_cache/storage.py `to_fp8`; the tests compare every byte with torch's). */
float fp8_value[3][256];

__attribute__((constructor)) static void fill_fp8_values(void) {
    for (int b = 0; b < 256; b++) {
        const float sign = (b & 0x80) ? -1.0f : 1.0f;
        const int e4 = (b >> 3) & 15, m3 = b & 7, e5 = (b >> 2) & 31, m2 = b & 3;
        fp8_value[KV_E4M3][b] = (b & 0x7F) == 0x7F ? NAN
                                : sign * (e4 ? ldexpf((float)(8 + m3), e4 - 10)
                                             : ldexpf((float)m3, -9));
        fp8_value[KV_E5M2][b] = e5 == 31 ? (m2 ? NAN : sign * INFINITY)
                                : sign * (e5 ? ldexpf((float)(4 + m2), e5 - 17)
                                             : ldexpf((float)m2, -16));
    }
}

/* x as an FP8 byte: `mantissa` bits, the smallest normal 2^min_exp (below it, steps of
 * 2^(min_exp - mantissa)), the largest finite value `top`, the exponent bias `bias`. */
static inline uint8_t to_fp8_byte(float x, int mantissa, int min_exp, float top, int bias) {
    const uint8_t sign = signbit(x) ? 0x80 : 0;
    if (isnan(x)) return sign | (mantissa == 3 ? 0x7F : 0x7E);
    float a = fabsf(x);
    a = a < top ? a : top;
    if (a < ldexpf(1.0f, min_exp)) /* subnormal: the default rounding mode is to nearest even */
        return sign | (uint8_t)nearbyintf(ldexpf(a, mantissa - min_exp));
    uint32_t bits;
    memcpy(&bits, &a, sizeof bits);
    const int drop = 23 - mantissa; /* float32 mantissa bits rounded away, ties to even */
    bits += (UINT32_C(1) << (drop - 1)) - 1 + ((bits >> drop) & 1);
    const int exponent = (int)(bits >> 23) - 127 + bias;
    return sign | (uint8_t)(exponent << mantissa) | (uint8_t)((bits >> drop) & ((1 << mantissa) - 1));
}

static inline uint8_t to_kv_byte(float x, int64_t kv_format) {
    return kv_format == KV_E4M3 ? to_fp8_byte(x, 3, -6, 448.0f, 7)
                                : to_fp8_byte(x, 2, -14, 57344.0f, 15);
}

/* Row `pos` of a K or V cache [slots][width] as floats: the row itself (float32), or its FP8
 * bytes widened into `buffer`. */
static inline const float *kv_row(const void *cache, int64_t slot, int64_t width,
                                  int64_t kv_format, float *buffer) {
    if (kv_format == KV_FLOAT32) return (const float *)cache + slot * width;
    const uint8_t *bytes = (const uint8_t *)cache + slot * width;
    const float *values = fp8_value[kv_format];
    for (int64_t i = 0; i < width; i++) buffer[i] = values[bytes[i]];
    return buffer;
}

/* Decode attention over a block-table KV cache, read in place.
 *
 * q [B, H, D] (token stride q_stride, heads contiguous), k/v cache [NB, BS, KVH, D]
 * contiguous, block_tables [B, *] int32 (row stride bt_stride), seq_lens [B] int32: sequence
 * b's query is its last position, seq_lens[b] - 1, and sees keys 0..seq_lens[b]-1, only the
 * last `window` of them when window > 0. out [B, H, D] contiguous. `threads`: torch's
 * intra-op thread count (torch passes its own to every parallel region, so do these kernels).
 *
 * A task is one sequence's run of ATTN_SPLIT positions (split-K, as flash-decoding splits
 * it), all heads: it walks its positions in order and reads each one's K (then V) row whole,
 * one contiguous stream the hardware prefetcher follows. (Tasks of some of the heads read a
 * piece of every row: on SmolLM2, 256 of every 768 bytes, and two cores each pulling in the
 * other's lines made attention at 800 tokens slower on 2 threads than on 1.) Scores go to a
 * per-task buffer: an exact two-pass softmax within the task. A sequence of one task writes
 * its output directly; one of several writes each task's unnormalised output, maximum and sum,
 * and the task that finishes last merges them, in task order (so the result does not depend
 * on which thread ran which task, nor on how many threads there are). Four heads' dot products
 * run side by side (four independent sums instead of one long chain). */
#define ATTN_SPLIT 128

typedef struct {
    int64_t *offsets;      /* [B + 1]: sequence b's tasks are offsets[b] .. offsets[b + 1] - 1 */
    float *partials;       /* [tasks][H][D + 2]: a task's output, maximum and sum per head */
    _Atomic int64_t *done; /* [B]: tasks of the sequence finished */
} AttentionWork;

/* The visible positions of sequence b: [*first, *first + *n). */
static inline void visible(const int32_t *seq_lens, int64_t b, int64_t window, int64_t *first,
                           int64_t *n) {
    const int64_t len = seq_lens[b];
    *first = (window > 0 && len > window) ? len - window : 0;
    *n = len - *first;
}

int64_t decode_attention_tasks(const int32_t *seq_lens, int64_t B, int64_t window,
                               int64_t *offsets) {
    offsets[0] = 0;
    for (int64_t b = 0; b < B; b++) {
        int64_t first, n;
        visible(seq_lens, b, window, &first, &n);
        offsets[b + 1] = offsets[b] + (n > ATTN_SPLIT ? (n + ATTN_SPLIT - 1) / ATTN_SPLIT : 1);
    }
    return offsets[B];
}

/* Sequence b's tasks' partial results merged into out[b]. */
static void merge_splits(const AttentionWork *w, int64_t b, int64_t H, int64_t D, float *out) {
    const int64_t t0 = w->offsets[b], t1 = w->offsets[b + 1];
    for (int64_t i = 0; i < H; i++) {
        float mx = -INFINITY, sum = 0.0f;
        for (int64_t t = t0; t < t1; t++) {
            const float m = w->partials[(t * H + i) * (D + 2) + D];
            mx = m > mx ? m : mx;
        }
        float *o = out + (b * H + i) * D;
        for (int64_t d = 0; d < D; d++) o[d] = 0.0f;
        for (int64_t t = t0; t < t1; t++) {
            const float *part = w->partials + (t * H + i) * (D + 2);
            const float weight = part[D] == -INFINITY ? 0.0f : exp_f32(part[D] - mx);
            sum += weight * part[D + 1];
#pragma omp simd
            for (int64_t d = 0; d < D; d++) o[d] += weight * part[d];
        }
        const float inv = 1.0f / sum;
        for (int64_t d = 0; d < D; d++) o[d] *= inv;
    }
}

/* Task `task` of sequence b (its split-th run of positions). */
static void decode_attention_task(const float *q, int64_t q_stride, const void *k_cache,
                                  const void *v_cache, int64_t kv_format,
                                  const int32_t *block_tables, int64_t bt_stride,
                                  const int32_t *seq_lens, int64_t H, int64_t KVH, int64_t D,
                                  int64_t BS, float scale, int64_t window, float *out,
                                  const AttentionWork *w, int64_t b, int64_t task) {
    const int64_t G = H / KVH, nq = H;
    const int64_t row = KVH * D; /* floats between consecutive positions */
    const int64_t split = task - w->offsets[b], splits = w->offsets[b + 1] - w->offsets[b];
    int64_t first, n_all;
    visible(seq_lens, b, window, &first, &n_all);
    first += split * ATTN_SPLIT;
    const int64_t n = splits == 1 ? n_all : (n_all - split * ATTN_SPLIT < ATTN_SPLIT
                                                 ? n_all - split * ATTN_SPLIT : ATTN_SPLIT);
    const float *qt = q + b * q_stride;
    /* one task: the output itself, normalised; several: this task's part, [H][D + 2] */
    const int64_t stride = splits == 1 ? D : D + 2;
    float *o = splits == 1 ? out + b * H * D : w->partials + task * H * (D + 2);
    for (int64_t i = 0; i < nq; i++)
        for (int64_t d = 0; d < D; d++) o[i * stride + d] = 0.0f;
    /* the scores, then (FP8) a row's widened values */
    float *scores = n > 0 ? malloc(sizeof(float) * (nq * n + row)) : NULL;
    float *widened = scores == NULL ? NULL : scores + nq * n;
    if (n > 0 && scores == NULL) { /* out of memory: NaN outputs, never a wrong number */
        for (int64_t i = 0; i < nq; i++)
            for (int64_t d = 0; d < stride; d++) o[i * stride + d] = NAN;
    }
    const int32_t *table = block_tables + b * bt_stride;
    for (int64_t j = 0; scores != NULL && j < n; j++) {
        const int64_t pos = first + j;
        const int64_t slot = (int64_t)table[pos / BS] * BS + pos % BS;
        const float *kr = kv_row(k_cache, slot, row, kv_format, widened);
        int64_t i = 0;
        for (; i + 4 <= nq; i += 4) {
            const float *q0 = qt + i * D, *q1 = q0 + D, *q2 = q1 + D, *q3 = q2 + D;
            const float *k0 = kr + (i / G) * D;
            const float *k1 = kr + ((i + 1) / G) * D;
            const float *k2 = kr + ((i + 2) / G) * D;
            const float *k3 = kr + ((i + 3) / G) * D;
            float d0 = 0.0f, d1 = 0.0f, d2 = 0.0f, d3 = 0.0f;
#pragma omp simd reduction(+ : d0, d1, d2, d3)
            for (int64_t d = 0; d < D; d++) {
                d0 += q0[d] * k0[d];
                d1 += q1[d] * k1[d];
                d2 += q2[d] * k2[d];
                d3 += q3[d] * k3[d];
            }
            scores[i * n + j] = d0 * scale;
            scores[(i + 1) * n + j] = d1 * scale;
            scores[(i + 2) * n + j] = d2 * scale;
            scores[(i + 3) * n + j] = d3 * scale;
        }
        for (; i < nq; i++) {
            const float *qi = qt + i * D;
            const float *ki = kr + (i / G) * D;
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < D; d++) dot += qi[d] * ki[d];
            scores[i * n + j] = dot * scale;
        }
    }
    for (int64_t i = 0; scores != NULL && i < nq; i++) {
        float *si = scores + i * n;
        float mx = -INFINITY, sum = 0.0f;
        for (int64_t j = 0; j < n; j++) mx = si[j] > mx ? si[j] : mx;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < n; j++) {
            si[j] = exp_f32(si[j] - mx);
            sum += si[j];
        }
        if (splits == 1) {
            const float inv = 1.0f / sum;
            for (int64_t j = 0; j < n; j++) si[j] *= inv;
        } else {
            o[i * stride + D] = mx;
            o[i * stride + D + 1] = sum;
        }
    }
    for (int64_t j = 0; scores != NULL && j < n; j++) {
        const int64_t pos = first + j;
        const int64_t slot = (int64_t)table[pos / BS] * BS + pos % BS;
        const float *vr = kv_row(v_cache, slot, row, kv_format, widened);
        for (int64_t i = 0; i < nq; i++) {
            const float p = scores[i * n + j];
            const float *vi = vr + (i / G) * D;
            float *oi = o + i * stride;
#pragma omp simd
            for (int64_t d = 0; d < D; d++) oi[d] += p * vi[d];
        }
    }
    free(scores);
    if (splits > 1 && atomic_fetch_add(&w->done[b], 1) + 1 == splits)
        merge_splits(w, b, H, D, out); /* the last of the sequence's tasks */
}

/* The sequence a task belongs to (offsets ascending). */
static int64_t task_sequence(const int64_t *offsets, int64_t B, int64_t task) {
    int64_t lo = 0, hi = B - 1;
    while (lo < hi) {
        const int64_t mid = (lo + hi + 1) / 2;
        if (offsets[mid] <= task) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

void decode_attention_f32(const float *q, int64_t q_stride, const void *k_cache,
                          const void *v_cache, int64_t kv_format,
                          const int32_t *block_tables, int64_t bt_stride,
                          const int32_t *seq_lens, int64_t B, int64_t H, int64_t KVH, int64_t D,
                          int64_t BS, float scale, int64_t window, int64_t threads,
                          float *out) {
    if (B <= 0) return;
    int64_t *offsets = malloc(sizeof(int64_t) * (B + 1));
    _Atomic int64_t *done = calloc((size_t)B, sizeof(_Atomic int64_t));
    const int64_t tasks = offsets == NULL ? 0 : decode_attention_tasks(seq_lens, B, window, offsets);
    float *partials = tasks > B ? malloc(sizeof(float) * tasks * H * (D + 2)) : NULL;
    if (offsets == NULL || done == NULL || (tasks > B && partials == NULL)) {
        for (int64_t i = 0; i < B * H * D; i++) out[i] = NAN; /* never a wrong number */
    } else {
        const AttentionWork w = {offsets, partials, done};
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
        for (int64_t task = 0; task < tasks; task++)
            decode_attention_task(q, q_stride, k_cache, v_cache, kv_format, block_tables,
                                  bt_stride, seq_lens, H, KVH, D, BS, scale, window, out, &w,
                                  task_sequence(offsets, B, task), task);
    }
    free(offsets);
    free((void *)done);
    free(partials);
}

int64_t decode_attention_scratch(int64_t tasks, int64_t B, int64_t H, int64_t D) {
    return tasks > B ? tasks * H * (D + 2) : 0;
}

void decode_attention_part(const float *q, int64_t q_stride, const void *k_cache,
                           const void *v_cache, int64_t kv_format,
                           const int32_t *block_tables, int64_t bt_stride,
                           const int32_t *seq_lens, int64_t B, int64_t H, int64_t KVH,
                           int64_t D, int64_t BS, float scale, int64_t window, float *out,
                           int64_t *offsets, float *partials, _Atomic int64_t *done,
                           _Atomic int64_t *next_task, const Member *me) {
    (void)me;
    const AttentionWork w = {offsets, partials, done};
    const int64_t tasks = offsets[B];
    for (int64_t task; (task = atomic_fetch_add(next_task, 1)) < tasks;)
        decode_attention_task(q, q_stride, k_cache, v_cache, kv_format, block_tables, bt_stride,
                              seq_lens, H, KVH, D, BS, scale, window, out, &w,
                              task_sequence(offsets, B, task), task);
}

/* RMSNorm of T rows of width N, each row computed in float32 as torch's composite does:
 * out = x * (1 / sqrt(mean(x^2) + eps)) * weight. With `residual` (not NULL), the row is first
 * added into the residual stream, x + residual, which is kept (written to `residual`) for the
 * next block: the decoder's "residual add, then norm" in one pass over the row. `out` may be
 * `x` itself. */
void add_rms_norm_rows(const float *x, float *residual, const float *weight, float *out,
                       int64_t t0, int64_t t1, int64_t N, float eps) {
    for (int64_t t = t0; t < t1; t++) {
        const float *xr = x + t * N;
        float *o = out + t * N;
        const float *src = xr;
        if (residual != NULL) {
            float *r = residual + t * N;
#pragma omp simd
            for (int64_t i = 0; i < N; i++) r[i] = xr[i] + r[i];
            src = r;
        }
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < N; i++) sum += src[i] * src[i];
        const float inv = 1.0f / sqrtf(sum / (float)N + eps);
#pragma omp simd
        for (int64_t i = 0; i < N; i++) o[i] = src[i] * inv * weight[i];
    }
}

void add_rms_norm_f32(const float *x, float *residual, const float *weight, float *out,
                      int64_t T, int64_t N, float eps, int64_t threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (T * N >= 16384)
    for (int64_t t = 0; t < T; t++) add_rms_norm_rows(x, residual, weight, out, t, t + 1, N, eps);
}

/* out [T, I] = silu(gate) * up, for gate_up [T, 2I] (gate | up, row stride 2I); columns
 * i0 .. i1 - 1 of every row (silu_and_mul_cols), or all of them. */
void silu_and_mul_cols(const float *gate_up, float *out, int64_t T, int64_t I, int64_t i0,
                       int64_t i1) {
    for (int64_t t = 0; t < T; t++) {
        const float *g = gate_up + t * 2 * I;
        const float *u = g + I;
        float *o = out + t * I;
#pragma omp simd
        for (int64_t i = i0; i < i1; i++) o[i] = g[i] / (1.0f + exp_f32(-g[i])) * u[i];
    }
}

void silu_and_mul_f32(const float *gate_up, float *out, int64_t T, int64_t I,
                      int64_t threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (T * I >= 16384)
    for (int64_t t = 0; t < T; t++)
        silu_and_mul_cols(gate_up + t * 2 * I, out + t * I, 1, I, 0, I);
}

/* The LoRA delta of one layer, BGMV-style (kernels.h LoraWeights): each row t with an adapter
 * slot s = slots[t] >= 0 (of rank r = ranks[s]; 0: the adapter skips the layer) gets
 * y[t] += B_s (A_s x[t]), in place, in two parts with a barrier between them: the shrink
 * h[t] = A_s x[t] (the team shares the rows' (t, q) dot products) and the expand (the team
 * shares y's columns). Rows of the base model (slot -1) are left alone. h [T, parts * R]. */
void lora_shrink_part(const LoraWeights *l, const float *x, const int32_t *slots, float *h,
                      int64_t T, const Member *me) {
    const int64_t width = l->parts * l->R, in = l->in_features;
    int64_t k0, k1;
    team_share(T * width, me, &k0, &k1);
    for (int64_t k = k0; k < k1; k++) {
        const int64_t t = k / width, q = k % width;
        const int32_t s = slots[t];
        if (s < 0 || q >= l->parts * l->ranks[s]) continue;
        const float *aq = l->a + ((int64_t)s * width + q) * in, *xt = x + t * in;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t i = 0; i < in; i++) dot += aq[i] * xt[i];
        h[k] = dot;
    }
}

void lora_expand_part(const LoraWeights *l, const float *h, const int32_t *slots, float *y,
                      int64_t T, const Member *me) {
    const int64_t out = l->out_features, width = l->parts * l->R;
    int64_t c0, c1;
    team_share(out, me, &c0, &c1);
    for (int64_t t = 0; t < T; t++) {
        const int32_t s = slots[t];
        if (s < 0) continue;
        const int64_t r = l->ranks[s];
        const float *bs = l->b + (int64_t)s * l->R * out, *ht = h + t * width;
        float *yt = y + t * out;
        for (int64_t p = 0; p < l->parts; p++) {
            const int64_t start = p ? l->part_ends[p - 1] : 0, stop = l->part_ends[p];
            const int64_t o0 = start > c0 ? start : c0, o1 = stop < c1 ? stop : c1;
            for (int64_t j = 0; j < r; j++) {
                const float hj = ht[p * r + j];
                const float *bj = bs + j * out;
#pragma omp simd
                for (int64_t o = o0; o < o1; o++) yt[o] += hj * bj[o];
            }
        }
    }
}

void lora_bgmv_f32(const LoraWeights *l, const float *x, float *y, const int32_t *slots,
                   float *h, int64_t T, int64_t threads) {
    Team team = {.spin_ns = team_default_spin_ns()};
    if (threads <= 1 || T * l->out_features < 8192) {
        const Member me = {&team, 0, 1};
        lora_shrink_part(l, x, slots, h, T, &me);
        lora_expand_part(l, h, slots, y, T, &me);
        return;
    }
#pragma omp parallel num_threads(threads)
    {
        const Member me = team_member(&team);
        lora_shrink_part(l, x, slots, h, T, &me);
        team_barrier(&me);
        lora_expand_part(l, h, slots, y, T, &me);
    }
}

/* Rotary embedding of the query and key heads of qkv [T, (H + 2 KVH) D] (row stride
 * qkv_stride; q heads, then k heads, then v heads) in place, then this step's K and V rows
 * stored at their flat cache slots (k/v cache [slots, KVH, D]; skipped when k_cache is NULL,
 * and for rows whose slot is negative).
 * The rotate-half layout of Hugging Face Llama, with cos|sin of position p in
 * table[p] = cos[D/2] | sin[D/2]: x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin, each product
 * and sum rounded as torch's separate ops round them (no fused multiply-add). */
void rope_and_cache_rows(float *qkv, int64_t qkv_stride, const int64_t *positions,
                         const float *table, void *k_cache, void *v_cache, int64_t kv_format,
                         const int64_t *slots, int64_t t0, int64_t t1, int64_t H, int64_t KVH,
                         int64_t D) {
    const int64_t half = D / 2;
    const int64_t element = kv_format == KV_FLOAT32 ? (int64_t)sizeof(float) : 1;
    for (int64_t t = t0; t < t1; t++) {
        float *row = qkv + t * qkv_stride;
        if (k_cache != NULL && slots[t] >= 0) {
            /* ask for the cache lines this token's K and V go to before rotating: left to the
             * stores, the misses (a decode step writes lines no one touched lately) are taken
             * one after another, and the call took ~4x longer (64 tokens of the small
             * preset: 420 vs 90 us) */
            const int64_t width = KVH * D;
            const char *kd = (const char *)k_cache + slots[t] * width * element;
            const char *vd = (const char *)v_cache + slots[t] * width * element;
            for (int64_t i = 0; i < width * element; i += 64) {
                __builtin_prefetch(kd + i, 1, 3);
                __builtin_prefetch(vd + i, 1, 3);
            }
        }
        const float *cos = table + positions[t] * D;
        const float *sin = cos + half;
        for (int64_t h = 0; h < H + KVH; h++) {
            float *x1 = row + h * D;
            float *x2 = x1 + half;
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                const float a = x1[i], b = x2[i];
                const float a_cos = a * cos[i], b_sin = b * sin[i];
                const float b_cos = b * cos[i], a_sin = a * sin[i];
                x1[i] = a_cos - b_sin;
                x2[i] = b_cos + a_sin;
            }
        }
        if (k_cache != NULL && slots[t] >= 0) { /* slot < 0: a padding row, not stored */
            const int64_t width = KVH * D;
            const float *ks = row + H * D;
            const float *vs = ks + width;
            if (kv_format == KV_FLOAT32) {
                float *kd = (float *)k_cache + slots[t] * width;
                float *vd = (float *)v_cache + slots[t] * width;
                for (int64_t i = 0; i < width; i++) {
                    kd[i] = ks[i];
                    vd[i] = vs[i];
                }
            } else {
                uint8_t *kd = (uint8_t *)k_cache + slots[t] * width;
                uint8_t *vd = (uint8_t *)v_cache + slots[t] * width;
                for (int64_t i = 0; i < width; i++) {
                    kd[i] = to_kv_byte(ks[i], kv_format);
                    vd[i] = to_kv_byte(vs[i], kv_format);
                }
            }
        }
    }
}

void rope_and_cache_f32(float *qkv, int64_t qkv_stride, const int64_t *positions,
                        const float *table, void *k_cache, void *v_cache, int64_t kv_format,
                        const int64_t *slots, int64_t T, int64_t H, int64_t KVH, int64_t D,
                        int64_t threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (T * (H + KVH) * D >= 16384)
    for (int64_t t = 0; t < T; t++)
        rope_and_cache_rows(qkv, qkv_stride, positions, table, k_cache, v_cache, kv_format, slots,
                            t, t + 1, H, KVH, D);
}

/* The packed layout of this build's linear_f32: out[0] = PANEL (weight rows per panel),
 * out[1] = ROW_BLOCK (input rows per packed block); and the instruction set it was built for. */
void linear_layout(int64_t *out) {
    out[0] = PANEL;
    out[1] = ROW_BLOCK;
}

const char *kernel_isa(void) { return KERNEL_ISA; }

/* Linear layers for up to a few hundred rows of input (decode, short prefills).
 *
 * The weight is packed once, at load, into panels of PANEL of its rows transposed,
 * [ceil(N / PANEL)][K][PANEL] (the last one zero-padded): a panel is one contiguous stream,
 * and at each k it holds the weights that one input value multiplies. The input is packed per
 * call into blocks of ROW_BLOCK rows, [ceil(M / ROW_BLOCK)][K][ROW_BLOCK], so that the values
 * a step broadcasts are adjacent. The kernel keeps a ROW_BLOCK x PANEL block of the output in
 * registers (above) and per k does PANEL_VECS weight loads, ROW_BLOCK broadcasts and their
 * fused multiply-adds: compute-bound from the first level of cache. Each thread takes whole
 * panels; a panel is read from memory once per pass (about 128 rows), by the first block of
 * rows, and from cache by the others, while the next panel is prefetched a little per k
 * across all blocks, so that the weight keeps streaming while the arithmetic runs (oneDNN's
 * GEMM, which does not, took 1.1-1.4x compute + memory time at 4-64 rows on a 2-core Xeon;
 * this one 0.9-1.15x). */
void pack_linear_weight_f32(const float *w, int64_t N, int64_t K, float *panels,
                            int64_t threads) {
    const int64_t count = (N + PANEL - 1) / PANEL;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t p = 0; p < count; p++)
        for (int64_t k = 0; k < K; k++)
            for (int64_t j = 0; j < PANEL; j++) {
                const int64_t n = p * PANEL + j;
                panels[(p * K + k) * PANEL + j] = n < N ? w[n * K + k] : 0.0f;
            }
}

/* One step of k: out[i, :] += x[k][i] * panel[k][:] for the R rows of an input block of B
 * rows, against a panel of NV vectors. */
#define PANEL_STEP(R, B, NV, kk)                                                               \
    {                                                                                          \
        vec w[NV];                                                                             \
        for (int v = 0; v < NV; v++) w[v] = load_vec(panel + (kk) * (NV * VEC) + v * VEC);     \
        for (int i = 0; i < R; i++) {                                                          \
            const vec xv = broadcast_vec(xb + (kk) * (B) + i);                                 \
            for (int v = 0; v < NV; v++) acc[i][v] = fma_vec(xv, w[v], acc[i][v]);             \
        }                                                                                      \
    }

/* Prefetches of the next panel that are due after `steps` more steps of k. */
#define PANEL_PREFETCH(steps)                                                                  \
    {                                                                                          \
        due += (steps) * lines;                                                                \
        while (due >= per_lines) {                                                             \
            due -= per_lines;                                                                  \
            __builtin_prefetch(ahead, 0, 2);                                                   \
            ahead += 64;                                                                       \
        }                                                                                      \
    }

/* out[i * NV VEC + :] = sum_k x[k][i] * panel[k][:] for the R rows of a packed input block
 * (B rows); meanwhile prefetches `lines` cache lines of the next panel, spread evenly over the
 * k. Where at most one prefetch falls due per 4 steps (32 rows or more), k goes 4 steps a
 * round and the round's bookkeeping is shared by them: 4-15% faster at 32-2,000 rows on a
 * 2-core Xeon; with fewer rows the prefetches are denser and, bunched 4 steps' worth at a
 * time, cost more than they save (8 rows: 5-10% slower), so k goes step by step there. */
#define PANEL_ROUND 4
#define DEFINE_PANEL_KERNEL(NAME, R, B, NV)                                                    \
    static inline void NAME(const float *xb, const float *panel, int64_t K, float *out,       \
                            const char **next, int64_t lines, int64_t per_lines,              \
                            int64_t *credit) {                                                \
        vec acc[R][NV];                                                                       \
        for (int i = 0; i < R; i++)                                                           \
            for (int v = 0; v < NV; v++) acc[i][v] = (vec){0};                                \
        const char *ahead = *next;                                                            \
        int64_t due = *credit, k = 0;                                                         \
        if (PANEL_ROUND * lines <= per_lines)                                                 \
            for (; k + PANEL_ROUND <= K; k += PANEL_ROUND) {                                  \
                for (int u = 0; u < PANEL_ROUND; u++) PANEL_STEP(R, B, NV, k + u)             \
                PANEL_PREFETCH(PANEL_ROUND)                                                   \
            }                                                                                 \
        for (; k < K; k++) {                                                                  \
            PANEL_STEP(R, B, NV, k)                                                           \
            PANEL_PREFETCH(1)                                                                 \
        }                                                                                     \
        *next = ahead;                                                                        \
        *credit = due;                                                                        \
        for (int i = 0; i < R; i++)                                                           \
            for (int v = 0; v < NV; v++) store_vec(out + i * (NV * VEC) + v * VEC, acc[i][v]); \
    }
DEFINE_PANEL_KERNEL(panel_kernel_1, 1, ROW_BLOCK, PANEL_VECS)
DEFINE_PANEL_KERNEL(panel_kernel_2, 2, ROW_BLOCK, PANEL_VECS)
DEFINE_PANEL_KERNEL(panel_kernel_4, 4, ROW_BLOCK, PANEL_VECS)
#if ROW_BLOCK > 4
DEFINE_PANEL_KERNEL(panel_kernel_full, ROW_BLOCK, ROW_BLOCK, PANEL_VECS)
#else
#define panel_kernel_full panel_kernel_4
#endif

void gemm_panel(const float *xp, const float *panel, const float *next_panel,
                const float *bias, float *y, int64_t M, int64_t K, int64_t N, int64_t n0,
                int64_t b0, int64_t b1) {
    /* the next panel, a panel's PANEL x 4 x K bytes spread over the (b1 - b0) x K steps of
     * this one */
    const char *next = (const char *)(next_panel == NULL ? panel : next_panel);
    const int64_t lines = next_panel == NULL ? 0 : PANEL * (int64_t)sizeof(float) * K / 64;
    const int64_t per_lines = (b1 - b0) * K;
    int64_t credit = 0;
    const int64_t cols = N - n0 < PANEL ? N - n0 : PANEL;
    for (int64_t b = b0; b < b1; b++) {
        float out[ROW_BLOCK * PANEL];
        const int64_t rows = M - b * ROW_BLOCK < ROW_BLOCK ? M - b * ROW_BLOCK : ROW_BLOCK;
        const float *xb = xp + b * K * ROW_BLOCK;
        if (rows > 4)
            panel_kernel_full(xb, panel, K, out, &next, lines, per_lines, &credit);
        else if (rows > 2)
            panel_kernel_4(xb, panel, K, out, &next, lines, per_lines, &credit);
        else if (rows == 2)
            panel_kernel_2(xb, panel, K, out, &next, lines, per_lines, &credit);
        else
            panel_kernel_1(xb, panel, K, out, &next, lines, per_lines, &credit);
        for (int64_t i = 0; i < rows; i++) {
            float *yr = y + (b * ROW_BLOCK + i) * N + n0;
            if (cols == PANEL) { /* vector stores (gcc makes the loop a memcpy call) */
                for (int v = 0; v < PANEL_VECS; v++) {
                    vec o = load_vec(out + i * PANEL + v * VEC);
                    if (bias != NULL) o += load_vec(bias + n0 + v * VEC);
                    store_vec(yr + v * VEC, o);
                }
            } else {
                for (int64_t j = 0; j < cols; j++)
                    yr[j] = bias != NULL ? out[i * PANEL + j] + bias[n0 + j] : out[i * PANEL + j];
            }
        }
    }
}

/* Blocks of rows of x one pass over the panels takes (128 rows with AVX-512): the packed rows
 * stay in the core's cache while every panel goes by, and the weight is read once per pass
 * (16, 32 and 64 blocks of 8 measured alike at 2,048 rows on a 2-core Xeon). */
#define LINEAR_PASS_BLOCKS (128 / ROW_BLOCK)

/* x [M, K] -> xp (pack_gemm_input in kernels.h): this member's share of the blocks. */
void pack_gemm_input(const float *x, float *xp, int64_t M, int64_t K, const Member *me) {
    int64_t b0, b1;
    team_share((M + ROW_BLOCK - 1) / ROW_BLOCK, me, &b0, &b1);
    for (int64_t b = b0; b < b1; b++)
        for (int64_t k = 0; k < K; k++)
            for (int64_t i = 0; i < ROW_BLOCK; i++) {
                const int64_t m = b * ROW_BLOCK + i;
                xp[(b * K + k) * ROW_BLOCK + i] = m < M ? x[m * K + k] : 0.0f;
            }
}

/* y [M, N] = x [M, K] w^T (+ bias [N]) with w packed by pack_linear_weight_f32; x and y
 * contiguous; xp: room for x packed, ceil(M / ROW_BLOCK) x ROW_BLOCK x K floats. As one
 * member of a team (linear_f32_part; each takes a share of the panels), or on `threads`. */
void linear_f32_part(const float *x, const float *panels, const float *bias, float *y,
                     float *xp, int64_t M, int64_t K, int64_t N, const Member *me) {
    if (M <= 0 || N <= 0) return;
    const int64_t blocks = (M + ROW_BLOCK - 1) / ROW_BLOCK;
    const int64_t count = (N + PANEL - 1) / PANEL;
    pack_gemm_input(x, xp, M, K, me);
    team_barrier(me);
    int64_t p0, p1;
    team_share(count, me, &p0, &p1);
    for (int64_t b0 = 0; b0 < blocks; b0 += LINEAR_PASS_BLOCKS) {
        const int64_t b1 = b0 + LINEAR_PASS_BLOCKS < blocks ? b0 + LINEAR_PASS_BLOCKS : blocks;
        for (int64_t p = p0; p < p1; p++) {
            const float *panel = panels + p * K * PANEL;
            gemm_panel(xp, panel, p + 1 < count ? panel + K * PANEL : NULL, bias, y, M, K, N,
                       p * PANEL, b0, b1);
        }
    }
}

void linear_f32(const float *x, const float *panels, const float *bias, float *y, float *xp,
                int64_t M, int64_t K, int64_t N, int64_t threads) {
    Team team = {.spin_ns = team_default_spin_ns()};
#pragma omp parallel num_threads(threads)
    {
        const Member me = team_member(&team);
        linear_f32_part(x, panels, bias, y, xp, M, K, N, &me);
    }
}

/* Causal self-attention of prompts with no cached context (a whole prompt in one step), as
 * two small GEMMs per tile of 32 queries through a panel kernel like the GEMM's.
 *
 * q [T, H, D], k/v [T, KVH, D] with token strides q_stride, k_stride, v_stride (the rows of
 * the fused QKV projection), heads and d contiguous; starts [S + 1] int32: sequence s is rows
 * starts[s] .. starts[s + 1] - 1, its positions 0, 1, ...; `window` > 0: query i sees keys
 * i - window + 1 .. i (Mistral's). out [T, H, D] contiguous.
 *
 * A task is one sequence, one KV head and a run of its query tiles. It packs the keys it needs
 * as the kernel's input blocks ([key / 8][D][8]) and the values as panels of ATT_PANEL of D
 * ([D / ATT_PANEL][keys][ATT_PANEL]). Per tile, the 32 queries (pre-scaled) are packed as
 * panels, and the kernel gives the scores 8 keys x ATT_PANEL queries at a time, already in
 * the layout P V takes: for each group of 8 queries, [key][8]. The softmax then runs along
 * contiguous memory, 8 queries per vector, and P V is the kernel again with a group's
 * probabilities as its input rows; each output row is divided by its sum at the end.
 *
 * The kernel's block is 8 keys (or queries) x ATT_PANEL: with AVX-512 the GEMM's own 8 x 32;
 * with AVX2 8 x 8 (8 accumulators of 8 floats, in the 16 registers), so that a block of
 * scores is exactly one group's [key][8] with no reshuffling (the GEMM's 6 x 16 would split
 * groups of 8 across blocks); elsewhere 8 x 4. A query panel none of whose queries sees the
 * key block (above the causal diagonal) is skipped. */
#define ATT_BLOCK 8
#if defined(__AVX512F__)
#define ATT_VECS 2
#else
#define ATT_VECS 1
#endif
#define ATT_PANEL (ATT_VECS * VEC)
#define QUERY_TILE 32
#define PACK_AHEAD 8
#define ATT_CHUNK (ATT_PANEL < ATT_BLOCK ? ATT_PANEL : ATT_BLOCK)
_Static_assert(QUERY_TILE % ATT_PANEL == 0 && QUERY_TILE % ATT_BLOCK == 0
               && ATT_PANEL % ATT_CHUNK == 0 && ATT_BLOCK % ATT_CHUNK == 0,
               "a tile is whole query panels and whole groups");
DEFINE_PANEL_KERNEL(attention_kernel, ATT_BLOCK, ATT_BLOCK, ATT_VECS)

void prefill_attention_f32(const float *q, int64_t q_stride, const float *k, int64_t k_stride,
                           const float *v, int64_t v_stride, const int32_t *starts, int64_t S,
                           int64_t H, int64_t KVH, int64_t D, float scale, int64_t window,
                           int64_t threads, float *out) {
    if (S <= 0) return;
    const int64_t G = H / KVH;
    const int64_t dpanels = (D + ATT_PANEL - 1) / ATT_PANEL;
    const int64_t groups = QUERY_TILE / ATT_BLOCK;
    const int64_t chunks = (2 * threads + S * KVH - 1) / (S * KVH);
#pragma omp parallel for collapse(3) schedule(dynamic, 1) num_threads(threads)
    for (int64_t s = 0; s < S; s++) {
        for (int64_t h = 0; h < KVH; h++) {
            for (int64_t c = 0; c < chunks; c++) {
                const int64_t row0 = starts[s], n = starts[s + 1] - starts[s];
                const int64_t tiles = (n + QUERY_TILE - 1) / QUERY_TILE;
                const int64_t per_chunk = (tiles + chunks - 1) / chunks;
                const int64_t t0 = c * per_chunk;
                const int64_t t1 = t0 + per_chunk < tiles ? t0 + per_chunk : tiles;
                if (t0 >= t1) continue;
                /* keys this task's tiles see: from its first query's window to its last query,
                 * counted from key_begin (a multiple of 8) */
                const int64_t key_end = t1 * QUERY_TILE < n ? t1 * QUERY_TILE : n;
                int64_t key_begin = 0;
                if (window > 0 && t0 * QUERY_TILE - window + 1 > 0)
                    key_begin = (t0 * QUERY_TILE - window + 1) / ATT_BLOCK * ATT_BLOCK;
                const int64_t nk = key_end - key_begin;
                const int64_t nk_pad = (nk + ATT_BLOCK - 1) / ATT_BLOCK * ATT_BLOCK;
                float *kx = malloc(sizeof(float) * (nk_pad * D + dpanels * nk_pad * ATT_PANEL
                                                    + groups * nk_pad * ATT_BLOCK
                                                    + D * QUERY_TILE));
                if (kx == NULL) { /* out of memory: NaN outputs, never a wrong number */
                    for (int64_t i = t0 * QUERY_TILE; i < key_end; i++)
                        for (int64_t g = 0; g < G; g++)
                            for (int64_t d = 0; d < D; d++)
                                out[((row0 + i) * H + h * G + g) * D + d] = NAN;
                    continue;
                }
                float *vp = kx + nk_pad * D;                      /* [dpanels][nk_pad][ATT_PANEL] */
                float *probs = vp + dpanels * nk_pad * ATT_PANEL; /* [groups][nk_pad][8] */
                float *qp = probs + groups * nk_pad * ATT_BLOCK;  /* [32 / ATT_PANEL][D][ATT_PANEL] */
                for (int64_t j = 0; j < nk_pad; j++) {
                    const float *kr = k + (row0 + key_begin + j) * k_stride + h * D;
                    const float *vr = v + (row0 + key_begin + j) * v_stride + h * D;
                    if (j + PACK_AHEAD < nk) /* rows are a head's D floats, a whole row apart:
                                              * too far apart for the hardware prefetcher */
                        for (int64_t d = 0; d < D; d += 16) {
                            __builtin_prefetch(kr + PACK_AHEAD * k_stride + d, 0, 3);
                            __builtin_prefetch(vr + PACK_AHEAD * v_stride + d, 0, 3);
                        }
                    float *kd = kx + (j / ATT_BLOCK) * D * ATT_BLOCK + j % ATT_BLOCK;
                    for (int64_t d = 0; d < D; d++) kd[d * ATT_BLOCK] = j < nk ? kr[d] : 0.0f;
                    for (int64_t dp = 0; dp < dpanels; dp++) {
                        float *vd = vp + (dp * nk_pad + j) * ATT_PANEL;
                        const int64_t cols = j < nk ? (D - dp * ATT_PANEL < ATT_PANEL
                                                       ? D - dp * ATT_PANEL : ATT_PANEL) : 0;
                        for (int64_t d = 0; d < cols; d++) vd[d] = vr[dp * ATT_PANEL + d];
                        for (int64_t d = cols; d < ATT_PANEL; d++) vd[d] = 0.0f;
                    }
                }
                const char *no_prefetch = (const char *)kx;
                int64_t credit = 0;
                for (int64_t g = 0; g < G; g++) {
                    const int64_t head = h * G + g;
                    for (int64_t t = t0; t < t1; t++) {
                        const int64_t q0 = t * QUERY_TILE;
                        const int64_t rows = n - q0 < QUERY_TILE ? n - q0 : QUERY_TILE;
                        /* the queries of the next tile (or the next head's first), for the
                         * same reason as the keys */
                        const int64_t next = t + 1 < t1 ? q0 + QUERY_TILE : t0 * QUERY_TILE;
                        if (t + 1 < t1 || g + 1 < G)
                            for (int64_t i = next; i < next + QUERY_TILE && i < n; i++)
                                for (int64_t d = 0; d < D; d += 16)
                                    __builtin_prefetch(q + (row0 + i) * q_stride
                                                       + (t + 1 < t1 ? head : head + 1) * D + d,
                                                       0, 3);
                        for (int64_t i = 0; i < QUERY_TILE; i++) {
                            const float *qr = q + (row0 + q0 + i) * q_stride + head * D;
                            float *qd = qp + (i / ATT_PANEL) * D * ATT_PANEL + i % ATT_PANEL;
                            for (int64_t d = 0; d < D; d++)
                                qd[d * ATT_PANEL] = i < rows ? qr[d] * scale : 0.0f;
                        }
                        /* key blocks the tile sees (relative to key_begin): the window of its
                         * first query to its last query */
                        int64_t kb0 = 0;
                        if (window > 0 && q0 - window + 1 > key_begin)
                            kb0 = (q0 - window + 1 - key_begin) / ATT_BLOCK;
                        const int64_t kb1 = (q0 + rows - 1 - key_begin) / ATT_BLOCK + 1;
                        for (int64_t kb = kb0; kb < kb1; kb++) {
                            for (int64_t qi = 0; qi < QUERY_TILE && qi < rows; qi += ATT_PANEL) {
                                /* the panel's last query is before the block's first key: no
                                 * query of it sees the block, whose scores the softmax of
                                 * these queries masks (or stops before, at their j1) */
                                if (q0 + qi + ATT_PANEL - 1 < key_begin + kb * ATT_BLOCK)
                                    continue;
                                float tile[ATT_BLOCK * ATT_PANEL]; /* [8 keys][queries] */
                                attention_kernel(kx + kb * D * ATT_BLOCK, qp + qi * D, D, tile,
                                                 &no_prefetch, 0, 1, &credit);
                                for (int64_t c0 = 0; c0 < ATT_PANEL; c0 += ATT_CHUNK) {
                                    float *dst = probs + (((qi + c0) / ATT_BLOCK * nk_pad
                                                           + kb * ATT_BLOCK) * ATT_BLOCK
                                                          + (qi + c0) % ATT_BLOCK);
                                    for (int64_t kk = 0; kk < ATT_BLOCK; kk++)
                                        for (int64_t l = 0; l < ATT_CHUNK; l++)
                                            dst[kk * ATT_BLOCK + l] = tile[kk * ATT_PANEL + c0 + l];
                                }
                            }
                        }
                        for (int64_t gi = 0; gi < groups && gi * ATT_BLOCK < rows; gi++) {
                            const int64_t first = q0 + gi * ATT_BLOCK; /* this group's queries */
                            const int64_t count = rows - gi * ATT_BLOCK < ATT_BLOCK
                                                      ? rows - gi * ATT_BLOCK : ATT_BLOCK;
                            /* keys j0 .. j1 - 1 (relative) hold every key these queries see */
                            const int64_t j0 = kb0 * ATT_BLOCK;
                            const int64_t j1 = first + count - key_begin;
                            float *p = probs + gi * nk_pad * ATT_BLOCK;
                            float mx[ATT_BLOCK], sum[ATT_BLOCK];
                            for (int64_t i = 0; i < ATT_BLOCK; i++) mx[i] = -INFINITY;
                            for (int64_t j = j0; j < j1; j++) {
                                const int64_t key = key_begin + j;
                                for (int64_t i = 0; i < ATT_BLOCK; i++) {
                                    const int64_t pos = first + i;
                                    const int visible = i < count && key <= pos
                                                        && (window <= 0 || key > pos - window);
                                    float *e = p + j * ATT_BLOCK + i;
                                    *e = visible ? *e : -INFINITY;
                                    mx[i] = *e > mx[i] ? *e : mx[i];
                                }
                            }
                            for (int64_t i = 0; i < ATT_BLOCK; i++) sum[i] = 0.0f;
                            for (int64_t j = j0; j < j1; j++) {
                                float *e = p + j * ATT_BLOCK;
                                for (int64_t i = 0; i < ATT_BLOCK; i++) {
                                    /* exp_f32 clamps at e^-87: masked keys are set to 0 */
                                    e[i] = e[i] == -INFINITY ? 0.0f : exp_f32(e[i] - mx[i]);
                                    sum[i] += e[i];
                                }
                            }
                            for (int64_t dp = 0; dp < dpanels; dp++) {
                                float tile[ATT_BLOCK * ATT_PANEL]; /* [8 queries][d] */
                                attention_kernel(p + j0 * ATT_BLOCK,
                                                 vp + (dp * nk_pad + j0) * ATT_PANEL, j1 - j0,
                                                 tile, &no_prefetch, 0, 1, &credit);
                                const int64_t cols = D - dp * ATT_PANEL < ATT_PANEL
                                                         ? D - dp * ATT_PANEL : ATT_PANEL;
                                for (int64_t i = 0; i < count; i++) {
                                    float *o = out + ((row0 + first + i) * H + head) * D
                                               + dp * ATT_PANEL;
                                    const float inv = 1.0f / sum[i];
                                    for (int64_t d = 0; d < cols; d++)
                                        o[d] = tile[i * ATT_PANEL + d] * inv;
                                }
                            }
                        }
                    }
                }
                free(kx);
            }
        }
    }
}
