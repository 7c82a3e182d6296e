/* The AVX-512 VNNI level's Q8_0 / Q4_0 kernels: vpdpbusd (kernels_x86.h's unsigned weights,
 * the accumulator started at -bias times the activations' block sums) in 512-bit vectors where
 * they pay (16 features in lanes for Q8_0, two groups of 8 rows in lanes for Q4_0) and
 * vnni256.h's 256-bit kernels in its EVEX form for the rest. The same exact integers and float
 * steps as the AVX2 kernels: the same bits. */
#include "internal.h"
#include "transposes.h"
#include "kernels_x86.h"

#if HS_X86
/* Two 256-bit halves as one 512-bit vector (lo in lanes 0-7). */
HS_VNNI INLINE __m512i join256(const void *lo, const void *hi) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)lo)),
                              _mm256_loadu_si256((const __m256i *)hi), 1);
}

/* Rows in lanes for two whole groups (16 rows) in 512-bit vectors: lane r of each vector is
 * row r of the groups, so one broadcast of four weights and one vpdpbusd serve all 16 rows
 * (half the instructions of two 256-bit groups, and the wider vpdpbusd does more products a
 * cycle). `tile` (1 or 4) weight rows share the block's activations, held in 8 registers.
 * Each lane does exactly what rows_in_lanes_vnni's (vnni256.h) does: the same bits. */
HS_VNNI INLINE void rows16_in_lanes_vnni(const char *wrows, const size_t stride, const int type,
                                         const int blocks, const activations *a, const int group,
                                         const int tile, float *result) {
    const int shift = type == HS_Q8_0 ? Q8_BIAS_SHIFT : Q4_BIAS_SHIFT;
    const size_t block_bytes = stride / blocks;
    __m512 acc[4];
    for (int t = 0; t < tile; t++) acc[t] = _mm512_setzero_ps();
    int32_t staged[2][4][HS_BLOCK / 4] __attribute__((aligned(32)));
    stage_tile(wrows, stride, type, 0, tile, block_bytes, staged[0]);
    for (int b = 0; b < blocks; b++) {
        if (b + 1 < blocks) stage_tile(wrows, stride, type, b + 1, tile, block_bytes, staged[(b + 1) & 1]);
        const size_t at = ((size_t)group * blocks + b) * GROUP;
        const size_t next = at + (size_t)blocks * GROUP; /* the second group's block b */
        __m512i x[HS_BLOCK / 4];
        for (int k = 0; k < HS_BLOCK / 4; k++)
            x[k] = join256(a->grouped + (at + k) * 4 * GROUP, a->grouped + (next + k) * 4 * GROUP);
        const __m512i sums = join256(a->grouped_sum + at, a->grouped_sum + next);
        const __m512i start = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(sums, shift));
        const __m512 x_scales = _mm512_castsi512_ps(join256(a->grouped_d + at, a->grouped_d + next));
        for (int t = 0; t < tile; t++) {
            const char *wrow = wrows + stride * t;
            const int32_t *weights = staged[b & 1][t];
            __m512i chains[2] = {start, _mm512_setzero_si512()}; /* vpdpbusd waits on its sum */
            for (int k = 0; k < HS_BLOCK / 4; k++)
                chains[k & 1] = _mm512_dpbusd_epi32(chains[k & 1], _mm512_set1_epi32(weights[k]), x[k]);
            const __m512 w_scale = _mm512_set1_ps(_cvtsh_ss(weight_scale_of(wrow, type, b)));
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(chains[0], chains[1])),
                                     _mm512_mul_ps(x_scales, w_scale), acc[t]);
        }
    }
    for (int t = 0; t < tile; t++) _mm512_storeu_ps(result + t * 2 * GROUP, acc[t]);
}

/* Block b of 16 Q8_0 weight rows `stride` bytes apart, transposed in registers so that lane f
 * of w[k] holds row f's k-th four values (rows16_transposed), made unsigned (w + 128, as
 * load_unsigned_weights); their scales in *w_scales, gathered (each lane's dword starts at its
 * row's block: its low half is the scale). On even blocks it prefetches the next 16 rows'. */
