/* What the kernels of weights read by unpacking them to bytes first share (unpacked.c and the
 * levels' unpacked_avx2.c, unpacked_vnni.c, unpacked_avx_vnni.c, unpacked_neon.c): the
 * formats, a chunk unpacked, and the recipes below. The types: ggml's K-quants (Q4_K, Q5_K,
 * Q6_K: what most users' GGUF files hold, e.g. Q4_K_M's mix of Q4_K and Q6_K), Q5_0 and Q5_1
 * (the types llama.cpp's Q4_K_M and Q5_K_M mixes fall back to for rows that are not whole
 * super-blocks), Q4_1, and the non-linear IQ4_XS and IQ4_NL (4-bit indices into a table of 16
 * int8 values).
 *
 * A row is read in chunks of 8 activation blocks (256 values: a K-quant super-block, or 8
 * blocks of the 32-value types; such a row's last chunk may hold fewer). Each chunk is
 * unpacked once, for all the rows a call multiplies: its values q as bytes, and its factors:
 * for the super-block types (Q4_K, Q5_K, Q6_K, IQ4_XS) the integer scales (Q6_K's a
 * half-block of 16) and mins, d and -dmin; for the 32-value types per block a float factor d_b
 * and (Q4_1, Q5_1) a float offset m_b, so that weight k of block b is d_b * q_k + m_b (their
 * blocks' d and m; dequantization writes every type this way, as ggml does). The weights are
 * read once, in place.
 *
 * The recipes every kernel here follows for one (row, output feature) and one chunk, with
 * activation block b's int8 values x and the integer sum of x, sum_b(x):
 *
 * Q4_K, Q5_K, Q6_K and IQ4_XS (hs_unpacked_super): integer scales within a super-block, whose
 * activations share one float scale x_scale (quantized per 256), so the chunk's products add
 * up as integers and one float step a chunk remains:
 *     I = sum over b of scale_b * sum(q x)       (Q6_K: over half-blocks h, scale_h * sum(q x))
 *     M = sum over b of min_b * sum_b(x)         (Q4_K, Q5_K)
 *     v = (float)I * (x_scale * d)
 *     v = fma((float)M, x_scale * -dmin, v)      (Q4_K, Q5_K)
 *     acc = acc + v
 * with scale_b Q4_K's and Q5_K's 6-bit scales, IQ4_XS's scale - 32, Q6_K's signed 8-bit
 * half-block scales, and d, dmin the super-block's. I and M are exact integers (|I| < 2^28,
 * M < 2^21) whatever order a kernel adds them in, so their floats are the same everywhere.
 *
 * Q5_0, Q4_1, Q5_1, IQ4_NL (blocks of 32, a float scale each; activations quantized per 32
 * with block scale x_scale_b):
 *     P_b = sum(q x)
 *     v_b = (float)P_b * (x_scale_b * d_b)
 *     v_b = fma((float)sum_b(x), x_scale_b * m_b, v_b)              (Q4_1, Q5_1)
 *     acc = acc + (((v_0 + v_1) + (v_2 + v_3)) + ((v_4 + v_5) + (v_6 + v_7)))
 * with v_b = 0 for the blocks a short chunk lacks. P_b is exact (|P_b| < 2^24), and a chunk's
 * blocks add up as a tree, so one row's chunk is a few vector steps (no chain of dependent
 * multiply-adds). Every kernel level gives the same bits, for a row alone or among others. */
#ifndef HS_UNPACKED_H
#define HS_UNPACKED_H

#include "internal.h"

#define SUB (HS_SUPER / HS_BLOCK) /* activation blocks in a chunk */

typedef struct {
    uint16_t d, dmin;
    uint8_t scales[12]; /* 8 scales and 8 mins of 6 bits */
    uint8_t qs[HS_SUPER / 2];
} block_q4_k;

typedef struct {
    uint16_t d, dmin;
    uint8_t scales[12];
    uint8_t qh[HS_SUPER / 8]; /* the fifth bits */
    uint8_t qs[HS_SUPER / 2];
} block_q5_k;

