/* INT8, grouped INT8 and INT4 weight-only linear layers: y [M, N] = x [M, K] W^T (+ bias [N]), with W kept
 * quantized in the layouts below (packed once, at load, by engines/builtin/layers/quant.py) and
 * the input in float32. Tested against float64 dequantize-then-matmul
 * (tests/test_quant_kernels.py).
 *
 * Layouts (W's rows contiguous):
 * - INT8: q int8 [N][K], scale float [N]:  W[n, k] = q[n, k] scale[n].
 * - INT4: nibbles uint8 [N][K / 2] in blocks of 32 weights (16 bytes): byte j of a block holds
 *   its weight j in the low 4 bits and weight 16 + j in the high 4 bits (llama.cpp's Q4_0/Q4_1
 *   order: one load gives QW weights of each half, with a mask and a shift); a scale and a
 *   minimum (float) per group of g inputs (g a multiple of 32):
 *   W[n, k] = q[n, k] scale[n, k / g] + min[n, k / g]. An integer zero point z is the same form
 *   with min = -z scale.
 * - INT5 blocks: the INT4 layout's nibbles, each level's fifth bit (a 32-bit word per block of
 *   32: bit i is weight i's) and a float16 scale d and minimum m per block:
 *   W = (nibble + 16 bit) d + m (llama.cpp's Q5_0 with m = -16 d, Q5_1 as it is).
 * - INT8 blocks: q int8 [N][K], a float16 scale d per block of 32 inputs: W = q d (llama.cpp's
 *   Q8_0 as it is; Q5_0 as q - 16): a byte and 1/16 of one a weight, as the file.
 * - grouped INT8: q uint8 [N][K], a scale and a minimum (float) per group of g inputs (g 16 or
 *   32): W[n, k] = q[n, k] scale[n, k / g] + min[n, k / g]. The form every GGUF type of 5 to 8
 *   bits takes exactly (Q8_0: q + 128 and min = -128 d; Q6_K: groups of 16, d sc (q - 32);
 *   Q5_1/Q5_K: 5-bit q with their minima), made by engines/builtin/layers/checkpoint_quant.py.
 *
 * Two kernels per format, `rows_max` choosing (Python passes its measured crossover):
 * - M <= rows_max (decode, small batches): the rows kernels (quant_rows.h). Each thread takes a
 *   range of W's rows and streams them once; the weights are widened to float and multiplied
 *   into up to 2 input rows at a time with fused multiply-adds (the dequantized weight never
 *   leaves the registers). The INT4 minimum's term, min * (sum of the group's inputs), takes
 *   each group's input sum, computed once per call.
 * - more rows (prefill): per panel of PANEL weight rows, dequantize them into a [K][PANEL] float
 *   tile (a thread's own, cache-resident) and run the float32 GEMM's panel kernel on it
 *   (gemm_panel, cpu_kernels.c), once per pass of the GEMM over the input's rows. Never a
 *   per-row op: the dequantization is paid once per 128 input rows.
 *
 * `path` forces the rows kernels' vector width (QUANT_PATH_*; 0: the widest this build has),
 * so that tests run every one the machine can: the portable scalar loops, 4 floats (SSE, NEON),
 * 8 (AVX2) and 16 (AVX-512, only where the build targets it). The library is compiled on the
 * machine that runs it (-march=native), so the widest is this CPU's. */

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "team.h"

/* Bytes ahead of the weight stream the rows kernels prefetch: a thread's weight rows are one
 * contiguous stream, and with the hardware prefetcher alone one core streamed INT8 decode at
 * ~6 GB/s here (SmolLM2's gate/up projection, 1 thread: 0.233 ms a call without, 0.182 ms
 * with 2 KB ahead; 1 KB and 4 KB alike; INT4 with INT8 activations 0.184 -> 0.169 ms). */
#ifndef QPREFETCH
#define QPREFETCH 2048
#endif

enum {
    QUANT_PATH_AUTO = 0,
    QUANT_PATH_PORTABLE = 1,
    QUANT_PATH_VEC4 = 2,
    QUANT_PATH_VEC8 = 3,
    QUANT_PATH_VEC16 = 4,
};

/* A float16 (the INT8-blocks layout's scales) as a float: F16C's instruction where the build
 * has it, else the bits rebuilt (normal, subnormal, zero, infinity, NaN). */
static inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 31, mantissa = h & 1023;
    uint32_t bits;
    if (exponent == 0) {
        const float tiny = ldexpf((float)mantissa, -24);
        return sign ? -tiny : tiny;
    }
    if (exponent == 31)
        bits = sign | 0x7f800000u | (mantissa << 13);
    else
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

/* sum_i h[i] v[i] for float16 h: F16C's conversion 16 (or 8) at a time where the build has it
 * (the INT5 minima's term, once per output and input row: scalar, it cost more than the
 * minima's bytes saved). */
static inline float half_dot(const uint16_t *h, const float *v, int64_t count) {
    float total = 0.0f;
    int64_t i = 0;
#if defined(__AVX512F__)
    __m512 acc = _mm512_setzero_ps();
    for (; i + 16 <= count; i += 16)
        acc = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(h + i))),
                              _mm512_loadu_ps(v + i), acc);
    total = _mm512_reduce_add_ps(acc);
#elif defined(__F16C__) && defined(__FMA__)
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= count; i += 8)
        acc = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))),
                              _mm256_loadu_ps(v + i), acc);
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    total = _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
#endif
    for (; i < count; i++) total += half_to_float(h[i]) * v[i];
    return total;
}

/* An FP8 (e4m3) weight's value / 256, by its byte: the portable kernels' widening, from
 * cpu_kernels.c's table of the values (the vector kernels widen through float16, whose value
 * is the byte's / 256: the same numbers, exactly). */
static inline float fp8_over_256(uint8_t byte) { return fp8_value[KV_E4M3][byte] * 0.00390625f; }

#define QW 4
#define QSUFFIX _vec4
#include "quant_rows.h"
#undef QW
#undef QSUFFIX

#if VEC >= 8
#define QW 8
#define QSUFFIX _vec8
#include "quant_rows.h"
#undef QW
#undef QSUFFIX
#endif

#if VEC >= 16
#define QW 16
#define QSUFFIX _vec16
#include "quant_rows.h"
#undef QW
#undef QSUFFIX
#endif

/* Bit p set: path p callable in this build (the portable one always is). */
int64_t quant_paths(void) {
    int64_t paths = (1 << QUANT_PATH_PORTABLE) | (1 << QUANT_PATH_VEC4);
#if VEC >= 8
    paths |= 1 << QUANT_PATH_VEC8;
#endif
#if VEC >= 16
    paths |= 1 << QUANT_PATH_VEC16;
#endif
    return paths;
}

static int64_t widest_path(void) {
#if VEC >= 16
    return QUANT_PATH_VEC16;
#elif VEC >= 8
    return QUANT_PATH_VEC8;
#else
    return QUANT_PATH_VEC4;
#endif
}

/* The portable rows kernels: plain loops, the reference the vector ones must match. */
static void q4_rows_portable(const float *x, const uint8_t *nib, const float *scale,
                             const float *minv, const float *xsum, const float *bias, float *y,
                             int64_t M, int64_t K, int64_t N, int64_t g, int64_t n0, int64_t n1) {
    const int64_t groups = K / g;
    for (int64_t n = n0; n < n1; n++)
        for (int64_t m = 0; m < M; m++) {
            const float *xm = x + m * K;
            float total = bias != NULL ? bias[n] : 0.0f;
            for (int64_t gi = 0; gi < groups; gi++) {
                float acc = 0.0f;
                for (int64_t k = gi * g; k < (gi + 1) * g; k++) {
                    const uint8_t byte = nib[n * (K / 2) + (k / 32) * 16 + k % 16];
                    acc += (float)(k % 32 < 16 ? byte & 15 : byte >> 4) * xm[k];
                }
                total += scale[n * groups + gi] * acc + minv[n * groups + gi] * xsum[m * groups + gi];
            }
            y[m * N + n] = total;
        }
}

