/* Weights read by unpacking them to bytes first: ggml's K-quants (Q4_K, Q5_K, Q6_K: what most
 * users' GGUF files hold, e.g. Q4_K_M's mix of Q4_K and Q6_K), Q5_0 and Q5_1 (the types
 * llama.cpp's Q4_K_M and Q5_K_M mixes fall back to for rows that are not whole super-blocks),
 * Q4_1, and the non-linear IQ4_XS and IQ4_NL (4-bit indices into a table of 16 int8 values).
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
#include "internal.h"
#include "transposes.h"

#include <limits.h>

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

int hs_unpacked_is(int type) { return hs_unpacked_super(type) || small_blocks(type); }

/* Q4_K, Q5_K, Q4_1, Q5_1: values unsigned, with mins; Q6_K, Q5_0, IQ4_*: values signed, no
 * mins. */
INLINE int has_mins(int type) { return hs_unpacked_has_mins(type); }

/* The VNNI kernels' bias that makes a type's signed values vpdpbusd's unsigned side, as a
 * shift (1 << shift): Q6_K -32..31 + 32, Q5_0 -16..15 + 16, IQ4 -127..113 + 128; 0: unsigned
 * already. */
INLINE int unsigned_shift(int type) { return type == HS_Q6_K ? 5 : type == HS_Q5_0 ? 4 : iq4(type) ? 7 : 0; }

/* Values a storage block holds, and its bytes. */
static int block_values(int type) { return small_blocks(type) ? HS_BLOCK : HS_SUPER; }

static size_t block_bytes(int type) {
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

size_t hs_unpacked_row_bytes(int type, int cols) {
    const int values = block_values(type);
    return cols > 0 && cols % values == 0 ? (size_t)(cols / values) * block_bytes(type) : 0;
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

/* Everything but the values. */
static void unpack_factors_portable(const char *chunk, int type, unpacked *u) {
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

static void unpack_portable(const char *chunk, int type, int blocks, unpacked *u) {
    u->blocks = blocks;
    unpack_factors_portable(chunk, type, u);
    if (type == HS_Q6_K) {
        const block_q6_k *blk = (const block_q6_k *)chunk;
        for (int half = 0; half < 2; half++) {
            const uint8_t *ql = blk->ql + 64 * half, *qh = blk->qh + 32 * half;
            int8_t *q = u->q + 128 * half;
            for (int l = 0; l < 32; l++) {
                q[l] = (int8_t)(((ql[l] & 0x0f) | ((qh[l] & 3) << 4)) - 32);
                q[l + 32] = (int8_t)(((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) - 32);
                q[l + 64] = (int8_t)(((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
                q[l + 96] = (int8_t)(((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
            }
        }
    } else if (small_blocks(type) || type == HS_IQ4_XS) {
        const int offset = type == HS_Q5_0 ? 16 : 0; /* Q5_0's values are signed */
        for (int b = 0; b < blocks; b++) {
            const uint8_t *qs = nibbles(chunk, type, b);
            const uint32_t qh = fifth_bits(chunk, type, b);
            for (int j = 0; j < HS_BLOCK / 2; j++) {
                const int lo = (qs[j] & 0x0f) | ((qh >> j) & 1) << 4, hi = (qs[j] >> 4) | ((qh >> (j + 16)) & 1) << 4;
                u->q[32 * b + j] = iq4(type) ? IQ4_VALUES[lo] : (int8_t)(lo - offset);
                u->q[32 * b + j + 16] = iq4(type) ? IQ4_VALUES[hi] : (int8_t)(hi - offset);
            }
        }
    } else { /* Q4_K, Q5_K: each 32 bytes of qs hold 64 values, the first 32 in the low nibbles */
        const uint8_t *qs = type == HS_Q4_K ? ((const block_q4_k *)chunk)->qs : ((const block_q5_k *)chunk)->qs;
        const uint8_t *qh = type == HS_Q5_K ? ((const block_q5_k *)chunk)->qh : NULL;
        for (int c = 0; c < 4; c++)
            for (int l = 0; l < 32; l++) {
                const int high_lo = qh ? ((qh[l] >> (2 * c)) & 1) << 4 : 0;
                const int high_hi = qh ? ((qh[l] >> (2 * c + 1)) & 1) << 4 : 0;
                u->q[64 * c + l] = (int8_t)((qs[32 * c + l] & 0x0f) | high_lo);
                u->q[64 * c + 32 + l] = (int8_t)((qs[32 * c + l] >> 4) | high_hi);
            }
    }
}

void hs_unpacked_dequantize_row(int type, const void *row, int cols, float *out) {
    unpacked u;
    for (int c = 0; c * HS_SUPER < cols; c++) {
        const int blocks = chunk_blocks(cols / HS_BLOCK, c);
        unpack_portable(chunk_at(row, type, c), type, blocks, &u);
        for (int k = 0; k < blocks * HS_BLOCK; k++) { /* as ggml: (d * scale) * q - dmin * min */
            const int b = k / HS_BLOCK;
            const float d = type == HS_Q6_K ? u.d[b] * (float)u.scale[k / 16] : u.d[b];
            out[c * HS_SUPER + k] = d * (float)u.q[k] + u.offset[b];
        }
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

#define ROW_CHUNK 16         /* rows the portable kernel accumulates at a time */
#define PREFETCH_AHEAD 2048 /* bytes of weights the AVX2 kernels ask for ahead of their use */

static void features_portable(const hs_matrix *w, const activations *a, int n, int first, int end,
                              float *out) {
    const int blocks = w->cols / HS_BLOCK, chunks = (blocks + SUB - 1) / SUB;
    const size_t stride = hs_unpacked_row_bytes(w->type, w->cols);
    unpacked u;
    for (int j = first; j < end; j++) {
        const char *wrow = (const char *)w->data + stride * j;
        for (int r0 = 0; r0 < n; r0 += ROW_CHUNK) {
            const int m = n - r0 < ROW_CHUNK ? n - r0 : ROW_CHUNK;
            float acc[ROW_CHUNK] = {0};
            for (int c = 0; c < chunks; c++) {
                unpack_portable(chunk_at(wrow, w->type, c), w->type, chunk_blocks(blocks, c), &u);
                for (int r = 0; r < m; r++) {
                    const size_t row = (size_t)(r0 + r);
                    const int8_t *x = a->q + row * w->cols + (size_t)c * HS_SUPER;
                    float v[SUB] = {0};
                    int32_t products = 0, mins = 0; /* the super-block recipe's I and M */
                    for (int b = 0; b < u.blocks; b++) {
                        int32_t lo = 0, hi = 0;
                        for (int k = 0; k < 16; k++) {
                            lo += u.q[32 * b + k] * x[32 * b + k];
                            hi += u.q[32 * b + 16 + k] * x[32 * b + 16 + k];
                        }
                        const size_t at = row * blocks + (size_t)c * SUB + b;
                        if (w->type == HS_Q6_K) {
                            products += u.scale[2 * b] * lo + u.scale[2 * b + 1] * hi;
                        } else if (hs_unpacked_super(w->type)) {
                            products += u.iscale[b] * (lo + hi);
                            if (has_mins(w->type)) mins += u.imin[b] * a->sum[at];
                        } else {
                            v[b] = (float)(lo + hi) * (a->d[at] * u.d[b]);
                            if (has_mins(w->type)) v[b] = fmaf((float)a->sum[at], a->d[at] * u.offset[b], v[b]);
                        }
                    }
                    if (hs_unpacked_super(w->type))
                        acc[r] = acc[r] + super_term(w->type, products, mins, a->d[row * blocks + (size_t)c * SUB], &u);
                    else
                        acc[r] = acc[r] + chunk_sum(v);
                }
            }
            for (int r = 0; r < m; r++) out[(size_t)(r0 + r) * w->rows + j] = acc[r];
        }
    }
}

#if HS_X86
/* unpack_factors_portable's factors that the kernels read (for the super-block types: not
 * d_b and m_b). Q4_K's and Q5_K's
 * packed scales and mins as four 32-bit words: scales 0-3 and mins 0-3 are the low 6 bits of
 * bytes 0-3 and 4-7; scales 4-7 take bytes 8-11's low nibbles and bytes 0-3's top 2 bits,
 * mins 4-7 bytes 8-11's high nibbles and bytes 4-7's top bits. */
HS_AVX2 INLINE void unpack_factors_avx2(const char *chunk, const int type, unpacked *u) {
    if (type == HS_Q6_K) {
        const block_q6_k *blk = (const block_q6_k *)chunk;
        const __m128i bytes = _mm_loadu_si128((const __m128i *)blk->scales);
        _mm256_store_si256((__m256i *)u->scale, _mm256_cvtepi8_epi16(bytes));
        u->sd = _cvtsh_ss(blk->d);
        return;
    }
    if (type == HS_IQ4_XS) {
        const block_iq4_xs *blk = (const block_iq4_xs *)chunk;
        for (int b = 0; b < SUB; b++) u->iscale[b] = iq4_xs_scale(blk, b) - 32;
        u->sd = _cvtsh_ss(blk->d);
        return;
    }
    if (small_blocks(type)) { /* d first in each block; Q4_1's and Q5_1's m next */
        uint16_t d[SUB] = {0}, m[SUB] = {0}; /* a short chunk's missing blocks: 0 */
        for (int b = 0; b < u->blocks; b++) {
            const uint16_t *halves = (const uint16_t *)(chunk + (size_t)b * block_bytes(type));
            d[b] = halves[0];
            if (has_mins(type)) m[b] = halves[1];
        }
        _mm256_store_ps(u->d, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)d)));
        _mm256_store_ps(u->offset, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)m)));
        return;
    }
    const block_q4_k *blk = (const block_q4_k *)chunk;
    uint32_t words[3];
    memcpy(words, blk->scales, sizeof words);
    const uint32_t low6 = 0x3f3f3f3fu, low4 = 0x0f0f0f0fu, low2 = 0x03030303u;
    const uint32_t scales_hi = (words[2] & low4) | ((words[0] >> 6) & low2) << 4;
    const uint32_t mins_hi = ((words[2] >> 4) & low4) | ((words[1] >> 6) & low2) << 4;
    const __m128i scale_bytes = _mm_setr_epi32((int)(words[0] & low6), (int)scales_hi, 0, 0);
    const __m128i min_bytes = _mm_setr_epi32((int)(words[1] & low6), (int)mins_hi, 0, 0);
    _mm256_store_si256((__m256i *)u->iscale, _mm256_cvtepu8_epi32(scale_bytes));
    _mm256_store_si256((__m256i *)u->imin, _mm256_cvtepu8_epi32(min_bytes));
    u->sd = _cvtsh_ss(blk->d);
    u->smin = -_cvtsh_ss(blk->dmin);
}

/* A chunk's values as bytes, and its factors. */
HS_AVX2 INLINE void unpack_avx2(const char *chunk, const int type, const int blocks, unpacked *u) {
    u->blocks = blocks;
    unpack_factors_avx2(chunk, type, u);
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    if (type == HS_Q6_K) {
        const block_q6_k *blk = (const block_q6_k *)chunk;
        const __m256i low2 = _mm256_set1_epi8(3), offset = _mm256_set1_epi8(32);
        for (int half = 0; half < 2; half++) {
            const __m256i ql0 = _mm256_loadu_si256((const __m256i *)(blk->ql + 64 * half));
            const __m256i ql1 = _mm256_loadu_si256((const __m256i *)(blk->ql + 64 * half + 32));
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk->qh + 32 * half));
            /* bits 2k, 2k + 1 of qh, moved to bits 4, 5 (16-bit shifts, then masked per byte) */
            const __m256i h0 = _mm256_slli_epi16(_mm256_and_si256(qh, low2), 4);
            const __m256i h1 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), low2), 4);
            const __m256i h2 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), low2), 4);
            const __m256i h3 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), low2), 4);
            const __m256i v0 = _mm256_or_si256(_mm256_and_si256(ql0, low4), h0);
            const __m256i v1 = _mm256_or_si256(_mm256_and_si256(ql1, low4), h1);
            const __m256i v2 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), low4), h2);
            const __m256i v3 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), low4), h3);
            int8_t *q = u->q + 128 * half;
            _mm256_store_si256((__m256i *)q, _mm256_sub_epi8(v0, offset));
            _mm256_store_si256((__m256i *)(q + 32), _mm256_sub_epi8(v1, offset));
            _mm256_store_si256((__m256i *)(q + 64), _mm256_sub_epi8(v2, offset));
            _mm256_store_si256((__m256i *)(q + 96), _mm256_sub_epi8(v3, offset));
        }
        return;
    }
    if (iq4(type)) { /* indices looked up in the table, 16 bytes (a block of 32) at a time */
        const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)IQ4_VALUES));
        for (int b = 0; b < blocks; b++) {
            const __m128i raw = _mm_loadu_si128((const __m128i *)nibbles(chunk, type, b));
            const __m128i lo = _mm_and_si128(raw, _mm_set1_epi8(0x0f));
            const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(0x0f));
            _mm256_store_si256((__m256i *)(u->q + 32 * b), _mm256_shuffle_epi8(table, _mm256_set_m128i(hi, lo)));
        }
        return;
    }
    if (small_blocks(type)) {
        /* byte i of a block takes qh's byte i / 8, then keeps bit i % 8 */
        const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                                2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
        const __m256i bits = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
        const __m256i sixteen = _mm256_set1_epi8(16);
        for (int b = 0; b < blocks; b++) {
            const __m128i raw = _mm_loadu_si128((const __m128i *)nibbles(chunk, type, b));
            const __m128i lo = _mm_and_si128(raw, _mm_set1_epi8(0x0f));
            const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(0x0f));
            __m256i values = _mm256_set_m128i(hi, lo);
            if (type != HS_Q4_1) {
                const int qh = (int)fifth_bits(chunk, type, b);
                const __m256i high = _mm256_cmpeq_epi8(
                    _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32(qh), spread), bits), bits);
                values = _mm256_or_si256(values, _mm256_and_si256(high, sixteen));
            }
            if (type == HS_Q5_0) values = _mm256_sub_epi8(values, sixteen); /* signed */
            _mm256_store_si256((__m256i *)(u->q + 32 * b), values);
        }
        return;
    }
    const uint8_t *qs = type == HS_Q4_K ? ((const block_q4_k *)chunk)->qs : ((const block_q5_k *)chunk)->qs;
    __m256i qh = _mm256_setzero_si256();
    if (type == HS_Q5_K) qh = _mm256_loadu_si256((const __m256i *)((const block_q5_k *)chunk)->qh);
    for (int c = 0; c < 4; c++) {
        const __m256i bytes = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
        __m256i lo = _mm256_and_si256(bytes, low4);
        __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4);
        if (type == HS_Q5_K) { /* bit 2c of qh[l] is value l's fifth bit, bit 2c + 1 value 32 + l's */
            const __m256i bit_lo = _mm256_set1_epi8((char)(1 << (2 * c)));
            const __m256i bit_hi = _mm256_set1_epi8((char)(2 << (2 * c)));
            const __m256i sixteen = _mm256_set1_epi8(16);
            const __m256i set_lo = _mm256_cmpeq_epi8(_mm256_and_si256(qh, bit_lo), bit_lo);
            const __m256i set_hi = _mm256_cmpeq_epi8(_mm256_and_si256(qh, bit_hi), bit_hi);
            lo = _mm256_or_si256(lo, _mm256_and_si256(set_lo, sixteen));
            hi = _mm256_or_si256(hi, _mm256_and_si256(set_hi, sixteen));
        }
        _mm256_store_si256((__m256i *)(u->q + 64 * c), lo);
        _mm256_store_si256((__m256i *)(u->q + 64 * c + 32), hi);
    }
}

