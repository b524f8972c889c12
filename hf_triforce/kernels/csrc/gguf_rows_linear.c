/* A few fp32 rows times a weight matrix held in GGUF's quantized blocks (hf_triforce.kernels.gguf_linear): Q4_0, Q4_1
 * and Q8_0, read at their stored width; products and sums in fp32.
 *
 * y[m, n] = sum_k x[m, k] * w[n, k] for rows m < ROWS <= 8, w [N, K] stored row by row as K / 32 blocks of 32 values
 * (GGUF's own block layout, GGMLQuantizationType codes):
 *   Q4_0 (2): fp16 d, 16 bytes of nibbles q;              w = d * (q - 8)
 *   Q4_1 (3): fp16 d, fp16 m, 16 bytes of nibbles q;      w = d * q + m
 *   Q8_0 (8): fp16 d, 32 int8 q;                          w = d * q
 * Byte i of a 4-bit block holds value i in its low nibble and value i + 16 in its high one. Each w is computed in
 * fp32 exactly as gguf's dequantization (and so transformers' GGUF loading) computes it: d * q is exact in fp32 (an
 * fp16 significand of 11 bits times at most 8 bits), and Q4_1's + m is its one rounding (a fused multiply-add gives
 * the same value). So the kernel multiplies by exactly the values of the dequantized fp32 matrix, and
 * triforce_gguf_dequantize writes those values (the Python side checks them bit for bit against the model's).
 *
 * As in few_rows_linear.c, a pass reads NB weight rows' blocks once and multiplies each block's values (widened in
 * registers) into every row of x (x stays in the cache), so 1-8 rows cost one pass over the packed weights; threads
 * take contiguous ranges of output columns. Each output is its own dot product of row m with weight row n (rows never
 * mix), summed in LANES lanes over k = lane mod LANES, then across the lanes.
 */
#include <omp.h>
#include <stdlib.h>

#include "vectors.h"

#define MAX_ROWS 8
#define BLOCK 32               /* values per block, every type */
#define VECS (BLOCK / LANES)   /* vectors per block: 2 with AVX-512, 4 with AVX2 */

enum { GGUF_Q4_0 = 2, GGUF_Q4_1 = 3, GGUF_Q8_0 = 8 };

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

/* values v * LANES .. v * LANES + LANES - 1 of a block's 16 bytes of nibbles, as floats 0..15 */
static inline vec nibbles(const uint8_t *q, int v) {
    ivec bytes = widen_u8(q + (v * LANES) % 16);
    ivec n = v * LANES >= 16 ? bytes >> 4 : bytes & 15;
    return __builtin_convertvector(n, vec);
}

/* the 32 values of one block, VECS vectors */
static inline void dequantize_q4_0(const uint8_t *block, vec out[VECS]) {
    float d = half_at(block);
    for (int v = 0; v < VECS; v++) out[v] = d * (nibbles(block + 2, v) - 8.f);
}

static inline void dequantize_q4_1(const uint8_t *block, vec out[VECS]) {
    float d = half_at(block), m = half_at(block + 2);
    for (int v = 0; v < VECS; v++) out[v] = d * nibbles(block + 4, v) + m;
}

static inline void dequantize_q8_0(const uint8_t *block, vec out[VECS]) {
    float d = half_at(block);
    for (int v = 0; v < VECS; v++) out[v] = d * __builtin_convertvector(widen_i8(block + 2 + v * LANES), vec);
}

/* weight rows per pass for 1-8 rows: ROWS * NB accumulators, a block's VECS values and an x vector in the target's
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

/* one block of NB_ weight rows (count: NB_ or fewer) into the accumulators */
#define BLOCK_STEP(ROWS, NB_, count, DEQUANTIZE, BYTES)                                                             \
    for (int j = 0; j < (count); j++) {                                                                              \
        vec wv[VECS];                                                                                                \
        DEQUANTIZE(w + (n + j) * row_bytes + b * (BYTES), wv);                                                       \
        for (int m = 0; m < ROWS; m++)                                                                               \
            for (int v = 0; v < VECS; v++) acc[m][j] += load_f32(x + m * K + b * BLOCK + v * LANES) * wv[v];       \
    }

