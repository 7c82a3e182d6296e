/* aarch64's kernels of the unpacked types with the dot product (sdot): chunks unpacked with
 * NEON to the portable C's bytes, whole groups of 8 rows in lanes by sdot's lane form, the
 * other rows one by one, and the portable recipe's float steps in its order: the portable bits
 * (tested under qemu: tests/test_native_cross.py).
 *
 * sdot multiplies signed bytes by signed bytes, so every unpacked type's values go as they are
 * (Q4_K's 0..15 and IQ4's -127..113 alike). A block's P_b is the exact integer and the float
 * steps are the portable kernel's, in its order (vfmaq_f32 rounds once, as fmaf): the
 * portable bits. The chunks unpack to the portable C's bytes (unpack_neon). */
#include "unpacked.h"

#if HS_ARM
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
HS_DOTPROD void hs_unpacked_features_neon(const hs_matrix *w, const activations *a, int n, int first,
                                          int end, float *out) {
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