static void f8_rows_portable(const float *x, const uint8_t *q, const float *scale,
                             const float *bias, float *y, int64_t M, int64_t K, int64_t N,
                             int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++)
        for (int64_t m = 0; m < M; m++) {
            float acc = 0.0f;
            for (int64_t k = 0; k < K; k++) acc += fp8_over_256(q[n * K + k]) * x[m * K + k];
            y[m * N + n] = acc * (scale[n] * 256.0f) + (bias != NULL ? bias[n] : 0.0f);
        }
}

static void q8_rows_portable(const float *x, const int8_t *q, const float *scale,
                             const float *bias, float *y, int64_t M, int64_t K, int64_t N,
                             int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++)
        for (int64_t m = 0; m < M; m++) {
            float acc = 0.0f;
            for (int64_t k = 0; k < K; k++) acc += (float)q[n * K + k] * x[m * K + k];
            y[m * N + n] = acc * scale[n] + (bias != NULL ? bias[n] : 0.0f);
        }
}

static void g8_rows_portable(const float *x, const uint8_t *q, const float *scale,
                             const float *minv, const float *xsum, const float *bias, float *y,
                             int64_t M, int64_t K, int64_t N, int64_t g, int64_t n0, int64_t n1) {
    const int64_t groups = K / g;
    for (int64_t n = n0; n < n1; n++)
        for (int64_t m = 0; m < M; m++) {
            const float *xm = x + m * K;
            float total = bias != NULL ? bias[n] : 0.0f;
            for (int64_t gi = 0; gi < groups; gi++) {
                float acc = 0.0f;
                for (int64_t k = gi * g; k < (gi + 1) * g; k++) acc += (float)q[n * K + k] * xm[k];
                total += scale[n * groups + gi] * acc + minv[n * groups + gi] * xsum[m * groups + gi];
            }
            y[m * N + n] = total;
        }
}

static void b8_rows_portable(const float *x, const int8_t *q, const uint16_t *d,
                             const float *bias, float *y, int64_t M, int64_t K, int64_t N,
                             int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++)
        for (int64_t m = 0; m < M; m++) {
            float total = bias != NULL ? bias[n] : 0.0f;
            for (int64_t b = 0; b < K / 32; b++) {
                float acc = 0.0f;
                for (int64_t k = b * 32; k < b * 32 + 32; k++) acc += (float)q[n * K + k] * x[m * K + k];
                total += half_to_float(d[n * (K / 32) + b]) * acc;
            }
            y[m * N + n] = total;
        }
}

static inline int q5_level(const uint8_t *nib, const uint32_t *high, int64_t k) {
    const uint8_t byte = nib[(k / 32) * 16 + k % 16];
    return (k % 32 < 16 ? byte & 15 : byte >> 4) | (int)((high[k / 32] >> (k % 32)) & 1) << 4;
}

static void q5_rows_portable(const float *x, const uint8_t *nib, const uint32_t *high,
                             const uint16_t *d, const uint16_t *m, const float *xsum,
                             const float *bias, float *y, int64_t M, int64_t K, int64_t N,
                             int64_t n0, int64_t n1) {
    const int64_t blocks = K / 32;
    for (int64_t n = n0; n < n1; n++)
        for (int64_t row = 0; row < M; row++) {
            float total = bias != NULL ? bias[n] : 0.0f;
            for (int64_t b = 0; b < blocks; b++) {
                float acc = 0.0f;
                for (int64_t k = b * 32; k < b * 32 + 32; k++)
                    acc += (float)q5_level(nib + n * (K / 2), high + n * blocks, k) * x[row * K + k];
                total += half_to_float(d[n * blocks + b]) * acc +
                         half_to_float(m[n * blocks + b]) * xsum[row * blocks + b];
            }
            y[row * N + n] = total;
        }
}

/* INT4 weights times INT8 activations (llama.cpp's Q4_1 x Q8_1): each input row quantized per
 * block of 32 values, dx = max|x| / 127, xq = round(x 127 / max|x|) (half to even), and each
 * block's integer dot product sum(q xq) exact in int32, scaled by scale dx once per block:
 * y[n] = sum_b scale dx_b sum(q xq) + sum_groups min sum(dx xq). About half the instructions
 * of widening the nibbles to float (a block is one byte multiply-add, one pair add, one
 * conversion and one fused multiply-add per input row), so it is faster wherever the float
 * kernel is compute-bound (one or two cores). */
typedef struct {
    int8_t *xq;  /* [M][K] */
    float *dx;   /* [M][K / 32] */
    float *sx;   /* [M][K / g]: sum over the group of dx xq (g a multiple of 16) */
} QuantizedRows;

static void quantize_rows_q8(const float *x, int64_t M, int64_t K, int64_t g, QuantizedRows *out) {
    const int64_t blocks = K / 32, groups = K / g;
    for (int64_t m = 0; m < M; m++) {
        for (int64_t gi = 0; gi < groups; gi++) out->sx[m * groups + gi] = 0.0f;
        for (int64_t b = 0; b < blocks; b++) {
            const float *xb = x + m * K + b * 32;
            float amax = 0.0f, poison = 0.0f;
            for (int i = 0; i < 32; i++) {
                amax = fmaxf(amax, fabsf(xb[i]));
                poison += xb[i] * 0.0f; /* NaN when any value is NaN or infinite */
            }
            /* a non-finite input makes the row's outputs NaN (its scale NaN, its values 0: a
             * NaN converted to int8 would be undefined), never a wrong number */
            const int finite = poison == 0.0f;
            const float inv = finite && amax > 0.0f ? 127.0f / amax : 0.0f;
            const float d = finite ? amax / 127.0f : NAN;
            int32_t total[2] = {0, 0}; /* per half: grouped INT8's groups may be 16 */
            for (int i = 0; i < 32; i++) {
                const int8_t v = (int8_t)nearbyintf(xb[i] * inv);
                out->xq[m * K + b * 32 + i] = v;
                total[i / 16] += v;
            }
            out->dx[m * blocks + b] = d;
            out->sx[m * groups + (b * 32) / g] += d * (float)total[0];
            out->sx[m * groups + (b * 32 + 16) / g] += d * (float)total[1];
        }
    }
}

static void q4q8_rows_portable(const QuantizedRows *xr, const uint8_t *nib, const float *scale,
                               const float *minv, const float *bias, float *y, int64_t M,
                               int64_t K, int64_t N, int64_t g, int64_t n0, int64_t n1) {
    const int64_t blocks = K / 32, groups = K / g;
    for (int64_t n = n0; n < n1; n++)
        for (int64_t m = 0; m < M; m++) {
            float total = bias != NULL ? bias[n] : 0.0f;
            for (int64_t b = 0; b < blocks; b++) {
                const uint8_t *bytes = nib + n * (K / 2) + b * 16;
                const int8_t *xq = xr->xq + m * K + b * 32;
                int32_t dot = 0;
                for (int i = 0; i < 16; i++)
                    dot += (bytes[i] & 15) * xq[i] + (bytes[i] >> 4) * xq[16 + i];
                total += scale[n * groups + (b * 32) / g] * xr->dx[m * blocks + b] * (float)dot;
            }
            for (int64_t gi = 0; gi < groups; gi++)
                total += minv[n * groups + gi] * xr->sx[m * groups + gi];
            y[m * N + n] = total;
        }
}

/* Grouped INT8 weights times INT8 activations: the same scheme per chunk of 16 (a group of 16
 * or half of one of 32): y[n] = sum_c scale dx sum(q xq) + sum_groups min sum(dx xq). The
 * unsigned weights reach 255, so the AVX2 kernel widens both to 16 bits (vpmaddubsw's 16-bit
 * pair sums could saturate); VNNI's vpdpbusd sums four products straight into 32 bits. */
