/* A few fp32 rows times a weight matrix held in GGUF's quantized blocks (hf_triforce.kernels.gguf_linear): Q4_0,
 * Q4_1, Q5_0, Q5_1, Q8_0, Q4_K and Q6_K, read at their stored width; products and sums in fp32.
 *
 * y[m, n] = sum_k x[m, k] * w[n, k] for rows m < ROWS <= 8, w [N, K] stored row by row as K / VALUES blocks (GGUF's
 * own block layout; types by their GGMLQuantizationType codes; d, m, dmin fp16; nibbles: byte i of 16 holds value i
 * in its low nibble and value i + 16 in its high one):
 *   Q4_0 (2), 32 values:  d, 16 bytes of nibbles q;                      w = d * (q - 8)
 *   Q4_1 (3), 32 values:  d, m, 16 bytes of nibbles q;                   w = d * q + m
 *   Q5_0 (6), 32 values:  d, 32 high bits (bit i: value i), nibbles;     w = d * (q - 16)
 *   Q5_1 (7), 32 values:  d, m, 32 high bits, nibbles;                   w = d * q + m
 *   Q8_0 (8), 32 values:  d, 32 int8 q;                                  w = d * q
 *   Q4_K (12), 256 values: d, dmin, 12 bytes of 6-bit scales sc and mins mn of 8 sub-blocks of 32, 4 x 32 bytes of
 *       nibbles (sub-block j: the low (j even) or high (j odd) nibbles of bytes 32 (j / 2) ..);
 *                                                                       w = (d * sc) * q - dmin * mn
 *   Q6_K (14), 256 values: 128 bytes of low nibbles, 64 bytes of 2-bit highs, 16 int8 scales sc (one per 16 values),
 *       d in its last two bytes;                                        w = (d * sc) * (q - 32)
 * Each w is computed in fp32 exactly as gguf's dequantization (and so transformers' GGUF loading) computes it: d * q,
 * d * sc, (d * sc) * q (Q4_K) and dmin * mn are exact in fp32 (at most 11 + 6 + 4 significant bits), and the one
 * rounding gguf makes (+ m, - dmin * mn, Q6_K's (d * sc) * (q - 32)) is made once here too (a fused multiply-add of
 * an exact product gives the same value). So the kernel multiplies by exactly the values of the dequantized fp32
 * matrix, and triforce_gguf_dequantize writes those values (the Python side checks them bit for bit against the
 * model's).
 *
 * As in few_rows_linear.c, a pass reads NB weight rows' blocks once and multiplies each 32 values (widened in
 * registers) into every row of x (x stays in the cache), so 1-8 rows cost one pass over the packed weights; threads
 * take contiguous ranges of output columns. Each output is its own dot product of row m with weight row n (rows never
 * mix), summed in LANES lanes over k = lane mod LANES, then across the lanes.
 */
#include <omp.h>
#include <stdlib.h>

#include "vectors.h"

#define MAX_ROWS 8
#define SUB 32               /* values per step: a block of the 32-value types, a sub-block of the K-quants */
#define VECS (SUB / LANES)   /* vectors per step: 2 with AVX-512, 4 with AVX2 */

enum { GGUF_Q4_0 = 2, GGUF_Q4_1 = 3, GGUF_Q5_0 = 6, GGUF_Q5_1 = 7, GGUF_Q8_0 = 8, GGUF_Q4_K = 12, GGUF_Q6_K = 14 };

static inline float lane_sum(vec v) {
    float s = 0.f;
    for (int i = 0; i < LANES; i++) s += v[i];
    return s;
}

static inline float half_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
    return widen_f16(h);
}

/* LANES bytes widened to int32: unsigned, or signed */
static inline ivec widen_u8(const uint8_t *p) {
#if LANES == 16
    return (ivec)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
#else
    return (ivec)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
#endif
}

static inline ivec widen_i8(const uint8_t *p) {
#if LANES == 16
    return (ivec)_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p));
#else
    return (ivec)_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p));
#endif
}

static inline vec as_float(ivec v) { return __builtin_convertvector(v, vec); }

