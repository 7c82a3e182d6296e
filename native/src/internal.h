/* What the native kernels' source files share: target attributes, the weight blocks read in
 * place (Q8_0, Q4_0) and the recipe their products follow, the activations' layouts, small
 * helpers, and the functions one file calls in another. Not a public header (the contracts are
 * in hsnative.h).
 *
 * The files, one concern each (native/README.md has the table):
 *   cpu.c            which kernel levels this CPU runs, and the level a call gets
 *   weights.c        weight rows as floats (embeddings, hs_dequantize_rows); Q8_0 packing
 *   activations.c    a matrix's input rows quantized, into the two layouts below
 *   matmul.c         a matrix product: its work items, each item's kernel (hs_matmul)
 *   kernels_*.c      the Q8_0 / Q4_0 (and F32 / F16) products, a file per kernel level, with
 *                    kernels_x86.h and vnni256.h for what the x86 levels share
 *   unpacked*.c      the types unpacked to bytes first (K-quants, Q5_0, Q5_1, Q4_1, IQ4_*):
 *                    formats and portable C, then a file per level (unpacked.h, unpacked_x86.h)
 *   attention.c      attention over the half-precision KV cache
 *   forward.c        the forward (hs_forward) and its per-row float steps
 *   sequences.c      several sequences' rows in one forward (hs_forward_sequences): their
 *                    layout in the cache, checked, as the forward's per-row arrays
 *   sampling.c       choosing tokens from logits (hs_argmax), and the draft loops that do
 *
 * Build with -ffp-contract=off (setup.py): a fused multiply-add that the compiler forms in one
 * specialization of a kernel and not in another would break width invariance. Kernel levels
 * are chosen at run time (cpu.c), each function compiled for its level by a target attribute
 * below, never by -march. What must inline into a kernel sits in its file or in a header
 * (INLINE); the files meet only at calls made once a call, work item, row or layer (most were
 * calls before the sources were split too: a function of one target level never inlines into
 * another's), so the split costs no speed.
 *
 * The functions declared here for other files are HS_INTERNAL: hidden, so called directly (as
 * the static functions they were) and not exported from the library. */
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
#define HS_INTERNAL __attribute__((visibility("hidden")))
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

/* ------------------------------------------------------------------ weights read in place
 * Q8_0 and Q4_0 blocks, as GGUF stores them; the kernels read them where the file is mapped. */

typedef struct {
    uint16_t d;
    int8_t qs[HS_BLOCK];
} block_q8_0;

typedef struct {
    uint16_t d;
    uint8_t qs[HS_BLOCK / 2]; /* element i in the low nibble of qs[i], i + 16 in the high */
} block_q4_0;

_Static_assert(sizeof(block_q8_0) == 34, "GGUF Q8_0 blocks are 34 bytes");
_Static_assert(sizeof(block_q4_0) == 18, "GGUF Q4_0 blocks are 18 bytes");

/* Block b's scale (IEEE half) of a Q8_0 or Q4_0 weight row. */
INLINE uint16_t weight_scale_of(const void *wrow, int type, int b) {
    return type == HS_Q8_0 ? ((const block_q8_0 *)wrow)[b].d : ((const block_q4_0 *)wrow)[b].d;
}

/* The recipe every quantized kernel follows for one (row, output feature), so that a row's
 * result never depends on which kernel computed it, how many rows shared the call, or which
 * thread ran it: for each block b in order,
 *     acc = fma((float)dot_b, x_scale_b * w_scale_b, acc)
 * where dot_b is the exact integer dot product of the block (at most 32 * 127 * 127 in
 * magnitude, so its conversion to float is exact). */

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

/* ------------------------------------------------------------------ small helpers */

#if HS_X86
/* Four bytes at p in every int32 lane, by a broadcast load (no shuffle). */
HS_AVX2 INLINE __m256i broadcast4(const void *p) {
    return _mm256_castps_si256(_mm256_broadcast_ss((const float *)p));
}