static void g8q8_rows_portable(const QuantizedRows *xr, const uint8_t *q, const float *scale,
                               const float *minv, const float *bias, float *y, int64_t M,
                               int64_t K, int64_t N, int64_t g, int64_t n0, int64_t n1) {
    const int64_t blocks = K / 32, groups = K / g;
    for (int64_t n = n0; n < n1; n++)
        for (int64_t m = 0; m < M; m++) {
            float total = bias != NULL ? bias[n] : 0.0f;
            for (int64_t c = 0; c < K / 16; c++) {
                const uint8_t *w = q + n * K + c * 16;
                const int8_t *xq = xr->xq + m * K + c * 16;
                int32_t dot = 0;
                for (int i = 0; i < 16; i++) dot += w[i] * xq[i];
                total += scale[n * groups + (c * 16) / g] * xr->dx[m * blocks + c / 2] * (float)dot;
            }
            for (int64_t gi = 0; gi < groups; gi++)
                total += minv[n * groups + gi] * xr->sx[m * groups + gi];
            y[m * N + n] = total;
        }
}

/* INT8 blocks times INT8 activations (llama.cpp's Q8_0 x Q8_0): per block scale d dx sum(q xq). */
static void b8q8_rows_portable(const QuantizedRows *xr, const int8_t *q, const uint16_t *d,
                               const float *bias, float *y, int64_t M, int64_t K, int64_t N,
                               int64_t n0, int64_t n1) {
    const int64_t blocks = K / 32;
    for (int64_t n = n0; n < n1; n++)
        for (int64_t m = 0; m < M; m++) {
            float total = bias != NULL ? bias[n] : 0.0f;
            for (int64_t b = 0; b < blocks; b++) {
                int32_t dot = 0;
                for (int i = 0; i < 32; i++) dot += q[n * K + b * 32 + i] * xr->xq[m * K + b * 32 + i];
                total += half_to_float(d[n * blocks + b]) * xr->dx[m * blocks + b] * (float)dot;
            }
            y[m * N + n] = total;
        }
}

/* y[m, n] for W's rows [n0, n1), all M input rows four at a time, by ROW (INT8 blocks). */
#define DEFINE_B8Q8_ROWS(NAME, ROW)                                                            \
    static void NAME(const QuantizedRows *xr, const int8_t *q, const uint16_t *d,             \
                     const float *bias, float *y, int64_t M, int64_t K, int64_t N, int64_t n0, \
                     int64_t n1) {                                                             \
        const int64_t blocks = K / 32;                                                         \
        for (int64_t n = n0; n < n1; n++) {                                                    \
            const int8_t *wn = q + n * K;                                                      \
            const uint16_t *dn = d + n * blocks;                                               \
            const float bn = bias != NULL ? bias[n] : 0.0f;                                    \
            for (int64_t m = 0; m < M; m += 4) {                                               \
                float out[4];                                                                  \
                const QuantizedRows rows = {xr->xq + m * K, xr->dx + m * blocks,               \
                                            xr->sx + m * blocks};                              \
                switch (M - m < 4 ? M - m : 4) {                                               \
                case 1: ROW(1, &rows, K, wn, dn, out); break;                                  \
                case 2: ROW(2, &rows, K, wn, dn, out); break;                                  \
                case 3: ROW(3, &rows, K, wn, dn, out); break;                                  \
                default: ROW(4, &rows, K, wn, dn, out); break;                                 \
                }                                                                              \
                for (int64_t r = 0; r < 4 && m + r < M; r++) y[(m + r) * N + n] = out[r] + bn; \
            }                                                                                  \
        }                                                                                      \
    }

/* INT5 blocks times INT8 activations (llama.cpp's Q5_0/Q5_1 x Q8_1): per block
 * d dx sum(q xq) + m sx, sx = dx sum(xq). */
static void q5q8_rows_portable(const QuantizedRows *xr, const uint8_t *nib, const uint32_t *high,
                               const uint16_t *d, const uint16_t *m, const float *bias, float *y,
                               int64_t M, int64_t K, int64_t N, int64_t n0, int64_t n1) {
    const int64_t blocks = K / 32;
    for (int64_t n = n0; n < n1; n++)
        for (int64_t row = 0; row < M; row++) {
            float total = bias != NULL ? bias[n] : 0.0f;
            for (int64_t b = 0; b < blocks; b++) {
                int32_t dot = 0;
                for (int64_t k = b * 32; k < b * 32 + 32; k++)
                    dot += q5_level(nib + n * (K / 2), high + n * blocks, k) * xr->xq[row * K + k];
                total += half_to_float(d[n * blocks + b]) * xr->dx[row * blocks + b] * (float)dot +
                         half_to_float(m[n * blocks + b]) * xr->sx[row * blocks + b];
            }
            y[row * N + n] = total;
        }
}

/* y[m, n] for W's rows [n0, n1), all M input rows four at a time, by ROW (INT5 blocks). */
#define DEFINE_Q5Q8_ROWS(NAME, ROW)                                                            \
    static void NAME(const QuantizedRows *xr, const uint8_t *nib, const uint32_t *high,       \
                     const uint16_t *d, const uint16_t *mins, const float *bias, float *y,     \
                     int64_t M, int64_t K, int64_t N, int64_t n0, int64_t n1) {                \
        const int64_t blocks = K / 32;                                                         \
        for (int64_t n = n0; n < n1; n++) {                                                    \
            const float bn = bias != NULL ? bias[n] : 0.0f;                                    \
            for (int64_t m = 0; m < M; m += 4) {                                               \
                float out[4];                                                                  \
                const QuantizedRows rows = {xr->xq + m * K, xr->dx + m * blocks,               \
                                            xr->sx + m * blocks};                              \
                const uint8_t *wn = nib + n * (K / 2);                                         \
                const uint32_t *hn = high + n * blocks;                                        \
                const uint16_t *dn = d + n * blocks, *mn = mins + n * blocks;                  \
                switch (M - m < 4 ? M - m : 4) {                                               \
                case 1: ROW(1, &rows, K, wn, hn, dn, mn, out); break;                          \
                case 2: ROW(2, &rows, K, wn, hn, dn, mn, out); break;                          \
                case 3: ROW(3, &rows, K, wn, hn, dn, mn, out); break;                          \
                default: ROW(4, &rows, K, wn, hn, dn, mn, out); break;                         \
                }                                                                              \
                for (int64_t r = 0; r < 4 && m + r < M; r++) y[(m + r) * N + n] = out[r] + bn; \
            }                                                                                  \
        }                                                                                      \
    }

/* y[m, n] = the INT4 (BITS 4) or grouped INT8 (BITS 8) x INT8 product for W's rows [n0, n1) and
 * all M input rows, four at a time, by the row kernel ROW (one per instruction set, each always
 * inlined per row count); a group is UNIT << shift inputs (ROW's unit: 32 or 16). */
#define DEFINE_Q8_INPUT_ROWS(NAME, ROW, BITS, UNIT)                                            \
    static void NAME(const QuantizedRows *xr, const uint8_t *nib, const float *scale,         \
                     const float *minv, const float *bias, float *y, int64_t M, int64_t K,     \
                     int64_t N, int64_t g, int64_t n0, int64_t n1) {                           \
        const int64_t groups = K / g, blocks = K / 32;                                         \
        int64_t shift = 0;                                                                     \
        while ((UNIT << shift) < g) shift++;                                                   \
        for (int64_t n = n0; n < n1; n++) {                                                    \
            const uint8_t *wn = nib + n * (K * BITS / 8);                                      \
            const float *sn = scale + n * groups, *mn = minv + n * groups;                     \
            const float bn = bias != NULL ? bias[n] : 0.0f;                                    \
            for (int64_t m = 0; m < M; m += 4) {                                               \
                float out[4];                                                                  \
                const QuantizedRows rows = {xr->xq + m * K, xr->dx + m * blocks,               \
                                            xr->sx + m * groups};                              \
                switch (M - m < 4 ? M - m : 4) {                                               \
                case 1: ROW(1, &rows, K, wn, sn, mn, groups, shift, out); break;               \
                case 2: ROW(2, &rows, K, wn, sn, mn, groups, shift, out); break;               \
                case 3: ROW(3, &rows, K, wn, sn, mn, groups, shift, out); break;               \
                default: ROW(4, &rows, K, wn, sn, mn, groups, shift, out); break;              \
                }                                                                              \
                for (int64_t r = 0; r < 4 && m + r < M; r++) y[(m + r) * N + n] = out[r] + bn; \
            }                                                                                  \
        }                                                                                      \
    }