/* values v * LANES .. v * LANES + LANES - 1 of 16 bytes of nibbles, 0..15 */
static inline ivec nibbles(const uint8_t *q, int v) {
    ivec bytes = widen_u8(q + (v * LANES) % 16);
    return v * LANES >= 16 ? bytes >> 4 : bytes & 15;
}

/* bits v * LANES + lane of the 32 little-endian bits at h, each times 16 (a 5-bit value's high bit) */
static inline ivec high_bits(const uint8_t *h, int v) {
    uint32_t bits;
    memcpy(&bits, h, sizeof bits);
    ivec lane;
    for (int i = 0; i < LANES; i++) lane[i] = i;
    return (((ivec){0} + (int)(bits >> (v * LANES))) >> lane & 1) << 4;
}

/* DEQUANTIZE(block, sub, out): values 32 sub .. 32 sub + 31 of one block, VECS vectors */
static inline void dequantize_q4_0(const uint8_t *block, int sub, vec out[VECS]) {
    (void)sub;
    float d = half_at(block);
    for (int v = 0; v < VECS; v++) out[v] = d * (as_float(nibbles(block + 2, v)) - 8.f);
}

static inline void dequantize_q4_1(const uint8_t *block, int sub, vec out[VECS]) {
    (void)sub;
    float d = half_at(block), m = half_at(block + 2);
    for (int v = 0; v < VECS; v++) out[v] = d * as_float(nibbles(block + 4, v)) + m;
}

static inline void dequantize_q5_0(const uint8_t *block, int sub, vec out[VECS]) {
    (void)sub;
    float d = half_at(block);
    for (int v = 0; v < VECS; v++) out[v] = d * (as_float(nibbles(block + 6, v) | high_bits(block + 2, v)) - 16.f);
}

static inline void dequantize_q5_1(const uint8_t *block, int sub, vec out[VECS]) {
    (void)sub;
    float d = half_at(block), m = half_at(block + 2);
    for (int v = 0; v < VECS; v++) out[v] = d * as_float(nibbles(block + 8, v) | high_bits(block + 4, v)) + m;
}

static inline void dequantize_q8_0(const uint8_t *block, int sub, vec out[VECS]) {
    (void)sub;
    float d = half_at(block);
    for (int v = 0; v < VECS; v++) out[v] = d * as_float(widen_i8(block + 2 + v * LANES));
}

static inline void dequantize_q4_k(const uint8_t *block, int sub, vec out[VECS]) {
    const uint8_t *s = block + 4, *q = block + 16 + (sub / 2) * 32;
    int sc = sub < 4 ? s[sub] & 63 : (s[sub + 4] & 15) | ((s[sub - 4] >> 6) << 4);
    int mn = sub < 4 ? s[sub + 4] & 63 : (s[sub + 4] >> 4) | ((s[sub] >> 6) << 4);
    float scale = half_at(block) * (float)sc, low = half_at(block + 2) * (float)mn;
    for (int v = 0; v < VECS; v++) {
        ivec bytes = widen_u8(q + v * LANES);
        out[v] = scale * as_float(sub & 1 ? bytes >> 4 : bytes & 15) - low;
    }
}

static inline void dequantize_q6_k(const uint8_t *block, int sub, vec out[VECS]) {
    /* value k = 32 sub + i: half h = k / 128; its low nibble from byte 64 h + k % 64 (shift 4 (k % 128 / 64)), its
     * high 2 bits from byte 128 + 32 h + k % 32 (shift 2 (k % 128 / 32)); its scale k / 16 */
    int h = sub / 4, r = (sub % 4) * 32;
    const uint8_t *low = block + h * 64 + r % 64, *high = block + 128 + h * 32;
    const int8_t *scales = (const int8_t *)(block + 192);
    float d = half_at(block + 208);
    for (int v = 0; v < VECS; v++) {
        ivec q = (widen_u8(low + v * LANES) >> (4 * (r / 64)) & 15)
                 | (widen_u8(high + v * LANES) >> (2 * (r / 32)) & 3) << 4;
        out[v] = d * (float)scales[(32 * sub + v * LANES) / 16] * as_float(q - 32);
    }
}

/* weight rows per pass for 1-8 rows: ROWS * NB accumulators, a step's VECS values and an x vector in the target's
 * 32 or 16 vector registers */
