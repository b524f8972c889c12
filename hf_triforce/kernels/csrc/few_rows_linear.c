/* A few rows times a weight matrix on the CPU, in fp32 (hf_triforce.kernels.few_rows_linear).
 *
 * y[m, n] = sum_k x[m, k] * w[n, k] for rows m < ROWS <= 8, w [N, K] row-major (nn.Linear's layout). A decoding or
 * verification forward is bound by reading the weights: each block of NB weight rows is read once, 16 floats a load,
 * and multiplied into every row of x (x stays in the cache: at most 8 x K floats), so 1-8 rows cost one pass over the
 * weights. Threads take contiguous ranges of output columns.
 *
 * Numerics: each output is its own dot product of row m with weight row n (rows never mix), summed in 16 lanes over
 * k = lane mod 16, then across the lanes; a K not a multiple of 16 ends with a scalar tail.
 */
#include <omp.h>
#include <string.h>

typedef float vec __attribute__((vector_size(64)));
#define LANES 16
#define MAX_ROWS 8

static inline vec load(const float *p) { vec x; memcpy(&x, p, sizeof x); return x; }
static inline float lane_sum(vec v) {
    float s = 0.f;
    for (int i = 0; i < LANES; i++) s += v[i];
    return s;
}

/* output columns [n0, n1) of ROWS rows, NB weight rows per pass (ROWS * NB + NB vector registers at most ~30) */
#define KERNEL(NAME, ROWS, NB)                                                                                     \
    static void NAME(const float *restrict x, const float *restrict w, float *restrict y, long n0, long n1,      \
                     long K, long ldy) {                                                                           \
        long body = K - K % LANES;                                                                                 \
        for (long n = n0; n < n1; n += NB) {                                                                       \
            int nb = n1 - n < NB ? (int)(n1 - n) : NB;                                                             \
            vec acc[ROWS][NB];                                                                                     \
            for (int m = 0; m < ROWS; m++)                                                                         \
                for (int j = 0; j < NB; j++) acc[m][j] = (vec){0};                                                 \
            if (nb == NB) {                                                                                        \
                for (long k = 0; k < body; k += LANES) {                                                           \
                    vec wv[NB];                                                                                    \
                    for (int j = 0; j < NB; j++) wv[j] = load(w + (n + j) * K + k);                                \
                    for (int m = 0; m < ROWS; m++) {                                                               \
                        vec xv = load(x + m * K + k);                                                              \
                        for (int j = 0; j < NB; j++) acc[m][j] += xv * wv[j];                                      \
                    }                                                                                              \
                }                                                                                                  \
            } else {                                                                                               \
                for (long k = 0; k < body; k += LANES)                                                             \
                    for (int j = 0; j < nb; j++) {                                                                 \
                        vec wv = load(w + (n + j) * K + k);                                                        \
                        for (int m = 0; m < ROWS; m++) acc[m][j] += load(x + m * K + k) * wv;                      \
                    }                                                                                              \
            }                                                                                                      \
            for (int m = 0; m < ROWS; m++)                                                                         \
                for (int j = 0; j < nb; j++) {                                                                     \
                    float s = lane_sum(acc[m][j]);                                                                 \
                    for (long k = body; k < K; k++) s += x[m * K + k] * w[(n + j) * K + k];                        \
                    y[m * ldy + n + j] = s;                                                                        \
                }                                                                                                  \
        }                                                                                                          \
    }

KERNEL(rows1, 1, 8)
KERNEL(rows2, 2, 8)
KERNEL(rows3, 3, 7)
KERNEL(rows4, 4, 6)
KERNEL(rows5, 5, 5)
KERNEL(rows6, 6, 4)
KERNEL(rows7, 7, 3)
KERNEL(rows8, 8, 3)

typedef void (*kernel_fn)(const float *, const float *, float *, long, long, long, long);
static const kernel_fn KERNELS[MAX_ROWS + 1] = {0, rows1, rows2, rows3, rows4, rows5, rows6, rows7, rows8};

/* x [rows, K], w [N, K], y [rows, N], all contiguous; rows from 1 on (passes of up to 8 rows), on `threads` OpenMP
 * threads. Returns 0, or -1 for rows < 1. */
int triforce_few_rows_linear(int rows, const float *x, const float *w, float *y, long N, long K, int threads) {
    if (rows < 1) return -1;
    #pragma omp parallel num_threads(threads)
    {
        int t = omp_get_thread_num(), count = omp_get_num_threads();
        long chunk = (N + count - 1) / count, lo = t * chunk, hi = lo + chunk < N ? lo + chunk : N;
        for (int r = 0; r < rows && lo < hi; r += MAX_ROWS) {
            int take = rows - r < MAX_ROWS ? rows - r : MAX_ROWS;
            KERNELS[take](x + (long)r * K, w, y + (long)r * N, lo, hi, K, N);
        }
    }
    return 0;
}