/* Run k (values 4k..4k+3 of the group's 8 rows) of activation block blk of group g. */
HS_AVX2 INLINE __m256i grouped_run(const activations *a, const int g, const int blocks, const size_t blk,
                                   const int k) {
    return _mm256_loadu_si256((const __m256i *)(a->grouped + (((size_t)g * blocks + blk) * GROUP + k) * 4 * GROUP));
}

/* The 8 rows' sums of x at `at` in the grouped layout, where the type has mins (else zeros). */
HS_AVX2 INLINE __m256i grouped_sums(const activations *a, const int type, const size_t at) {
    return has_mins(type) ? _mm256_loadu_si256((const __m256i *)(a->grouped_sum + at)) : _mm256_setzero_si256();
}

/* Pair sums of w times x: unsigned values (Q4_K, Q5_K) are maddubs's unsigned side; signed
 * ones (Q6_K, Q5_0) go as |w| times x with w's sign. */
HS_AVX2 INLINE __m256i pair_products(const int type, const __m256i w, const __m256i x) {
    if (!has_mins(type)) return _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
    return _mm256_maddubs_epi16(w, x);
}

/* v_b of the recipe in 8 lanes: the products P (as floats: exact), the activations' scales
 * and sums, and the weights' factors (as vectors: lanes of rows, or of blocks). */
HS_AVX2 INLINE __m256 block_terms(const int type, const __m256 products, const __m256 x_scales,
                                  const __m256i x_sums, const __m256 d, const __m256 offset) {
    const __m256 v = _mm256_mul_ps(products, _mm256_mul_ps(x_scales, d));
    if (!has_mins(type)) return v;
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(x_sums), _mm256_mul_ps(x_scales, offset), v);
}

/* Rows in lanes, block b of chunk c (unpacked in u) for the rows of `count` (1 or 2) whole
 * groups from `group` on: each group's 8 rows' block integers in lanes: P_b, or for the
 * super-block types scale_b * P_b (Q6_K: its halves' sum of scale_h * P_h). Pair sums stay in
 * 16 bits over runs while they fit: all eight for Q4_K and Q4_1 (8 * 2 * 15 * 127 < 2^15) and
 * Q5_0 (|q| <= 16), a half-block's four for Q5_K, Q5_1 and Q6_K (Q6_K's halves then take their
 * own scales), one for IQ4_NL and IQ4_XS (2 * 127 * 127 < 2^15); vpmaddwd then applies the
 * scale (1 for the 32-value types). */
HS_AVX2 INLINE void block_sums_in_lanes_avx2(const unpacked *u, const int type, const int c, const int b,
                                             const int blocks, const activations *a, const int group,
                                             const int count, __m256i sums[2]) {
    const size_t blk = (size_t)c * SUB + b;
    /* 16-bit sums a block: IQ4's values (up to 127) fit one run's pairs only */
    const int spans = type == HS_Q4_K || type == HS_Q5_0 || type == HS_Q4_1 ? 1 : iq4(type) ? GROUP : 2;
    sums[0] = sums[1] = _mm256_setzero_si256();
    for (int h = 0; h < spans; h++) {
        __m256i pairs[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
        for (int k = GROUP / spans * h; k < GROUP / spans * (h + 1); k++) {
            const __m256i w = broadcast4(u->q + 32 * b + 4 * k);
            for (int g = 0; g < count; g++)
                pairs[g] = _mm256_add_epi16(pairs[g], pair_products(type, w, grouped_run(a, group + g, blocks, blk, k)));
        }
        const int scale = type == HS_Q6_K ? u->scale[2 * b + h] : hs_unpacked_super(type) ? u->iscale[b] : 1;
        for (int g = 0; g < count; g++)
            sums[g] = _mm256_add_epi32(sums[g], _mm256_madd_epi16(pairs[g], _mm256_set1_epi16((short)scale)));
    }
}

/* The 32-value types' v_b (block b of chunk c) of each group's 8 rows in lanes, into v (0 for a
 * short chunk's missing block). Defined per kernel level, on its block_sums_in_lanes. */
#define BLOCK_IN_LANES(ATTR, SUFFIX)                                                                          \
    ATTR INLINE void block_in_lanes_##SUFFIX(const unpacked *u, const int type, const int c, const int b,     \
                                             const int blocks, const activations *a, const int group,         \
                                             const int count, __m256 v[2]) {                                  \
        v[0] = v[1] = _mm256_setzero_ps();                                                                    \
        if (b >= u->blocks) return;                                                                           \
        __m256i sums[2];                                                                                      \
        block_sums_in_lanes_##SUFFIX(u, type, c, b, blocks, a, group, count, sums);                           \
        for (int g = 0; g < count; g++) {                                                                     \
            const size_t at = ((size_t)(group + g) * blocks + (size_t)c * SUB + b) * GROUP;                   \
            v[g] = block_terms(type, _mm256_cvtepi32_ps(sums[g]), _mm256_loadu_ps(a->grouped_d + at),         \
                               grouped_sums(a, type, at), _mm256_set1_ps(u->d[b]), _mm256_set1_ps(u->offset[b])); \
        }                                                                                                     \
    }
BLOCK_IN_LANES(HS_AVX2, avx2)

/* Rows in lanes, the super-block recipe: chunk c times the rows of `count` whole groups;
 * acc[g] += each of group g's 8 rows' v. Defined per kernel level, on its
 * block_sums_in_lanes. */
#define SUPER_IN_LANES(ATTR, SUFFIX)                                                                           \
    ATTR INLINE void super_in_lanes_##SUFFIX(const unpacked *u, const int type, const int c, const int blocks, \
                                            const activations *a, const int group, const int count,           \
                                            __m256 acc[2]) {                                                   \
        __m256i products[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};                               \
        __m256i mins[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};                                   \
        for (int b = 0; b < SUB; b++) {                                                                        \
            __m256i sums[2];                                                                                   \
            block_sums_in_lanes_##SUFFIX(u, type, c, b, blocks, a, group, count, sums);                        \
            for (int g = 0; g < count; g++) {                                                                  \
                products[g] = _mm256_add_epi32(products[g], sums[g]);                                          \
                if (has_mins(type)) {                                                                          \
                    const size_t at = ((size_t)(group + g) * blocks + (size_t)c * SUB + b) * GROUP;            \
                    mins[g] = _mm256_add_epi32(mins[g], _mm256_mullo_epi32(_mm256_loadu_si256(               \
                        (const __m256i *)(a->grouped_sum + at)), _mm256_set1_epi32(u->imin[b])));              \
                }                                                                                              \
            }                                                                                                  \
        }                                                                                                      \
        for (int g = 0; g < count; g++) { /* super_term's steps */                                             \
            const __m256 x_scale = _mm256_loadu_ps(a->grouped_d + ((size_t)(group + g) * blocks + (size_t)c * SUB) * GROUP); \
            __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(products[g]), _mm256_mul_ps(x_scale, _mm256_set1_ps(u->sd))); \
            if (has_mins(type))                                                                                \
                v = _mm256_fmadd_ps(_mm256_cvtepi32_ps(mins[g]), _mm256_mul_ps(x_scale, _mm256_set1_ps(u->smin)), v); \
            acc[g] = _mm256_add_ps(acc[g], v);                                                                 \
        }                                                                                                      \
    }
SUPER_IN_LANES(HS_AVX2, avx2)

/* Rows in lanes: chunk c times the rows of `count` whole groups; acc[g] holds group g's 8
 * rows. The chunk's terms add up by chunk_sum's tree as they come (few live registers; the
 * eight calls written out measured 7-14% faster than a loop). Defined per kernel level, on
 * that level's block_in_lanes. */