/* output columns [n0, n1) of ROWS fp32 rows, NB weight rows of BYTES-byte blocks per pass */
#define KERNEL(NAME, ROWS, NB, DEQUANTIZE, BYTES)                                                                   \
    static void NAME(const float *restrict x, const uint8_t *restrict w, float *restrict y, long n0, long n1,        \
                     long K, long ldy) {                                                                             \
        long blocks = K / BLOCK, row_bytes = blocks * (BYTES);                                                       \
        for (long n = n0; n < n1; n += NB) {                                                                         \
            int nb = n1 - n < NB ? (int)(n1 - n) : NB;                                                               \
            vec acc[ROWS][NB];                                                                                       \
            for (int m = 0; m < ROWS; m++)                                                                           \
                for (int j = 0; j < NB; j++) acc[m][j] = (vec){0};                                                   \
            if (nb == NB) {                                                                                          \
                for (long b = 0; b < blocks; b++) BLOCK_STEP(ROWS, NB, NB, DEQUANTIZE, BYTES)                        \
            } else {                                                                                                 \
                for (long b = 0; b < blocks; b++) BLOCK_STEP(ROWS, NB, nb, DEQUANTIZE, BYTES)                        \
            }                                                                                                        \
            for (int m = 0; m < ROWS; m++)                                                                           \
                for (int j = 0; j < nb; j++) y[m * ldy + n + j] = lane_sum(acc[m][j]);                               \
        }                                                                                                            \
    }

/* the eight row counts' kernels for one block type, and a function that runs the one for 1-8 rows */
#define KERNELS(SUFFIX, DEQUANTIZE, BYTES)                                                                          \
    KERNEL(rows1_##SUFFIX, 1, NB1, DEQUANTIZE, BYTES)                                                                \
    KERNEL(rows2_##SUFFIX, 2, NB2, DEQUANTIZE, BYTES)                                                                \
    KERNEL(rows3_##SUFFIX, 3, NB3, DEQUANTIZE, BYTES)                                                                \
    KERNEL(rows4_##SUFFIX, 4, NB4, DEQUANTIZE, BYTES)                                                                \
    KERNEL(rows5_##SUFFIX, 5, NB5, DEQUANTIZE, BYTES)                                                                \
    KERNEL(rows6_##SUFFIX, 6, NB6, DEQUANTIZE, BYTES)                                                                \
    KERNEL(rows7_##SUFFIX, 7, NB7, DEQUANTIZE, BYTES)                                                                \
    KERNEL(rows8_##SUFFIX, 8, NB8, DEQUANTIZE, BYTES)                                                                \
    static void kernel_##SUFFIX(int rows, const float *x, const uint8_t *w, float *y, long n0, long n1, long K,      \
                                long ldy) {                                                                          \
        static void (*const table[MAX_ROWS + 1])(const float *, const uint8_t *, float *, long, long, long, long) = { \
            0, rows1_##SUFFIX, rows2_##SUFFIX, rows3_##SUFFIX, rows4_##SUFFIX,                                       \
            rows5_##SUFFIX, rows6_##SUFFIX, rows7_##SUFFIX, rows8_##SUFFIX};                                         \
        table[rows](x, w, y, n0, n1, K, ldy);                                                                        \
    }

KERNELS(q4_0, dequantize_q4_0, 18)
KERNELS(q4_1, dequantize_q4_1, 20)
KERNELS(q8_0, dequantize_q8_0, 34)

typedef void (*kernel_fn)(int, const float *, const uint8_t *, float *, long, long, long, long);

/* the kernel and block size of GGMLQuantizationType `type`; 0 bytes for a type without one */
static kernel_fn kernel_of(int type, long *bytes) {
    switch (type) {
    case GGUF_Q4_0: *bytes = 18; return kernel_q4_0;
    case GGUF_Q4_1: *bytes = 20; return kernel_q4_1;
    case GGUF_Q8_0: *bytes = 34; return kernel_q8_0;
    default: *bytes = 0; return 0;
    }
}

/* x [rows, K] fp32, w [N, K / 32 blocks] of GGMLQuantizationType `type`, y [rows, N] fp32, all contiguous; rows from 1
 * on (passes of up to 8 rows), on `threads` OpenMP threads. Returns 0; -1 for rows < 1, -2 for a type without a
 * kernel, -3 for K not a multiple of 32. */
int triforce_gguf_linear(int type, int rows, const float *x, const uint8_t *w, float *y, long N, long K, int threads) {
    long bytes;
    kernel_fn kernel = kernel_of(type, &bytes);
    if (rows < 1) return -1;
    if (kernel == 0) return -2;
    if (K % BLOCK) return -3;
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
 * type without a kernel, -3 for K not a multiple of 32. */
int triforce_gguf_dequantize(int type, const uint8_t *w, float *out, long N, long K) {
    long bytes;
    if (kernel_of(type, &bytes) == 0) return -2;
    if (K % BLOCK) return -3;
    long blocks = K / BLOCK;
    for (long i = 0; i < N * blocks; i++) {
        vec values[VECS];
        const uint8_t *block = w + i * bytes;
        if (type == GGUF_Q4_0) dequantize_q4_0(block, values);
        else if (type == GGUF_Q4_1) dequantize_q4_1(block, values);
        else dequantize_q8_0(block, values);
        for (int v = 0; v < VECS; v++) store_f32(out + i * BLOCK + v * LANES, values[v]);
    }
    return 0;
}