/* The sum of 8 lanes, in a fixed order (attention.c's hsum8_each adds in the same one). */
HS_AVX2 INLINE float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* e^x for x <= 0, 8 lanes: 2^n times a degree-6 polynomial of the remainder (relative error
 * about 2e-7); the same lanes give the same results whatever else is in the vector. */
HS_AVX2 INLINE __m256 exp_nonpositive(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i exponent = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(exponent));
}
#endif

/* cap * tanh(x / cap) over n values in place (cap <= 0: none) */
static inline void soft_cap(float *x, int n, float cap) {
    if (cap > 0.0f)
        for (int k = 0; k < n; k++) x[k] = cap * tanhf(x[k] / cap);
}

/* ------------------------------------------------------------------ across files */

/* cpu.c: the kernels a call runs: the best this CPU has, at most `cap` where cap >= 0. */
HS_INTERNAL int hs_simd_for(int cap);

/* weights.c: row `token` of e as floats, as ggml dequantizes it (an embedding). */
HS_INTERNAL void hs_embed_row(const hs_matrix *e, int token, float *out);

/* activations.c: row i (of n rows of width cols), x, into both of a's layouts, with the
 * block sums where a->with_sums. */
HS_INTERNAL void hs_quantize_activation(const activations *a, const float *x, int i, int n,
                                        int cols, int simd);

/* matmul.c: out (n, w->rows) = xf times w's transpose, a's rows (xf quantized) for quantized
 * weights, split into work items across the threads of the caller's parallel region (or run
 * alone outside one); `wait`: a barrier at the end. */
HS_INTERNAL void hs_matmul_items(const hs_matrix *w, const activations *a, const float *xf,
                                 int n, float *out, int simd, int wait);

/* The kernels of one work item, a file per level (kernels_*.c): output features [first, end)
 * of all n rows into out (n, w->rows); quantized types read a, F32 / F16 read xf. */
HS_INTERNAL void hs_features_portable(const hs_matrix *w, const activations *a, const float *xf,
                                      int n, int first, int end, float *out);
#if HS_X86
HS_AVX2 HS_INTERNAL void hs_quantized_features_avx2(const hs_matrix *w, const activations *a,
                                                    int n, int first, int end, float *out);
HS_AVX2 HS_INTERNAL void hs_float_features_avx2(const hs_matrix *w, const float *xf, int n,
                                                int first, int end, float *out);
HS_AVX_VNNI HS_INTERNAL void hs_quantized_features_avx_vnni(const hs_matrix *w,
                                                            const activations *a, int n,
                                                            int first, int end, float *out);
HS_VNNI HS_INTERNAL void hs_quantized_features_vnni(const hs_matrix *w, const activations *a,
                                                    int n, int first, int end, float *out);
#endif
#if HS_ARM
HS_DOTPROD HS_INTERNAL void hs_quantized_features_neon(const hs_matrix *w, const activations *a,
                                                       int n, int first, int end, float *out);
#endif

/* Where the n rows of a forward sit in the cache (sequences.c lays them out from
 * hs_forward_sequences' arguments): row i's key and value go to slot[i]; it sees its
 * sequence's committed prefix, slots prefix_start[i]..prefix_start[i]+prefix_len[i]-1, then
 * visible[offsets[i]..offsets[i+1]); a sequence's rows are consecutive and share its prefix.
 * Attention takes rows in sets (rows sets[k]..sets[k+1]-1, n_sets of them: one sequence's,
 * hs_attention_sets). Logits are computed for rows logit_rows[0..outputs), in that order. */
typedef struct {
    int n;
    const int32_t *tokens, *positions, *offsets, *visible;
    const int32_t *slot, *prefix_start, *prefix_len;
    const int32_t *sets;
    int n_sets;
    const int32_t *logit_rows;
    int outputs;
} hs_rows;

