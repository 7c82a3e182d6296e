/* The AVX-512 VNNI level's kernels of the unpacked types: vpdpbusd on a tile of four weight
 * rows against whole groups of rows (two weight rows to a 512-bit vector), 16 features in lanes
 * for the super-block types, and unpacked_x86.h's one-row kernels on vpdpbusd and vpdpwssd.
 * The AVX2 kernels' exact integers and float steps: the same bits.
 *
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
#include "unpacked.h"
#include "unpacked_x86.h"

#if HS_X86
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
                /* the next tile's same chunk (see FEATURES_IN_PASSES): the tile reads four
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
ROWS_ALONE8(HS_VNNI, vnni, _mm256_dpbusd_epi32)

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

HS_VNNI void hs_unpacked_features_vnni(const hs_matrix *w, const activations *a, int n, int first, int end,
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

#endif