#define ROWS_IN_LANES(ATTR, SUFFIX)                                                                                 \
    ATTR INLINE void rows_in_lanes_##SUFFIX(const unpacked *u, const int type, const int c, const int blocks,       \
                                           const activations *a, const int group, const int count, __m256 acc[2]) { \
        if (hs_unpacked_super(type)) {                                                                              \
            super_in_lanes_##SUFFIX(u, type, c, blocks, a, group, count, acc);                                      \
            return;                                                                                                 \
        }                                                                                                           \
        __m256 even[2], odd[2], first[2], second[2];                                                                \
        block_in_lanes_##SUFFIX(u, type, c, 0, blocks, a, group, count, even);                                      \
        block_in_lanes_##SUFFIX(u, type, c, 1, blocks, a, group, count, odd);                                       \
        for (int g = 0; g < count; g++) first[g] = _mm256_add_ps(even[g], odd[g]);                                  \
        block_in_lanes_##SUFFIX(u, type, c, 2, blocks, a, group, count, even);                                      \
        block_in_lanes_##SUFFIX(u, type, c, 3, blocks, a, group, count, odd);                                       \
        for (int g = 0; g < count; g++)                                                                             \
            first[g] = _mm256_add_ps(first[g], _mm256_add_ps(even[g], odd[g]));                                     \
        block_in_lanes_##SUFFIX(u, type, c, 4, blocks, a, group, count, even);                                      \
        block_in_lanes_##SUFFIX(u, type, c, 5, blocks, a, group, count, odd);                                       \
        for (int g = 0; g < count; g++) second[g] = _mm256_add_ps(even[g], odd[g]);                                 \
        block_in_lanes_##SUFFIX(u, type, c, 6, blocks, a, group, count, even);                                      \
        block_in_lanes_##SUFFIX(u, type, c, 7, blocks, a, group, count, odd);                                       \
        for (int g = 0; g < count; g++)                                                                             \
            acc[g] = _mm256_add_ps(acc[g], _mm256_add_ps(first[g], _mm256_add_ps(                                   \
                                               second[g], _mm256_add_ps(even[g], odd[g]))));                        \
    }
ROWS_IN_LANES(HS_AVX2, avx2)

/* P_b in lane b, from block b's products summed in pairs (lanes 0-3 the low half-block's,
 * 4-7 the high's): the halves' sums added (exact integers). The 32-value types'. */
HS_AVX2 INLINE __m256i block_products(const __m256i sums[SUB]) {
    /* lanes: the low halves of blocks 0-3, then their high halves (blocks 4-7 likewise) */
    const __m256i first = _mm256_hadd_epi32(_mm256_hadd_epi32(sums[0], sums[1]), _mm256_hadd_epi32(sums[2], sums[3]));
    const __m256i second = _mm256_hadd_epi32(_mm256_hadd_epi32(sums[4], sums[5]), _mm256_hadd_epi32(sums[6], sums[7]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(first, second, 0x20),
                            _mm256_permute2x128_si256(first, second, 0x31));
}

/* chunk_sum of 8 lanes: hadd pairs lanes (0,1), (2,3) within each half, then the pairs'
 * pairs; the halves' sums add last. */
HS_AVX2 INLINE float chunk_sum8(const __m256 v) {
    const __m256 pairs = _mm256_hadd_ps(v, v), quads = _mm256_hadd_ps(pairs, pairs);
    return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(quads), _mm256_extractf128_ps(quads, 1)));
}

/* The sum of 8 int32 lanes (exact: any order). */
HS_AVX2 INLINE int32_t sum_lanes(const __m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1)));
}

/* A super-block type's block b scale in the 16 int16 lanes of its pair sums (Q6_K: the low
 * half-block's in lanes 0-7, the high's in 8-15). */
HS_AVX2 INLINE __m256i block_scale16(const int type, const unpacked *u, const int b) {
    if (type == HS_Q6_K) return _mm256_set_m128i(_mm_set1_epi16(u->scale[2 * b + 1]), _mm_set1_epi16(u->scale[2 * b]));
    return _mm256_set1_epi16((short)u->iscale[b]);
}

/* acc + block b's products in pairs times its scale (scale16), in 8 int32 lanes. */
HS_AVX2 INLINE __m256i scaled_sums_avx2(const __m256i acc, const int type, const __m256i w, const __m256i x,
                                        const __m256i scale16) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pair_products(type, w, x), scale16));
}

/* Block b's products in pairs summed to 8 int32 lanes (lanes 0-3 the low half-block's). */
HS_AVX2 INLINE __m256i block_sums_avx2(const int type, const __m256i w, const __m256i x) {
    return _mm256_madd_epi16(pair_products(type, w, x), _mm256_set1_epi16(1));
}

/* Rows one by one: chunk c of one weight row times m row-major rows (rows first_row.., of
 * `cols` values); acc[r] is row r's sum. The super-block types' pair sums are scaled and
 * added as they come (one horizontal sum a chunk); the 32-value types' lanes hold the chunk's
 * blocks. Defined per kernel level, on that level's block_sums and scaled_sums. */
#define ROWS_MAJOR(ATTR, SUFFIX)                                                                               \
    ATTR INLINE void rows_major_##SUFFIX(const unpacked *u, const int type, const int c,                       \
                                         const int blocks, const activations *a,                               \
                                         const int first_row, const int cols, const int m,                     \
                                         float *acc) {                                                         \
        for (int r = 0; r < m; r++) {                                                                          \
            const size_t row = (size_t)(first_row + r);                                                        \
            const int8_t *x = a->q + row * cols + (size_t)c * HS_SUPER;                                        \
            const size_t at = row * blocks + (size_t)c * SUB;                                                  \
            if (hs_unpacked_super(type)) { /* whole chunks: the block sums scaled as they come */              \
                __m256i products = _mm256_setzero_si256();                                                     \
                for (int b = 0; b < SUB; b++)                                                                  \
                    products = scaled_sums_##SUFFIX(products, type,                                            \
                                                    _mm256_load_si256((const __m256i *)(u->q + 32 * b)),       \
                                                    _mm256_loadu_si256((const __m256i *)(x + 32 * b)),         \
                                                    block_scale16(type, u, b));                                \
                const int32_t mins = has_mins(type) ? sum_lanes(_mm256_mullo_epi32(                            \
                    _mm256_loadu_si256((const __m256i *)(a->sum + at)),                                        \
                    _mm256_load_si256((const __m256i *)u->imin))) : 0;                                         \
                acc[r] = acc[r] + super_term(type, sum_lanes(products), mins, a->d[at], u);                    \
                continue;                                                                                      \
            }                                                                                                  \
            __m256i sums[SUB];                                                                                 \
            for (int b = 0; b < SUB; b++)                                                                      \
                sums[b] = b < u->blocks                                                                        \
                              ? block_sums_##SUFFIX(type, _mm256_load_si256((const __m256i *)(u->q + 32 * b)), \
                                                    _mm256_loadu_si256((const __m256i *)(x + 32 * b)))         \
                              : _mm256_setzero_si256();                                                        \
            const __m256i products = block_products(sums);                                                     \
            __m256 x_scales;                                                                                   \
            __m256i x_sums = _mm256_setzero_si256();                                                           \
            if (u->blocks == SUB) {                                                                            \
                x_scales = _mm256_loadu_ps(a->d + at);                                                         \
                if (has_mins(type)) x_sums = _mm256_loadu_si256((const __m256i *)(a->sum + at));               \
            } else { /* a short chunk: the missing blocks' terms are 0 * 0 */                                  \
                float scales[SUB] = {0};                                                                       \
                int32_t sums_x[SUB] = {0};                                                                     \
                memcpy(scales, a->d + at, sizeof(float) * (size_t)u->blocks);                                  \
                x_scales = _mm256_loadu_ps(scales);                                                            \
                if (has_mins(type)) {                                                                          \
                    memcpy(sums_x, a->sum + at, sizeof(int32_t) * (size_t)u->blocks);                          \
                    x_sums = _mm256_loadu_si256((const __m256i *)sums_x);                                      \
                }                                                                                              \
            }                                                                                                  \
            acc[r] = acc[r] + chunk_sum8(block_terms(type, _mm256_cvtepi32_ps(products), x_scales, x_sums,     \
                                                     _mm256_load_ps(u->d), _mm256_load_ps(u->offset)));        \
        }                                                                                                      \
    }
ROWS_MAJOR(HS_AVX2, avx2)

/* Fewer rows than a group: each weight row's chunks unpacked and met by every row in turn
 * (one weight stream at a time: the one the prefetchers follow best; measured faster than a
 * pass of features_typed's without groups). Defined per kernel level, on its rows_major. */
#define ROWS_ALONE(ATTR, SUFFIX)                                                             \
    ATTR INLINE void rows_alone_typed_##SUFFIX(const hs_matrix *w, const int type,           \
                                               const activations *a, const int n,            \
                                               const int first, const int end, float *out) { \
        const int blocks = w->cols / HS_BLOCK, chunks = (blocks + SUB - 1) / SUB;            \
        const size_t stride = hs_unpacked_row_bytes(type, w->cols);                          \
        unpacked u;                                                                          \
        for (int j = first; j < end; j++) {                                                  \
            const char *wrow = (const char *)w->data + stride * j;                           \
            float acc[PAD_FROM] = {0};                                                       \
            for (int c = 0; c < chunks; c++) {                                               \
                const char *chunk = chunk_at(wrow, type, c);                                 \
                for (size_t line = 0; line < chunk_bytes(type); line += 64) /* see below */  \
                    _mm_prefetch(chunk + PREFETCH_AHEAD + line, _MM_HINT_T0);                \
                unpack_avx2(chunk, type, chunk_blocks(blocks, c), &u);                       \
                rows_major_##SUFFIX(&u, type, c, blocks, a, 0, w->cols, n, acc);             \
            }                                                                                \
            for (int r = 0; r < n; r++) out[(size_t)r * w->rows + j] = acc[r];               \
        }                                                                                    \
    }

/* features_typed's call for each type as a literal (each call is compiled for its own type):
 * rows_alone_typed where there are fewer rows than a group (w, a, n, first, end and out in
 * scope). */
#define TYPED_CALLS(SUFFIX)                                                                  \
    switch (w->type) {                                                                       \
    case HS_Q4_K: TYPED_CALL(SUFFIX, HS_Q4_K) break;                                         \
    case HS_Q5_K: TYPED_CALL(SUFFIX, HS_Q5_K) break;                                         \
    case HS_Q6_K: TYPED_CALL(SUFFIX, HS_Q6_K) break;                                         \
    case HS_Q4_1: TYPED_CALL(SUFFIX, HS_Q4_1) break;                                         \
    case HS_Q5_1: TYPED_CALL(SUFFIX, HS_Q5_1) break;                                         \
    case HS_IQ4_NL: TYPED_CALL(SUFFIX, HS_IQ4_NL) break;                                     \
    case HS_IQ4_XS: TYPED_CALL(SUFFIX, HS_IQ4_XS) break;                                     \
    default: TYPED_CALL(SUFFIX, HS_Q5_0) break;                                              \
    }
#define TYPED_CALL(SUFFIX, type)                                                             \
    if (grouped_rows(n) >= GROUP) features_typed_##SUFFIX(w, type, a, n, first, end, out);   \
    else rows_alone_typed_##SUFFIX(w, type, a, n, first, end, out);

/* All n rows against output features [first, end): passes of up to two whole groups rows in
 * lanes, the last pass also taking the rows outside whole groups (fewer than PAD_FROM) one
 * by one; each chunk is unpacked once a pass. Literal types: each call is compiled for its
 * own. Defined per kernel level, on that level's rows_in_lanes and rows_major; its
 * features_##SUFFIX sends K-quant calls of 2 to SUPER8_MAX_ROWS rows 8 features in lanes
 * (super8_passes) instead. */