/* forward.c: the forward of rows laid out and checked (sequences.c), logits (rows->outputs,
 * vocab); 0, or -1 for a model the kernels cannot run or no memory. */
HS_INTERNAL int hs_forward_rows(const hs_model *m, const hs_rows *rows, float *logits,
                                int threads);

/* attention.c: the scores one thread's attention needs (floats), and layer `layer`'s attention
 * for a forward's rows: queries (n, n_heads * head_dim) into attended (the same shape). A
 * worksharing loop, run by every thread of the caller's team or by the caller alone; scores:
 * the calling thread's. */
HS_INTERNAL size_t hs_attention_scratch(const hs_model *m);
HS_INTERNAL void hs_attention(const hs_model *m, int layer, const hs_rows *rows,
                              const float *queries, float *attended, float *scores, int simd);
/* attention.c: the row sets of n rows (prefix_start, prefix_len: each row's) into sets (room
 * for n + 1): runs of rows sharing a prefix, at most as many as one attention call takes;
 * returns how many. */
HS_INTERNAL int hs_attention_sets(int n, const int32_t *prefix_start, const int32_t *prefix_len,
                                  int32_t *sets);
#if HS_X86
/* attention.c: scores -> exp(score - the largest) in place, returning their sum (its softmax,
 * which sampling.c's probabilities use too) */
HS_AVX2 HS_INTERNAL float hs_softmax_weights_avx2(float *row, int n);
/* forward.c: soft_cap over n values, 8 lanes at a time (attention's scores, the logits) */
HS_AVX2 HS_INTERNAL void hs_soft_cap_avx2(float *x, int n, float cap);
#endif

/* Weights unpacked to bytes before their products (unpacked*.c): Q4_K, Q5_K, Q6_K, Q5_0, Q4_1,
 * Q5_1, IQ4_NL, IQ4_XS. (These few are exported, as they were before the split: hidden, the
 * kernels would call hs_unpacked_row_bytes directly, or inline it; a change of its own.) */
int hs_unpacked_is(int type);
/* Q4_K, Q5_K, Q4_1 and Q5_1: a min per block, whose term needs the activations' block sums. */
static inline int hs_unpacked_has_mins(int type) {
    return type == HS_Q4_K || type == HS_Q5_K || type == HS_Q4_1 || type == HS_Q5_1;
}
/* Q4_K, Q5_K, Q6_K and IQ4_XS: integer scales within 256-value super-blocks, so their
 * activations are quantized per super-block (span HS_SUPER) and a chunk's products add up as
 * integers (unpacked.h's recipe). */
static inline int hs_unpacked_super(int type) {
    return type == HS_Q4_K || type == HS_Q5_K || type == HS_Q6_K || type == HS_IQ4_XS;
}
size_t hs_unpacked_row_bytes(int type, int cols); /* 0: another type, or not whole blocks */
void hs_unpacked_dequantize_row(int type, const void *row, int cols, float *out);
/* Output features [first, end) of all n rows (quantized, block sums where needed) into
 * out (n, w->rows), with kernels of level simd at most. */
void hs_unpacked_features(const hs_matrix *w, const activations *a, int n, int first, int end,
                    float *out, int simd);

/* ------------------------------------------------------------------ a matrix's rows */

static inline int is_quantized(int type) { return type == HS_Q8_0 || type == HS_Q4_0 || hs_unpacked_is(type); }

static inline size_t row_bytes(const hs_matrix *w) {
    switch (w->type) {
    case HS_F32: return (size_t)w->cols * 4;
    case HS_F16: return (size_t)w->cols * 2;
    case HS_Q8_0: return (size_t)(w->cols / HS_BLOCK) * sizeof(block_q8_0);
    case HS_Q4_0: return (size_t)(w->cols / HS_BLOCK) * sizeof(block_q4_0);
    default: return hs_unpacked_row_bytes(w->type, w->cols);
    }
}

#endif