typedef struct {
    uint8_t ql[HS_SUPER / 2]; /* low 4 bits */
    uint8_t qh[HS_SUPER / 4]; /* high 2 bits */
    int8_t scales[HS_SUPER / 16];
    uint16_t d;
} block_q6_k;

typedef struct {
    uint16_t d;
    uint8_t qh[4];            /* bit i: value i's fifth bit */
    uint8_t qs[HS_BLOCK / 2]; /* value i in the low nibble of qs[i], i + 16 in the high */
} block_q5_0;

typedef struct {
    uint16_t d, m;
    uint8_t qs[HS_BLOCK / 2]; /* value i in the low nibble of qs[i], i + 16 in the high */
} block_q4_1;

typedef struct {
    uint16_t d, m;
    uint8_t qh[4]; /* bit i: value i's fifth bit */
    uint8_t qs[HS_BLOCK / 2];
} block_q5_1;

typedef struct {
    uint16_t d;
    uint8_t qs[HS_BLOCK / 2]; /* table indices: value i in the low nibble of qs[i], i + 16 high */
} block_iq4_nl;

typedef struct {
    uint16_t d;
    uint16_t scales_h;       /* block b's scale: 2 high bits at 2b */
    uint8_t scales_l[4];     /* 4 low bits: block b's in byte b / 2, at 4 (b % 2) */
    uint8_t qs[HS_SUPER / 2]; /* 16 bytes a block of 32, as IQ4_NL's */
} block_iq4_xs;

/* IQ4_NL's and IQ4_XS's 16 values (ggml's kvalues_iq4nl) */
static const int8_t IQ4_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

_Static_assert(sizeof(block_q4_k) == 144, "GGUF Q4_K super-blocks are 144 bytes");
_Static_assert(sizeof(block_q5_k) == 176, "GGUF Q5_K super-blocks are 176 bytes");
_Static_assert(sizeof(block_q6_k) == 210, "GGUF Q6_K super-blocks are 210 bytes");
_Static_assert(sizeof(block_q5_0) == 22, "GGUF Q5_0 blocks are 22 bytes");
_Static_assert(sizeof(block_q4_1) == 20, "GGUF Q4_1 blocks are 20 bytes");
_Static_assert(sizeof(block_q5_1) == 24, "GGUF Q5_1 blocks are 24 bytes");
_Static_assert(sizeof(block_iq4_nl) == 18, "GGUF IQ4_NL blocks are 18 bytes");
_Static_assert(sizeof(block_iq4_xs) == 136, "GGUF IQ4_XS super-blocks are 136 bytes");

/* One chunk, unpacked. */
typedef struct {
    int8_t q[HS_SUPER] __attribute__((aligned(32))); /* Q4_K, Q4_1 0..15, Q5_K, Q5_1 0..31,
                                                      * Q6_K -32..31, Q5_0 -16..15, IQ4 -127..113 */
    float d[SUB] __attribute__((aligned(32)));      /* d_b; a short chunk's missing blocks: 0 */
    float offset[SUB] __attribute__((aligned(32))); /* m_b (with mins; else 0) */
    int16_t scale[2 * SUB] __attribute__((aligned(32))); /* Q6_K: per half-block of 16 */
    /* the super-block types' integer scale a block (Q4_K, Q5_K 0..63; IQ4_XS -32..31) and
     * min (Q4_K, Q5_K), and their float d and -dmin */
    int32_t iscale[SUB] __attribute__((aligned(32)));
    int32_t imin[SUB] __attribute__((aligned(32)));
    float sd, smin;
    int blocks; /* activation blocks in this chunk: SUB, or fewer at a 32-value type's row end */
} unpacked;

/* Q5_0, Q4_1, Q5_1, IQ4_NL: blocks of 32 values (the K-quants' and IQ4_XS's: 256). */
INLINE int small_blocks(int type) {
    return type == HS_Q5_0 || type == HS_Q4_1 || type == HS_Q5_1 || type == HS_IQ4_NL;
}

