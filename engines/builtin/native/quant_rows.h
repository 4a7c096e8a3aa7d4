/* The few-rows (decode) INT8, FP8, grouped INT8 and INT4 kernels of quant_kernels.c at one vector width: QW floats
 * per vector, function names suffixed with QSUFFIX. quant_kernels.c includes this file once per
 * width the build has (4, 8 and, with AVX-512, 16 floats), so that every width the machine can
 * run is callable and testable, not only its widest. GCC/clang vector extensions: the same text
 * is SSE/NEON, AVX2 or AVX-512 code by QW. */

#define QCAT2(a, b) a##b
#define QCAT(a, b) QCAT2(a, b)
#define QFN(name) QCAT(name, QSUFFIX)

typedef float QFN(fvec) __attribute__((vector_size(QW * 4)));
typedef float QFN(fvec_u) __attribute__((vector_size(QW * 4), aligned(4)));
typedef uint8_t QFN(bvec_u) __attribute__((vector_size(QW), aligned(1)));
typedef int8_t QFN(svec_u) __attribute__((vector_size(QW), aligned(1)));

static inline QFN(fvec) QFN(loadf)(const float *p) { return *(const QFN(fvec_u) *)p; }

/* a * b + c in one rounding (-std=c11 forbids the compiler to contract it on its own) */
static inline QFN(fvec) QFN(fma)(QFN(fvec) a, QFN(fvec) b, QFN(fvec) c) {
#if QW == 16
    return (QFN(fvec))_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif QW == 8 && defined(__FMA__)
    return (QFN(fvec))_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#elif QW == 4 && defined(__FMA__)
    return (QFN(fvec))_mm_fmadd_ps((__m128)a, (__m128)b, (__m128)c);
#else
    return a * b + c;
#endif
}

static inline float QFN(hsum)(QFN(fvec) v) {
    float s = 0.0f;
    for (int i = 0; i < QW; i++) s += v[i];
    return s;
}

typedef int32_t QFN(ivec) __attribute__((vector_size(QW * 4)));

/* Widening bytes to floats with the instruction set's zero/sign extension (vpmovzxbd and
 * vcvtdq2ps); GCC 12 turns __builtin_convertvector from bytes to floats into one scalar
 * conversion per element, 3-5x slower. Generic vectors (NEON, SSE without 4.1) elsewhere. */
#if (QW == 16 && defined(__AVX512F__)) || (QW == 8 && defined(__AVX2__)) ||                     \
    (QW == 4 && defined(__SSE4_1__))
#define QX86 1
#else
#define QX86 0
#endif

/* The 32 weights of an INT4 block as 32 / QW float vectors, in order (the low nibbles are
 * weights 0-15, the high ones 16-31). */
static inline __attribute__((always_inline)) void QFN(q4_unpack)(const uint8_t *bytes,
                                                                 QFN(fvec) w[32 / QW]) {
#if QX86
    const __m128i packed = _mm_loadu_si128((const __m128i *)bytes);
    const __m128i mask = _mm_set1_epi8(15);
    const __m128i halves[2] = {_mm_and_si128(packed, mask),
                               _mm_and_si128(_mm_srli_epi16(packed, 4), mask)};
    for (int h = 0; h < 2; h++)
        for (int v = 0; v < 16 / QW; v++) {
#if QW == 16
            w[h] = (QFN(fvec))_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(halves[h]));
#elif QW == 8
            w[h * 2 + v] = (QFN(fvec))_mm256_cvtepi32_ps(
                _mm256_cvtepu8_epi32(v ? _mm_unpackhi_epi64(halves[h], halves[h]) : halves[h]));
#else
            __m128i part = halves[h];
            if (v == 1) part = _mm_srli_si128(part, 4);
            if (v == 2) part = _mm_srli_si128(part, 8);
            if (v == 3) part = _mm_srli_si128(part, 12);
            w[h * 4 + v] = (QFN(fvec))_mm_cvtepi32_ps(_mm_cvtepu8_epi32(part));
#endif
        }