HS_VNNI INLINE void transposed16_q8_0(const char *wrows, const size_t stride, const int b,
                                      const __m512i scale_at, __m512i w[8], __m512 *w_scales) {
    const size_t at = (size_t)b * sizeof(block_q8_0);
    if (!(b & 1))
        for (int f = 0; f < 16; f++) _mm_prefetch(wrows + stride * (16 + f) + at, _MM_HINT_T0);
    rows16_transposed((const char *)((const block_q8_0 *)(wrows + at))->qs, stride, w);
    for (int k = 0; k < HS_BLOCK / 4; k++) w[k] = _mm512_xor_si512(w[k], _mm512_set1_epi8((char)0x80));
    const __m512i scales = _mm512_i32gather_epi32(scale_at, wrows + at, 1);
    *w_scales = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(scales));
}

/* Features in lanes for Q8_0, 16 at a time: m (<= FEATURES16_PASS) row-major rows times 16
 * weight rows `stride` bytes apart, read in place (transposed16_q8_0), each row's four activations
 * broadcast. The same exact dot_b and float steps as features_in_lanes_vnni: the same bits,
 * at twice its products a cycle for 2-8 rows (docs/bench/native/staged-weights.md). */
HS_VNNI INLINE void features16_in_lanes_vnni(const char *wrows, const size_t stride, const int blocks,
                                             const int8_t *xq, const float *xd, const int32_t *xs,
                                             const int cols, const int m, float *result) {
    const __m512i scale_at = _mm512_mullo_epi32(
        _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), _mm512_set1_epi32((int)stride));
    __m512 acc[FEATURES16_PASS];
    for (int r = 0; r < m; r++) acc[r] = _mm512_setzero_ps();
    for (int b = 0; b < blocks; b++) {
        __m512i w[8];
        __m512 w_scales;
        transposed16_q8_0(wrows, stride, b, scale_at, w, &w_scales);
        for (int r = 0; r < m; r++) {
            const int32_t *x = (const int32_t *)(xq + (size_t)r * cols + (size_t)b * HS_BLOCK);
            __m512i chains[2] = {_mm512_set1_epi32(-(xs[(size_t)r * blocks + b] << Q8_BIAS_SHIFT)),
                                 _mm512_setzero_si512()};
            for (int k = 0; k < HS_BLOCK / 4; k++)
                chains[k & 1] = _mm512_dpbusd_epi32(chains[k & 1], w[k], _mm512_set1_epi32(x[k]));
            const __m512 x_scale = _mm512_set1_ps(xd[(size_t)r * blocks + b]);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(chains[0], chains[1])),
                                     _mm512_mul_ps(x_scale, w_scales), acc[r]);
        }
    }
    for (int r = 0; r < m; r++) _mm512_storeu_ps(result + 16 * r, acc[r]);
}

/* rows from which Q8_0 goes 16 features in lanes; a lone row measured the same either way and
 * keeps one_row_in_lanes */
#define IN_PLACE16_FROM 2
/* rows up to which a packed Q8_0 copy serves (passes of 4): it beat 16 features in lanes at
 * every width to 16 on the small models that get a copy (SmolLM2's 30 MB head: T(8) 13.4 ->
 * 12.1 ms; docs/bench/native/q4_1-smollm2.md) */
#define PACKED_MAX_ROWS 16

/* All n rows against output features [j, j + 16) of a Q8_0 matrix, in passes of at most
 * FEATURES16_PASS rows of equal size; literal row counts up to 16 (each call compiled for its
 * own: their accumulators stay in registers), a counted loop beyond. */
