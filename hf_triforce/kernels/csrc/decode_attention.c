/* Attention of a few query rows over a long KV cache on the CPU, in fp32 (hf_triforce.kernels.cpu_attention).
 *
 * Each (KV head, span of the cache) pair is one task: its query rows (the query heads of the KV head's group times the
 * new tokens) attend to the span's keys block by block with a running max and sum (online softmax); the spans'
 * partial results are then merged by their maxima and sums. Keys and values are read once per KV head whatever the
 * number of rows, so a decoding step is bound by the cache's bytes and a verification of a few rows costs little more.
 *
 * Scores (decode_attention_span.h): the partial products of 8 keys with each of two rows (16 keys with a lone row),
 * one vector per key and row, are summed lane-wise into one vector of 16 dot products by a transposing reduction, so
 * no horizontal sum is taken per key; the values are accumulated two rows per pass, each value loaded once for both.
 *
 * Masking: the last `new_rows` keys are the new tokens themselves; query row r is new token i = r % new_rows and sees
 * keys [0, kv_len - new_rows + 1 + i) (bottom-right causal, the layout TriForce's caches keep).
 */
#include <math.h>
#include <omp.h>
#include <string.h>

/* glibc's vector exp (libmvec) for the softmax's exponentials */
#pragma omp declare simd notinbranch
extern float expf(float);

typedef float vec __attribute__((vector_size(64)));
typedef int ivec __attribute__((vector_size(64)));
#define LANES 16
#define BLOCK 64 /* keys per block of scores */

/* the transposing reduction: two vectors holding groups of `s` partial sums become one holding groups of s / 2 */
static const ivec LO8 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
static const ivec HI8 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
static const ivec LO4 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
static const ivec HI4 = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
static const ivec LO2 = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
static const ivec HI2 = {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31};
static const ivec LO1 = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
static const ivec HI1 = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};

static inline vec load(const float *p) { vec x; memcpy(&x, p, sizeof x); return x; }
static inline void store(float *p, vec x) { memcpy(p, &x, sizeof x); }

#define SHUFFLE __builtin_shuffle

#define HEAD_DIM 64
#define SPAN_ATTENTION span_attention_64
#define REDUCE reduce_64
#include "decode_attention_span.h"
#undef SPAN_ATTENTION
#undef REDUCE
#undef HEAD_DIM
#define HEAD_DIM 128
#define SPAN_ATTENTION span_attention_128
#define REDUCE reduce_128
#include "decode_attention_span.h"
#undef SPAN_ATTENTION
#undef REDUCE
#undef HEAD_DIM

/* Workspace floats `triforce_attend` needs. */
long triforce_attend_workspace(int head_dim, int kv_heads, int rows, int parts, int threads) {
    return (long)kv_heads * parts * rows * (head_dim + 2) + (long)threads * rows * BLOCK;
}

/* q [kv_heads, rows, head_dim] (row r: query head r / new_rows of the group, new token r % new_rows); keys of KV head
 * h at k + h * k_head, key j at + j * k_row (values alike); out [kv_heads, rows, head_dim]. The cache is cut into
 * `parts` spans per KV head, run on `threads` OpenMP threads. Returns 0, or -1 for a head dim it does not take. */
int triforce_attend(int head_dim, const float *q, const float *k, const float *v, long k_head, long k_row,
                    long v_head, long v_row, int kv_heads, int rows, int new_rows, long kv_len, float scale, int parts,
                    int threads, float *workspace, float *out) {
    if (head_dim != 64 && head_dim != 128) return -1;
    const int D = head_dim;
    long span = (kv_len + parts - 1) / parts;
    span = (span + BLOCK - 1) / BLOCK * BLOCK;
    float *scratch = workspace + (long)kv_heads * parts * rows * (D + 2);
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int t = 0; t < kv_heads * parts; t++) {
        int h = t / parts, p = t % parts;
        long lo = p * span, hi = lo + span < kv_len ? lo + span : kv_len;
        float *w = workspace + (long)t * rows * (D + 2);
        float *scores = scratch + (long)omp_get_thread_num() * rows * BLOCK;
        if (lo >= hi) {
            for (int r = 0; r < rows; r++) { w[r] = -INFINITY; w[rows + r] = 0.f; }
            continue;
        }
        (D == 64 ? span_attention_64 : span_attention_128)(q + (long)h * rows * D, k + h * k_head, v + h * v_head,
                                                           k_row, v_row, rows, new_rows, kv_len, scale, lo, hi, w,
                                                           w + rows, w + 2 * rows, scores);
    }
    for (int h = 0; h < kv_heads; h++) {
        for (int r = 0; r < rows; r++) {
            float top = -INFINITY, den = 0.f;
            for (int p = 0; p < parts; p++) {
                float mp = workspace[(long)(h * parts + p) * rows * (D + 2) + r];
                top = mp > top ? mp : top;
            }
            float *o = out + ((long)h * rows + r) * D;
            memset(o, 0, sizeof(float) * D);
            for (int p = 0; p < parts; p++) {
                const float *w = workspace + (long)(h * parts + p) * rows * (D + 2);
                if (w[r] == -INFINITY) continue;
                float c = expf(w[r] - top);
                den += c * w[rows + r];
                const float *a = w + 2 * rows + (long)r * D;
                for (int d = 0; d < D; d++) o[d] += c * a[d];
            }
            for (int d = 0; d < D; d++) o[d] /= den;
        }
    }
    return 0;
}