#else
    for (int v = 0; v < 16 / QW; v++) {
        const QFN(bvec_u) packed = *(const QFN(bvec_u) *)(bytes + v * QW);
        w[v] = __builtin_convertvector(
            __builtin_convertvector(packed & 15, QFN(ivec)), QFN(fvec));
        w[16 / QW + v] = __builtin_convertvector(
            __builtin_convertvector(packed >> 4, QFN(ivec)), QFN(fvec));
    }
#endif
}

/* QW INT8 weights as floats. */
static inline QFN(fvec) QFN(q8_widen)(const int8_t *q) {
#if QX86 && QW == 16
    return (QFN(fvec))_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q)));
#elif QX86 && QW == 8
    return (QFN(fvec))_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)q)));
#elif QX86
    int32_t word;
    memcpy(&word, q, 4);
    return (QFN(fvec))_mm_cvtepi32_ps(_mm_cvtepi8_epi32(_mm_cvtsi32_si128(word)));
#else
    return __builtin_convertvector(
        __builtin_convertvector(*(const QFN(svec_u) *)q, QFN(ivec)), QFN(fvec));
#endif
}

/* QW FP8 (e4m3) weights as floats divided by 256: each byte SEEEEMMM put in the high byte of a
 * 16-bit lane and shifted right arithmetically by one is the float16 S0EEEEMMM0000000 (with
 * the sign's copy in bit 14 cleared), whose value is the e4m3 one times 2^-8, subnormals
 * included, and the hardware widens float16 exactly. Elsewhere one lookup a weight. */
static inline QFN(fvec) QFN(f8_widen)(const uint8_t *q) {
#if QX86 && QW == 16
    const __m256i h = _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)q)), 8);
    return (QFN(fvec))_mm512_cvtph_ps(
        _mm256_and_si256(_mm256_srai_epi16(h, 1), _mm256_set1_epi16((short)0xBFFF)));
#elif QX86 && defined(__F16C__)
#if QW == 8
    const __m128i bytes = _mm_loadl_epi64((const __m128i *)q);
#else
    int32_t word;
    memcpy(&word, q, 4);
    const __m128i bytes = _mm_cvtsi32_si128(word);
#endif
    const __m128i h = _mm_and_si128(_mm_srai_epi16(_mm_slli_epi16(_mm_cvtepu8_epi16(bytes), 8), 1),
                                    _mm_set1_epi16((short)0xBFFF));
#if QW == 8
    return (QFN(fvec))_mm256_cvtph_ps(h);
#else
    return (QFN(fvec))_mm_cvtph_ps(h);
#endif
#else
    QFN(fvec) w;
    for (int i = 0; i < QW; i++) w[i] = fp8_over_256(q[i]);
    return w;
#endif
}

/* QW 8-bit weights as floats: INT8 levels, or FP8 values / 256 (`fp8`, a constant where it
 * is inlined). */
static inline __attribute__((always_inline)) QFN(fvec) QFN(w8_widen)(const int8_t *q, const int fp8) {
    return fp8 ? QFN(f8_widen)((const uint8_t *)q) : QFN(q8_widen)(q);
}

/* QW unsigned 8-bit weights (the grouped INT8 layout's) as floats. */
static inline QFN(fvec) QFN(u8_widen)(const uint8_t *q) {
#if QX86 && QW == 16
    return (QFN(fvec))_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)q)));
#elif QX86 && QW == 8
    return (QFN(fvec))_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)q)));
#elif QX86
    int32_t word;
    memcpy(&word, q, 4);
    return (QFN(fvec))_mm_cvtepi32_ps(_mm_cvtepu8_epi32(_mm_cvtsi32_si128(word)));
#else
    return __builtin_convertvector(
        __builtin_convertvector(*(const QFN(bvec_u) *)q, QFN(ivec)), QFN(fvec));
#endif
}

/* Accumulators per input row: enough independent chains of fused multiply-adds to cover their
 * latency. The same for every R, so that a row's sums are added in the same order whatever
 * rows share its call: bit-identical results across batch splits. With 4 chains a row, two
 * rows' worth stay in the 16 registers below AVX-512 (four rows spilled). */