#if defined(__AVX2__) && defined(__FMA__)
/* acc[r][c] += scale dx * sum(q xq) of block b for R input rows. */
static inline __attribute__((always_inline)) void q4q8_block_avx2(
    const int R, const QuantizedRows *xr, int64_t K, int64_t blocks, const uint8_t *nib,
    int64_t b, __m256 s, const int c, __m256 acc[4][2]) {
    const __m128i packed = _mm_loadu_si128((const __m128i *)(nib + b * 16));
    const __m128i mask = _mm_set1_epi8(15);
    const __m256i w = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(packed, 4), mask),
                                       _mm_and_si128(packed, mask));
    for (int r = 0; r < R; r++) {
        const __m256i xq = _mm256_loadu_si256((const __m256i *)(xr->xq + r * K + b * 32));
        const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(w, xq), _mm256_set1_epi16(1));
        const __m256 d = _mm256_mul_ps(s, _mm256_broadcast_ss(xr->dx + r * blocks + b));
        acc[r][c] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(dot), acc[r][c]);
    }
}

static inline __attribute__((always_inline)) void q4q8_row_avx2(
    const int R, const QuantizedRows *xr, int64_t K, const uint8_t *nib, const float *scale,
    const float *minv, int64_t groups, int64_t group_shift, float *out) {
    const int64_t blocks = K / 32;
    __m256 acc[4][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 2 <= blocks; b += 2) { /* two chains: consecutive blocks' sums independent */
        __builtin_prefetch(nib + b * 16 + QPREFETCH, 0, 0);
        q4q8_block_avx2(R, xr, K, blocks, nib, b, _mm256_broadcast_ss(scale + (b >> group_shift)),
                        0, acc);
        q4q8_block_avx2(R, xr, K, blocks, nib, b + 1,
                        _mm256_broadcast_ss(scale + ((b + 1) >> group_shift)), 1, acc);
    }
    if (b < blocks)
        q4q8_block_avx2(R, xr, K, blocks, nib, b, _mm256_broadcast_ss(scale + (b >> group_shift)),
                        0, acc);
    for (int r = 0; r < R; r++) {
        const __m256 sum = _mm256_add_ps(acc[r][0], acc[r][1]);
        __m128 h = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
        h = _mm_add_ps(h, _mm_movehl_ps(h, h));
        h = _mm_add_ss(h, _mm_movehdup_ps(h));
        float m = 0.0f;
        for (int64_t gi = 0; gi < groups; gi++) m += minv[gi] * xr->sx[r * groups + gi];
        out[r] = _mm_cvtss_f32(h) + m;
    }
}

DEFINE_Q8_INPUT_ROWS(q4q8_rows_avx2, q4q8_row_avx2, 4, 32)

/* acc[r][a] += scale dx * sum(q xq) of chunk c (16 weights) for R input rows, in 16 bits. */
static inline __attribute__((always_inline)) void g8q8_chunk_avx2(
    const int R, const QuantizedRows *xr, int64_t K, int64_t blocks, const uint8_t *q,
    int64_t c, __m256 s, const int a, __m256 acc[4][2]) {
    const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(q + c * 16)));
    for (int r = 0; r < R; r++) {
        const __m256i xq =
            _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(xr->xq + r * K + c * 16)));
        const __m256i dot = _mm256_madd_epi16(w, xq);
        const __m256 d = _mm256_mul_ps(s, _mm256_broadcast_ss(xr->dx + r * blocks + c / 2));
        acc[r][a] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(dot), acc[r][a]);
    }
}

static inline __attribute__((always_inline)) void g8q8_row_avx2(
    const int R, const QuantizedRows *xr, int64_t K, const uint8_t *q, const float *scale,
    const float *minv, int64_t groups, int64_t shift, float *out) {
    const int64_t blocks = K / 32, chunks = K / 16;
    __m256 acc[4][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    int64_t c = 0;
    for (; c + 2 <= chunks; c += 2) {
        __builtin_prefetch(q + c * 16 + QPREFETCH, 0, 0);
        g8q8_chunk_avx2(R, xr, K, blocks, q, c, _mm256_broadcast_ss(scale + (c >> shift)), 0, acc);
        g8q8_chunk_avx2(R, xr, K, blocks, q, c + 1,
                        _mm256_broadcast_ss(scale + ((c + 1) >> shift)), 1, acc);
    }
    if (c < chunks)
        g8q8_chunk_avx2(R, xr, K, blocks, q, c, _mm256_broadcast_ss(scale + (c >> shift)), 0, acc);
    for (int r = 0; r < R; r++) {
        const __m256 sum = _mm256_add_ps(acc[r][0], acc[r][1]);
        __m128 h = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
        h = _mm_add_ps(h, _mm_movehl_ps(h, h));
        h = _mm_add_ss(h, _mm_movehdup_ps(h));
        float m = 0.0f;
        for (int64_t gi = 0; gi < groups; gi++) m += minv[gi] * xr->sx[r * groups + gi];
        out[r] = _mm_cvtss_f32(h) + m;
    }
}

DEFINE_Q8_INPUT_ROWS(g8q8_rows_avx2, g8q8_row_avx2, 8, 16)

/* INT8 blocks x INT8 activations, llama.cpp's way: |q| times x with q's sign, vpmaddubsw's pair
 * sums (|q| <= 128, |x| <= 127: no saturation) and vpmaddwd to 32 bits; two chains. */
static inline __attribute__((always_inline)) void b8q8_row_avx2(
    const int R, const QuantizedRows *xr, int64_t K, const int8_t *q, const uint16_t *d,
    float *out) {
    const int64_t blocks = K / 32;
    __m256 acc[4][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        if ((b & 1) == 0) __builtin_prefetch(q + b * 32 + QPREFETCH, 0, 0);
        const __m256i w = _mm256_loadu_si256((const __m256i *)(q + b * 32));
        const __m256i magnitude = _mm256_sign_epi8(w, w);
        const __m256 s = _mm256_set1_ps(half_to_float(d[b]));
        for (int r = 0; r < R; r++) {
            const __m256i xq = _mm256_loadu_si256((const __m256i *)(xr->xq + r * K + b * 32));
            const __m256i dot = _mm256_madd_epi16(
                _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(xq, w)), _mm256_set1_epi16(1));
            const __m256 scale = _mm256_mul_ps(s, _mm256_broadcast_ss(xr->dx + r * blocks + b));
            acc[r][b & 1] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(dot), acc[r][b & 1]);
        }
    }
    for (int r = 0; r < R; r++) {
        const __m256 sum = _mm256_add_ps(acc[r][0], acc[r][1]);
        __m128 h = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
        h = _mm_add_ps(h, _mm_movehl_ps(h, h));
        h = _mm_add_ss(h, _mm_movehdup_ps(h));
        out[r] = _mm_cvtss_f32(h);
    }
}

DEFINE_B8Q8_ROWS(b8q8_rows_avx2, b8q8_row_avx2)

/* 0xFF in byte i where bit i of `bits` is set: each byte takes its bit's byte of the word, ORed
 * with every bit but its own; all ones exactly when that bit was set. */
static inline __m256i bits_to_bytes(uint32_t bits) {
    const __m256i spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32((int)bits),
        _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
    const __m256i others = _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe);
    return _mm256_cmpeq_epi8(_mm256_or_si256(spread, others), _mm256_set1_epi64x(-1));
}