HS_VNNI static void features16_passes_vnni(const hs_matrix *w, const activations *a, const int n, const int j,
                                           float *out) {
    const int blocks = w->cols / HS_BLOCK, passes = (n + FEATURES16_PASS - 1) / FEATURES16_PASS;
    const size_t stride = row_bytes(w);
    const char *rows16 = (const char *)w->data + stride * j;
    float result[FEATURES16_PASS * 16];
    for (int p = 0, r0 = 0; p < passes; p++) {
        const int m = pass_rows(n, r0, p, passes);
        const int8_t *q = a->q + (size_t)r0 * w->cols;
        const float *d = a->d + (size_t)r0 * blocks;
        const int32_t *sums = a->sum + (size_t)r0 * blocks;
#define FEATURES16(M) features16_in_lanes_vnni(rows16, stride, blocks, q, d, sums, w->cols, M, result)
        switch (m) {
        case 16: FEATURES16(16); break;
        case 15: FEATURES16(15); break;
        case 14: FEATURES16(14); break;
        case 13: FEATURES16(13); break;
        case 12: FEATURES16(12); break;
        case 11: FEATURES16(11); break;
        case 10: FEATURES16(10); break;
        case 9: FEATURES16(9); break;
        case 8: FEATURES16(8); break;
        case 7: FEATURES16(7); break;
        case 6: FEATURES16(6); break;
        case 5: FEATURES16(5); break;
        case 4: FEATURES16(4); break;
        case 3: FEATURES16(3); break;
        case 2: FEATURES16(2); break;
        default: FEATURES16(m); break;
        }
#undef FEATURES16
        for (int r = 0; r < m; r++)
            for (int f = 0; f < 16; f++) out[(size_t)(r0 + r) * w->rows + j + f] = result[16 * r + f];
        r0 += m;
    }
}

/* The 256-bit kernels, in vpdpbusd's EVEX form (AVX-512 VNNI with VL) */
#define V256_ATTR HS_VNNI
#define V256_DPBUSD _mm256_dpbusd_epi32
#define V256(name) name##_vnni
#include "vnni256.h"
#undef V256_ATTR
#undef V256_DPBUSD
#undef V256

/* hs_quantized_features_avx2's tiling with the VNNI kernels; leftover features go through the
 * AVX2 one-by-one product (the same exact dot_b, so the same bits). */
HS_VNNI void hs_quantized_features_vnni(const hs_matrix *w, const activations *a, int n,
                                        int first, int end, float *out) {
    /* Q8_0: calls of 2 or more rows go 16 features in lanes (one pass over the weights for up
     * to 32 rows, the transposes shared by all: it beat rows in lanes at every width from 2
     * to 128 rows); a packed copy serves up to PACKED_MAX_ROWS rows better (no transposes).
     * Q4_0 goes rows in lanes. */
    const int packed = w->type == HS_Q8_0 && w->packed && n <= PACKED_MAX_ROWS;
    const int in_place16 = w->type == HS_Q8_0 && n >= IN_PLACE16_FROM && !packed;
    const int blocks = w->cols / HS_BLOCK;
    const int groups = in_place16 || packed ? 0 : grouped_rows(n) / GROUP;
    const int grouped = groups * GROUP < n ? groups * GROUP : n;
    const size_t stride = row_bytes(w);
    const char *data = w->data;
    float result[8 * 16];
    for (int g = 0; g < groups; g += 2) {
        const int count = groups - g > 1 ? 2 : 1;
        for (int j = first; j < end;) {
            const int tile = end - j >= 4 ? 4 : 1; /* weight rows a call: the registers allow */
            /* literal counts and tiles: each call is compiled for its own */
            const char *wrows = data + stride * j;
            if (count == 2 && tile == 4) rows16_in_lanes_vnni(wrows, stride, HS_Q4_0, blocks, a, g, 4, result);
            else if (count == 2) rows16_in_lanes_vnni(wrows, stride, HS_Q4_0, blocks, a, g, 1, result);
            else if (tile == 4) rows_in_lanes_vnni(wrows, stride, HS_Q4_0, blocks, a, g, 4, result);
            else rows_in_lanes_vnni(wrows, stride, HS_Q4_0, blocks, a, g, 1, result);
            for (int t = 0; t < tile; t++)
                for (int r = 0; r < GROUP * count && g * GROUP + r < n; r++)
                    out[(size_t)(g * GROUP + r) * w->rows + j + t] = result[t * count * GROUP + r];
            j += tile;
        }
    }
    int j = first;
    if (in_place16)
        for (; j + 16 <= end; j += 16) features16_passes_vnni(w, a, n, j, out);
    PACKED_ROWS(packed_features_vnni, HS_PACKED_UNSIGNED)
    UNGROUPED_ROWS(features_in_lanes_vnni) /* Q4_0's rows outside groups; leftover features */
}

#endif