#define QACC 4
#define QROWS 2


/* acc[r][.] += one block of 32 INT4 weights (starting at input k0), widened and scaled by its
 * group's scale s, times input row r's values; each product on chain (base + its place in the
 * block) of QACC. */
static inline __attribute__((always_inline)) void QFN(q4_block)(const int R, const float *x,
                                                                int64_t K, const uint8_t *nib,
                                                                int64_t k0, QFN(fvec) s,
                                                                const int base,
                                                                QFN(fvec) acc[QROWS][QACC]) {
    QFN(fvec) w[32 / QW];
    QFN(q4_unpack)(nib + k0 / 2, w);
    for (int v = 0; v < 32 / QW; v++) {
        const QFN(fvec) scaled = w[v] * s;
        for (int r = 0; r < R; r++)
            acc[r][(base + v) % QACC] =
                QFN(fma)(scaled, QFN(loadf)(x + r * K + k0 + v * QW), acc[r][(base + v) % QACC]);
    }
}

/* out[r] = sum_k W[n, k] x[r][k] for R input rows (row stride K) and one INT4 weight row: its
 * nibbles `nib` (K / 32 blocks of 16 bytes), scale and minimum per group of g inputs (2^shift
 * blocks). `xsum`: each input row's sum per group (R x groups), for the minimum's term. Per
 * block: a load, a mask and a shift, the widening to float, one multiply by the scale per
 * vector, and one fused multiply-add per vector and input row, into accumulators that run
 * the whole row (scaling the weights, not each group's sum, leaves no per-group reduction:
 * 1.25x faster at g32 on one core). */
static inline __attribute__((always_inline)) void QFN(q4_row)(
    const int R, const float *x, int64_t K, const uint8_t *nib, const float *scale,
    const float *minv, const float *xsum, int64_t groups, int64_t shift, float *out) {
    QFN(fvec) acc[QROWS][QACC];
    for (int r = 0; r < R; r++)
        for (int a = 0; a < QACC; a++) acc[r][a] = (QFN(fvec)){0};
    const int64_t blocks = K / 32;
    int64_t b = 0;
    /* blocks in pairs, the second's products on the other chains (an AVX-512 block has one
     * vector per half: two chains a block) */
    for (; b + 2 <= blocks; b += 2) {
        __builtin_prefetch(nib + b * 16 + QPREFETCH, 0, 0);
        QFN(q4_block)(R, x, K, nib, b * 32, (QFN(fvec)){0} + scale[b >> shift], 0, acc);
        QFN(q4_block)(R, x, K, nib, b * 32 + 32, (QFN(fvec)){0} + scale[(b + 1) >> shift], 2,
                      acc);
    }
    if (b < blocks) QFN(q4_block)(R, x, K, nib, b * 32, (QFN(fvec)){0} + scale[b >> shift], 0, acc);
    for (int r = 0; r < R; r++) {
        /* the minimum's term, sum over groups of min * (the group's input sum), by vectors */
        const float *xs = xsum + r * groups;
        QFN(fvec) mv = (QFN(fvec)){0};
        int64_t i = 0;
        for (; i + QW <= groups; i += QW)
            mv = QFN(fma)(QFN(loadf)(minv + i), QFN(loadf)(xs + i), mv);
        float m = QFN(hsum)(mv);
        for (; i < groups; i++) m += minv[i] * xs[i];
        QFN(fvec) sum = acc[r][0];
        for (int a = 1; a < QACC; a++) sum += acc[r][a];
        out[r] = QFN(hsum)(sum) + m;
    }
}

/* out[r] = sum_k q[k] x[r][k] for R input rows and one INT8 weight row (unscaled), or one
 * FP8 row (`fp8`: its values / 256). */