/* IQ4_NL, IQ4_XS: table values (signed, up to 127 in size) */
INLINE int iq4(int type) { return type == HS_IQ4_NL || type == HS_IQ4_XS; }

/* Q4_K, Q5_K, Q4_1, Q5_1: values unsigned, with mins; Q6_K, Q5_0, IQ4_*: values signed, no
 * mins. */
INLINE int has_mins(int type) { return hs_unpacked_has_mins(type); }

/* The VNNI kernels' bias that makes a type's signed values vpdpbusd's unsigned side, as a
 * shift (1 << shift): Q6_K -32..31 + 32, Q5_0 -16..15 + 16, IQ4 -127..113 + 128; 0: unsigned
 * already. */
INLINE int unsigned_shift(int type) { return type == HS_Q6_K ? 5 : type == HS_Q5_0 ? 4 : iq4(type) ? 7 : 0; }

/* A storage block's bytes. */
static inline size_t block_bytes(int type) {
    switch (type) {
    case HS_Q4_K: return sizeof(block_q4_k);
    case HS_Q5_K: return sizeof(block_q5_k);
    case HS_Q6_K: return sizeof(block_q6_k);
    case HS_Q5_0: return sizeof(block_q5_0);
    case HS_Q4_1: return sizeof(block_q4_1);
    case HS_Q5_1: return sizeof(block_q5_1);
    case HS_IQ4_NL: return sizeof(block_iq4_nl);
    case HS_IQ4_XS: return sizeof(block_iq4_xs);
    default: return 0;
    }
}

/* Block b's 16 bytes of 4-bit values (value j in the low nibble of byte j, j + 16 in the high),
 * in a chunk of a 32-value type or of IQ4_XS. */
INLINE const uint8_t *nibbles(const char *chunk, int type, int b) {
    switch (type) {
    case HS_IQ4_XS: return ((const block_iq4_xs *)chunk)->qs + 16 * b;
    case HS_IQ4_NL: return ((const block_iq4_nl *)chunk)[b].qs;
    case HS_Q5_0: return ((const block_q5_0 *)chunk)[b].qs;
    case HS_Q5_1: return ((const block_q5_1 *)chunk)[b].qs;
    default: return ((const block_q4_1 *)chunk)[b].qs;
    }
}

/* Block b's fifth bits (bit j: value j's) in a Q5_0 or Q5_1 chunk; 0 for the 4-bit types. */
INLINE uint32_t fifth_bits(const char *chunk, int type, int b) {
    const uint8_t *qh = type == HS_Q5_0 ? ((const block_q5_0 *)chunk)[b].qh
                        : type == HS_Q5_1 ? ((const block_q5_1 *)chunk)[b].qh : NULL;
    return qh ? (uint32_t)qh[0] | (uint32_t)qh[1] << 8 | (uint32_t)qh[2] << 16 | (uint32_t)qh[3] << 24 : 0;
}

/* Bytes a chunk of a row takes (a short last chunk: fewer). */
INLINE size_t chunk_bytes(int type) { return small_blocks(type) ? SUB * block_bytes(type) : block_bytes(type); }

/* Chunk c of a row: its first byte. */
INLINE const char *chunk_at(const char *wrow, int type, int c) { return wrow + (size_t)c * chunk_bytes(type); }

/* Activation blocks in chunk c of a row of `blocks`: SUB, or fewer in a 32-value type's last. */
INLINE int chunk_blocks(int blocks, int c) { return blocks - c * SUB < SUB ? blocks - c * SUB : SUB; }

/* Scale and min j (0..7) of Q4_K's and Q5_K's 12 packed bytes: 6 bits each, the first four
 * in the low bits of bytes 0..7, the last four split across bytes 8..11 and the top bits. */