#define FEATURES_IN_PASSES(ATTR, SUFFIX, SUPER8_MAX_ROWS)                                                    \
    ATTR INLINE void features_typed_##SUFFIX(const hs_matrix *w, const int type, const activations *a,        \
                                            const int n, const int first, const int end, float *out) {        \
        const int blocks = w->cols / HS_BLOCK, chunks = (blocks + SUB - 1) / SUB;                             \
        const int groups = grouped_rows(n) / GROUP;                                                           \
        const int grouped = groups * GROUP < n ? groups * GROUP : n;                                          \
        const int passes = groups > 2 ? (groups + 1) / 2 : 1;                                                 \
        const size_t stride = hs_unpacked_row_bytes(type, w->cols);                                           \
        unpacked u;                                                                                           \
        for (int p = 0; p < passes; p++) {                                                                    \
            const int g = 2 * p, count = groups - g < 2 ? groups - g : 2;                                     \
            const int rest = p == passes - 1 ? n - grouped : 0;                                               \
            for (int j = first; j < end; j++) {                                                               \
                const char *wrow = (const char *)w->data + stride * j;                                        \
                __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};                                   \
                float alone[PAD_FROM] = {0};                                                                  \
                for (int c = 0; c < chunks; c++) {                                                            \
                    const char *chunk = chunk_at(wrow, type, c);                                              \
                    /* the stream ahead: unpacking costs more than streaming the bytes, and                   \
                     * without this the prefetchers stay too close to overlap the two */                      \
                    for (size_t line = 0; line < chunk_bytes(type); line += 64)                               \
                        _mm_prefetch(chunk + PREFETCH_AHEAD + line, _MM_HINT_T0);                             \
                    unpack_avx2(chunk, type, chunk_blocks(blocks, c), &u);                                    \
                    if (count == 2) rows_in_lanes_##SUFFIX(&u, type, c, blocks, a, g, 2, acc);                \
                    else if (count == 1) rows_in_lanes_##SUFFIX(&u, type, c, blocks, a, g, 1, acc);           \
                    if (rest > 0) rows_major_##SUFFIX(&u, type, c, blocks, a, grouped, w->cols, rest, alone); \
                }                                                                                             \
                for (int k = 0; k < count; k++) {                                                             \
                    float lanes[GROUP];                                                                       \
                    _mm256_storeu_ps(lanes, acc[k]);                                                          \
                    for (int r = 0; r < GROUP && (g + k) * GROUP + r < n; r++)                                \
                        out[(size_t)((g + k) * GROUP + r) * w->rows + j] = lanes[r];                          \
                }                                                                                             \
                for (int r = 0; r < rest; r++) out[(size_t)(grouped + r) * w->rows + j] = alone[r];           \
            }                                                                                                 \
        }                                                                                                     \
    }                                                                                                         \
                                                                                                              \
    ATTR static void features_##SUFFIX(const hs_matrix *w, const activations *a, int n, int first, int end,   \
                                      float *out) {                                                           \
        if (hs_unpacked_super(w->type) && n >= 2 && n <= (SUPER8_MAX_ROWS)) {                                 \
            for (; first + 8 <= end; first += 8) super8_passes_##SUFFIX(w, a, n, first, out);                 \
            if (first >= end) return;                                                                         \
        }                                                                                                     \
        TYPED_CALLS(SUFFIX)                                                                                   \
    }

/* The super-block types (Q4_K, Q5_K, Q6_K, IQ4_XS) in 256-bit vectors: rows [r0, r0 + m)
 * (m <= FEATURES16_PASS) against 8 weight rows [j, j + 8), 8 features in the lanes:
 * super16_in_lanes_vnni's steps (each chunk of the 8 rows unpacked, each block, the scales
 * and the mins transposed, each row's four activations broadcast), with DP4 the level's step
 * that adds four unsigned-by-signed products to a lane (vpmaddubsw's pairs cannot saturate:
 * at most 2 x 127 x 127) and the mins' sum as four vpmaddwd a row a chunk. Signed values
 * (Q6_K, IQ4_XS): where BIASED (the activations have their sums: the VNNI levels) biased by
 * 32 or 128 and that times each (half-)block's sum taken off, else |w| times x with w's sign
 * (DP4_SIGNED). A lane's integers are rows_major's exact ones and its float steps
 * super_term's: the same bits. */
#define SUPER8_IN_LANES(ATTR, SUFFIX, DP4, DP4_SIGNED, BIASED)                                                                    \
    ATTR INLINE void super8_in_lanes_##SUFFIX(const hs_matrix *w, const int type, const activations *a,       \
                                              const int r0, const int m, const int j, float *out) {           \
        const int blocks = w->cols / HS_BLOCK, chunks = blocks / SUB;                                         \
        const size_t stride = hs_unpacked_row_bytes(type, w->cols);                                           \
        unpacked u[8];                                                                                        \
        __m256 acc[FEATURES16_PASS];                                                                          \
        for (int r = 0; r < m; r++) acc[r] = _mm256_setzero_ps();                                             \
        for (int c = 0; c < chunks; c++) {                                                                    \
            for (int f = 0; f < 8; f++) {                                                                     \
                const char *chunk = chunk_at((const char *)w->data + stride * (size_t)(j + f), type, c);      \
                for (size_t line = 0; line < chunk_bytes(type); line += 64) /* the next 8 rows' */            \
                    _mm_prefetch(chunk + 8 * stride + line, _MM_HINT_T0);                                     \
                unpack_avx2(chunk, type, SUB, &u[f]);                                                         \
            }                                                                                                 \
            __m256i products[FEATURES16_PASS];                                                                \
            for (int r = 0; r < m; r++) products[r] = _mm256_setzero_si256();                                 \
            __m256i scales[SUB], min_pairs[SUB / 2];                                                          \
            rows8_transposed(type == HS_Q6_K ? (const char *)u[0].scale : (const char *)u[0].iscale,          \
                             sizeof(unpacked), scales);                                                       \
            if (has_mins(type)) {                                                                             \
                __m256i mins[SUB];                                                                            \
                rows8_transposed((const char *)u[0].imin, sizeof(unpacked), mins);                            \
                for (int i = 0; i < SUB / 2; i++)                                                             \
                    min_pairs[i] = _mm256_or_si256(mins[2 * i], _mm256_slli_epi32(mins[2 * i + 1], 16));      \
            }                                                                                                 \
            for (int b = 0; b < SUB; b++) {                                                                   \
                __m256i values[HS_BLOCK / 4];                                                                 \
                rows8_transposed((const char *)u[0].q + HS_BLOCK * b, sizeof(unpacked), values);              \
                if (type == HS_Q6_K && (BIASED)) /* 0..63 */                                                  \
                    for (int k = 0; k < HS_BLOCK / 4; k++)                                                    \
                        values[k] = _mm256_add_epi8(values[k], _mm256_set1_epi8(32));                         \
                if (type == HS_IQ4_XS && (BIASED)) /* 1..241 */                                               \
                    for (int k = 0; k < HS_BLOCK / 4; k++)                                                    \
                        values[k] = _mm256_xor_si256(values[k], _mm256_set1_epi8((char)0x80));                \
                const __m256i scale = scales[b];                                                              \
                for (int r = 0; r < m; r++) {                                                                 \
                    const int32_t *x = (const int32_t *)(a->q + (size_t)(r0 + r) * w->cols +                  \
                                                         (size_t)c * HS_SUPER + HS_BLOCK * b);                \
                    if (type == HS_Q6_K) {                                                                    \
                        __m256i halves[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};                 \
                        if (BIASED) {                                                                         \
                            const size_t at = (size_t)(r0 + r) * blocks + (size_t)c * SUB + b;                \
                            const int32_t x_sum = a->sum[at], low = a->half_sum[at];                          \
                            halves[0] = _mm256_set1_epi32(-(low << 5));                                       \
                            halves[1] = _mm256_set1_epi32(-((x_sum - low) << 5));                             \
                        }                                                                                     \
                        for (int k = 0; k < HS_BLOCK / 4; k++)                                                \
                            halves[k / 4] = (BIASED) ? DP4(halves[k / 4], values[k], _mm256_set1_epi32(x[k])) \
                                                     : DP4_SIGNED(halves[k / 4], values[k], _mm256_set1_epi32(x[k])); \
                        const __m256i scale_lo = _mm256_srai_epi32(_mm256_slli_epi32(scale, 16), 16);         \
                        const __m256i scale_hi = _mm256_srai_epi32(scale, 16);                                \
                        products[r] = _mm256_add_epi32(                                                       \
                            products[r], _mm256_add_epi32(_mm256_mullo_epi32(halves[0], scale_lo),            \
                                                          _mm256_mullo_epi32(halves[1], scale_hi)));          \
                        continue;                                                                             \
                    }                                                                                         \
                    __m256i chains[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};                     \
                    if (type == HS_IQ4_XS && (BIASED)) /* 128 times the block's sum off */                    \
                        chains[0] = _mm256_set1_epi32(-(a->sum[(size_t)(r0 + r) * blocks + (size_t)c * SUB + b] << 7)); \
                    for (int k = 0; k < HS_BLOCK / 4; k++)                                                    \
                        chains[k & 1] = type == HS_IQ4_XS && !(BIASED)                                        \
                                            ? DP4_SIGNED(chains[k & 1], values[k], _mm256_set1_epi32(x[k]))   \
                                            : DP4(chains[k & 1], values[k], _mm256_set1_epi32(x[k]));         \
                    products[r] = _mm256_add_epi32(                                                           \
                        products[r], _mm256_mullo_epi32(_mm256_add_epi32(chains[0], chains[1]), scale));      \
                }                                                                                             \
            }                                                                                                 \
            const __m256 sd = _mm256_setr_ps(u[0].sd, u[1].sd, u[2].sd, u[3].sd, u[4].sd, u[5].sd, u[6].sd,   \
                                             u[7].sd);                                                        \
            const __m256 smin = _mm256_setr_ps(u[0].smin, u[1].smin, u[2].smin, u[3].smin, u[4].smin,        \
                                               u[5].smin, u[6].smin, u[7].smin);                              \
            for (int r = 0; r < m; r++) { /* super_term's steps */                                            \
                const __m256 x_scale = _mm256_set1_ps(a->d[(size_t)(r0 + r) * blocks + (size_t)c * SUB]);     \
                __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(products[r]), _mm256_mul_ps(x_scale, sd));        \
                if (has_mins(type)) {                                                                         \
                    const int32_t *sums = a->sum + (size_t)(r0 + r) * blocks + (size_t)c * SUB;               \
                    __m256i mins = _mm256_setzero_si256();                                                    \
                    for (int i = 0; i < SUB / 2; i++) {                                                       \
                        const uint32_t pair = ((uint32_t)sums[2 * i] & 0xffffu) | (uint32_t)sums[2 * i + 1] << 16; \
                        mins = _mm256_add_epi32(mins, _mm256_madd_epi16(min_pairs[i], _mm256_set1_epi32((int)pair))); \
                    }                                                                                         \
                    v = _mm256_fmadd_ps(_mm256_cvtepi32_ps(mins), _mm256_mul_ps(x_scale, smin), v);           \
                }                                                                                             \
                acc[r] = _mm256_add_ps(acc[r], v);                                                            \
            }                                                                                                 \
        }                                                                                                     \
        for (int r = 0; r < m; r++) {                                                                         \
            float lanes[8];                                                                                   \
            _mm256_storeu_ps(lanes, acc[r]);                                                                  \
            for (int f = 0; f < 8; f++) out[(size_t)(r0 + r) * w->rows + j + f] = lanes[f];                   \
        }                                                                                                     \
    }                                                                                                         \
                                                                                                              \
    /* All n rows against features [j, j + 8), in passes of up to FEATURES16_PASS rows of equal               \
     * size; literal types and row counts up to 8. */                                                         \
    ATTR static void super8_passes_##SUFFIX(const hs_matrix *w, const activations *a, const int n,            \
                                            const int j, float *out) {                                        \
        const int passes = (n + FEATURES16_PASS - 1) / FEATURES16_PASS;                                       \
        for (int p = 0, r0 = 0; p < passes; p++) {                                                            \
            const int m = pass_rows(n, r0, p, passes);                                           \
            SUPER8_TYPES(SUFFIX, w->type, m)                                                                  \
            r0 += m;                                                                                          \
        }                                                                                                     \
    }