static inline __attribute__((always_inline)) void QFN(q8_row)(const int R, const float *x,
                                                              int64_t K, const int8_t *q,
                                                              const int fp8, float *out) {
    QFN(fvec) acc[QROWS][QACC];
    for (int r = 0; r < R; r++)
        for (int a = 0; a < QACC; a++) acc[r][a] = (QFN(fvec)){0};
    int64_t k = 0;
    for (; k + QACC * QW <= K; k += QACC * QW) {
        __builtin_prefetch(q + k + QPREFETCH, 0, 0);
        for (int a = 0; a < QACC; a++) {
            const QFN(fvec) w = QFN(w8_widen)(q + k + a * QW, fp8);
            for (int r = 0; r < R; r++)
                acc[r][a] = QFN(fma)(w, QFN(loadf)(x + r * K + k + a * QW), acc[r][a]);
        }
    }
    for (; k + QW <= K; k += QW) {
        const QFN(fvec) w = QFN(w8_widen)(q + k, fp8);
        for (int r = 0; r < R; r++) acc[r][0] = QFN(fma)(w, QFN(loadf)(x + r * K + k), acc[r][0]);
    }
    for (int r = 0; r < R; r++) {
        QFN(fvec) sum = acc[r][0];
        for (int a = 1; a < QACC; a++) sum += acc[r][a];
        float s = QFN(hsum)(sum);
        for (int64_t t = k; t < K; t++)
            s += (fp8 ? fp8_over_256((uint8_t)q[t]) : (float)q[t]) * x[r * K + t];
        out[r] = s;
    }
}

/* acc[r][.] += one chunk of 16 grouped-INT8 weights (starting at input k0), widened and scaled
 * by its group's scale s, times input row r's values; vector v on chain (base + v) of QACC. */
static inline __attribute__((always_inline)) void QFN(g8_chunk)(const int R, const float *x,
                                                                int64_t K, const uint8_t *q,
                                                                int64_t k0, QFN(fvec) s,
                                                                const int base,
                                                                QFN(fvec) acc[QROWS][QACC]) {
    for (int v = 0; v < 16 / QW; v++) {
        const QFN(fvec) scaled = QFN(u8_widen)(q + k0 + v * QW) * s;
        for (int r = 0; r < R; r++)
            acc[r][(base + v) % QACC] =
                QFN(fma)(scaled, QFN(loadf)(x + r * K + k0 + v * QW), acc[r][(base + v) % QACC]);
    }
}

/* out[r] = sum_k W[n, k] x[r][k] for R input rows and one grouped-INT8 weight row: its bytes
 * `q` [K], scale and minimum per group of g = 16 << shift inputs; `xsum` as q4_row's. The same
 * scheme as q4_row's, in chunks of 16 weights (the smallest group), four chunks a step. */
static inline __attribute__((always_inline)) void QFN(g8_row)(
    const int R, const float *x, int64_t K, const uint8_t *q, const float *scale,
    const float *minv, const float *xsum, int64_t groups, int64_t shift, float *out) {
    QFN(fvec) acc[QROWS][QACC];
    for (int r = 0; r < R; r++)
        for (int a = 0; a < QACC; a++) acc[r][a] = (QFN(fvec)){0};
    const int64_t chunks = K / 16;
    int64_t c = 0;
    for (; c + 4 <= chunks; c += 4) {
        __builtin_prefetch(q + c * 16 + QPREFETCH, 0, 0);
        for (int j = 0; j < 4; j++)
            QFN(g8_chunk)(R, x, K, q, (c + j) * 16, (QFN(fvec)){0} + scale[(c + j) >> shift],
                          (j * (16 / QW)) % QACC, acc);
    }
    for (; c < chunks; c++)
        QFN(g8_chunk)(R, x, K, q, c * 16, (QFN(fvec)){0} + scale[c >> shift], 0, acc);
    for (int r = 0; r < R; r++) {
        const float *xs = xsum + r * groups;
        QFN(fvec) mv = (QFN(fvec)){0};
        int64_t i = 0;
        for (; i + QW <= groups; i += QW)
            mv = QFN(fma)(QFN(loadf)(minv + i), QFN(loadf)(xs + i), mv);
        float m = QFN(hsum)(mv);
        for (; i < groups; i++) m += minv[i] * xs[i];
        QFN(fvec) sum = acc[r][0];
        for (int a = 1; a < QACC; a++) sum += acc[r][a];
        out[r] = QFN(hsum)(sum) + m;
    }
}

