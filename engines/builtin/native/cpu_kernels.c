/* CPU kernels the engine compiles once per machine (engines/builtin/native/__init__.py) and
 * calls through ctypes with raw pointers. Each has a torch reference it is tested against
 * (tests/test_native_kernels.py). Parallel loops use OpenMP; the library links the libgomp
 * torch has already loaded, so torch and these kernels share one thread pool. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

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

/* Decode attention over a block-table KV cache, read in place.
 *
 * q [B, H, D] (token stride q_stride, heads contiguous), k/v cache [NB, BS, KVH, D]
 * contiguous, block_tables [B, *] int32 (row stride bt_stride), seq_lens [B] int32: sequence
 * b's query is its last position, seq_lens[b] - 1, and sees keys 0..seq_lens[b]-1, only the
 * last `window` of them when window > 0. out [B, H, D] contiguous. `threads`: torch's
 * intra-op thread count (torch passes its own to every parallel region, so do these kernels).
 *
 * A task is one sequence and a run of its KV heads: it walks the sequence's positions in
 * order and reads, per position, the K (then V) of its heads as one contiguous run, which the
 * hardware prefetcher streams (one task per head would read 256-byte pieces 3 KB apart, which
 * it does not). Sequences are split into head runs only as far as needed to give every thread
 * two tasks. Scores go to a per-task buffer: an exact two-pass softmax, no rescaling. Four
 * heads' dot products run side by side (four independent sums instead of one long chain). */
void decode_attention_f32(const float *q, int64_t q_stride, const float *k_cache,
                          const float *v_cache, const int32_t *block_tables, int64_t bt_stride,
                          const int32_t *seq_lens, int64_t B, int64_t H, int64_t KVH, int64_t D,
                          int64_t BS, float scale, int64_t window, int64_t threads,
                          float *out) {
    if (B <= 0) return;
    const int64_t G = H / KVH;
    const int64_t row = KVH * D; /* floats between consecutive positions */
    int64_t chunks = (2 * threads + B - 1) / B;
    if (chunks > KVH) chunks = KVH;
    if (chunks < 1) chunks = 1;
    const int64_t per_chunk = (KVH + chunks - 1) / chunks;
#pragma omp parallel for collapse(2) schedule(dynamic, 1) num_threads(threads)
    for (int64_t b = 0; b < B; b++) {
        for (int64_t c = 0; c < chunks; c++) {
            const int64_t h0 = c * per_chunk;
            const int64_t h1 = h0 + per_chunk < KVH ? h0 + per_chunk : KVH;
            if (h0 >= h1) continue;
            const int64_t nq = (h1 - h0) * G; /* query heads of this task */
            const int64_t len = seq_lens[b];
            const int64_t first = (window > 0 && len > window) ? len - window : 0;
            const int64_t n = len - first;
            const float *qt = q + b * q_stride + h0 * G * D;
            float *o = out + (b * H + h0 * G) * D;
            for (int64_t i = 0; i < nq * D; i++) o[i] = 0.0f;
            if (n <= 0) continue;
            const int32_t *table = block_tables + b * bt_stride;
            float *scores = malloc(sizeof(float) * nq * n);
            if (scores == NULL) { /* out of memory: NaN outputs, never a wrong number */
                for (int64_t i = 0; i < nq * D; i++) o[i] = NAN;
                continue;
            }
            for (int64_t j = 0; j < n; j++) {
                const int64_t pos = first + j;
                const float *kr = k_cache + ((int64_t)table[pos / BS] * BS + pos % BS) * row;
                int64_t i = 0;
                for (; i + 4 <= nq; i += 4) {
                    const float *q0 = qt + i * D, *q1 = q0 + D, *q2 = q1 + D, *q3 = q2 + D;
                    const float *k0 = kr + (h0 + i / G) * D;
                    const float *k1 = kr + (h0 + (i + 1) / G) * D;
                    const float *k2 = kr + (h0 + (i + 2) / G) * D;
                    const float *k3 = kr + (h0 + (i + 3) / G) * D;
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
                    const float *ki = kr + (h0 + i / G) * D;
                    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                    for (int64_t d = 0; d < D; d++) dot += qi[d] * ki[d];
                    scores[i * n + j] = dot * scale;
                }
            }
            for (int64_t i = 0; i < nq; i++) {
                float *si = scores + i * n;
                float mx = -INFINITY, sum = 0.0f;
                for (int64_t j = 0; j < n; j++) mx = si[j] > mx ? si[j] : mx;
#pragma omp simd reduction(+ : sum)
                for (int64_t j = 0; j < n; j++) {
                    si[j] = exp_f32(si[j] - mx);
                    sum += si[j];
                }
                const float inv = 1.0f / sum;
                for (int64_t j = 0; j < n; j++) si[j] *= inv;
            }
            for (int64_t j = 0; j < n; j++) {
                const int64_t pos = first + j;
                const float *vr = v_cache + ((int64_t)table[pos / BS] * BS + pos % BS) * row;
                for (int64_t i = 0; i < nq; i++) {
                    const float p = scores[i * n + j];
                    const float *vi = vr + (h0 + i / G) * D;
                    float *oi = o + i * D;
#pragma omp simd
                    for (int64_t d = 0; d < D; d++) oi[d] += p * vi[d];
                }
            }
            free(scores);
        }
    }
}

