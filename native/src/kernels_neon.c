/* aarch64's Q8_0 / Q4_0 kernels with the dot product (NEON's sdot): whole groups of 8 rows
 * in lanes by sdot's lane form, the other rows one by one (tested under qemu:
 * tests/test_native_cross.py).
 *
 * sdot multiplies signed bytes by signed bytes, so a block product needs no sign tricks: two
 * (or, rows in lanes, eight) instructions give the exact dot_b, and the float step is the
 * portable recipe's, acc = fma((float)dot_b, x_scale * w_scale, acc): the same bits as the
 * portable kernels, faster. */
#include "internal.h"

#if HS_ARM
/* A block's 32 weights as signed bytes: values 0..15 in lo, 16..31 in hi. */
HS_DOTPROD INLINE void load_signed_weights(const void *wrow, const int type, int b, int8x16_t *lo,
                                          int8x16_t *hi) {
    if (type == HS_Q8_0) {
        const int8_t *qs = ((const block_q8_0 *)wrow)[b].qs;
        *lo = vld1q_s8(qs);
        *hi = vld1q_s8(qs + 16);
        return;
    }
    const uint8x16_t raw = vld1q_u8(((const block_q4_0 *)wrow)[b].qs);
    const int8x16_t eight = vdupq_n_s8(8);
    *lo = vsubq_s8(vreinterpretq_s8_u8(vandq_u8(raw, vdupq_n_u8(0x0f))), eight);
    *hi = vsubq_s8(vreinterpretq_s8_u8(vshrq_n_u8(raw, 4)), eight);
}

/* Rows in lanes: the 8 rows of group `group` times one weight row; run k of the interleaved
 * activations holds values 4k..4k+3 of rows 0..3 (first 16 bytes) and 4..7, and sdot by
 * lane takes the same four weights for each. */
HS_DOTPROD INLINE void rows_in_lanes_neon(const void *wrow, const int type, const int blocks,
                                          const activations *a, const int group, float *result) {
    float32x4_t acc_lo = vdupq_n_f32(0.0f), acc_hi = vdupq_n_f32(0.0f);
    for (int b = 0; b < blocks; b++) {
        int8x16_t w_lo, w_hi;
        load_signed_weights(wrow, type, b, &w_lo, &w_hi);
        const int8_t *x = a->grouped + ((size_t)group * blocks + b) * GROUP * HS_BLOCK;
        int32x4_t lo = vdupq_n_s32(0), hi = vdupq_n_s32(0);
#define RUN(k, w, lane)                                                                      \
    lo = vdotq_laneq_s32(lo, vld1q_s8(x + (k) * 4 * GROUP), w, lane);                         \
    hi = vdotq_laneq_s32(hi, vld1q_s8(x + (k) * 4 * GROUP + 16), w, lane);
        RUN(0, w_lo, 0) RUN(1, w_lo, 1) RUN(2, w_lo, 2) RUN(3, w_lo, 3)
        RUN(4, w_hi, 0) RUN(5, w_hi, 1) RUN(6, w_hi, 2) RUN(7, w_hi, 3)
#undef RUN
        const float32x4_t w_scale = vdupq_n_f32(half_to_float(weight_scale_of(wrow, type, b)));
        const float *x_scales = a->grouped_d + ((size_t)group * blocks + b) * GROUP;
        acc_lo = vfmaq_f32(acc_lo, vcvtq_f32_s32(lo), vmulq_f32(vld1q_f32(x_scales), w_scale));
        acc_hi = vfmaq_f32(acc_hi, vcvtq_f32_s32(hi), vmulq_f32(vld1q_f32(x_scales + 4), w_scale));
    }
    vst1q_f32(result, acc_lo);
    vst1q_f32(result + 4, acc_hi);
}

/* One (row, feature), for the rows outside whole groups. */
HS_DOTPROD static float dot_quantized_neon(const void *wrow, int type, int blocks, const int8_t *x,
                                           const float *xd) {
    float acc = 0.0f;
    for (int b = 0; b < blocks; b++) {
        int8x16_t w_lo, w_hi;
        load_signed_weights(wrow, type, b, &w_lo, &w_hi);
        const int8_t *xb = x + (size_t)b * HS_BLOCK;
        const int32_t dot = vaddvq_s32(vdotq_s32(vdotq_s32(vdupq_n_s32(0), w_lo, vld1q_s8(xb)),
                                                 w_hi, vld1q_s8(xb + 16)));
        acc = fmaf((float)dot, xd[b] * half_to_float(weight_scale_of(wrow, type, b)), acc);
    }
    return acc;
}

/* Output features [first, end) of all n rows: whole groups rows in lanes, the rest one by one;
 * each weight row is read once for all of them (it stays in L1 between the passes). */
HS_DOTPROD void hs_quantized_features_neon(const hs_matrix *w, const activations *a, int n,
                                           int first, int end, float *out) {
    const int blocks = w->cols / HS_BLOCK, groups = grouped_rows(n) / GROUP;
    const int grouped = groups * GROUP < n ? groups * GROUP : n;
    const size_t stride = row_bytes(w);
    float result[GROUP];
    for (int j = first; j < end; j++) {
        const char *wrow = (const char *)w->data + stride * j;
        for (int g = 0; g < groups; g++) {
            if (w->type == HS_Q8_0) rows_in_lanes_neon(wrow, HS_Q8_0, blocks, a, g, result);
            else rows_in_lanes_neon(wrow, HS_Q4_0, blocks, a, g, result);
            for (int r = 0; r < GROUP && g * GROUP + r < n; r++)
                out[(size_t)(g * GROUP + r) * w->rows + j] = result[r];
        }
        for (int r = grouped; r < n; r++)
            out[(size_t)r * w->rows + j] = dot_quantized_neon(
                wrow, w->type, blocks, a->q + (size_t)r * w->cols, a->d + (size_t)r * blocks);
    }
}
#endif