#define SUPER8_TYPES(SUFFIX, type, m)                                                        \
    if ((type) == HS_Q4_K) {                                                                 \
        SUPER8_ROWS(SUFFIX, HS_Q4_K, m)                                                      \
    } else if ((type) == HS_Q5_K) {                                                          \
        SUPER8_ROWS(SUFFIX, HS_Q5_K, m)                                                      \
    } else if ((type) == HS_Q6_K) {                                                          \
        SUPER8_ROWS(SUFFIX, HS_Q6_K, m)                                                      \
    } else {                                                                                 \
        SUPER8_ROWS(SUFFIX, HS_IQ4_XS, m)                                                    \
    }
#define SUPER8_ROWS(SUFFIX, type, m)                                                         \
    switch (m) {                                                                             \
    case 8: super8_in_lanes_##SUFFIX(w, type, a, r0, 8, j, out); break;                      \
    case 7: super8_in_lanes_##SUFFIX(w, type, a, r0, 7, j, out); break;                      \
    case 6: super8_in_lanes_##SUFFIX(w, type, a, r0, 6, j, out); break;                      \
    case 5: super8_in_lanes_##SUFFIX(w, type, a, r0, 5, j, out); break;                      \
    case 4: super8_in_lanes_##SUFFIX(w, type, a, r0, 4, j, out); break;                      \
    case 3: super8_in_lanes_##SUFFIX(w, type, a, r0, 3, j, out); break;                      \
    case 2: super8_in_lanes_##SUFFIX(w, type, a, r0, 2, j, out); break;                      \
    default: super8_in_lanes_##SUFFIX(w, type, a, r0, m, j, out); break;                     \
    }

/* four unsigned-by-signed products added to each lane: vpmaddubsw's pairs, vpmaddwd's sums */
HS_AVX2 INLINE __m256i dp4_avx2(const __m256i acc, const __m256i w, const __m256i x) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
}
/* ... of signed weights: |w| times x with w's sign */
HS_AVX2 INLINE __m256i dp4_signed_avx2(const __m256i acc, const __m256i w, const __m256i x) {
    return dp4_avx2(acc, _mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
}
SUPER8_IN_LANES(HS_AVX2, avx2, dp4_avx2, dp4_signed_avx2, 0)
ROWS_ALONE(HS_AVX2, avx2)
/* Super-block calls of 2-5 rows go 8 features in lanes; from 6 rows vpmaddubsw's products made
 * groups of rows in lanes as fast or faster (heavy-100m Q4_K_M T(4) 7.56 -> 6.55 ms, T(7)
 * 9.05 against 10.62) */
FEATURES_IN_PASSES(HS_AVX2, avx2, 5)

/* ------------------------------------------------------------------ AVX-512 VNNI
 * vpdpbusd multiplies unsigned by signed bytes and adds each lane's four products to it: the
 * unsigned values (Q4_K, Q5_K, Q4_1, Q5_1) are the unsigned side as they are; the signed ones
 * (Q6_K, Q5_0, IQ4) go as |w| times x with w's sign (rows one by one), or biased to unsigned
 * (tiles). Each block's (or half-block's) integer is the AVX2 kernels' exact one, and the
 * super-block types' scales multiply it as integers (vpmulld): the same bits. One row alone
 * takes its pair sums times the scale by vpdpwssd.
 *
 * Whole groups of rows go in tiles of TILE weight rows: each chunk of the tile's rows is
 * unpacked once for every group, and a pair of weight rows shares 512-bit vectors (lanes 0-7
 * the group's 8 rows against the first, 8-15 against the second), so one vpdpbusd and one
 * permute of the pair's four weights do the work of two 256-bit passes, and a block's
 * activations, loaded once, serve both pairs (docs/bench/native/kquants.md). */

HS_VNNI INLINE __m256i block_sums_vnni(const int type, const __m256i w, const __m256i x) {
    if (has_mins(type)) return _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x);
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
}
HS_VNNI INLINE __m256i scaled_sums_vnni(const __m256i acc, const int type, const __m256i w, const __m256i x,
                                        const __m256i scale16) {
    return _mm256_dpwssd_epi32(acc, pair_products(type, w, x), scale16);
}
ROWS_MAJOR(HS_VNNI, vnni)

#define TILE 4 /* weight rows the VNNI kernel unpacks and takes at once: two pairs */

/* A pair of weight rows' per-block factors for one chunk, 16 lanes each: lanes 0-7 the first
 * row's blocks 0-7, lanes 8-15 the second's; place[b] picks block b's into each half. The
 * 32-value types' d_b and m_b; the super-block types' integer scales (Q6_K: a half-block's)
 * and mins, and d and -dmin (each half its row's, in every lane). */
typedef struct {
    __m512 d, offset;
    __m512i scale, scale_hi, min; /* scale_hi: Q6_K's high half-blocks' (scale: the low's) */
    __m512 sd, smin;
} pair_factors;

HS_VNNI INLINE __m512i join(const void *lo, const void *hi) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_load_si256((const __m256i *)lo)),
                              _mm256_load_si256((const __m256i *)hi), 1);
}

/* lo in lanes 0-7, hi in lanes 8-15 */
HS_VNNI INLINE __m512 halves_ps(const float lo, const float hi) {
    return _mm512_castsi512_ps(_mm512_inserti64x4(_mm512_castsi256_si512(_mm256_castps_si256(_mm256_set1_ps(lo))),
                                                  _mm256_castps_si256(_mm256_set1_ps(hi)), 1));
}

HS_VNNI INLINE pair_factors factors_of_pair(const unpacked *u0, const unpacked *u1, const int type) {
    pair_factors f = {0};
    if (!hs_unpacked_super(type)) {
        f.d = _mm512_castsi512_ps(join(u0->d, u1->d));
        f.offset = _mm512_castsi512_ps(join(u0->offset, u1->offset));
        return f;
    }
    f.sd = halves_ps(u0->sd, u1->sd);
    f.smin = halves_ps(u0->smin, u1->smin);
    if (type == HS_Q6_K) {
        int32_t lo[2 * SUB] __attribute__((aligned(64))), hi[2 * SUB] __attribute__((aligned(64)));
        for (int b = 0; b < SUB; b++) {
            lo[b] = u0->scale[2 * b], hi[b] = u0->scale[2 * b + 1];
            lo[SUB + b] = u1->scale[2 * b], hi[SUB + b] = u1->scale[2 * b + 1];
        }
        f.scale = _mm512_load_si512(lo);
        f.scale_hi = _mm512_load_si512(hi);
    } else {
        f.scale = join(u0->iscale, u1->iscale);
        f.min = join(u0->imin, u1->imin);
    }
    return f;
}

/* Block b of chunk c, for one group of 8 rows against a pair of weight rows (unpacked in
 * u0, u1; factors f) in 512-bit vectors: lanes 0-7 the rows against u0, lanes 8-15 against
 * u1, each lane's block integer: P_b, or for the super-block types scale_b * P_b (Q6_K: its
 * halves' scale_h * P_h). `x` holds the block's 8 runs in both halves, `x_sums` its sums,
 * `half_sums` (Q6_K) the sums of its first 16 values. The weights go as vpdpbusd's unsigned
 * side: signed ones (Q6_K, Q5_0, IQ4_*) biased by 32, 16 or 128, the bias times the
 * activations' sum subtracted at the start, so each integer is the AVX2 kernels' exact one:
 * the same bits. */
HS_VNNI INLINE __m512i block_pair_vnni(const unpacked *u0, const unpacked *u1, const pair_factors *f,
                                       const int type, const int b, const __m512i x[GROUP], const __m512i x_sums,
                                       const __m512i half_sums, const __m512i place[GROUP]) {
    __m512i both = join(u0->q + 32 * b, u1->q + 32 * b);
    __m512i chains[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
    const int shift = unsigned_shift(type);
    if (shift) both = _mm512_add_epi8(both, _mm512_set1_epi8((char)(1 << shift)));
    if (type == HS_Q6_K) { /* a chain per half-block: each takes its own scale */
        chains[0] = _mm512_sub_epi32(chains[0], _mm512_slli_epi32(half_sums, shift));
        chains[1] = _mm512_sub_epi32(chains[1], _mm512_slli_epi32(_mm512_sub_epi32(x_sums, half_sums), shift));
    } else if (shift) {
        chains[0] = _mm512_sub_epi32(chains[0], _mm512_slli_epi32(x_sums, shift));
    }
    for (int k = 0; k < GROUP; k++) {
        const int chain = type == HS_Q6_K ? k / 4 : k & 1; /* else two chains: vpdpbusd waits for its sum */
        chains[chain] = _mm512_dpbusd_epi32(chains[chain], _mm512_permutexvar_epi32(place[k], both), x[k]);
    }
    if (type == HS_Q6_K)
        return _mm512_add_epi32(_mm512_mullo_epi32(chains[0], _mm512_permutexvar_epi32(place[b], f->scale)),
                                _mm512_mullo_epi32(chains[1], _mm512_permutexvar_epi32(place[b], f->scale_hi)));
    const __m512i products = _mm512_add_epi32(chains[0], chains[1]);
    if (hs_unpacked_super(type)) return _mm512_mullo_epi32(products, _mm512_permutexvar_epi32(place[b], f->scale));
    return products;
}

/* One group of 8 rows times chunk c of `pairs` (1 or 2) pairs of weight rows: acc[p] += each
 * lane's chunk term (the super-block recipe's v, or chunk_sum's tree of the v_b). A block's
 * activations are loaded once for every pair (the VNNI level always has the block sums). */
HS_VNNI INLINE void group_pairs_vnni(const unpacked *const u[TILE], const pair_factors f[2], const int type,
                                     const int c, const int blocks, const activations *a, const int group,
                                     const int pairs, const __m512i place[GROUP], __m512 acc[2]) {
    __m512 even[2] = {0}, first[2] = {0}, second[2] = {0}; /* chunk_sum's tree, as the terms come */
    __m512i products[2] = {0}, mins[2] = {0};            /* the super-block recipe's I and M */
    const size_t at0 = ((size_t)group * blocks + (size_t)c * SUB) * GROUP;
    for (int b = 0; b < SUB; b++) {
        const size_t at = at0 + (size_t)b * GROUP;
        const int present = b < u[0]->blocks; /* a short chunk's missing blocks: 0 */
        __m512i x[GROUP], x_sums = _mm512_setzero_si512(), half_sums = _mm512_setzero_si512();
        for (int k = 0; k < GROUP; k++)
            x[k] = present ? _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(a->grouped + (at + k) * 4 * GROUP)))
                           : _mm512_setzero_si512();
        if (present) {
            x_sums = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(a->grouped_sum + at)));
            if (type == HS_Q6_K)
                half_sums = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(a->grouped_half_sum + at)));
        }
        for (int p = 0; p < pairs; p++) {
            if (hs_unpacked_super(type)) { /* whole chunks only */
                products[p] = _mm512_add_epi32(
                    products[p], block_pair_vnni(u[2 * p], u[2 * p + 1], &f[p], type, b, x, x_sums, half_sums, place));
                if (has_mins(type))
                    mins[p] = _mm512_add_epi32(mins[p], _mm512_mullo_epi32(x_sums, _mm512_permutexvar_epi32(place[b], f[p].min)));
                continue;
            }
            __m512 v = _mm512_setzero_ps();
            if (present) {
                const __m512i ints = block_pair_vnni(u[2 * p], u[2 * p + 1], &f[p], type, b, x, x_sums, half_sums, place);
                const __m512 x_scales = _mm512_castsi512_ps(
                    _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(a->grouped_d + at))));
                v = _mm512_mul_ps(_mm512_cvtepi32_ps(ints), _mm512_mul_ps(x_scales, _mm512_permutexvar_ps(place[b], f[p].d)));
                if (has_mins(type))
                    v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(x_sums),
                                        _mm512_mul_ps(x_scales, _mm512_permutexvar_ps(place[b], f[p].offset)), v);
            }
            if (b % 2 == 0) even[p] = v;
            else if (b == 1) first[p] = _mm512_add_ps(even[p], v);
            else if (b == 3) first[p] = _mm512_add_ps(first[p], _mm512_add_ps(even[p], v));
            else if (b == 5) second[p] = _mm512_add_ps(even[p], v);
            else acc[p] = _mm512_add_ps(acc[p], _mm512_add_ps(first[p], _mm512_add_ps(second[p], _mm512_add_ps(even[p], v))));
        }
    }
    if (hs_unpacked_super(type)) { /* super_term's steps */
        const __m512 x_scale = _mm512_castsi512_ps(_mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(a->grouped_d + at0))));
        for (int p = 0; p < pairs; p++) {
            __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(products[p]), _mm512_mul_ps(x_scale, f[p].sd));
            if (has_mins(type)) v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(mins[p]), _mm512_mul_ps(x_scale, f[p].smin), v);
            acc[p] = _mm512_add_ps(acc[p], v);
        }
    }
}

