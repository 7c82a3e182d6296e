/* Weight rows read as floats, as ggml dequantizes them: a token's embedding (hs_embed_row,
 * for the forward) and rows of any type for the caller (hs_dequantize_rows); and the packed
 * copy of a small model's Q8_0 matrices (hs_pack_q8_0) that the kernels read for calls of few
 * rows. The unpacked types' rows come from unpacked.c. */
#include "internal.h"

void hs_embed_row(const hs_matrix *e, int token, float *out) {
    const char *row = (const char *)e->data + row_bytes(e) * (size_t)token;
    switch (e->type) {
    case HS_F32: memcpy(out, row, (size_t)e->cols * 4); break;
    case HS_F16:
        for (int k = 0; k < e->cols; k++) out[k] = half_to_float(((const uint16_t *)row)[k]);
        break;
    case HS_Q8_0:
        for (int b = 0; b < e->cols / HS_BLOCK; b++) {
            const block_q8_0 *blk = (const block_q8_0 *)row + b;
            const float d = half_to_float(blk->d);
            for (int k = 0; k < HS_BLOCK; k++) out[b * HS_BLOCK + k] = d * blk->qs[k];
        }
        break;
    case HS_Q4_0:
        for (int b = 0; b < e->cols / HS_BLOCK; b++) {
            const block_q4_0 *blk = (const block_q4_0 *)row + b;
            const float d = half_to_float(blk->d);
            for (int k = 0; k < HS_BLOCK / 2; k++) {
                out[b * HS_BLOCK + k] = d * ((blk->qs[k] & 0x0f) - 8);
                out[b * HS_BLOCK + k + HS_BLOCK / 2] = d * ((blk->qs[k] >> 4) - 8);
            }
        }
        break;
    default: hs_unpacked_dequantize_row(e->type, row, e->cols, out); break;
    }
}

int hs_dequantize_rows(const hs_matrix *w, int first, int count, float *out) {
    if (!row_bytes(w) || first < 0 || count < 0 || first + count > w->rows) return -1;
    for (int r = 0; r < count; r++) hs_embed_row(w, first + r, out + (size_t)r * w->cols);
    return 0;
}

int hs_pack_q8_0(const hs_matrix *w, int packing, void *out) {
    if (w->type != HS_Q8_0 || w->cols % HS_BLOCK) return -1;
    if (packing != HS_PACKED_UNSIGNED && packing != HS_PACKED_SIGNED) return -1;
    const uint8_t bias = packing == HS_PACKED_UNSIGNED ? 0x80u : 0; /* w + 128: flip the sign bit */
    const int blocks = w->cols / HS_BLOCK;
    const block_q8_0 *rows = w->data;
    char *packed = out;
    for (int g = 0; g < w->rows / 8; g++)
        for (int b = 0; b < blocks; b++, packed += HS_PACKED_BYTES) {
            for (int f = 0; f < 8; f++) {
                const block_q8_0 *block = rows + (size_t)(8 * g + f) * blocks + b;
                const float scale = half_to_float(block->d);
                memcpy(packed + 4 * f, &scale, sizeof scale);
                for (int k = 0; k < HS_BLOCK / 4; k++)
                    for (int i = 0; i < 4; i++) /* unsigned as load_unsigned_weights makes them */
                        packed[32 + 32 * k + 4 * f + i] = (char)((uint8_t)block->qs[4 * k + i] ^ bias);
            }
        }
    return 0;
}
