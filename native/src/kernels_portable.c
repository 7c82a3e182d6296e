/* The portable C kernels of Q8_0 / Q4_0 and F32 / F16 weights: each (row, feature) by
 * itself, the quantized ones by internal.h's recipe in plain C. Every level's fallback; on
 * aarch64 the dot-product kernels give these very bits. */
#include "internal.h"

/* One (row, feature) of quantized weights by internal.h's recipe, in plain C. */
static float dot_quantized_portable(const void *wrow, int type, int blocks, const int8_t *x,
                                    const float *xd) {
    float acc = 0.0f;
    for (int b = 0; b < blocks; b++) {
        int32_t sum = 0;
        float dw;
        if (type == HS_Q8_0) {
            const block_q8_0 *blk = (const block_q8_0 *)wrow + b;
            for (int k = 0; k < HS_BLOCK; k++) sum += blk->qs[k] * x[b * HS_BLOCK + k];
            dw = half_to_float(blk->d);
        } else {
            const block_q4_0 *blk = (const block_q4_0 *)wrow + b;
            for (int k = 0; k < HS_BLOCK / 2; k++)
                sum += ((blk->qs[k] & 0x0f) - 8) * x[b * HS_BLOCK + k] +
                       ((blk->qs[k] >> 4) - 8) * x[b * HS_BLOCK + k + HS_BLOCK / 2];
            dw = half_to_float(blk->d);
        }
        acc = fmaf((float)sum, xd[b] * dw, acc);
    }
    return acc;
}

static float dot_float_portable(const hs_matrix *w, const void *wrow, const float *x) {
    float acc = 0.0f;
    for (int k = 0; k < w->cols; k++)
        acc += (w->type == HS_F32 ? ((const float *)wrow)[k] : half_to_float(((const uint16_t *)wrow)[k])) * x[k];
    return acc;
}

/* Output features [first, end) of all n rows: one work item. */
void hs_features_portable(const hs_matrix *w, const activations *a, const float *xf, int n,
                          int first, int end, float *out) {
    const size_t stride = row_bytes(w);
    const int blocks = w->cols / HS_BLOCK;
    for (int j = first; j < end; j++) {
        const void *wrow = (const char *)w->data + stride * (size_t)j;
        for (int r = 0; r < n; r++) {
            float value;
            if (is_quantized(w->type))
                value = dot_quantized_portable(wrow, w->type, blocks, a->q + (size_t)r * w->cols,
                                               a->d + (size_t)r * blocks);
            else
                value = dot_float_portable(w, wrow, xf + (size_t)r * w->cols);
            out[(size_t)r * w->rows + j] = value;
        }
    }
}