/* All n rows against output features [first, end), TILE weight rows at a time: each chunk of
 * the tile's rows is unpacked once for every row of the call; whole groups go in pairs of
 * weight rows (a lone last row is its own pair's second), the rows outside whole groups one
 * by one (rows_major_vnni). Literal types: each call is compiled for its own. */
HS_VNNI INLINE void features_typed_vnni(const hs_matrix *w, const int type, const activations *a, const int n,
                                        const int first, const int end, float *out) {
    const int blocks = w->cols / HS_BLOCK, chunks = (blocks + SUB - 1) / SUB;
    const int groups = grouped_rows(n) / GROUP, grouped = groups * GROUP < n ? groups * GROUP : n;
    const int rest = n - grouped;
    const size_t stride = hs_unpacked_row_bytes(type, w->cols);
    __m512i place[GROUP]; /* lanes 0-7: dword k of the low half, 8-15: of the high */
    for (int k = 0; k < GROUP; k++)
        place[k] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi32(k)), _mm256_set1_epi32(8 + k), 1);
    unpacked tile_u[TILE];
    __m512 *acc = aligned_alloc(64, sizeof(__m512) * 2 * (size_t)groups);
    if (!acc) abort(); /* a few KB */
    for (int j = first; j < end; j += TILE) {
        const int rows = end - j < TILE ? end - j : TILE, pairs = (rows + 1) / 2;
        const unpacked *u[TILE];
        for (int t = 0; t < TILE; t++) u[t] = &tile_u[t < rows || rows < 1 ? t : rows - 1]; /* a lone row: its own second */
        for (int i = 0; i < 2 * groups; i++) acc[i] = _mm512_setzero_ps();
        float alone[TILE][PAD_FROM] = {{0}};
        for (int c = 0; c < chunks; c++) {
            for (int t = 0; t < rows; t++) {
                const char *chunk = chunk_at((const char *)w->data + stride * (size_t)(j + t), type, c);
                /* the next tile's same chunk (see features_typed_avx2): the tile reads four
                 * rows side by side, so the stream ahead is a tile away */
                for (size_t line = 0; line < chunk_bytes(type); line += 64)
                    _mm_prefetch(chunk + stride * TILE + line, _MM_HINT_T0);
                unpack_avx2(chunk, type, chunk_blocks(blocks, c), &tile_u[t]);
                if (rest > 0) rows_major_vnni(&tile_u[t], type, c, blocks, a, grouped, w->cols, rest, alone[t]);
            }
            const pair_factors f[2] = {factors_of_pair(u[0], u[1], type), factors_of_pair(u[2], u[3], type)};
            for (int g = 0; g < groups; g++) {
                if (pairs == 2) group_pairs_vnni(u, f, type, c, blocks, a, g, 2, place, acc + 2 * g);
                else group_pairs_vnni(u, f, type, c, blocks, a, g, 1, place, acc + 2 * g);
            }
        }
        for (int g = 0; g < groups; g++)
            for (int p = 0; p < pairs; p++) {
                float lanes[2 * GROUP];
                _mm512_storeu_ps(lanes, acc[2 * g + p]);
                for (int r = 0; r < GROUP && g * GROUP + r < n; r++)
                    for (int h = 0; h < 2 && 2 * p + h < rows; h++)
                        out[(size_t)(g * GROUP + r) * w->rows + j + 2 * p + h] = lanes[h * GROUP + r];
            }
        for (int t = 0; t < rows; t++)
            for (int r = 0; r < rest; r++) out[(size_t)(grouped + r) * w->rows + j + t] = alone[t][r];
    }
    free(acc);
}

ROWS_ALONE(HS_VNNI, vnni)

/* Q4_K, Q5_K (unsigned values, with mins), Q6_K (signed, a scale a half-block) and IQ4_XS
 * (signed table values): rows [r0, r0 + m) (m <= FEATURES16_PASS) against 16 weight rows
 * [j, j + 16): each chunk of the 16 rows unpacked, each block transposed so that the 16
 * features sit in the lanes (rows16_transposed; shared by every row of the pass), each row's
 * four activations broadcast; the chunk's integer scales and mins transposed alike, the mins
 * as int16 pairs so that a row's M is four vpdpwssd. Signed values go biased to vpdpbusd's
 * unsigned side, that times the activations' sum taken off: Q6_K's by 32 a half-block
 * (a->half_sum), IQ4_XS's by 128 a block. A lane's integers are rows_major's exact ones (I
 * and M are exact whatever the order) and its float steps super_term's: the same bits. */
HS_VNNI INLINE void super16_in_lanes_vnni(const hs_matrix *w, const int type, const activations *a,
                                          const int r0, const int m, const int j, float *out) {
    const int blocks = w->cols / HS_BLOCK, chunks = blocks / SUB;
    const size_t stride = hs_unpacked_row_bytes(type, w->cols);
    unpacked u[16];
    const __m512i at = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                          _mm512_set1_epi32((int)sizeof(unpacked)));
    __m512 acc[FEATURES16_PASS];
    for (int r = 0; r < m; r++) acc[r] = _mm512_setzero_ps();
    for (int c = 0; c < chunks; c++) {
        for (int f = 0; f < 16; f++) {
            const char *chunk = chunk_at((const char *)w->data + stride * (size_t)(j + f), type, c);
            /* the next 16 rows' same chunk, a row's chunks ahead (rows hold 4-16 of them) */
            for (size_t line = 0; line < chunk_bytes(type); line += 64)
                _mm_prefetch(chunk + 16 * stride + line, _MM_HINT_T0);
            unpack_avx2(chunk, type, SUB, &u[f]);
        }
        __m512i products[FEATURES16_PASS];
        for (int r = 0; r < m; r++) products[r] = _mm512_setzero_si512();
        /* lane f of scales[b]: row f's block b's scale (Q6_K: its two half-block scales, int16,
         * low then high); of min_pairs[i]: its mins of blocks 2i and 2i + 1 (int16 pairs, for
         * vpdpwssd: a chunk's M is four of them a row) */
        __m512i scales[SUB], min_pairs[SUB / 2];
        rows16_transposed(type == HS_Q6_K ? (const char *)u[0].scale : (const char *)u[0].iscale,
                          sizeof(unpacked), scales);
        if (has_mins(type)) {
            __m512i mins[SUB];
            rows16_transposed((const char *)u[0].imin, sizeof(unpacked), mins);
            for (int i = 0; i < SUB / 2; i++)
                min_pairs[i] = _mm512_or_si512(mins[2 * i], _mm512_slli_epi32(mins[2 * i + 1], 16));
        }
        for (int b = 0; b < SUB; b++) {
            __m512i values[HS_BLOCK / 4];
            rows16_transposed((const char *)u[0].q + HS_BLOCK * b, sizeof(unpacked), values);
            if (type == HS_Q6_K) /* 0..63 */
                for (int k = 0; k < HS_BLOCK / 4; k++) values[k] = _mm512_add_epi8(values[k], _mm512_set1_epi8(32));
            if (type == HS_IQ4_XS) /* 1..241 */
                for (int k = 0; k < HS_BLOCK / 4; k++) values[k] = _mm512_xor_si512(values[k], _mm512_set1_epi8((char)0x80));
            const __m512i scale = scales[b];
            for (int r = 0; r < m; r++) {
                const int32_t *x = (const int32_t *)(a->q + (size_t)(r0 + r) * w->cols + (size_t)c * HS_SUPER + HS_BLOCK * b);
                if (type == HS_Q6_K) { /* a chain a half-block: each takes its own scale */
                    const size_t at_block = (size_t)(r0 + r) * blocks + (size_t)c * SUB + b;
                    const int32_t x_sum = a->sum[at_block], low = a->half_sum[at_block];
                    __m512i halves[2] = {_mm512_set1_epi32(-(low << 5)), _mm512_set1_epi32(-((x_sum - low) << 5))};
                    for (int k = 0; k < HS_BLOCK / 4; k++)
                        halves[k / 4] = _mm512_dpbusd_epi32(halves[k / 4], values[k], _mm512_set1_epi32(x[k]));
                    const __m512i scale_lo = _mm512_srai_epi32(_mm512_slli_epi32(scale, 16), 16);
                    const __m512i scale_hi = _mm512_srai_epi32(scale, 16);
                    products[r] = _mm512_add_epi32(products[r], _mm512_add_epi32(_mm512_mullo_epi32(halves[0], scale_lo),
                                                                                 _mm512_mullo_epi32(halves[1], scale_hi)));
                    continue;
                }
                __m512i chains[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
                if (type == HS_IQ4_XS) /* 128 times the block's sum off */
                    chains[0] = _mm512_set1_epi32(-(a->sum[(size_t)(r0 + r) * blocks + (size_t)c * SUB + b] << 7));
                for (int k = 0; k < HS_BLOCK / 4; k++)
                    chains[k & 1] = _mm512_dpbusd_epi32(chains[k & 1], values[k], _mm512_set1_epi32(x[k]));
                products[r] = _mm512_add_epi32(products[r], _mm512_mullo_epi32(_mm512_add_epi32(chains[0], chains[1]), scale));
            }
        }
        const __m512 sd = _mm512_i32gather_ps(at, &u[0].sd, 1);
        const __m512 smin = has_mins(type) ? _mm512_i32gather_ps(at, &u[0].smin, 1) : _mm512_setzero_ps();
        for (int r = 0; r < m; r++) { /* super_term's steps */
            const __m512 x_scale = _mm512_set1_ps(a->d[(size_t)(r0 + r) * blocks + (size_t)c * SUB]);
            __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(products[r]), _mm512_mul_ps(x_scale, sd));
            if (has_mins(type)) { /* the blocks' activation sums (|sum| <= 32 x 127) as int16 pairs */
                const int32_t *sums = a->sum + (size_t)(r0 + r) * blocks + (size_t)c * SUB;
                __m512i mins = _mm512_setzero_si512();
                for (int i = 0; i < SUB / 2; i++) {
                    const uint32_t pair = ((uint32_t)sums[2 * i] & 0xffffu) | (uint32_t)sums[2 * i + 1] << 16;
                    mins = _mm512_dpwssd_epi32(mins, min_pairs[i], _mm512_set1_epi32((int)pair));
                }
                v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(mins), _mm512_mul_ps(x_scale, smin), v);
            }
            acc[r] = _mm512_add_ps(acc[r], v);
        }
    }
    for (int r = 0; r < m; r++) {
        float lanes[16];
        _mm512_storeu_ps(lanes, acc[r]);
        for (int f = 0; f < 16; f++) out[(size_t)(r0 + r) * w->rows + j + f] = lanes[f];
    }
}

