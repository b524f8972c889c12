/* The vectors the CPU kernels compute with, for the target they are compiled for, and the element types they read.
 *
 * Width: 16 fp32 lanes (512 bits) where the target has AVX-512, else 8 (256 bits, AVX2): vectors wider than the
 * target's registers are split by the compiler into pairs and spill, and their shuffles lose their one-instruction
 * forms. Each kernel sizes its blocks of registers by LANES.
 *
 * Elements: the kernels read tensors of fp32, bf16 or fp16 (ELEMENT_*, the codes the Python wrappers pass) and
 * compute in fp32. A bf16 value is the upper half of the fp32 value it stands for, so widening it is a 16-bit shift;
 * an fp16 value widens exactly by F16C's conversion (x86-64-v3 and every AVX-512 target have it). Outputs are
 * narrowed once, at the end, by round-to-nearest-even: what torch's own conversions do.
 */
#ifndef TRIFORCE_VECTORS_H
#define TRIFORCE_VECTORS_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
#error "the CPU kernels need AVX2, FMA and F16C (x86-64-v3 or newer)"
#endif

#ifdef __AVX512F__
#define LANES 16
#else
#define LANES 8
#endif

typedef float vec __attribute__((vector_size(LANES * 4)));
typedef int ivec __attribute__((vector_size(LANES * 4)));

enum { ELEMENT_F32 = 0, ELEMENT_BF16 = 1, ELEMENT_F16 = 2 };

static inline vec load_f32(const float *p) { vec x; memcpy(&x, p, sizeof x); return x; }
static inline void store_f32(float *p, vec x) { memcpy(p, &x, sizeof x); }

/* Rounding: the kernels are compiled with -ffp-contract=off (native_build.FLAGS), so no product and sum is fused
 * unless written so, here. A compiler left to fuse them decides per loop and per tuning (gcc's znver tunings leave
 * 256-bit multiply-add chains unfused, and so one loop of a kernel and not another), which would make a row's result
 * depend on which of a kernel's loops computed it. */

/* acc + x * w, lane by lane, rounded once (a fused multiply-add) */
static inline vec fmadd(vec x, vec w, vec acc) {
#ifdef __AVX512F__
    return (vec)_mm512_fmadd_ps((__m512)x, (__m512)w, (__m512)acc);
#else
    return (vec)_mm256_fmadd_ps((__m256)x, (__m256)w, (__m256)acc);
#endif
}

/* x in every lane */
static inline vec splat(float x) {
#ifdef __AVX512F__
    return (vec)_mm512_set1_ps(x);
#else
    return (vec)_mm256_set1_ps(x);
#endif
}

/* LANES bf16 elements widened to fp32 (one zero-extending load and a shift) */
static inline vec load_bf16(const uint16_t *p) {
#ifdef __AVX512F__
    return (vec)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
#else
    return (vec)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
#endif
}

/* LANES fp16 elements widened to fp32 */
static inline vec load_f16(const uint16_t *p) {
#ifdef __AVX512F__
    return (vec)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
#else
    return (vec)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#endif
}

#ifdef __AVX512BF16__
/* 32 bf16 elements as they are, for vdpbf16ps */
static inline vec load_pairs(const uint16_t *p) { vec x; memcpy(&x, p, sizeof x); return x; }

/* 32 fp32 values holding bf16 values, packed to bf16 (exactly) */
static inline vec pack_pairs(const float *p) {
    return (vec)_mm512_cvtne2ps_pbh((__m512)load_f32(p + LANES), (__m512)load_f32(p));
}

/* sum + the products of 32 pairs of bf16, each lane adding its two products to it in turn, in fp32 (vdpbf16ps:
 * inputs and results below fp32's normal range taken as 0) */
static inline vec dot_pairs(vec sum, vec x, vec w) {
    return (vec)_mm512_dpbf16_ps((__m512)sum, (__m512bh)x, (__m512bh)w);
}
#endif

static inline float widen_bf16(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float x;
    memcpy(&x, &bits, sizeof x);
    return x;
}

static inline float widen_f16(uint16_t h) { return _cvtsh_ss(h); }

/* fp32 to bf16, round to nearest even (a NaN stays a quiet NaN) */
static inline uint16_t narrow_bf16(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40);
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

static inline uint16_t narrow_f16(float x) { return _cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT); }

#endif