/* INT5 blocks x INT8 activations: the nibbles as q4q8's, the fifth bits ORed in as 16s. */
static inline __attribute__((always_inline)) void q5q8_row_avx2(
    const int R, const QuantizedRows *xr, int64_t K, const uint8_t *nib, const uint32_t *high,
    const uint16_t *d, const uint16_t *m, float *out) {
    const int64_t blocks = K / 32;
    const __m128i mask = _mm_set1_epi8(15);
    __m256 acc[4][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        if ((b & 1) == 0) __builtin_prefetch(nib + b * 16 + QPREFETCH, 0, 0);
        const __m128i packed = _mm_loadu_si128((const __m128i *)(nib + b * 16));
        const __m256i low = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(packed, 4), mask),
                                             _mm_and_si128(packed, mask));
        const __m256i w = _mm256_or_si256(
            low, _mm256_and_si256(bits_to_bytes(high[b]), _mm256_set1_epi8(16)));
        const __m256 s = _mm256_set1_ps(half_to_float(d[b]));
        for (int r = 0; r < R; r++) {
            const __m256i xq = _mm256_loadu_si256((const __m256i *)(xr->xq + r * K + b * 32));
            const __m256i dot =
                _mm256_madd_epi16(_mm256_maddubs_epi16(w, xq), _mm256_set1_epi16(1));
            const __m256 scale = _mm256_mul_ps(s, _mm256_broadcast_ss(xr->dx + r * blocks + b));
            acc[r][b & 1] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(dot), acc[r][b & 1]);
        }
    }
    for (int r = 0; r < R; r++) {
        const __m256 sum = _mm256_add_ps(acc[r][0], acc[r][1]);
        __m128 h = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
        h = _mm_add_ps(h, _mm_movehl_ps(h, h));
        h = _mm_add_ss(h, _mm_movehdup_ps(h));
        out[r] = _mm_cvtss_f32(h) + half_dot(m, xr->sx + r * blocks, blocks);
    }
}

DEFINE_Q5Q8_ROWS(q5q8_rows_avx2, q5q8_row_avx2)
#endif

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512DQ__) && \
    defined(__AVX512BW__)
#define Q4Q8_VNNI 1
/* AVX-512 VNNI (Zen 4, Ice Lake and later): two blocks' 64 weights in one register and one
 * vpdpbusd per input row (unsigned weights times signed activations, sums of 4 products in
 * int32 lanes: lanes 0-7 are block b's, 8-15 block b + 1's), where AVX2 takes two
 * multiply-adds and a widening per block. acc[r][c] += scale dx * sum(q xq) of blocks b and
 * b + 1 for R input rows. */
static inline __attribute__((always_inline)) void q4q8_pair_vnni(
    const int R, const QuantizedRows *xr, int64_t K, int64_t blocks, const uint8_t *nib,
    int64_t b, float s0, float s1, const int c, __m512 acc[4][2]) {
    const __m256i packed = _mm256_loadu_si256((const __m256i *)(nib + b * 16));
    const __m256i mask = _mm256_set1_epi8(15);
    const __m256i lo = _mm256_and_si256(packed, mask);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), mask);
    /* 128-bit lanes lo(b) lo(b+1) hi(b) hi(b+1) -> lo(b) hi(b) lo(b+1) hi(b+1): each block's
     * 32 weights in order, as its 32 activations are */
    const __m512i halves = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    const __m512i w = _mm512_shuffle_i64x2(halves, halves, _MM_SHUFFLE(3, 1, 2, 0));
    for (int r = 0; r < R; r++) {
        const __m512i xq = _mm512_loadu_si512((const void *)(xr->xq + r * K + b * 32));
        const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, xq);
        const float *dx = xr->dx + r * blocks + b;
        const __m512 d = _mm512_insertf32x8(_mm512_set1_ps(s0 * dx[0]),
                                            _mm256_set1_ps(s1 * dx[1]), 1);
        acc[r][c] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(dot), acc[r][c]);
    }
}

static inline __attribute__((always_inline)) void q4q8_row_vnni(
    const int R, const QuantizedRows *xr, int64_t K, const uint8_t *nib, const float *scale,
    const float *minv, int64_t groups, int64_t group_shift, float *out) {
    const int64_t blocks = K / 32;
    __m512 acc[4][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    int64_t b = 0;
    for (; b + 4 <= blocks; b += 4) { /* two chains: consecutive pairs' sums independent */
        __builtin_prefetch(nib + b * 16 + QPREFETCH, 0, 0);
        q4q8_pair_vnni(R, xr, K, blocks, nib, b, scale[b >> group_shift],
                       scale[(b + 1) >> group_shift], 0, acc);
        q4q8_pair_vnni(R, xr, K, blocks, nib, b + 2, scale[(b + 2) >> group_shift],
                       scale[(b + 3) >> group_shift], 1, acc);
    }
    if (b + 2 <= blocks) {
        q4q8_pair_vnni(R, xr, K, blocks, nib, b, scale[b >> group_shift],
                       scale[(b + 1) >> group_shift], 0, acc);
        b += 2;
    }
    for (int r = 0; r < R; r++) {
        float total = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]));
        if (b < blocks) { /* an odd last block */
            const uint8_t *bytes = nib + b * 16;
            const int8_t *xq = xr->xq + r * K + b * 32;
            int32_t dot = 0;
            for (int i = 0; i < 16; i++)
                dot += (bytes[i] & 15) * xq[i] + (bytes[i] >> 4) * xq[16 + i];
            total += scale[b >> group_shift] * xr->dx[r * blocks + b] * (float)dot;
        }
        for (int64_t gi = 0; gi < groups; gi++) total += minv[gi] * xr->sx[r * groups + gi];
        out[r] = total;
    }
}

DEFINE_Q8_INPUT_ROWS(q4q8_rows_vnni, q4q8_row_vnni, 4, 32)

/* Four chunks (64 weights, two activation blocks) in one register and one vpdpbusd per input
 * row: 128-bit lane i holds chunk c + i's sums, scaled by its group's scale times its block's
 * dx. */
static inline __attribute__((always_inline)) void g8q8_quad_vnni(
    const int R, const QuantizedRows *xr, int64_t K, int64_t blocks, const uint8_t *q,
    int64_t c, __m128 s, const int a, __m512 acc[4][2]) {
    const __m512i w = _mm512_loadu_si512((const void *)(q + c * 16));
    const __m512i lanes = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    for (int r = 0; r < R; r++) {
        const __m512i xq = _mm512_loadu_si512((const void *)(xr->xq + r * K + c * 16));
        const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, xq);
        const float *dx = xr->dx + r * blocks + c / 2;
        const __m128 d4 = _mm_mul_ps(s, _mm_set_ps(dx[1], dx[1], dx[0], dx[0]));
        const __m512 d = _mm512_permutexvar_ps(lanes, _mm512_castps128_ps512(d4));
        acc[r][a] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(dot), acc[r][a]);
    }
}

static inline __attribute__((always_inline)) void g8q8_row_vnni(
    const int R, const QuantizedRows *xr, int64_t K, const uint8_t *q, const float *scale,
    const float *minv, int64_t groups, int64_t shift, float *out) {
    const int64_t blocks = K / 32, chunks = K / 16;
    __m512 acc[4][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    int64_t c = 0;
    for (; c + 4 <= chunks; c += 4) {
        __builtin_prefetch(q + c * 16 + QPREFETCH, 0, 0);
        const __m128 s = _mm_set_ps(scale[(c + 3) >> shift], scale[(c + 2) >> shift],
                                    scale[(c + 1) >> shift], scale[c >> shift]);
        g8q8_quad_vnni(R, xr, K, blocks, q, c, s, (c / 4) & 1, acc);
    }
    for (int r = 0; r < R; r++) {
        float total = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]));
        for (int64_t t = c; t < chunks; t++) { /* the last one to three chunks */
            const uint8_t *w = q + t * 16;
            const int8_t *xq = xr->xq + r * K + t * 16;
            int32_t dot = 0;
            for (int i = 0; i < 16; i++) dot += w[i] * xq[i];
            total += scale[t >> shift] * xr->dx[r * blocks + t / 2] * (float)dot;
        }
        for (int64_t gi = 0; gi < groups; gi++) total += minv[gi] * xr->sx[r * groups + gi];
        out[r] = total;
    }
}

DEFINE_Q8_INPUT_ROWS(g8q8_rows_vnni, g8q8_row_vnni, 8, 16)

/* Two blocks a register: vpdpbusd takes unsigned weights, so q + 128 (q xor 0x80) times xq,
 * less 128 xq (a second vpdpbusd, of 0x80 bytes): a scalar correction per block after the loop
 * took a tenth of the LM head's time. */
