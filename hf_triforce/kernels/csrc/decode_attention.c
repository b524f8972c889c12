/* Attention of a few query rows over a long KV cache on the CPU (hf_triforce.kernels.cpu_attention): a cache of fp32,
 * bf16 or fp16, scores, softmax and sums in fp32.
 *
 * Each (KV head, span of the cache) pair is one task: its query rows (the query heads of the KV head's group times the
 * new tokens) attend to the span's keys block by block with a running max and sum (online softmax); the spans'
 * partial results are then merged by their maxima and sums. Keys and values are read once per KV head whatever the
 * number of rows, so a decoding step is bound by the cache's bytes and a verification of a few rows costs little more.
 *
 * Scores (decode_attention_span.h): the partial products of LANES / 2 keys with each of two rows (LANES keys with a
 * lone row), one vector per key and row, are summed lane-wise into one vector of LANES dot products by a transposing
 * reduction, so no horizontal sum is taken per key; the values are accumulated two rows per pass, each value loaded
 * once for both, in column chunks that fit the target's registers (vectors.h: LANES 16 with AVX-512, 8 with AVX2).
 * A verification's rows (more than `narrow_rows` per KV head: the wrapper's NARROW_ROWS) take another path with
 * AVX-512: the block's keys are transposed once, then four rows at a time multiply each key column, held in a
 * register, by a query element, and each value vector serves four rows; the next block's keys and values are
 * prefetched meanwhile. A decoding step is bound by the cache's bytes whichever path.
 *
 * Elements (vectors.h): keys and values are widened to fp32 in registers as they are loaded; the query rows are
 * widened once per call; every product of two bf16 or fp16 values is exact in fp32. The output is rounded once, from
 * the merged fp32 result, to the cache's type.
 *
 * Masking: the last `new_rows` keys are the new tokens themselves; query row r is new token i = r % new_rows and sees
 * keys [0, kv_len - new_rows + 1 + i) (bottom-right causal, the layout TriForce's caches keep).
 */
#include <math.h>
#include <omp.h>

#include "vectors.h"

/* glibc's vector exp (libmvec) for the softmax's exponentials */
#pragma omp declare simd notinbranch
extern float expf(float);

#define BLOCK 64 /* keys per block of scores */
#define MAX_HEAD_DIM 128

/* the transposing reduction: two vectors holding groups of `s` partial sums become one holding groups of s / 2 */
#define SHUFFLE __builtin_shuffle
#if LANES == 16
static const ivec LO8 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
static const ivec HI8 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
static const ivec LO4 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
static const ivec HI4 = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
static const ivec LO2 = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
static const ivec HI2 = {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31};
static const ivec LO1 = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
static const ivec HI1 = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
#else
static const ivec LO4 = {0, 1, 2, 3, 8, 9, 10, 11};
static const ivec HI4 = {4, 5, 6, 7, 12, 13, 14, 15};
static const ivec LO2 = {0, 1, 4, 5, 8, 9, 12, 13};
static const ivec HI2 = {2, 3, 6, 7, 10, 11, 14, 15};
static const ivec LO1 = {0, 2, 4, 6, 8, 10, 12, 14};
static const ivec HI1 = {1, 3, 5, 7, 9, 11, 13, 15};
#endif

/* lane-wise sums of x[0..LANES): lane i of x[0] becomes the sum of x[i]'s lanes */
static inline void reduce(vec *x) {
#if LANES == 16
    for (int i = 0; i < 8; i++) x[i] = SHUFFLE(x[2 * i], x[2 * i + 1], LO8) + SHUFFLE(x[2 * i], x[2 * i + 1], HI8);
#endif
    for (int i = 0; i < 4; i++) x[i] = SHUFFLE(x[2 * i], x[2 * i + 1], LO4) + SHUFFLE(x[2 * i], x[2 * i + 1], HI4);
    for (int i = 0; i < 2; i++) x[i] = SHUFFLE(x[2 * i], x[2 * i + 1], LO2) + SHUFFLE(x[2 * i], x[2 * i + 1], HI2);
    x[0] = SHUFFLE(x[0], x[1], LO1) + SHUFFLE(x[0], x[1], HI1);
}

/* each vector loaded once into a register and reused there (the compiler would otherwise fold its load into every
 * product that uses it, loading it once per row) */
#define IN_REGISTERS(a, b, c, d) __asm__("" : "+v"(a), "+v"(b), "+v"(c), "+v"(d))