/* RMSNorm of T rows of width N, each row computed in float32 as torch's composite does:
 * out = x * (1 / sqrt(mean(x^2) + eps)) * weight. With `residual` (not NULL), the row is first
 * added into the residual stream, x + residual, which is kept (written to `residual`) for the
 * next block: the decoder's "residual add, then norm" in one pass over the row. `out` may be
 * `x` itself. */
void add_rms_norm_f32(const float *x, float *residual, const float *weight, float *out,
                      int64_t T, int64_t N, float eps, int64_t threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (T * N >= 16384)
    for (int64_t t = 0; t < T; t++) {
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

/* out [T, I] = silu(gate) * up, for gate_up [T, 2I] (gate | up, row stride 2I). */
void silu_and_mul_f32(const float *gate_up, float *out, int64_t T, int64_t I,
                      int64_t threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (T * I >= 16384)
    for (int64_t t = 0; t < T; t++) {
        const float *g = gate_up + t * 2 * I;
        const float *u = g + I;
        float *o = out + t * I;
#pragma omp simd
        for (int64_t i = 0; i < I; i++) o[i] = g[i] / (1.0f + exp_f32(-g[i])) * u[i];
    }
}

/* Rotary embedding of the query and key heads of qkv [T, (H + 2 KVH) D] (row stride
 * qkv_stride; q heads, then k heads, then v heads) in place, then this step's K and V rows
 * stored at their flat cache slots (k/v cache [slots, KVH, D]; skipped when k_cache is NULL,
 * and for rows whose slot is negative).
 * The rotate-half layout of Hugging Face Llama, with cos|sin of position p in
 * table[p] = cos[D/2] | sin[D/2]: x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin, each product
 * and sum rounded as torch's separate ops round them (no fused multiply-add). */
void rope_and_cache_f32(float *qkv, int64_t qkv_stride, const int64_t *positions,
                        const float *table, float *k_cache, float *v_cache,
                        const int64_t *slots, int64_t T, int64_t H, int64_t KVH, int64_t D,
                        int64_t threads) {
    const int64_t half = D / 2;
#pragma omp parallel for schedule(static) num_threads(threads) if (T * (H + KVH) * D >= 16384)
    for (int64_t t = 0; t < T; t++) {
        float *row = qkv + t * qkv_stride;
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
            float *kd = k_cache + slots[t] * width;
            float *vd = v_cache + slots[t] * width;
            const float *ks = row + H * D;
            const float *vs = ks + width;
            for (int64_t i = 0; i < width; i++) {
                kd[i] = ks[i];
                vd[i] = vs[i];
            }
        }
    }
}