static inline __attribute__((always_inline)) void b8q8_row_vnni(
    const int R, const QuantizedRows *xr, int64_t K, const int8_t *q, const uint16_t *d,
    float *out) {
    const int64_t blocks = K / 32;
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512 acc[4][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    int64_t b = 0;
    for (; b + 2 <= blocks; b += 2) {
        __builtin_prefetch(q + b * 32 + QPREFETCH, 0, 0);
        const __m512i w = _mm512_xor_si512(_mm512_loadu_si512((const void *)(q + b * 32)), flip);
        const float s0 = half_to_float(d[b]), s1 = half_to_float(d[b + 1]);
        for (int r = 0; r < R; r++) {
            const __m512i xq = _mm512_loadu_si512((const void *)(xr->xq + r * K + b * 32));
            const __m512i dot = _mm512_sub_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), w, xq),
                                                 _mm512_dpbusd_epi32(_mm512_setzero_si512(), flip, xq));
            const float *dx = xr->dx + r * blocks + b;
            const __m512 scale = _mm512_insertf32x8(_mm512_set1_ps(s0 * dx[0]),
                                                    _mm256_set1_ps(s1 * dx[1]), 1);
            acc[r][(b / 2) & 1] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(dot), acc[r][(b / 2) & 1]);
        }
    }
    for (int r = 0; r < R; r++) {
        float total = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]));
        for (int64_t t = b; t < blocks; t++) { /* an odd last block */
            int32_t dot = 0;
            for (int i = 0; i < 32; i++) dot += q[t * 32 + i] * xr->xq[r * K + t * 32 + i];
            total += half_to_float(d[t]) * xr->dx[r * blocks + t] * (float)dot;
        }
        out[r] = total;
    }
}

DEFINE_B8Q8_ROWS(b8q8_rows_vnni, b8q8_row_vnni)

/* INT5 blocks x INT8 activations, two blocks a register as q4q8_pair_vnni's, the fifth bits
 * added as 16s under a 64-bit mask (the two blocks' words). */
static inline __attribute__((always_inline)) void q5q8_row_vnni(
    const int R, const QuantizedRows *xr, int64_t K, const uint8_t *nib, const uint32_t *high,
    const uint16_t *d, const uint16_t *m, float *out) {
    const int64_t blocks = K / 32;
    const __m256i mask = _mm256_set1_epi8(15);
    __m512 acc[4][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    int64_t b = 0;
    for (; b + 2 <= blocks; b += 2) {
        __builtin_prefetch(nib + b * 16 + QPREFETCH, 0, 0);
        const __m256i packed = _mm256_loadu_si256((const __m256i *)(nib + b * 16));
        const __m512i halves = _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_and_si256(packed, mask)),
            _mm256_and_si256(_mm256_srli_epi16(packed, 4), mask), 1);
        const __m512i levels = _mm512_shuffle_i64x2(halves, halves, _MM_SHUFFLE(3, 1, 2, 0));
        const __mmask64 fifth = (__mmask64)high[b] | (__mmask64)high[b + 1] << 32;
        const __m512i w = _mm512_mask_add_epi8(levels, fifth, levels, _mm512_set1_epi8(16));
        const float s0 = half_to_float(d[b]), s1 = half_to_float(d[b + 1]);
        for (int r = 0; r < R; r++) {
            const __m512i xq = _mm512_loadu_si512((const void *)(xr->xq + r * K + b * 32));
            const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, xq);
            const float *dx = xr->dx + r * blocks + b;
            const __m512 scale = _mm512_insertf32x8(_mm512_set1_ps(s0 * dx[0]),
                                                    _mm256_set1_ps(s1 * dx[1]), 1);
            acc[r][(b / 2) & 1] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(dot), acc[r][(b / 2) & 1]);
        }
    }
    for (int r = 0; r < R; r++) {
        float total = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]));
        for (int64_t t = b; t < blocks; t++) { /* an odd last block */
            int32_t dot = 0;
            for (int64_t k = t * 32; k < t * 32 + 32; k++)
                dot += q5_level(nib, high, k) * xr->xq[r * K + k];
            total += half_to_float(d[t]) * xr->dx[r * blocks + t] * (float)dot;
        }
        out[r] = total + half_dot(m, xr->sx + r * blocks, blocks);
    }
}

DEFINE_Q5Q8_ROWS(q5q8_rows_vnni, q5q8_row_vnni)
#else
#define Q4Q8_VNNI 0
#endif

/* Bit p set: an INT8-activation path: the portable one, AVX2's and AVX-512 VNNI's where the
 * build has them. */
int64_t quant_q8_activation_paths(void) {
    int64_t paths = 1 << QUANT_PATH_PORTABLE;
#if defined(__AVX2__) && defined(__FMA__)
    paths |= 1 << QUANT_PATH_VEC8;
#endif
#if Q4Q8_VNNI
    paths |= 1 << QUANT_PATH_VEC16;
#endif
    return paths;
}

static void nan_fill(float *y, int64_t count) {
    for (int64_t i = 0; i < count; i++) y[i] = NAN;
}

/* W's rows split among the threads in runs of 4 (whole cache lines of y's columns for most
 * shapes); each thread's rows are one contiguous stream of the packed weight. */
#define ROWS_CHUNK 4

/* The widest rows-kernel width's functions, for the tile kernels' dequantization. */
#if VEC >= 16
#define WIDEST(name) name##_vec16
#elif VEC >= 8
#define WIDEST(name) name##_vec8
#else
#define WIDEST(name) name##_vec4
#endif

/* W's rows n0 .. n0 + PANEL - 1 into tile [K][PANEL] (rows past N: zeros): each row
 * dequantized with vector instructions into `rows` [PANEL][K], then transposed from cache
 * (writing the tile's columns straight from the packed weights took 3-4x as long). */