/* acc[r][.] += one block of 32 INT8 weights (input k0) widened and scaled by s, times input
 * row r's values; vector v on chain (base + v) of QACC. */
static inline __attribute__((always_inline)) void QFN(b8_block)(const int R, const float *x,
                                                                int64_t K, const int8_t *q,
                                                                int64_t k0, QFN(fvec) s,
                                                                const int base,
                                                                QFN(fvec) acc[QROWS][QACC]) {
    for (int v = 0; v < 32 / QW; v++) {
        const QFN(fvec) w = QFN(q8_widen)(q + k0 + v * QW) * s;
        for (int r = 0; r < R; r++)
            acc[r][(base + v) % QACC] =
                QFN(fma)(w, QFN(loadf)(x + r * K + k0 + v * QW), acc[r][(base + v) % QACC]);
    }
}

/* out[r] = sum_k W[n, k] x[r][k] for R input rows and one INT8-blocks weight row: int8 levels
 * `q` [K] and a float16 scale per block of 32 (W = q d, no minimum: llama.cpp's Q8_0). Blocks
 * in pairs, the second's products on the other chains, as q4_row's. */
static inline __attribute__((always_inline)) void QFN(b8_row)(const int R, const float *x,
                                                              int64_t K, const int8_t *q,
                                                              const uint16_t *d, float *out) {
    QFN(fvec) acc[QROWS][QACC];
    for (int r = 0; r < R; r++)
        for (int a = 0; a < QACC; a++) acc[r][a] = (QFN(fvec)){0};
    const int64_t blocks = K / 32;
    int64_t b = 0;
    for (; b + 2 <= blocks; b += 2) {
        __builtin_prefetch(q + b * 32 + QPREFETCH, 0, 0);
        QFN(b8_block)(R, x, K, q, b * 32, (QFN(fvec)){0} + half_to_float(d[b]), 0, acc);
        QFN(b8_block)(R, x, K, q, b * 32 + 32, (QFN(fvec)){0} + half_to_float(d[b + 1]),
                      (32 / QW) % QACC == 0 ? 2 : 32 / QW, acc);
    }
    if (b < blocks) QFN(b8_block)(R, x, K, q, b * 32, (QFN(fvec)){0} + half_to_float(d[b]), 0, acc);
    for (int r = 0; r < R; r++) {
        QFN(fvec) sum = acc[r][0];
        for (int a = 1; a < QACC; a++) sum += acc[r][a];
        out[r] = QFN(hsum)(sum);
    }
}

/* out[k] = W[n, k] for one INT8-blocks weight row. */
static inline void QFN(b8_dequantize_row)(const int8_t *q, const uint16_t *d, int64_t K,
                                          float *out) {
    for (int64_t k0 = 0; k0 < K; k0 += 32) {
        const QFN(fvec) s = (QFN(fvec)){0} + half_to_float(d[k0 / 32]);
        for (int v = 0; v < 32 / QW; v++)
            *(QFN(fvec_u) *)(out + k0 + v * QW) = QFN(q8_widen)(q + k0 + v * QW) * s;
    }
}

static void QFN(b8_rows)(const float *x, const int8_t *q, const uint16_t *d, const float *bias,
                         float *y, int64_t M, int64_t K, int64_t N, int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++) {
        const int8_t *wn = q + n * K;
        const uint16_t *dn = d + n * (K / 32);
        const float b = bias != NULL ? bias[n] : 0.0f;
        for (int64_t m = 0; m < M; m += QROWS) {
            float out[QROWS];
            if (M - m == 1)
                QFN(b8_row)(1, x + m * K, K, wn, dn, out);
            else
                QFN(b8_row)(QROWS, x + m * K, K, wn, dn, out);
            for (int64_t r = 0; r < QROWS && m + r < M; r++) y[(m + r) * N + n] = out[r] + b;
        }
    }
}

