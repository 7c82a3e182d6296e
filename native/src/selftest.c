/* A self-test of the matrix kernels without Python, for builds that cannot run the Python
 * suite here (aarch64 under qemu-user: tests/test_native_cross.py):
 *
 *     selftest     exit 0 after checking, for Q8_0 and Q4_0 weights and 1..33 rows, that
 *                  every kernel level this CPU runs gives the exact integer products (block
 *                  scales 1), and that with real scales each level gives the same bits for a
 *                  row alone and among others, on 1 and 2 threads, and the same bits as the
 *                  portable level where the level promises that (hsnative.h); and for
 *                  Q4_K, Q5_K, Q6_K, Q5_0, Q4_1, Q5_1, IQ4_NL and IQ4_XS weights, the
 *                  dequantized rows' products within int8 activations' error, the portable
 *                  bits at every level, and the same bits for a row alone and among others.
 *
 * Prints the best level and "ok", or the first mismatch. */
#include "hsnative.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define ROWS 37            /* output features: not a multiple of any tile */
#if defined(__aarch64__)
#define SAME_AS_PORTABLE 1 /* the dot-product kernels promise the portable bits */
#else
#define SAME_AS_PORTABLE 0 /* x86's portable C rounds its float steps its own way */
#endif
#define COLS (5 * HS_BLOCK)

static uint32_t state = 12345;
static int next_int(int low, int high) { /* xorshift: the same numbers on every machine */
    state ^= state << 13;
    state ^= state >> 17;
    state ^= state << 5;
    return low + (int)(state % (uint32_t)(high - low + 1));
}

static uint16_t half_of(float f) { /* exact for the scales used here (powers of two) */
    if (f == 1.0f) return 0x3c00;
    if (f == 0.0078125f) return 0x2000; /* 2^-7 */
    return 0x1c00;                      /* 2^-8 */
}

/* weights (ROWS, COLS) of `type` with integer values v and block scales from `scales` */
static void *make_weights(int type, const int *v, const float *scales) {
    const int blocks = COLS / HS_BLOCK, bytes = type == HS_Q8_0 ? 34 : 18;
    unsigned char *data = calloc((size_t)ROWS * blocks, (size_t)bytes);
    for (int j = 0; j < ROWS; j++)
        for (int b = 0; b < blocks; b++) {
            unsigned char *blk = data + ((size_t)j * blocks + b) * bytes;
            const uint16_t d = half_of(scales[j * blocks + b]);
            memcpy(blk, &d, 2);
            for (int k = 0; k < HS_BLOCK; k++) {
                const int value = v[j * COLS + b * HS_BLOCK + k];
                if (type == HS_Q8_0) blk[2 + k] = (unsigned char)(int8_t)value;
                else if (k < 16) blk[2 + k] = (unsigned char)(value + 8);
                else blk[2 + k - 16] |= (unsigned char)((value + 8) << 4);
            }
        }
    return data;
}

static int check(int type, int unit, int best) {
    const int blocks = COLS / HS_BLOCK;
    int *v = malloc(sizeof(int) * ROWS * COLS);
    float *scales = malloc(sizeof(float) * ROWS * blocks);
    for (int i = 0; i < ROWS * COLS; i++)
        v[i] = type == HS_Q8_0 ? next_int(-127, 127) : next_int(-8, 7);
    for (int i = 0; i < ROWS * blocks; i++) scales[i] = unit ? 1.0f : next_int(0, 1) ? 0.0078125f : 0.00390625f;
    void *data = make_weights(type, v, scales);
    hs_matrix w = {type, ROWS, COLS, 0, data};
    float *x = malloc(sizeof(float) * 33 * COLS), *alone = malloc(sizeof(float) * 33 * ROWS),
          *portable = malloc(sizeof(float) * 33 * ROWS), *out = malloc(sizeof(float) * 33 * ROWS);
    for (int i = 0; i < 33 * COLS; i++) /* unit: every block's largest is 127, so scale 1 */
        x[i] = unit ? (i % HS_BLOCK == 0 ? 127.0f : (float)next_int(-127, 127))
                    : (float)next_int(-1000, 1000) / 37.0f;
    int failures = 0;
    for (int r = 0; r < 33; r++) hs_matmul(&w, x + r * COLS, 1, portable + r * ROWS, 1, 0);
    for (int level = 0; level <= best; level++) {
        if (!hs_simd_supported(level)) continue;
        for (int r = 0; r < 33; r++) hs_matmul(&w, x + r * COLS, 1, alone + r * ROWS, 1, level);
        for (int i = 0; SAME_AS_PORTABLE && i < 33 * ROWS; i++)
            if (alone[i] != portable[i] && failures++ < 5)
                printf("type %d level %d: row %d feature %d: %.9g, the portable kernels %.9g\n",
                       type, level, i / ROWS, i % ROWS, alone[i], portable[i]);
        for (int n = 1; n <= 33; n++)
            for (int threads = 1; threads <= 2; threads++) {
                hs_matmul(&w, x, n, out, threads, level);
                for (int i = 0; i < n * ROWS; i++) {
                    const int r = i / ROWS, j = i % ROWS;
                    long long exact = 0;
                    for (int k = 0; k < COLS; k++) exact += (long long)x[r * COLS + k] * v[j * COLS + k];
                    const int wrong = unit ? out[i] != (float)exact : out[i] != alone[i];
                    if (wrong && failures++ < 5)
                        printf("type %d level %d, %d rows on %d threads: row %d feature %d: %.9g, "
                               "expected %.9g\n", type, level, n, threads, r, j, out[i],
                               unit ? (double)exact : (double)alone[i]);
                }
            }
    }
    free(v), free(scales), free(data), free(x), free(alone), free(portable), free(out);
    return failures;
}