static void dequantize_panel(const LinearWeights *l, int64_t n0, float *rows, float *tile) {
    const int64_t K = l->in_features, N = l->out_features, g = l->group_size;
    const float *scale = l->scale, *minv = l->minv;
    int64_t shift = 0; /* grouped INT8: g = 16 << shift */
    while (g && (16 << shift) < g) shift++;
    for (int64_t j = 0; j < PANEL; j++) {
        const int64_t n = n0 + j;
        float *row = rows + j * K;
        if (n >= N) {
            for (int64_t k = 0; k < K; k++) row[k] = 0.0f;
        } else if (l->kind == LINEAR_INT4 || l->kind == LINEAR_INT4_A8) {
            WIDEST(q4_dequantize_row)((const uint8_t *)l->weight + n * (K / 2),
                                      scale + n * (K / g), minv + n * (K / g), K, g, row);
        } else if (l->kind == LINEAR_INT5B || l->kind == LINEAR_INT5B_A8) {
            WIDEST(q5_dequantize_row)((const uint8_t *)l->weight + n * (K / 2),
                                      l->bits + n * (K / 32), (const uint16_t *)scale + n * (K / 32),
                                      (const uint16_t *)minv + n * (K / 32), K, row);
        } else if (l->kind == LINEAR_INT8B || l->kind == LINEAR_INT8B_A8) {
            WIDEST(b8_dequantize_row)((const int8_t *)l->weight + n * K,
                                      (const uint16_t *)scale + n * (K / 32), K, row);
        } else if (l->kind == LINEAR_INT8G || l->kind == LINEAR_INT8G_A8) {
            WIDEST(g8_dequantize_row)((const uint8_t *)l->weight + n * K, scale + n * (K / g),
                                      minv + n * (K / g), K, shift, row);
        } else if (l->kind == LINEAR_FP8) {
            WIDEST(f8_dequantize_row)((const uint8_t *)l->weight + n * K, scale[n], K, row);
        } else {
            WIDEST(q8_dequantize_row)((const int8_t *)l->weight + n * K, scale[n], K, row);
        }
    }
    int64_t k = 0;
#if defined(__AVX__)
    /* 8 x 8 blocks transposed in registers: 24 shuffles per 64 values instead of 64 scalar
     * moves with strided stores (the tile kernels at 64-128 rows: ~25% of their time) */
    for (; k + 8 <= K; k += 8)
        for (int64_t j0 = 0; j0 < PANEL; j0 += 8) {
            __m256 r[8], t[8], u[8];
            for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_ps(rows + (j0 + i) * K + k);
            for (int i = 0; i < 8; i += 2) {
                t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
                t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
            }
            for (int i = 0; i < 8; i += 4) {
                u[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
                u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
                u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
                u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
            }
            for (int i = 0; i < 4; i++) {
                _mm256_storeu_ps(tile + (k + i) * PANEL + j0,
                                 _mm256_permute2f128_ps(u[i], u[i + 4], 0x20));
                _mm256_storeu_ps(tile + (k + i + 4) * PANEL + j0,
                                 _mm256_permute2f128_ps(u[i], u[i + 4], 0x31));
            }
        }
#endif
    for (; k < K; k++)
        for (int64_t j = 0; j < PANEL; j++) tile[k * PANEL + j] = rows[j * K + k];
}

/* Input rows one pass of the tile kernels takes: each panel is dequantized once per pass, so
 * passes are twice the float32 GEMM's 128 rows (at 128 prompt rows its 126-row passes cost a
 * second dequantization for 2 rows). SmolLM2's gate/up and down projections, 1 thread, vs the
 * float32 GEMM on the same rows: 128-row passes 1.02x and 1.29x at 128 rows, 256-row passes
 * 0.97x and 1.15x; at 200 rows 1.09x / 1.06x vs 1.02x / 0.99x. */
#ifndef TILE_PASS_ROWS
#define TILE_PASS_ROWS 256
#endif
#define TILE_PASS_BLOCKS (TILE_PASS_ROWS / ROW_BLOCK)

/* The tile path of every format (the kind picks the dequantization). xp: the packed input
 * (shared), tile: this member's 2 K PANEL floats. */
static void quant_tiles_part(const LinearWeights *l, const float *x, float *y,
                             int64_t M, float *xp, float *tile, const Member *me) {
    const int64_t K = l->in_features, N = l->out_features;
    const int64_t blocks = (M + ROW_BLOCK - 1) / ROW_BLOCK;
    const int64_t count = (N + PANEL - 1) / PANEL;
    pack_gemm_input(x, xp, M, K, me);
    team_barrier(me);
    int64_t p0, p1;
    team_share(count, me, &p0, &p1);
    for (int64_t b0 = 0; b0 < blocks; b0 += TILE_PASS_BLOCKS) {
        const int64_t b1 = b0 + TILE_PASS_BLOCKS < blocks ? b0 + TILE_PASS_BLOCKS : blocks;
        for (int64_t p = p0; p < p1; p++) {
            dequantize_panel(l, p * PANEL, tile + K * PANEL, tile);
            gemm_panel(xp, tile, NULL, l->bias, y, M, K, N, p * PANEL, b0, b1);
        }
    }
}

/* The rows kernels' input, INT8 activations: where each part sits in the shared scratch. */
static QuantizedRows quantized_rows(float *shared, int64_t M, int64_t K, int64_t g) {
    float *dx = shared, *sx = dx + M * (K / 32);
    return (QuantizedRows){(int8_t *)(sx + M * (K / g)), dx, sx};
}

/* name##_vec16 / _vec8 / _vec4 / _portable (args) by `path`: the float rows kernels at the
 * vector widths this build has. */
#if VEC >= 16
#define CASE_VEC16(name, ...)                                                                     \
    case QUANT_PATH_VEC16: name##_vec16(__VA_ARGS__); break;
#else
#define CASE_VEC16(name, ...)
#endif
#if VEC >= 8
#define CASE_VEC8(name, ...)                                                                      \
    case QUANT_PATH_VEC8: name##_vec8(__VA_ARGS__); break;
#else
#define CASE_VEC8(name, ...)
#endif
#define BY_WIDTH(path, name, ...)                                                                 \
    switch (path) {                                                                               \
        CASE_VEC16(name, __VA_ARGS__)                                                             \
        CASE_VEC8(name, __VA_ARGS__)                                                              \
    case QUANT_PATH_VEC4: name##_vec4(__VA_ARGS__); break;                                        \
    default: name##_portable(__VA_ARGS__);                                                        \
    }

/* name##_vnni / _avx2 / _portable (args) by `path`: the INT8-activation rows kernels (VNNI on
 * the 16-float path, AVX2 on the 8- and 16-float ones where VNNI is missing). */
#if Q4Q8_VNNI
#define IF_VNNI(path, name, ...)                                                                  \
    if (path == QUANT_PATH_VEC16) {                                                               \
        name##_vnni(__VA_ARGS__);                                                                 \
        break;                                                                                    \
    }
#else
#define IF_VNNI(path, name, ...)
#endif
#if defined(__AVX2__) && defined(__FMA__)
#define IF_AVX2(path, name, ...)                                                                  \
    if (path != QUANT_PATH_PORTABLE && path != QUANT_PATH_VEC4) {                                 \
        name##_avx2(__VA_ARGS__);                                                                 \
        break;                                                                                    \
    }
#else
#define IF_AVX2(path, name, ...)
#endif
#define BY_A8_PATH(path, name, ...)                                                               \
    IF_VNNI(path, name, __VA_ARGS__)                                                              \
    IF_AVX2(path, name, __VA_ARGS__)                                                              \
    name##_portable(__VA_ARGS__);

void quant_linear_scratch(const LinearWeights *l, int64_t M, int64_t *shared, int64_t *own) {
    const int64_t K = l->in_features, g = l->group_size;
    *own = 0;
    if (M > l->rows_max) {
        *shared = (M + ROW_BLOCK - 1) / ROW_BLOCK * ROW_BLOCK * K;
        *own = 2 * K * PANEL;
    } else if (l->kind == LINEAR_INT4_A8 || l->kind == LINEAR_INT8G_A8 ||
               l->kind == LINEAR_INT8B_A8 || l->kind == LINEAR_INT5B_A8) {
        *shared = M * (K / 32) + M * (K / g) + (M * K + 3) / 4;
    } else if (l->kind == LINEAR_INT4 || l->kind == LINEAR_INT8G || l->kind == LINEAR_INT5B) {
        *shared = M * (K / g);
    } else {
        *shared = 0;
    }
}

void quant_linear_part(const LinearWeights *l, const float *x, float *y, int64_t M,
                       int64_t path, float *shared, float *own, const Member *me) {
    const int64_t K = l->in_features, N = l->out_features, g = l->group_size;
    if (M <= 0 || N <= 0) return;
    if (M > l->rows_max) {
        quant_tiles_part(l, x, y, M, shared, own, me);
        return;
    }
    if (path == QUANT_PATH_AUTO) path = widest_path();
    /* the input's per-row preparation, rows shared among the members */
    int64_t m0, m1;
    team_share(M, me, &m0, &m1);
    const int64_t groups = l->kind == LINEAR_INT8 || l->kind == LINEAR_FP8 ? 0 : K / g;
    QuantizedRows xr = {0};
    const int int8_inputs = l->kind == LINEAR_INT4_A8 || l->kind == LINEAR_INT8G_A8 ||
                            l->kind == LINEAR_INT8B_A8 || l->kind == LINEAR_INT5B_A8;
    if (int8_inputs) {
        xr = quantized_rows(shared, M, K, g);
        QuantizedRows mine = {xr.xq + m0 * K, xr.dx + m0 * (K / 32), xr.sx + m0 * groups};
        quantize_rows_q8(x + m0 * K, m1 - m0, K, g, &mine);
        team_barrier(me);
    } else if (l->kind == LINEAR_INT4 || l->kind == LINEAR_INT8G || l->kind == LINEAR_INT5B) {
        for (int64_t m = m0; m < m1; m++)
            for (int64_t gi = 0; gi < groups; gi++) {
                float sum = 0.0f;
                for (int64_t k = gi * g; k < (gi + 1) * g; k++) sum += x[m * K + k];
                shared[m * groups + gi] = sum;
            }
        team_barrier(me);
    }
    int64_t c0, c1;
    team_share((N + ROWS_CHUNK - 1) / ROWS_CHUNK, me, &c0, &c1);
    const int64_t n0 = c0 * ROWS_CHUNK, n1 = c1 * ROWS_CHUNK < N ? c1 * ROWS_CHUNK : N;
    if (n0 >= n1) return;
    const float *xsum = shared; /* the float rows kernels' per-group input sums */
    const uint16_t *d = (const uint16_t *)l->scale, *mn = (const uint16_t *)l->minv;
    switch (l->kind) {
    case LINEAR_INT8: BY_WIDTH(path, q8_rows, x, l->weight, l->scale, l->bias, y, M, K, N, n0, n1); break;
    case LINEAR_FP8: BY_WIDTH(path, f8_rows, x, l->weight, l->scale, l->bias, y, M, K, N, n0, n1); break;
    case LINEAR_INT5B:
        BY_WIDTH(path, q5_rows, x, l->weight, l->bits, d, mn, xsum, l->bias, y, M, K, N, n0, n1);
        break;
    case LINEAR_INT5B_A8:
        BY_A8_PATH(path, q5q8_rows, &xr, l->weight, l->bits, d, mn, l->bias, y, M, K, N, n0, n1);
        break;
    case LINEAR_INT8B: BY_WIDTH(path, b8_rows, x, l->weight, d, l->bias, y, M, K, N, n0, n1); break;
    case LINEAR_INT8B_A8: BY_A8_PATH(path, b8q8_rows, &xr, l->weight, d, l->bias, y, M, K, N, n0, n1); break;
    case LINEAR_INT8G:
        BY_WIDTH(path, g8_rows, x, l->weight, l->scale, l->minv, xsum, l->bias, y, M, K, N, g, n0, n1);
        break;
    case LINEAR_INT8G_A8:
        BY_A8_PATH(path, g8q8_rows, &xr, l->weight, l->scale, l->minv, l->bias, y, M, K, N, g, n0, n1);
        break;
    case LINEAR_INT4_A8:
        BY_A8_PATH(path, q4q8_rows, &xr, l->weight, l->scale, l->minv, l->bias, y, M, K, N, g, n0, n1);
        break;
    default: /* LINEAR_INT4 */
        BY_WIDTH(path, q4_rows, x, l->weight, l->scale, l->minv, xsum, l->bias, y, M, K, N, g, n0, n1);
    }
}

/* One call on `threads` (Python's entry points below): the scratch allocated for it. */
static void quant_linear(const LinearWeights *l, const float *x, float *y, int64_t M,
                         int64_t path, int64_t threads) {
    if (M <= 0 || l->out_features <= 0) return;
    int64_t shared_floats, own_floats;
    quant_linear_scratch(l, M, &shared_floats, &own_floats);
    float *scratch = malloc(sizeof(float) * (shared_floats + threads * own_floats + 1));
    if (scratch == NULL) { /* out of memory: NaN outputs, never a wrong number */
        nan_fill(y, M * l->out_features);
        return;
    }
    Team team = {.spin_ns = team_default_spin_ns()};
#pragma omp parallel num_threads(threads)
    {
        const Member me = team_member(&team);
        quant_linear_part(l, x, y, M, path, scratch,
                          scratch + shared_floats + me.id * own_floats, &me);
    }
    free(scratch);
}

/* y [M, N] = x [M, K] W^T (+ bias) for an INT4 W (layout above), group size g. */
void q4_linear_f32(const float *x, const uint8_t *nib, const float *scale, const float *minv,
                   const float *bias, float *y, int64_t M, int64_t K, int64_t N, int64_t g,
                   int64_t rows_max, int64_t path, int64_t threads) {
    const LinearWeights l = {LINEAR_INT4, nib, scale, minv, bias, K, N, g, rows_max};
    quant_linear(&l, x, y, M, path, threads);
}

/* y [M, N] = x [M, K] W^T (+ bias) for an INT8 W (layout above). */
void q8_linear_f32(const float *x, const int8_t *q, const float *scale, const float *bias,
                   float *y, int64_t M, int64_t K, int64_t N, int64_t rows_max, int64_t path,
                   int64_t threads) {
    const LinearWeights l = {LINEAR_INT8, q, scale, NULL, bias, K, N, 0, rows_max};
    quant_linear(&l, x, y, M, path, threads);
}

/* As q4_linear_f32, with each input row quantized to INT8 per block of 32 where the rows kernel
 * runs (M <= rows_max; more rows take the float tile kernel). `path`: QUANT_PATH_PORTABLE,
 * QUANT_PATH_VEC8 (AVX2) or QUANT_PATH_VEC16 (AVX-512 VNNI; else AVX2's); AUTO: the widest. */
void q4_linear_q8_f32(const float *x, const uint8_t *nib, const float *scale, const float *minv,
                      const float *bias, float *y, int64_t M, int64_t K, int64_t N, int64_t g,
                      int64_t rows_max, int64_t path, int64_t threads) {
    const LinearWeights l = {LINEAR_INT4_A8, nib, scale, minv, bias, K, N, g, rows_max};
    quant_linear(&l, x, y, M, path, threads);
}

/* y [M, N] = x [M, K] W^T (+ bias) for an FP8 W: e4m3 bytes [N, K] and a float32 scale a row. */
void f8_linear_f32(const float *x, const uint8_t *q, const float *scale, const float *bias,
                   float *y, int64_t M, int64_t K, int64_t N, int64_t rows_max, int64_t path,
                   int64_t threads) {
    const LinearWeights l = {LINEAR_FP8, q, scale, NULL, bias, K, N, 0, rows_max};
    quant_linear(&l, x, y, M, path, threads);
}

/* y [M, N] = x [M, K] W^T (+ bias) for a grouped-INT8 W (layout above), group size g (16, 32). */
void g8_linear_f32(const float *x, const uint8_t *q, const float *scale, const float *minv,
                   const float *bias, float *y, int64_t M, int64_t K, int64_t N, int64_t g,
                   int64_t rows_max, int64_t path, int64_t threads) {
    const LinearWeights l = {LINEAR_INT8G, q, scale, minv, bias, K, N, g, rows_max};
    quant_linear(&l, x, y, M, path, threads);
}

/* As g8_linear_f32 with INT8 activations where the rows kernel runs (K a multiple of 32), as
 * q4_linear_q8_f32. */
void g8_linear_q8_f32(const float *x, const uint8_t *q, const float *scale, const float *minv,
                      const float *bias, float *y, int64_t M, int64_t K, int64_t N, int64_t g,
                      int64_t rows_max, int64_t path, int64_t threads) {
    const LinearWeights l = {LINEAR_INT8G_A8, q, scale, minv, bias, K, N, g, rows_max};
    quant_linear(&l, x, y, M, path, threads);
}

/* y [M, N] = x [M, K] W^T (+ bias) for an INT8-blocks W (int8 q, float16 d per 32 inputs). */
void b8_linear_f32(const float *x, const int8_t *q, const uint16_t *d, const float *bias,
                   float *y, int64_t M, int64_t K, int64_t N, int64_t rows_max, int64_t path,
                   int64_t threads) {
    const LinearWeights l = {LINEAR_INT8B, q, (const float *)d, NULL, bias, K, N, 32, rows_max};
    quant_linear(&l, x, y, M, path, threads);
}

/* As b8_linear_f32 with INT8 activations where the rows kernel runs (llama.cpp's Q8_0 x Q8_0). */
void b8_linear_q8_f32(const float *x, const int8_t *q, const uint16_t *d, const float *bias,
                      float *y, int64_t M, int64_t K, int64_t N, int64_t rows_max, int64_t path,
                      int64_t threads) {
    const LinearWeights l = {LINEAR_INT8B_A8, q, (const float *)d, NULL, bias, K, N, 32, rows_max};
    quant_linear(&l, x, y, M, path, threads);
}

/* y [M, N] = x [M, K] W^T (+ bias) for an INT5-blocks W (nibbles, fifth bits, float16 d and m
 * per 32 inputs); `activations_int8`: INT8 activations where the rows kernel runs. */
void q5_linear_f32(const float *x, const uint8_t *nib, const uint32_t *high, const uint16_t *d,
                   const uint16_t *m, const float *bias, float *y, int64_t M, int64_t K,
                   int64_t N, int64_t rows_max, int64_t path, int64_t activations_int8,
                   int64_t threads) {
    const LinearWeights l = {activations_int8 ? LINEAR_INT5B_A8 : LINEAR_INT5B,
                             nib, (const float *)d, (const float *)m, bias, K, N, 32, rows_max,
                             high};
    quant_linear(&l, x, y, M, path, threads);
}