#if LANES == 16
#define NB1 8
#define NB2 8
#define NB3 6
#define NB4 5
#define NB5 4
#define NB6 4
#define NB7 3
#define NB8 3
#else
#define NB1 6
#define NB2 4
#define NB3 3
#define NB4 2
#define NB5 2
#define NB6 1
#define NB7 1
#define NB8 1
#endif

/* one step (32 values) of `count` weight rows into the accumulators */
#define STEP(ROWS, count, DEQUANTIZE, BYTES, VALUES)                                                                  \
    for (int j = 0; j < (count); j++) {                                                                              \
        vec wv[VECS];                                                                                                \
        DEQUANTIZE(w + (n + j) * row_bytes + b * (BYTES), sub, wv);                                                  \
        for (int m = 0; m < ROWS; m++)                                                                               \
            for (int v = 0; v < VECS; v++)                                                                           \
                acc[m][j] = fmadd(load_f32(x + m * K + b * (VALUES) + sub * SUB + v * LANES), wv[v], acc[m][j]); \
    }

/* output columns [n0, n1) of ROWS fp32 rows, NB weight rows of BYTES-byte blocks of VALUES values per pass */
#define KERNEL(NAME, ROWS, NB, DEQUANTIZE, BYTES, VALUES)                                                           \
    static void NAME(const float *restrict x, const uint8_t *restrict w, float *restrict y, long n0, long n1,        \
                     long K, long ldy) {                                                                             \
        long blocks = K / (VALUES), row_bytes = blocks * (BYTES);                                                    \
        for (long n = n0; n < n1; n += NB) {                                                                         \
            int nb = n1 - n < NB ? (int)(n1 - n) : NB;                                                               \
            vec acc[ROWS][NB];                                                                                       \
            for (int m = 0; m < ROWS; m++)                                                                           \
                for (int j = 0; j < NB; j++) acc[m][j] = (vec){0};                                                   \
            if (nb == NB) {                                                                                          \
                for (long b = 0; b < blocks; b++)                                                                    \
                    for (int sub = 0; sub < (VALUES) / SUB; sub++) STEP(ROWS, NB, DEQUANTIZE, BYTES, VALUES)         \
            } else {                                                                                                 \
                for (long b = 0; b < blocks; b++)                                                                    \
                    for (int sub = 0; sub < (VALUES) / SUB; sub++) STEP(ROWS, nb, DEQUANTIZE, BYTES, VALUES)         \
            }                                                                                                        \
            for (int m = 0; m < ROWS; m++)                                                                           \
                for (int j = 0; j < nb; j++) y[m * ldy + n + j] = lane_sum(acc[m][j]);                               \
        }                                                                                                            \
    }