/* 16.0 in the lanes whose bit of `bits` is set (an INT5 level's fifth bit), 0 elsewhere. */
static inline QFN(fvec) QFN(bit_sixteens)(uint32_t bits) {
#if QX86 && QW == 16
    return (QFN(fvec))_mm512_maskz_mov_ps((__mmask16)bits, _mm512_set1_ps(16.0f));
#else
    QFN(ivec) lanes;
    for (int i = 0; i < QW; i++) lanes[i] = i;
    const QFN(ivec) set = (((QFN(ivec)){0} + (int32_t)bits) >> lanes) & 1;
    return __builtin_convertvector(set, QFN(fvec)) * 16.0f;
#endif
}

/* acc[r][.] += one INT5 block (32 weights from input k0: nibbles, `high` their fifth bits)
 * widened and scaled by s, times input row r's values. */
static inline __attribute__((always_inline)) void QFN(q5_block)(const int R, const float *x,
                                                                int64_t K, const uint8_t *nib,
                                                                uint32_t high, int64_t k0,
                                                                QFN(fvec) s, const int base,
                                                                QFN(fvec) acc[QROWS][QACC]) {
    QFN(fvec) w[32 / QW];
    QFN(q4_unpack)(nib + k0 / 2, w);
    for (int v = 0; v < 32 / QW; v++) {
        const QFN(fvec) scaled = (w[v] + QFN(bit_sixteens)(high >> (v * QW))) * s;
        for (int r = 0; r < R; r++)
            acc[r][(base + v) % QACC] =
                QFN(fma)(scaled, QFN(loadf)(x + r * K + k0 + v * QW), acc[r][(base + v) % QACC]);
    }
}

/* out[r] = sum_k W[n, k] x[r][k] for R input rows and one INT5-blocks weight row: nibbles,
 * fifth bits `high` (one word a block), float16 scale d and minimum m per block of 32;
 * `xsum`: each input row's sum per block (R x K / 32). */
static inline __attribute__((always_inline)) void QFN(q5_row)(
    const int R, const float *x, int64_t K, const uint8_t *nib, const uint32_t *high,
    const uint16_t *d, const uint16_t *m, const float *xsum, float *out) {
    QFN(fvec) acc[QROWS][QACC];
    for (int r = 0; r < R; r++)
        for (int a = 0; a < QACC; a++) acc[r][a] = (QFN(fvec)){0};
    const int64_t blocks = K / 32;
    int64_t b = 0;
    for (; b + 2 <= blocks; b += 2) {
        __builtin_prefetch(nib + b * 16 + QPREFETCH, 0, 0);
        QFN(q5_block)(R, x, K, nib, high[b], b * 32, (QFN(fvec)){0} + half_to_float(d[b]), 0,
                      acc);
        QFN(q5_block)(R, x, K, nib, high[b + 1], b * 32 + 32,
                      (QFN(fvec)){0} + half_to_float(d[b + 1]), 2, acc);
    }
    if (b < blocks)
        QFN(q5_block)(R, x, K, nib, high[b], b * 32, (QFN(fvec)){0} + half_to_float(d[b]), 0,
                      acc);
    for (int r = 0; r < R; r++) {
        const float minimum = half_dot(m, xsum + r * blocks, blocks);
        QFN(fvec) sum = acc[r][0];
        for (int a = 1; a < QACC; a++) sum += acc[r][a];
        out[r] = QFN(hsum)(sum) + minimum;
    }
}

static void QFN(q5_rows)(const float *x, const uint8_t *nib, const uint32_t *high,
                         const uint16_t *d, const uint16_t *m, const float *xsum,
                         const float *bias, float *y, int64_t M, int64_t K, int64_t N, int64_t n0,
                         int64_t n1) {
    const int64_t blocks = K / 32;
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *wn = nib + n * (K / 2);
        const uint32_t *hn = high + n * blocks;
        const uint16_t *dn = d + n * blocks, *mn = m + n * blocks;
        const float b = bias != NULL ? bias[n] : 0.0f;
        for (int64_t row = 0; row < M; row += QROWS) {
            float out[QROWS];
            const float *xm = x + row * K, *xs = xsum + row * blocks;
            if (M - row == 1)
                QFN(q5_row)(1, xm, K, wn, hn, dn, mn, xs, out);
            else
                QFN(q5_row)(QROWS, xm, K, wn, hn, dn, mn, xs, out);
            for (int64_t r = 0; r < QROWS && row + r < M; r++) y[(row + r) * N + n] = out[r] + b;
        }
    }
}