INLINE void scale_min(const uint8_t *s, int j, int *scale, int *min) {
    if (j < 4) {
        *scale = s[j] & 63;
        *min = s[j + 4] & 63;
    } else {
        *scale = (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4);
        *min = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* IQ4_XS's 6-bit scale of block b (0..63; the factor is scale - 32). */
INLINE int iq4_xs_scale(const block_iq4_xs *blk, int b) {
    return ((blk->scales_l[b / 2] >> (4 * (b % 2))) & 0x0f) | ((blk->scales_h >> (2 * b)) & 3) << 4;
}

/* Everything but the values (unpack_portable's, and unpack_neon's). */
static inline void unpack_factors_portable(const char *chunk, int type, unpacked *u) {
    for (int b = 0; b < SUB; b++) {
        u->d[b] = u->offset[b] = 0.0f;
        u->iscale[b] = u->imin[b] = 0;
    }
    u->sd = u->smin = 0.0f;
    if (type == HS_Q6_K) {
        const block_q6_k *blk = (const block_q6_k *)chunk;
        for (int h = 0; h < 2 * SUB; h++) u->scale[h] = blk->scales[h];
        for (int b = 0; b < SUB; b++) u->d[b] = half_to_float(blk->d);
        u->sd = half_to_float(blk->d);
    } else if (type == HS_Q5_0 || type == HS_IQ4_NL) { /* d first in each block */
        for (int b = 0; b < u->blocks; b++)
            u->d[b] = half_to_float(*(const uint16_t *)(chunk + (size_t)b * block_bytes(type)));
    } else if (type == HS_IQ4_XS) {
        const block_iq4_xs *blk = (const block_iq4_xs *)chunk;
        for (int b = 0; b < SUB; b++) {
            u->iscale[b] = iq4_xs_scale(blk, b) - 32;
            u->d[b] = half_to_float(blk->d) * (float)u->iscale[b];
        }
        u->sd = half_to_float(blk->d);
    } else if (small_blocks(type)) { /* Q5_1 begins as Q4_1 does */
        for (int b = 0; b < u->blocks; b++) {
            const block_q4_1 *blk = (const block_q4_1 *)(chunk + (size_t)b * block_bytes(type));
            u->d[b] = half_to_float(blk->d);
            u->offset[b] = half_to_float(blk->m);
        }
    } else { /* Q5_K begins as Q4_K does */
        const block_q4_k *blk = (const block_q4_k *)chunk;
        const float d = half_to_float(blk->d), dmin = half_to_float(blk->dmin);
        for (int b = 0; b < SUB; b++) {
            int scale, min;
            scale_min(blk->scales, b, &scale, &min);
            u->iscale[b] = scale;
            u->imin[b] = min;
            u->d[b] = d * (float)scale;
            u->offset[b] = -(dmin * (float)min);
        }
        u->sd = d;
        u->smin = -dmin;
    }
}

/* The tree a chunk's 8 terms add up in. */
INLINE float chunk_sum(const float v[SUB]) {
    return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
}

/* The super-block recipe's float step: a chunk's integers I and M for one row whose
 * activations have scale x_scale. */
INLINE float super_term(const int type, const int32_t products, const int32_t mins, const float x_scale,
                        const unpacked *u) {
    const float v = (float)products * (x_scale * u->sd);
    return has_mins(type) ? fmaf((float)mins, x_scale * u->smin, v) : v;
}

/* Output features [first, end) of all n rows, at each level (hs_unpacked_features' choice). */
#if HS_X86
HS_AVX2 HS_INTERNAL void hs_unpacked_features_avx2(const hs_matrix *w, const activations *a, int n,
                                                   int first, int end, float *out);
HS_AVX_VNNI HS_INTERNAL void hs_unpacked_features_avx_vnni(const hs_matrix *w, const activations *a,
                                                           int n, int first, int end, float *out);
HS_VNNI HS_INTERNAL void hs_unpacked_features_vnni(const hs_matrix *w, const activations *a, int n,
                                                   int first, int end, float *out);
#endif
#if HS_ARM
HS_DOTPROD HS_INTERNAL void hs_unpacked_features_neon(const hs_matrix *w, const activations *a,
                                                      int n, int first, int end, float *out);
#endif

#endif
