/* A few rows times a weight matrix on the CPU (hf_triforce.kernels.few_rows_linear): rows and weights of one type,
 * fp32, bf16 or fp16; products and sums in fp32.
 *
 * y[m, n] = sum_k x[m, k] * w[n, k] for rows m < ROWS <= 8, w [N, K] row-major (nn.Linear's layout). A decoding or
 * verification forward is bound by reading the weights: each block of NB weight rows is read once, LANES elements a
 * load (vectors.h: 16 with AVX-512, 8 with AVX2), widened to fp32 in registers, and multiplied into every row of x
 * (x stays in the cache: at most 8 x K floats), so 1-8 rows cost one pass over the weights. Threads take contiguous
 * ranges of output columns.
 *
 * Numerics: each output is its own dot product of row m with weight row n (rows never mix), summed in LANES lanes over
 * k = lane mod LANES, each product added by one fused multiply-add, then across the lanes; a K not a multiple of LANES
 * ends with a scalar tail of fused multiply-adds. Every row count's pass does the same operations in the same order
 * (vectors.h: nothing is fused but what is written so), so a row's outputs do not depend on the rows beside it. bf16 and fp16 rows
 * are widened to fp32 once per call (exactly), and the product of two such values is exact in fp32, so the sum's
 * rounding is an fp32 dot product's; the output is then rounded once to the weights' type. Where the target has
 * AVX512-BF16, bf16 rows and weights are multiplied in pairs by vdpbf16ps instead (lane i sums k = 2i, 2i + 1 mod 32;
 * values below fp32's normal range taken as 0), with the same one rounding at the end.
 */
#include <omp.h>
#include <stdlib.h>

#include "vectors.h"

#define MAX_ROWS 8

static inline float lane_sum(vec v) {
    float s = 0.f;
    for (int i = 0; i < LANES; i++) s += v[i];
    return s;
}

static inline float same(float x) { return x; }

/* weight rows per pass for 1-8 rows: ROWS * NB accumulators and NB weight vectors fill the target's 32 or 16 vector
 * registers (x is read from memory by each multiply-add) */
#if LANES == 16
#define NB1 8
#define NB2 8
#define NB3 7
#define NB4 6
#define NB5 5
#define NB6 4
#define NB7 3
#define NB8 3
#else
#define NB1 7
#define NB2 5
#define NB3 3
#define NB4 3
#define NB5 2
#define NB6 2
#define NB7 1
#define NB8 1
#endif

/* output columns [n0, n1) of ROWS rows of type XT, NB weight rows of type T per pass: STEP elements of each row a
 * step, loaded by LOADX / LOADW and multiplied into the accumulators by MAC; the tail past the last whole step is
 * widened by WIDENX / WIDEN, the outputs narrowed by NARROW */
#define KERNEL(NAME, ROWS, NB, XT, T, STEP, LOADX, LOADW, MAC, WIDENX, WIDEN, NARROW)                             \
    static void NAME(const XT *restrict x, const T *restrict w, T *restrict y, long n0, long n1, long K, long ldy) { \
        long body = K - K % (STEP);                                                                                \
        for (long n = n0; n < n1; n += NB) {                                                                       \
            int nb = n1 - n < NB ? (int)(n1 - n) : NB;                                                             \
            vec acc[ROWS][NB];                                                                                     \
            for (int m = 0; m < ROWS; m++)                                                                         \
                for (int j = 0; j < NB; j++) acc[m][j] = (vec){0};                                                 \
            if (nb == NB) {                                                                                        \
                for (long k = 0; k < body; k += STEP) {                                                            \
                    vec wv[NB];                                                                                    \
                    for (int j = 0; j < NB; j++) wv[j] = LOADW(w + (n + j) * K + k);                               \
                    for (int m = 0; m < ROWS; m++) {                                                               \
                        vec xv = LOADX(x + m * K + k);                                                             \
                        for (int j = 0; j < NB; j++) acc[m][j] = MAC(acc[m][j], xv, wv[j]);                        \
                    }                                                                                              \
                }                                                                                                  \
            } else {                                                                                               \
                for (long k = 0; k < body; k += STEP)                                                              \
                    for (int j = 0; j < nb; j++) {                                                                 \
                        vec wv = LOADW(w + (n + j) * K + k);                                                       \
                        for (int m = 0; m < ROWS; m++) acc[m][j] = MAC(acc[m][j], LOADX(x + m * K + k), wv);       \
                    }                                                                                              \
            }                                                                                                      \
            for (int m = 0; m < ROWS; m++)                                                                         \
                for (int j = 0; j < nb; j++) {                                                                     \
                    float s = lane_sum(acc[m][j]);                                                                 \
                    for (long k = body; k < K; k++) s = __builtin_fmaf(WIDENX(x[m * K + k]), WIDEN(w[(n + j) * K + k]), s);         \
                    y[m * ldy + n + j] = NARROW(s);                                                                \
                }                                                                                                  \
        }                                                                                                          \
    }