/* out[k] = W[n, k] for one INT5-blocks weight row. */
static inline void QFN(q5_dequantize_row)(const uint8_t *nib, const uint32_t *high,
                                          const uint16_t *d, const uint16_t *m, int64_t K,
                                          float *out) {
    for (int64_t k0 = 0; k0 < K; k0 += 32) {
        QFN(fvec) w[32 / QW];
        QFN(q4_unpack)(nib + k0 / 2, w);
        const QFN(fvec) s = (QFN(fvec)){0} + half_to_float(d[k0 / 32]);
        const QFN(fvec) mn = (QFN(fvec)){0} + half_to_float(m[k0 / 32]);
        for (int v = 0; v < 32 / QW; v++)
            *(QFN(fvec_u) *)(out + k0 + v * QW) =
                QFN(fma)(w[v] + QFN(bit_sixteens)(high[k0 / 32] >> (v * QW)), s, mn);
    }
}

/* out[k] = W[n, k] for one INT4 weight row (the tile kernels' dequantization). */
static inline void QFN(q4_dequantize_row)(const uint8_t *nib, const float *scale, const float *minv,
                                   int64_t K, int64_t g, float *out) {
    for (int64_t k0 = 0; k0 < K; k0 += 32) {
        QFN(fvec) w[32 / QW];
        QFN(q4_unpack)(nib + k0 / 2, w);
        const QFN(fvec) s = (QFN(fvec)){0} + scale[k0 / g], mn = (QFN(fvec)){0} + minv[k0 / g];
        for (int v = 0; v < 32 / QW; v++)
            *(QFN(fvec_u) *)(out + k0 + v * QW) = QFN(fma)(w[v], s, mn);
    }
}

/* out[k] = W[n, k] for one grouped-INT8 weight row (groups of g = 16 << shift). */
static inline void QFN(g8_dequantize_row)(const uint8_t *q, const float *scale, const float *minv,
                                          int64_t K, int64_t shift, float *out) {
    for (int64_t k0 = 0; k0 < K; k0 += 16) {
        const QFN(fvec) s = (QFN(fvec)){0} + scale[(k0 / 16) >> shift];
        const QFN(fvec) mn = (QFN(fvec)){0} + minv[(k0 / 16) >> shift];
        for (int v = 0; v < 16 / QW; v++)
            *(QFN(fvec_u) *)(out + k0 + v * QW) = QFN(fma)(QFN(u8_widen)(q + k0 + v * QW), s, mn);
    }
}

/* out[k] = W[n, k] for one INT8 weight row, or one FP8 row (`fp8`: `scale` x 256). */
static inline __attribute__((always_inline)) void QFN(w8_dequantize_row)(const int8_t *q,
                                                                         float scale, int64_t K,
                                                                         const int fp8,
                                                                         float *out) {
    const QFN(fvec) s = (QFN(fvec)){0} + scale;
    int64_t k = 0;
    for (; k + QW <= K; k += QW) *(QFN(fvec_u) *)(out + k) = QFN(w8_widen)(q + k, fp8) * s;
    for (; k < K; k++) out[k] = (fp8 ? fp8_over_256((uint8_t)q[k]) : (float)q[k]) * scale;
}

static inline void QFN(q8_dequantize_row)(const int8_t *q, float scale, int64_t K, float *out) {
    QFN(w8_dequantize_row)(q, scale, K, 0, out);
}

static inline void QFN(f8_dequantize_row)(const uint8_t *q, float scale, int64_t K, float *out) {
    QFN(w8_dequantize_row)((const int8_t *)q, scale * 256.0f, K, 1, out);
}

/* y[m, n] for W's rows [n0, n1) and all M input rows, QROWS at a time: each weight row is
 * read from memory once and from the first level of cache by the other groups of inputs. */
