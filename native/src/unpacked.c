/* The unpacked types' formats as this library reads them (hs_unpacked_is,
 * hs_unpacked_row_bytes), their rows as floats (hs_unpacked_dequantize_row), the portable C
 * kernel, and each call's kernel level (hs_unpacked_features). The recipes every level follows
 * are in unpacked.h; the levels' kernels in unpacked_avx2.c, unpacked_vnni.c,
 * unpacked_avx_vnni.c and unpacked_neon.c. */
#include "unpacked.h"

int hs_unpacked_is(int type) { return hs_unpacked_super(type) || small_blocks(type); }

/* Values a storage block holds. */
static int block_values(int type) { return small_blocks(type) ? HS_BLOCK : HS_SUPER; }

size_t hs_unpacked_row_bytes(int type, int cols) {
    const int values = block_values(type);
    return cols > 0 && cols % values == 0 ? (size_t)(cols / values) * block_bytes(type) : 0;
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

#define ROW_CHUNK 16         /* rows the portable kernel accumulates at a time */

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

void hs_unpacked_features(const hs_matrix *w, const activations *a, int n, int first, int end,
                          float *out, int simd) {
#if HS_X86
    if (simd >= HS_SIMD_VNNI) {
        hs_unpacked_features_vnni(w, a, n, first, end, out);
        return;
    }
    if (simd == HS_SIMD_AVX_VNNI) {
        hs_unpacked_features_avx_vnni(w, a, n, first, end, out);
        return;
    }
    if (simd >= HS_SIMD_AVX2) {
        hs_unpacked_features_avx2(w, a, n, first, end, out);
        return;
    }
#endif
#if HS_ARM
    if (simd >= HS_SIMD_DOTPROD) {
        hs_unpacked_features_neon(w, a, n, first, end, out);
        return;
    }
#endif
    (void)simd;
    features_portable(w, a, n, first, end, out);
}
