/* What the native kernels' source files share: target attributes, the activations' layouts
 * and small helpers. Not a public header (the contracts are in hsnative.h). */
#ifndef HS_INTERNAL_H
#define HS_INTERNAL_H

#include "hsnative.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#include <immintrin.h>
#define HS_X86 1
#define HS_AVX2 __attribute__((target("avx2,fma,f16c")))
/* vpdpbusd on 256-bit vectors (AVX-512 VNNI with VL): the AVX2 kernels plus one instruction */
#define HS_VNNI __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")))
/* vpdpbusd's VEX form on 256-bit vectors, without AVX-512 (AVX-VNNI) */
#define HS_AVX_VNNI __attribute__((target("avx2,fma,f16c,avxvnni")))
#else
#define HS_X86 0
#endif

#if defined(__aarch64__)
#include <arm_neon.h>
#include <sys/auxv.h>
#define HS_ARM 1
/* sdot (ARMv8.2's dot product, optional there and standard from v8.4): four int8 products
 * summed into each int32 lane */
#define HS_DOTPROD __attribute__((target("arch=armv8.2-a+dotprod")))
#ifndef HWCAP_ASIMDDP
#define HWCAP_ASIMDDP (1 << 20)
#endif
#else
#define HS_ARM 0
#endif

#ifdef _OPENMP
#include <omp.h>
#endif

#define INLINE __attribute__((always_inline)) static inline
#define GROUP 8       /* rows of one interleaved activation group: the 8 int32 lanes of AVX2 */
#define PAD_FROM 5     /* leftover rows from which a padded group is cheaper than them alone */
/* rows a pass of a 16-features-in-lanes kernel takes at most: each pass reads (and transposes)
 * the weights again, and passes of more rows than this measured no faster */
#define FEATURES16_PASS 32

/* Rows of pass p of `passes` over n rows, `done` of them in the passes before: passes of
 * equal size (33 rows: 17, 16). */
static inline int pass_rows(int n, int done, int p, int passes) {
    return (n - done + passes - p - 1) / (passes - p);
}

/* Rows computed rows-in-lanes: whole groups of 8, and the leftover rows too (in a group
 * padded with zero rows) where there are PAD_FROM or more of them: one pass of 8 rows costs
 * about what 4 rows cost features-in-lanes. Both kernels give the same bits. */
static inline int grouped_rows(int n) {
    const int leftover = n % GROUP;
    return leftover >= PAD_FROM ? n + GROUP - leftover : n - leftover;
}

static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    const uint32_t exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
    uint32_t bits;
    if (exponent == 0) {
        const float magnitude = ldexpf((float)mantissa, -24); /* zero or subnormal */
        return sign ? -magnitude : magnitude;
    }
    if (exponent == 31)
        bits = sign | 0x7f800000u | (mantissa << 13);
    else
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* ------------------------------------------------------------------ quantized activations
 * A matrix's input rows are quantized once, into two layouts: row-major, for the kernels
 * that put output features in vector lanes, and, for every whole group of GROUP rows,
 * interleaved so that one 32-byte load holds the same four input values of all GROUP rows
 * (the kernel that puts rows in lanes). Values share a scale over a span: a block of 32, or
 * for the super-block weights (hs_unpacked_super) a super-block of 256, whose blocks then
 * all hold its one scale (the layouts stay per block). */

typedef struct {
    int8_t *q;        /* (n, cols) */
    float *d;         /* (n, cols / 32) block scales */
    int8_t *grouped;  /* per group, per block: 8 runs of 32 bytes; run k holds values
                       * 4k..4k+3 of the block for rows 0..7 of the group */
    float *grouped_d; /* per group, per block: the group's 8 block scales */
    /* block sums of the int8 values, where with_sums (the VNNI kernels and the types with mins
     * need them): */
    int32_t *sum;              /* (n, cols / 32) */
    int32_t *half_sum;         /* (n, cols / 32): the sums of each block's first 16 values (Q6_K) */
    int32_t *grouped_sum;      /* per group, per block: the group's 8 sums */
    int32_t *grouped_half_sum; /* ... and the 8 sums of the block's first 16 values (Q6_K) */
    int with_sums;
    int span; /* values sharing one scale: HS_BLOCK or HS_SUPER */
} activations;

#if HS_X86
/* Four bytes at p in every int32 lane, by a broadcast load (no shuffle). */
HS_AVX2 INLINE __m256i broadcast4(const void *p) {
    return _mm256_castps_si256(_mm256_broadcast_ss((const float *)p));
}
#endif

/* Weights unpacked to bytes before their products (unpacked.c): Q4_K, Q5_K, Q6_K, Q5_0, Q4_1,
 * Q5_1, IQ4_NL, IQ4_XS. */
int hs_unpacked_is(int type);
/* Q4_K, Q5_K, Q4_1 and Q5_1: a min per block, whose term needs the activations' block sums. */
static inline int hs_unpacked_has_mins(int type) {
    return type == HS_Q4_K || type == HS_Q5_K || type == HS_Q4_1 || type == HS_Q5_1;
}
/* Q4_K, Q5_K, Q6_K and IQ4_XS: integer scales within 256-value super-blocks, so their
 * activations are quantized per super-block (span HS_SUPER) and a chunk's products add up as
 * integers (unpacked.c's recipe). */
static inline int hs_unpacked_super(int type) {
    return type == HS_Q4_K || type == HS_Q5_K || type == HS_Q6_K || type == HS_IQ4_XS;
}
size_t hs_unpacked_row_bytes(int type, int cols); /* 0: another type, or not whole blocks */
void hs_unpacked_dequantize_row(int type, const void *row, int cols, float *out);
/* Output features [first, end) of all n rows (quantized, block sums where needed) into
 * out (n, w->rows), with kernels of level simd at most. */
void hs_unpacked_features(const hs_matrix *w, const activations *a, int n, int first, int end,
                    float *out, int simd);

#endif