static void QFN(q4_rows)(const float *x, const uint8_t *nib, const float *scale,
                         const float *minv, const float *xsum, const float *bias, float *y,
                         int64_t M, int64_t K, int64_t N, int64_t g, int64_t n0, int64_t n1) {
    const int64_t groups = K / g;
    int64_t shift = 0; /* g = 32 << shift */
    while ((32 << shift) < g) shift++;
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *wn = nib + n * (K / 2);
        const float *sn = scale + n * groups, *mn = minv + n * groups;
        const float b = bias != NULL ? bias[n] : 0.0f;
        for (int64_t m = 0; m < M; m += QROWS) {
            float out[QROWS];
            const float *xm = x + m * K, *xs = xsum + m * groups;
            if (M - m == 1)
                QFN(q4_row)(1, xm, K, wn, sn, mn, xs, groups, shift, out);
            else
                QFN(q4_row)(QROWS, xm, K, wn, sn, mn, xs, groups, shift, out);
            for (int64_t r = 0; r < QROWS && m + r < M; r++) y[(m + r) * N + n] = out[r] + b;
        }
    }
}

static void QFN(g8_rows)(const float *x, const uint8_t *q, const float *scale,
                         const float *minv, const float *xsum, const float *bias, float *y,
                         int64_t M, int64_t K, int64_t N, int64_t g, int64_t n0, int64_t n1) {
    const int64_t groups = K / g;
    int64_t shift = 0; /* g = 16 << shift */
    while ((16 << shift) < g) shift++;
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *wn = q + n * K;
        const float *sn = scale + n * groups, *mn = minv + n * groups;
        const float b = bias != NULL ? bias[n] : 0.0f;
        for (int64_t m = 0; m < M; m += QROWS) {
            float out[QROWS];
            const float *xm = x + m * K, *xs = xsum + m * groups;
            if (M - m == 1)
                QFN(g8_row)(1, xm, K, wn, sn, mn, xs, groups, shift, out);
            else
                QFN(g8_row)(QROWS, xm, K, wn, sn, mn, xs, groups, shift, out);
            for (int64_t r = 0; r < QROWS && m + r < M; r++) y[(m + r) * N + n] = out[r] + b;
        }
    }
}

/* y[m, n] for one scale a row: INT8 levels, or FP8 values (`fp8`). */
static inline __attribute__((always_inline)) void QFN(w8_rows)(
    const float *x, const int8_t *q, const float *scale, const float *bias, float *y, int64_t M,
    int64_t K, int64_t N, int64_t n0, int64_t n1, const int fp8) {
    for (int64_t n = n0; n < n1; n++) {
        const int8_t *wn = q + n * K;
        const float b = bias != NULL ? bias[n] : 0.0f;
        const float s = fp8 ? scale[n] * 256.0f : scale[n];
        for (int64_t m = 0; m < M; m += QROWS) {
            float out[QROWS];
            const float *xm = x + m * K;
            if (M - m == 1)
                QFN(q8_row)(1, xm, K, wn, fp8, out);
            else
                QFN(q8_row)(QROWS, xm, K, wn, fp8, out);
            for (int64_t r = 0; r < QROWS && m + r < M; r++) y[(m + r) * N + n] = out[r] * s + b;
        }
    }
}

static void QFN(q8_rows)(const float *x, const int8_t *q, const float *scale, const float *bias,
                         float *y, int64_t M, int64_t K, int64_t N, int64_t n0, int64_t n1) {
    QFN(w8_rows)(x, q, scale, bias, y, M, K, N, n0, n1, 0);
}

static void QFN(f8_rows)(const float *x, const uint8_t *q, const float *scale, const float *bias,
                         float *y, int64_t M, int64_t K, int64_t N, int64_t n0, int64_t n1) {
    QFN(w8_rows)(x, (const int8_t *)q, scale, bias, y, M, K, N, n0, n1, 1);
}

#undef QACC
#undef QROWS
#undef QX86
#undef QFN
#undef QCAT
#undef QCAT2