/* K-quant, Q5_0, Q4_1, Q5_1, IQ4_NL and IQ4_XS weights: random blocks (their float scales set
 * to small powers of two), against a float reference from their dequantized rows; the same
 * bits at every level (one recipe), and for a row alone and among others, on 1 and 2 threads. */
static int check_unpacked(int type, int best) {
    const int small = type == HS_Q5_0 || type == HS_Q4_1 || type == HS_Q5_1 || type == HS_IQ4_NL;
    const int values = small ? HS_BLOCK : HS_SUPER;
    const int KCOLS = small ? 11 * HS_BLOCK : 2 * HS_SUPER; /* 32-value blocks: a short chunk */
    const size_t bytes = type == HS_Q4_K ? 144 : type == HS_Q5_K ? 176 : type == HS_Q6_K ? 210
                       : type == HS_Q5_0 ? 22 : type == HS_Q4_1 ? 20 : type == HS_Q5_1 ? 24
                       : type == HS_IQ4_NL ? 18 : 136;
    const size_t row = bytes * (size_t)(KCOLS / values);
    unsigned char *data = malloc(ROWS * row);
    for (size_t i = 0; i < ROWS * row; i++) data[i] = (unsigned char)next_int(0, 255);
    for (int s = 0; s < ROWS * (KCOLS / values); s++) { /* d (and dmin): 2^-7 or 2^-8 */
        unsigned char *block = data + bytes * (size_t)s;
        const uint16_t d = next_int(0, 1) ? 0x2000 : 0x1c00, dmin = next_int(0, 1) ? 0x2000 : 0x1c00;
        if (type == HS_Q6_K) memcpy(block + 208, &d, 2);
        else if (type == HS_Q5_0 || type == HS_IQ4_NL) memcpy(block, &d, 2);
        else memcpy(block, &d, 2), memcpy(block + 2, &dmin, 2); /* K-quants' dmin; Q4_1's, Q5_1's m */
    }
    hs_matrix w = {type, ROWS, KCOLS, 0, data};
    float *x = malloc(sizeof(float) * 33 * KCOLS), *alone = malloc(sizeof(float) * 33 * ROWS),
          *out = malloc(sizeof(float) * 33 * ROWS), *weights = malloc(sizeof(float) * ROWS * KCOLS),
          *portable = malloc(sizeof(float) * 33 * ROWS);
    for (int i = 0; i < 33 * KCOLS; i++) x[i] = (float)next_int(-1000, 1000) / 37.0f;
    hs_dequantize_rows(&w, 0, ROWS, weights);
    int failures = 0;
    for (int r = 0; r < 33; r++) hs_matmul(&w, x + r * KCOLS, 1, portable + r * ROWS, 1, 0);
    for (int level = 0; level <= best; level++) {
        if (!hs_simd_supported(level)) continue;
        for (int r = 0; r < 33; r++) hs_matmul(&w, x + r * KCOLS, 1, alone + r * ROWS, 1, level);
        for (int i = 0; i < 33 * ROWS; i++) /* one recipe at every level */
            if (alone[i] != portable[i] && failures++ < 5)
                printf("type %d level %d: row %d feature %d: %.9g, the portable kernels %.9g\n",
                       type, level, i / ROWS, i % ROWS, alone[i], portable[i]);
        for (int i = 0; i < 33 * ROWS; i++) { /* int8 activations: ~1% of the magnitudes */
            const int r = i / ROWS, j = i % ROWS;
            double exact = 0.0, scale = 0.0;
            for (int k = 0; k < KCOLS; k++) {
                exact += (double)x[r * KCOLS + k] * weights[j * KCOLS + k];
                scale += fabs((double)x[r * KCOLS + k] * weights[j * KCOLS + k]);
            }
            if (fabs(alone[i] - exact) > 0.02 * scale + 1e-6 && failures++ < 5)
                printf("type %d level %d: row %d feature %d: %.9g, the dequantized weights give %.9g\n",
                       type, level, r, j, alone[i], exact);
        }
        for (int n = 1; n <= 33; n++)
            for (int threads = 1; threads <= 2; threads++) {
                hs_matmul(&w, x, n, out, threads, level);
                for (int i = 0; i < n * ROWS; i++)
                    if (out[i] != alone[i] && failures++ < 5)
                        printf("type %d level %d, %d rows on %d threads: row %d feature %d: %.9g, "
                               "alone %.9g\n", type, level, n, threads, i / ROWS, i % ROWS, out[i],
                               alone[i]);
            }
    }
    free(data), free(x), free(alone), free(out), free(weights), free(portable);
    return failures;
}

int main(void) {
    const int best = hs_simd_level();
    printf("kernel level %d\n", best);
    int failures = 0;
    for (int unit = 1; unit >= 0; unit--) {
        failures += check(HS_Q8_0, unit, best);
        failures += check(HS_Q4_0, unit, best);
    }
    failures += check_unpacked(HS_Q4_K, best);
    failures += check_unpacked(HS_Q5_K, best);
    failures += check_unpacked(HS_Q6_K, best);
    failures += check_unpacked(HS_Q5_0, best);
    failures += check_unpacked(HS_Q4_1, best);
    failures += check_unpacked(HS_Q5_1, best);
    failures += check_unpacked(HS_IQ4_NL, best);
    failures += check_unpacked(HS_IQ4_XS, best);
    puts(failures ? "FAILED" : "ok");
    return failures != 0;
}