#if LANES == 16
/* x[i] becomes the vector of lane i of x[0..16) (a 16 x 16 transpose) */
static inline void transpose(vec *x) {
    __m512 t[16], r[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps((__m512)x[i], (__m512)x[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps((__m512)x[i], (__m512)x[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
        r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
        r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
        r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xdd);
    }
    for (int i = 0; i < 8; i++) {
        x[i] = (vec)_mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
        x[i + 8] = (vec)_mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
    }
}
#endif

/* one task's function for each head dim and element type (decode_attention_span.h) */
#define HEAD_DIM 64
#define ELEMENT float
#define LOAD_KV load_f32
#define SPAN_ATTENTION span_64_f32
#include "decode_attention_span.h"
#define HEAD_DIM 128
#define ELEMENT float
#define LOAD_KV load_f32
#define SPAN_ATTENTION span_128_f32
#include "decode_attention_span.h"
#ifdef __AVX512BF16__
#define SCORE_PAIRS
#endif
#define HEAD_DIM 64
#define ELEMENT uint16_t
#define LOAD_KV load_bf16
#define SPAN_ATTENTION span_64_bf16
#include "decode_attention_span.h"
#ifdef __AVX512BF16__
#define SCORE_PAIRS
#endif
#define HEAD_DIM 128
#define ELEMENT uint16_t
#define LOAD_KV load_bf16
#define SPAN_ATTENTION span_128_bf16
#include "decode_attention_span.h"
#define HEAD_DIM 64
#define ELEMENT uint16_t
#define LOAD_KV load_f16
#define SPAN_ATTENTION span_64_f16
#include "decode_attention_span.h"
#define HEAD_DIM 128
#define ELEMENT uint16_t
#define LOAD_KV load_f16
#define SPAN_ATTENTION span_128_f16
#include "decode_attention_span.h"

typedef void (*span_fn)(const float *, const void *, const void *, long, long, int, int, int, long, float, long,
                        long, float *, float *, float *, float *);
static const span_fn SPANS[3][2] = {[ELEMENT_F32] = {span_64_f32, span_128_f32},
                                    [ELEMENT_BF16] = {span_64_bf16, span_128_bf16},
                                    [ELEMENT_F16] = {span_64_f16, span_128_f16}};

/* Workspace floats `triforce_attend` needs. */
long triforce_attend_workspace(int head_dim, int kv_heads, int rows, int parts, int threads) {
    return (long)kv_heads * parts * rows * (head_dim + 2) + (long)threads * rows * BLOCK
           + (long)kv_heads * rows * head_dim;
}

/* q [kv_heads, rows, head_dim] (row r: query head r / new_rows of the group, new token r % new_rows); keys of KV head
 * h at k + h * k_head, key j at + j * k_row (values alike; strides in elements); out [kv_heads, rows, head_dim]; q, k,
 * v and out of type `element` (ELEMENT_F32, _BF16, _F16). The cache is cut into `parts` spans per KV head, run on
 * `threads` OpenMP threads. Up to `narrow_rows` rows a KV head go in pairs (a decoding step's: bound by the cache's
 * bytes), more in fours against the block's keys transposed (a verification's; AVX-512 only). Returns 0, -1 for a head dim it does not take, -2 for an unknown element. */
int triforce_attend(int element, int head_dim, const void *q, const void *k, const void *v, long k_head, long k_row,
                    long v_head, long v_row, int kv_heads, int rows, int new_rows, int narrow_rows, long kv_len,
                    float scale, int parts, int threads, float *workspace, void *out) {
    if (head_dim != 64 && head_dim != 128) return -1;
    if (element < 0 || element > ELEMENT_F16) return -2;
    const int D = head_dim;
    const long size = element == ELEMENT_F32 ? 4 : 2;
    const span_fn span_attention = SPANS[element][D == 128];
    long span = (kv_len + parts - 1) / parts;
    span = (span + BLOCK - 1) / BLOCK * BLOCK;
    float *scratch = workspace + (long)kv_heads * parts * rows * (D + 2);
    const float *query = q;
    if (element != ELEMENT_F32) { /* the query rows widened once */
        float *widened = scratch + (long)threads * rows * BLOCK;
        const uint16_t *h = q;
        for (long i = 0; i < (long)kv_heads * rows * D; i++)
            widened[i] = element == ELEMENT_BF16 ? widen_bf16(h[i]) : widen_f16(h[i]);
        query = widened;
    }
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
        span_attention(query + (long)h * rows * D, (const char *)k + h * k_head * size,
                       (const char *)v + h * v_head * size, k_row, v_row, rows, new_rows, narrow_rows, kv_len, scale,
                       lo, hi, w, w + rows, w + 2 * rows, scores);
    }
    for (int h = 0; h < kv_heads; h++) {
        for (int r = 0; r < rows; r++) {
            float top = -INFINITY, den = 0.f, o[MAX_HEAD_DIM] = {0};
            for (int p = 0; p < parts; p++) {
                float mp = workspace[(long)(h * parts + p) * rows * (D + 2) + r];
                top = mp > top ? mp : top;
            }
            for (int p = 0; p < parts; p++) {
                const float *w = workspace + (long)(h * parts + p) * rows * (D + 2);
                if (w[r] == -INFINITY) continue;
                float c = expf(w[r] - top);
                den += c * w[rows + r];
                const float *a = w + 2 * rows + (long)r * D;
                for (int d = 0; d < D; d++) o[d] += c * a[d];
            }
            long at = ((long)h * rows + r) * D;
            for (int d = 0; d < D; d++) {
                float x = o[d] / den;
                if (element == ELEMENT_F32) ((float *)out)[at + d] = x;
                else ((uint16_t *)out)[at + d] = element == ELEMENT_BF16 ? narrow_bf16(x) : narrow_f16(x);
            }
        }
    }
    return 0;
}