HS_VNNI static void features_vnni(const hs_matrix *w, const activations *a, int n, int first, int end,
                                  float *out) {
    if (hs_unpacked_super(w->type) && n >= 2) {
        const int passes = (n + FEATURES16_PASS - 1) / FEATURES16_PASS; /* of equal size */
        for (; first + 16 <= end; first += 16)
            for (int p = 0, r0 = 0; p < passes; p++) {
                const int m = pass_rows(n, r0, p, passes);
#define SUPER16(type)                                                                        \
    switch (m) {                                                                             \
    case 16: super16_in_lanes_vnni(w, type, a, r0, 16, first, out); break;                   \
    case 15: super16_in_lanes_vnni(w, type, a, r0, 15, first, out); break;                   \
    case 14: super16_in_lanes_vnni(w, type, a, r0, 14, first, out); break;                   \
    case 13: super16_in_lanes_vnni(w, type, a, r0, 13, first, out); break;                   \
    case 12: super16_in_lanes_vnni(w, type, a, r0, 12, first, out); break;                   \
    case 11: super16_in_lanes_vnni(w, type, a, r0, 11, first, out); break;                   \
    case 10: super16_in_lanes_vnni(w, type, a, r0, 10, first, out); break;                   \
    case 9: super16_in_lanes_vnni(w, type, a, r0, 9, first, out); break;                     \
    case 8: super16_in_lanes_vnni(w, type, a, r0, 8, first, out); break;                     \
    case 7: super16_in_lanes_vnni(w, type, a, r0, 7, first, out); break;                     \
    case 6: super16_in_lanes_vnni(w, type, a, r0, 6, first, out); break;                     \
    case 5: super16_in_lanes_vnni(w, type, a, r0, 5, first, out); break;                     \
    case 4: super16_in_lanes_vnni(w, type, a, r0, 4, first, out); break;                     \
    case 3: super16_in_lanes_vnni(w, type, a, r0, 3, first, out); break;                     \
    case 2: super16_in_lanes_vnni(w, type, a, r0, 2, first, out); break;                     \
    default: super16_in_lanes_vnni(w, type, a, r0, m, first, out); break;                   \
    }
                if (w->type == HS_Q4_K) {
                    SUPER16(HS_Q4_K)
                } else if (w->type == HS_Q5_K) {
                    SUPER16(HS_Q5_K)
                } else if (w->type == HS_Q6_K) {
                    SUPER16(HS_Q6_K)
                } else {
                    SUPER16(HS_IQ4_XS)
                }
#undef SUPER16
                r0 += m;
            }
        if (first >= end) return;
    }
    TYPED_CALLS(vnni)
}

/* ------------------------------------------------------------------ AVX-VNNI
 * vpdpbusd's VEX form, on 256-bit vectors (CPUs without AVX-512: Intel's client cores since
 * Alder Lake): the AVX2 kernels' passes and chunk tree, each four weights times the 8 rows
 * of a group in one vpdpbusd where AVX2 needs a vpmaddubsw and a 16-bit add (and the signs).
 * The signed values are biased to the unsigned side as in block_pair_vnni: the same integers,
 * the same float steps, the same bits. (Tiles of four weight rows, as at the VNNI level but
 * one row a vector, measured slower at 8 rows: docs/bench/native/avx-vnni.md.) */

HS_AVX_VNNI INLINE __m256i block_sums_avx_vnni(const int type, const __m256i w, const __m256i x) {
    if (has_mins(type)) return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), w, x);
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), _mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
}
HS_AVX_VNNI INLINE __m256i scaled_sums_avx_vnni(const __m256i acc, const int type, const __m256i w, const __m256i x,
                                                const __m256i scale16) {
    return _mm256_dpwssd_avx_epi32(acc, pair_products(type, w, x), scale16);
}
ROWS_MAJOR(HS_AVX_VNNI, avx_vnni)

/* block_sums_in_lanes_avx2's integers with vpdpbusd: two chains a group (Q6_K: one a
 * half-block, each taking its own scale), started at -bias times the activations' sums. */
HS_AVX_VNNI INLINE void block_sums_in_lanes_avx_vnni(const unpacked *u, const int type, const int c, const int b,
                                                     const int blocks, const activations *a, const int group,
                                                     const int count, __m256i sums[2]) {
    const size_t blk = (size_t)c * SUB + b;
    const int shift = unsigned_shift(type);
    int32_t biased[GROUP] __attribute__((aligned(32)));
    const int8_t *weights = u->q + 32 * b;
    if (shift) {
        _mm256_store_si256((__m256i *)biased, _mm256_add_epi8(_mm256_load_si256((const __m256i *)weights),
                                                              _mm256_set1_epi8((char)(1 << shift))));
        weights = (const int8_t *)biased;
    }
    __m256i chains[2][2];
    for (int g = 0; g < count; g++) {
        const size_t at = ((size_t)(group + g) * blocks + blk) * GROUP;
        const __m256i x_sums = _mm256_loadu_si256((const __m256i *)(a->grouped_sum + at));
        chains[g][0] = chains[g][1] = _mm256_setzero_si256();
        if (type == HS_Q6_K) {
            const __m256i half = _mm256_loadu_si256((const __m256i *)(a->grouped_half_sum + at));
            chains[g][0] = _mm256_sub_epi32(chains[g][0], _mm256_slli_epi32(half, shift));
            chains[g][1] = _mm256_sub_epi32(chains[g][1], _mm256_slli_epi32(_mm256_sub_epi32(x_sums, half), shift));
        } else if (shift) {
            chains[g][0] = _mm256_sub_epi32(chains[g][0], _mm256_slli_epi32(x_sums, shift));
        }
    }
    for (int k = 0; k < GROUP; k++) {
        const __m256i w = broadcast4(weights + 4 * k);
        const int chain = type == HS_Q6_K ? k / 4 : k & 1; /* else two chains: vpdpbusd waits for its sum */
        for (int g = 0; g < count; g++)
            chains[g][chain] = _mm256_dpbusd_avx_epi32(chains[g][chain], w, grouped_run(a, group + g, blocks, blk, k));
    }
    for (int g = 0; g < count; g++) {
        if (type == HS_Q6_K)
            sums[g] = _mm256_add_epi32(_mm256_mullo_epi32(chains[g][0], _mm256_set1_epi32(u->scale[2 * b])),
                                       _mm256_mullo_epi32(chains[g][1], _mm256_set1_epi32(u->scale[2 * b + 1])));
        else if (hs_unpacked_super(type))
            sums[g] = _mm256_mullo_epi32(_mm256_add_epi32(chains[g][0], chains[g][1]), _mm256_set1_epi32(u->iscale[b]));
        else
            sums[g] = _mm256_add_epi32(chains[g][0], chains[g][1]);
    }
}
BLOCK_IN_LANES(HS_AVX_VNNI, avx_vnni)
SUPER_IN_LANES(HS_AVX_VNNI, avx_vnni)
ROWS_IN_LANES(HS_AVX_VNNI, avx_vnni)
SUPER8_IN_LANES(HS_AVX_VNNI, avx_vnni, _mm256_dpbusd_avx_epi32, _mm256_dpbusd_avx_epi32, 1)
ROWS_ALONE(HS_AVX_VNNI, avx_vnni)
/* Super-block calls of any width go 8 features in lanes (heavy-100m Q4_K_M T(4) 6.97 -> 4.99 ms,
 * T(12) 15.59 -> 11.96; 8 and 32 rows as fast as groups) */
FEATURES_IN_PASSES(HS_AVX_VNNI, avx_vnni, INT_MAX)
#endif

#if HS_ARM
/* ------------------------------------------------------------------ NEON with the dot product
 * sdot multiplies signed bytes by signed bytes, so every unpacked type's values go as they are
 * (Q4_K's 0..15 and IQ4's -127..113 alike). A block's P_b is the exact integer and the float
 * steps are the portable kernel's, in its order (vfmaq_f32 rounds once, as fmaf): the
 * portable bits. The chunks unpack to the portable C's bytes (unpack_neon). */

/* unpack_portable's values with NEON (its factors as they are): the same bytes, 16 at a time. */
HS_DOTPROD INLINE void unpack_neon(const char *chunk, const int type, const int blocks, unpacked *u) {
    u->blocks = blocks;
    unpack_factors_portable(chunk, type, u);
    const uint8x16_t low4 = vdupq_n_u8(0x0f), sixteen = vdupq_n_u8(16);
    if (type == HS_Q6_K) {
        const block_q6_k *blk = (const block_q6_k *)chunk;
        const uint8x16_t low2 = vdupq_n_u8(3);
        const int8x16_t offset = vdupq_n_s8(32);
        for (int half = 0; half < 2; half++)
            for (int l = 0; l < 32; l += 16) {
                const uint8x16_t a = vld1q_u8(blk->ql + 64 * half + l), b = vld1q_u8(blk->ql + 64 * half + 32 + l);
                const uint8x16_t h = vld1q_u8(blk->qh + 32 * half + l);
                int8_t *q = u->q + 128 * half + l;
#define SIX(low, shift) vsubq_s8(vreinterpretq_s8_u8(vorrq_u8(low, vshlq_n_u8(vandq_u8(vshrq_n_u8(h, shift), low2), 4))), offset)
                vst1q_s8(q, SIX(vandq_u8(a, low4), 0));
                vst1q_s8(q + 32, SIX(vandq_u8(b, low4), 2));
                vst1q_s8(q + 64, SIX(vshrq_n_u8(a, 4), 4));
                vst1q_s8(q + 96, SIX(vshrq_n_u8(b, 4), 6));
#undef SIX
            }
        return;
    }
    if (type == HS_Q4_K || type == HS_Q5_K) { /* each 32 bytes of qs: 64 values, the first 32 low */
        const uint8_t *qs = type == HS_Q4_K ? ((const block_q4_k *)chunk)->qs : ((const block_q5_k *)chunk)->qs;
        for (int c = 0; c < 4; c++)
            for (int l = 0; l < 32; l += 16) {
                const uint8x16_t bytes = vld1q_u8(qs + 32 * c + l);
                uint8x16_t lo = vandq_u8(bytes, low4), hi = vshrq_n_u8(bytes, 4);
                if (type == HS_Q5_K) { /* bit 2c of qh[l]: value l's fifth bit; 2c + 1: 32 + l's */
                    const uint8x16_t qh = vld1q_u8(((const block_q5_k *)chunk)->qh + l);
                    lo = vorrq_u8(lo, vandq_u8(vtstq_u8(qh, vdupq_n_u8((uint8_t)(1 << (2 * c)))), sixteen));
                    hi = vorrq_u8(hi, vandq_u8(vtstq_u8(qh, vdupq_n_u8((uint8_t)(2 << (2 * c)))), sixteen));
                }
                vst1q_s8(u->q + 64 * c + l, vreinterpretq_s8_u8(lo));
                vst1q_s8(u->q + 64 * c + 32 + l, vreinterpretq_s8_u8(hi));
            }
        return;
    }
    /* 16 bytes a block of 32: value j in the low nibble of byte j, j + 16 in the high */
    const int8x16_t table = vld1q_s8(IQ4_VALUES);
    const uint8x16_t spread_lo = {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1}; /* qh's byte j / 8 */
    const uint8x16_t bit = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
    for (int b = 0; b < blocks; b++) {
        const uint8x16_t raw = vld1q_u8(nibbles(chunk, type, b));
        uint8x16_t lo = vandq_u8(raw, low4), hi = vshrq_n_u8(raw, 4);
        int8x16_t lo_s, hi_s;
        if (iq4(type)) {
            lo_s = vqtbl1q_s8(table, lo);
            hi_s = vqtbl1q_s8(table, hi);
        } else {
            if (type == HS_Q5_0 || type == HS_Q5_1) {
                const uint8x16_t qh = vreinterpretq_u8_u32(vdupq_n_u32(fifth_bits(chunk, type, b)));
                const uint8x16_t spread_hi = vaddq_u8(spread_lo, vdupq_n_u8(2));
                lo = vorrq_u8(lo, vandq_u8(vtstq_u8(vqtbl1q_u8(qh, spread_lo), bit), sixteen));
                hi = vorrq_u8(hi, vandq_u8(vtstq_u8(vqtbl1q_u8(qh, spread_hi), bit), sixteen));
            }
            lo_s = vreinterpretq_s8_u8(lo);
            hi_s = vreinterpretq_s8_u8(hi);
            if (type == HS_Q5_0) { /* signed */
                lo_s = vsubq_s8(lo_s, vdupq_n_s8(16));
                hi_s = vsubq_s8(hi_s, vdupq_n_s8(16));
            }
        }
        vst1q_s8(u->q + 32 * b, lo_s);
        vst1q_s8(u->q + 32 * b + 16, hi_s);
    }
}