/* the eight row counts' kernels for one block type, and a function that runs the one for 1-8 rows */
#define KERNELS(SUFFIX, DEQUANTIZE, BYTES, VALUES)                                                                  \
    KERNEL(rows1_##SUFFIX, 1, NB1, DEQUANTIZE, BYTES, VALUES)                                                        \
    KERNEL(rows2_##SUFFIX, 2, NB2, DEQUANTIZE, BYTES, VALUES)                                                        \
    KERNEL(rows3_##SUFFIX, 3, NB3, DEQUANTIZE, BYTES, VALUES)                                                        \
    KERNEL(rows4_##SUFFIX, 4, NB4, DEQUANTIZE, BYTES, VALUES)                                                        \
    KERNEL(rows5_##SUFFIX, 5, NB5, DEQUANTIZE, BYTES, VALUES)                                                        \
    KERNEL(rows6_##SUFFIX, 6, NB6, DEQUANTIZE, BYTES, VALUES)                                                        \
    KERNEL(rows7_##SUFFIX, 7, NB7, DEQUANTIZE, BYTES, VALUES)                                                        \
    KERNEL(rows8_##SUFFIX, 8, NB8, DEQUANTIZE, BYTES, VALUES)                                                        \
    static void kernel_##SUFFIX(int rows, const float *x, const uint8_t *w, float *y, long n0, long n1, long K,      \
                                long ldy) {                                                                          \
        static void (*const table[MAX_ROWS + 1])(const float *, const uint8_t *, float *, long, long, long, long) = { \
            0, rows1_##SUFFIX, rows2_##SUFFIX, rows3_##SUFFIX, rows4_##SUFFIX,                                       \
            rows5_##SUFFIX, rows6_##SUFFIX, rows7_##SUFFIX, rows8_##SUFFIX};                                         \
        table[rows](x, w, y, n0, n1, K, ldy);                                                                        \
    }

KERNELS(q4_0, dequantize_q4_0, 18, 32)
KERNELS(q4_1, dequantize_q4_1, 20, 32)
KERNELS(q5_0, dequantize_q5_0, 22, 32)
KERNELS(q5_1, dequantize_q5_1, 24, 32)
KERNELS(q8_0, dequantize_q8_0, 34, 32)
KERNELS(q4_k, dequantize_q4_k, 144, 256)
KERNELS(q6_k, dequantize_q6_k, 210, 256)

typedef void (*kernel_fn)(int, const float *, const uint8_t *, float *, long, long, long, long);
typedef void (*dequantize_fn)(const uint8_t *, int, vec *);

/* GGMLQuantizationType `type`'s kernel, dequantization, bytes and values per block; 0 for a type without one */
static kernel_fn kernel_of(int type, dequantize_fn *dequantize, long *bytes, long *values) {
    *values = 32;
    switch (type) {
    case GGUF_Q4_0: *dequantize = dequantize_q4_0; *bytes = 18; return kernel_q4_0;
    case GGUF_Q4_1: *dequantize = dequantize_q4_1; *bytes = 20; return kernel_q4_1;
    case GGUF_Q5_0: *dequantize = dequantize_q5_0; *bytes = 22; return kernel_q5_0;
    case GGUF_Q5_1: *dequantize = dequantize_q5_1; *bytes = 24; return kernel_q5_1;
    case GGUF_Q8_0: *dequantize = dequantize_q8_0; *bytes = 34; return kernel_q8_0;
    case GGUF_Q4_K: *dequantize = dequantize_q4_k; *bytes = 144; *values = 256; return kernel_q4_k;
    case GGUF_Q6_K: *dequantize = dequantize_q6_k; *bytes = 210; *values = 256; return kernel_q6_k;
    default: *dequantize = 0; *bytes = 0; return 0;
    }
}

/* x [rows, K] fp32, w [N, K / values blocks] of GGMLQuantizationType `type`, y [rows, N] fp32, all contiguous; rows
 * from 1 on (passes of up to 8 rows), on `threads` OpenMP threads. Returns 0; -1 for rows < 1, -2 for a type without
 * a kernel, -3 for K not a multiple of the type's values per block. */
int triforce_gguf_linear(int type, int rows, const float *x, const uint8_t *w, float *y, long N, long K, int threads) {
    dequantize_fn dequantize;
    long bytes, values;
    kernel_fn kernel = kernel_of(type, &dequantize, &bytes, &values);
    if (rows < 1) return -1;
    if (kernel == 0) return -2;
    if (K % values) return -3;
    #pragma omp parallel num_threads(threads)
    {
        int t = omp_get_thread_num(), count = omp_get_num_threads();
        long chunk = (N + count - 1) / count, lo = t * chunk, hi = lo + chunk < N ? lo + chunk : N;
        for (int r = 0; r < rows && lo < hi; r += MAX_ROWS) {
            int take = rows - r < MAX_ROWS ? rows - r : MAX_ROWS;
            kernel(take, x + r * K, w, y + r * N, lo, hi, K, N);
        }
    }
    return 0;
}

/* out [N, K] fp32: the values the kernel multiplies by, from w as triforce_gguf_linear takes it. Returns 0; -2 for a
 * type without a kernel, -3 for K not a multiple of the type's values per block. */
int triforce_gguf_dequantize(int type, const uint8_t *w, float *out, long N, long K) {
    dequantize_fn dequantize;
    long bytes, values;
    if (kernel_of(type, &dequantize, &bytes, &values) == 0) return -2;
    if (K % values) return -3;
    for (long i = 0; i < N * (K / values); i++)
        for (int sub = 0; sub < values / SUB; sub++) {
            vec part[VECS];
            dequantize(w + i * bytes, sub, part);
            for (int v = 0; v < VECS; v++) store_f32(out + i * values + sub * SUB + v * LANES, part[v]);
        }
    return 0;
}