/* the eight row counts' kernels for one pair of types, and a function that runs the one for 1-8 rows */
#define KERNELS(SUFFIX, XT, T, STEP, LOADX, LOADW, MAC, WIDENX, WIDEN, NARROW)                                     \
    KERNEL(rows1_##SUFFIX, 1, NB1, XT, T, STEP, LOADX, LOADW, MAC, WIDENX, WIDEN, NARROW)                          \
    KERNEL(rows2_##SUFFIX, 2, NB2, XT, T, STEP, LOADX, LOADW, MAC, WIDENX, WIDEN, NARROW)                          \
    KERNEL(rows3_##SUFFIX, 3, NB3, XT, T, STEP, LOADX, LOADW, MAC, WIDENX, WIDEN, NARROW)                          \
    KERNEL(rows4_##SUFFIX, 4, NB4, XT, T, STEP, LOADX, LOADW, MAC, WIDENX, WIDEN, NARROW)                          \
    KERNEL(rows5_##SUFFIX, 5, NB5, XT, T, STEP, LOADX, LOADW, MAC, WIDENX, WIDEN, NARROW)                          \
    KERNEL(rows6_##SUFFIX, 6, NB6, XT, T, STEP, LOADX, LOADW, MAC, WIDENX, WIDEN, NARROW)                          \
    KERNEL(rows7_##SUFFIX, 7, NB7, XT, T, STEP, LOADX, LOADW, MAC, WIDENX, WIDEN, NARROW)                          \
    KERNEL(rows8_##SUFFIX, 8, NB8, XT, T, STEP, LOADX, LOADW, MAC, WIDENX, WIDEN, NARROW)                          \
    static void kernel_##SUFFIX(int rows, const void *x, const void *w, void *y, long n0, long n1, long K,          \
                                long ldy) {                                                                        \
        static void (*const table[MAX_ROWS + 1])(const XT *, const T *, T *, long, long, long, long) = {           \
            0, rows1_##SUFFIX, rows2_##SUFFIX, rows3_##SUFFIX, rows4_##SUFFIX,                                     \
            rows5_##SUFFIX, rows6_##SUFFIX, rows7_##SUFFIX, rows8_##SUFFIX};                                       \
        table[rows]((const XT *)x, (const T *)w, (T *)y, n0, n1, K, ldy);                                          \
    }

static inline vec fma_lanes(vec acc, vec x, vec w) { return fmadd(x, w, acc); }

/* fp32 rows, weights of each type widened in registers */
KERNELS(f32, float, float, LANES, load_f32, load_f32, fma_lanes, same, same, same)
KERNELS(bf16, float, uint16_t, LANES, load_f32, load_bf16, fma_lanes, same, widen_bf16, narrow_bf16)
KERNELS(f16, float, uint16_t, LANES, load_f32, load_f16, fma_lanes, same, widen_f16, narrow_f16)

#ifdef __AVX512BF16__
/* bf16 rows and weights: vdpbf16ps multiplies 32 pairs (exact in fp32) into 16 lanes (vectors.h) */
KERNELS(bf16_pairs, uint16_t, uint16_t, (2 * LANES), load_pairs, load_pairs, dot_pairs, widen_bf16, widen_bf16,
        narrow_bf16)
#endif

typedef void (*kernel_fn)(int, const void *, const void *, void *, long, long, long, long);

/* x [rows, K], w [N, K] and y [rows, N] of type `element` (ELEMENT_F32, _BF16, _F16), all contiguous; rows from 1 on
 * (passes of up to 8 rows), on `threads` OpenMP threads. bf16 rows go to vdpbf16ps where the target has AVX512-BF16;
 * else bf16 and fp16 rows are widened to fp32 first. Returns 0; -1 for rows < 1, -2 for an unknown element, -3 where
 * the widened rows cannot be allocated. */
int triforce_few_rows_linear(int element, int rows, const void *x, const void *w, void *y, long N, long K,
                             int threads) {
    if (rows < 1) return -1;
    if (element < 0 || element > ELEMENT_F16) return -2;
    kernel_fn kernel = element == ELEMENT_F32 ? kernel_f32 : element == ELEMENT_BF16 ? kernel_bf16 : kernel_f16;
    long x_size = 4, y_size = element == ELEMENT_F32 ? 4 : 2;
    float *widened = NULL;
#ifdef __AVX512BF16__
    if (element == ELEMENT_BF16) {
        kernel = kernel_bf16_pairs;
        x_size = 2;
    }
#endif
    if (element != ELEMENT_F32 && x_size == 4) {
        widened = malloc(sizeof(float) * rows * K);
        if (widened == NULL) return -3;
        const uint16_t *h = x;
        for (long i = 0; i < rows * K; i++) widened[i] = element == ELEMENT_BF16 ? widen_bf16(h[i]) : widen_f16(h[i]);
        x = widened;
    }
    #pragma omp parallel num_threads(threads)
    {
        int t = omp_get_thread_num(), count = omp_get_num_threads();
        long chunk = (N + count - 1) / count, lo = t * chunk, hi = lo + chunk < N ? lo + chunk : N;
        for (int r = 0; r < rows && lo < hi; r += MAX_ROWS) {
            int take = rows - r < MAX_ROWS ? rows - r : MAX_ROWS;
            kernel(take, (const char *)x + r * K * x_size, w, (char *)y + r * N * y_size, lo, hi, K, N);
        }
    }
    free(widened);
    return 0;
}