/* Block b of a chunk times one row's 32 values x: P_b (Q6_K: each half times its scale). */
HS_DOTPROD INLINE int32_t block_product_neon(const unpacked *u, const int type, const int b, const int8_t *x) {
    const int32_t lo = vaddvq_s32(vdotq_s32(vdupq_n_s32(0), vld1q_s8(u->q + 32 * b), vld1q_s8(x)));
    const int32_t hi = vaddvq_s32(vdotq_s32(vdupq_n_s32(0), vld1q_s8(u->q + 32 * b + 16), vld1q_s8(x + 16)));
    return type == HS_Q6_K ? u->scale[2 * b] * lo + u->scale[2 * b + 1] * hi : lo + hi;
}

/* Rows one by one: chunk c (unpacked in u) times rows first_row.. of the row-major
 * activations; acc[r] is row first_row + r's sum. */
HS_DOTPROD INLINE void rows_major_neon(const unpacked *u, const int type, const int c, const int blocks,
                                       const activations *a, const int first_row, const int cols, const int m,
                                       float *acc) {
    for (int r = 0; r < m; r++) {
        const size_t row = (size_t)(first_row + r);
        const int8_t *x = a->q + row * cols + (size_t)c * HS_SUPER;
        if (hs_unpacked_super(type)) {
            int32_t products = 0, mins = 0;
            for (int b = 0; b < SUB; b++) {
                const int32_t p = block_product_neon(u, type, b, x + 32 * b);
                products += type == HS_Q6_K ? p : u->iscale[b] * p;
                if (has_mins(type)) mins += u->imin[b] * a->sum[row * blocks + (size_t)c * SUB + b];
            }
            acc[r] = acc[r] + super_term(type, products, mins, a->d[row * blocks + (size_t)c * SUB], u);
            continue;
        }
        float v[SUB] = {0};
        for (int b = 0; b < u->blocks; b++) {
            const size_t at = row * blocks + (size_t)c * SUB + b;
            v[b] = (float)block_product_neon(u, type, b, x + 32 * b) * (a->d[at] * u->d[b]);
            if (has_mins(type)) v[b] = fmaf((float)a->sum[at], a->d[at] * u->offset[b], v[b]);
        }
        acc[r] = acc[r] + chunk_sum(v);
    }
}

/* Rows in lanes: chunk c times the 8 rows of group `group` (run k of the interleaved
 * activations: values 4k..4k+3 of rows 0..3, then of rows 4..7), each run's four values of
 * the weight row taken by lane; acc (8) += the chunk's tree of each row's v_b. */
HS_DOTPROD INLINE void rows_in_lanes_neon(const unpacked *u, const int type, const int c, const int blocks,
                                          const activations *a, const int group, float *acc) {
    float32x4_t v_lo[SUB], v_hi[SUB];
    int32x4_t products_lo = vdupq_n_s32(0), products_hi = products_lo; /* the super-block recipe's I */
    int32x4_t mins_lo = products_lo, mins_hi = products_lo;             /* ... and M */
    for (int b = 0; b < SUB; b++) {
        v_lo[b] = v_hi[b] = vdupq_n_f32(0.0f);
        if (b >= u->blocks) continue; /* a short chunk's missing block: 0 */
        const size_t blk = (size_t)group * blocks + (size_t)c * SUB + b;
        const int8_t *x = a->grouped + blk * GROUP * HS_BLOCK;
        const int8x16_t w_lo = vld1q_s8(u->q + 32 * b), w_hi = vld1q_s8(u->q + 32 * b + 16);
        int32x4_t lo[2] = {vdupq_n_s32(0), vdupq_n_s32(0)}, hi[2] = {vdupq_n_s32(0), vdupq_n_s32(0)};
#define RUN(k, w, lane, h)                                                                   \
    lo[h] = vdotq_laneq_s32(lo[h], vld1q_s8(x + (k) * 4 * GROUP), w, lane);                  \
    hi[h] = vdotq_laneq_s32(hi[h], vld1q_s8(x + (k) * 4 * GROUP + 16), w, lane);
        RUN(0, w_lo, 0, 0) RUN(1, w_lo, 1, 0) RUN(2, w_lo, 2, 0) RUN(3, w_lo, 3, 0)
        RUN(4, w_hi, 0, 1) RUN(5, w_hi, 1, 1) RUN(6, w_hi, 2, 1) RUN(7, w_hi, 3, 1)
#undef RUN
        int32x4_t p_lo, p_hi; /* P_b of rows 0..3 and 4..7 (exact) */
        if (type == HS_Q6_K) {
            p_lo = vmlaq_n_s32(vmulq_n_s32(lo[0], u->scale[2 * b]), lo[1], u->scale[2 * b + 1]);
            p_hi = vmlaq_n_s32(vmulq_n_s32(hi[0], u->scale[2 * b]), hi[1], u->scale[2 * b + 1]);
        } else {
            p_lo = vaddq_s32(lo[0], lo[1]);
            p_hi = vaddq_s32(hi[0], hi[1]);
        }
        if (hs_unpacked_super(type)) {
            products_lo = type == HS_Q6_K ? vaddq_s32(products_lo, p_lo) : vmlaq_n_s32(products_lo, p_lo, u->iscale[b]);
            products_hi = type == HS_Q6_K ? vaddq_s32(products_hi, p_hi) : vmlaq_n_s32(products_hi, p_hi, u->iscale[b]);
            if (has_mins(type)) {
                const int32_t *sums = a->grouped_sum + blk * GROUP;
                mins_lo = vmlaq_n_s32(mins_lo, vld1q_s32(sums), u->imin[b]);
                mins_hi = vmlaq_n_s32(mins_hi, vld1q_s32(sums + 4), u->imin[b]);
            }
            continue;
        }
        const float *xd = a->grouped_d + blk * GROUP;
        const float32x4_t d = vdupq_n_f32(u->d[b]);
        v_lo[b] = vmulq_f32(vcvtq_f32_s32(p_lo), vmulq_f32(vld1q_f32(xd), d));
        v_hi[b] = vmulq_f32(vcvtq_f32_s32(p_hi), vmulq_f32(vld1q_f32(xd + 4), d));
        if (has_mins(type)) {
            const int32_t *sums = a->grouped_sum + blk * GROUP;
            const float32x4_t m = vdupq_n_f32(u->offset[b]);
            v_lo[b] = vfmaq_f32(v_lo[b], vcvtq_f32_s32(vld1q_s32(sums)), vmulq_f32(vld1q_f32(xd), m));
            v_hi[b] = vfmaq_f32(v_hi[b], vcvtq_f32_s32(vld1q_s32(sums + 4)), vmulq_f32(vld1q_f32(xd + 4), m));
        }
    }
    if (hs_unpacked_super(type)) { /* super_term's steps */
        const float *xd = a->grouped_d + ((size_t)group * blocks + (size_t)c * SUB) * GROUP;
        const float32x4_t sd = vdupq_n_f32(u->sd), smin = vdupq_n_f32(u->smin);
        float32x4_t lo = vmulq_f32(vcvtq_f32_s32(products_lo), vmulq_f32(vld1q_f32(xd), sd));
        float32x4_t hi = vmulq_f32(vcvtq_f32_s32(products_hi), vmulq_f32(vld1q_f32(xd + 4), sd));
        if (has_mins(type)) {
            lo = vfmaq_f32(lo, vcvtq_f32_s32(mins_lo), vmulq_f32(vld1q_f32(xd), smin));
            hi = vfmaq_f32(hi, vcvtq_f32_s32(mins_hi), vmulq_f32(vld1q_f32(xd + 4), smin));
        }
        vst1q_f32(acc, vaddq_f32(vld1q_f32(acc), lo));
        vst1q_f32(acc + 4, vaddq_f32(vld1q_f32(acc + 4), hi));
        return;
    }
#define TREE(v) vaddq_f32(vaddq_f32(vaddq_f32(v[0], v[1]), vaddq_f32(v[2], v[3])),           \
                          vaddq_f32(vaddq_f32(v[4], v[5]), vaddq_f32(v[6], v[7])))
    vst1q_f32(acc, vaddq_f32(vld1q_f32(acc), TREE(v_lo)));
    vst1q_f32(acc + 4, vaddq_f32(vld1q_f32(acc + 4), TREE(v_hi)));
#undef TREE
}

/* All n rows against output features [first, end): each weight row's chunk unpacked once for
 * every row, whole groups rows in lanes, the rest one by one. */
HS_DOTPROD static void features_neon(const hs_matrix *w, const activations *a, int n, int first, int end,
                                     float *out) {
    const int blocks = w->cols / HS_BLOCK, chunks = (blocks + SUB - 1) / SUB;
    const int groups = grouped_rows(n) / GROUP, grouped = groups * GROUP < n ? groups * GROUP : n;
    const size_t stride = hs_unpacked_row_bytes(w->type, w->cols);
    float *acc = malloc(sizeof(float) * (size_t)(groups * GROUP + n));
    if (!acc) abort(); /* a few KB */
    unpacked u;
    for (int j = first; j < end; j++) {
        const char *wrow = (const char *)w->data + stride * j;
        for (int i = 0; i < groups * GROUP + n; i++) acc[i] = 0.0f;
        for (int c = 0; c < chunks; c++) {
            unpack_neon(chunk_at(wrow, w->type, c), w->type, chunk_blocks(blocks, c), &u);
            for (int g = 0; g < groups; g++) rows_in_lanes_neon(&u, w->type, c, blocks, a, g, acc + g * GROUP);
            if (n > grouped)
                rows_major_neon(&u, w->type, c, blocks, a, grouped, w->cols, n - grouped, acc + groups * GROUP);
        }
        for (int r = 0; r < grouped; r++) out[(size_t)r * w->rows + j] = acc[r];
        for (int r = grouped; r < n; r++) out[(size_t)r * w->rows + j] = acc[groups * GROUP + r - grouped];
    }
    free(acc);
}
#endif

void hs_unpacked_features(const hs_matrix *w, const activations *a, int n, int first, int end,
                          float *out, int simd) {
#if HS_X86
    if (simd >= HS_SIMD_VNNI) {
        features_vnni(w, a, n, first, end, out);
        return;
    }
    if (simd == HS_SIMD_AVX_VNNI) {
        features_avx_vnni(w, a, n, first, end, out);
        return;
    }
    if (simd >= HS_SIMD_AVX2) {
        features_avx2(w, a, n, first, end, out);
        return;
    }
#endif
#if HS_ARM
    if (simd >= HS_SIMD_DOTPROD) {
        features_neon(w, a, n, first, end, out);
        return;
    }
#endif
    (void)simd;
    features_portable(w, a, n, first, end, out);
}
