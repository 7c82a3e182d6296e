/* What the x86 levels' unpacked kernels share (unpacked_avx2.c, unpacked_vnni.c,
 * unpacked_avx_vnni.c): a chunk unpacked with AVX2, the 256-bit recipe steps, and the kernels
 * written once as macros that each level instantiates on its own products (its block_sums,
 * scaled_sums, block_sums_in_lanes and 4-byte dot products): rows one by one (ROWS_MAJOR,
 * ROWS_ALONE), groups of rows in lanes (BLOCK_IN_LANES, SUPER_IN_LANES, ROWS_IN_LANES,
 * FEATURES_IN_PASSES), 8 features in lanes (SUPER8_IN_LANES). Include after unpacked.h. */
#ifndef HS_UNPACKED_X86_H
#define HS_UNPACKED_X86_H

#include "transposes.h"

#if HS_X86
#define PREFETCH_AHEAD 2048 /* bytes of weights the AVX2 kernels ask for ahead of their use */

/* Lanes 0..count-1 all ones, the rest zero: a short chunk's present blocks, for masked loads
 * and gathers that read nothing past them. */
HS_AVX2 INLINE __m256i first_lanes(const int count) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(count), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

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
        /* Each block's first 4 bytes (d, and m or qh's first half) in a dword, by one masked
         * gather: a short chunk's missing blocks read nothing and are 0. Halves written to a
         * stack array one by one and read back as a vector stalled on store forwarding (a
         * quarter of a Q4_1 forward's time). */
        const int bytes = (int)block_bytes(type);
        __m256i words;
        if (u->blocks == SUB) { /* scalar loads: measured faster than the gather */
            int32_t w[SUB];
            for (int b = 0; b < SUB; b++) memcpy(&w[b], chunk + (size_t)b * bytes, 4);
            words = _mm256_setr_epi32(w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7]);
        } else {
            const __m256i at = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(bytes));
            words = _mm256_mask_i32gather_epi32(_mm256_setzero_si256(), (const int *)chunk, at, first_lanes(u->blocks), 1);
        }
        /* dword k's low half (d) to bytes 2k, 2k+1 of each 128-bit lane, its high half (m) to 8+2k, 8+2k+1 */
        const __m256i split = _mm256_shuffle_epi8(words, _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
                                                                          0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15));
        const __m256i halves = _mm256_permute4x64_epi64(split, 0xd8); /* d of blocks 0-7, then their m */
        _mm256_store_ps(u->d, _mm256_cvtph_ps(_mm256_castsi256_si128(halves)));
        _mm256_store_ps(u->offset, has_mins(type) ? _mm256_cvtph_ps(_mm256_extracti128_si256(halves, 1)) : _mm256_setzero_ps());
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
            } else { /* a short chunk: the missing blocks' terms are 0 * 0 (masked loads) */               \
                const __m256i present = first_lanes(u->blocks);                                                \
                x_scales = _mm256_maskload_ps(a->d + at, present);                                             \
                if (has_mins(type)) x_sums = _mm256_maskload_epi32((const int *)(a->sum + at), present);       \
            }                                                                                                  \
            acc[r] = acc[r] + chunk_sum8(block_terms(type, _mm256_cvtepi32_ps(products), x_scales, x_sums,     \
                                                     _mm256_load_ps(u->d), _mm256_load_ps(u->offset)));        \
        }                                                                                                      \
    }

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

/* chunk_sum8 of eight vectors at once: lane t of the result is chunk_sum8(v[t]) (its hadd
 * pairs, their pairs, then the halves' sums added: the same additions, the same bits). */
HS_AVX2 INLINE __m256 chunk_sums8(const __m256 v[8]) {
    const __m256 low = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 high = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(low, high, 0x20), _mm256_permute2f128_ps(low, high, 0x31));
}

/* out[k] lane b = dword k of in[b]: an 8 x 8 transpose of 32-bit lanes. */
HS_AVX2 INLINE void transpose8x8_epi32(const __m256i in[8], __m256i out[8]) {
    __m256i t[8], u[8];
    for (int i = 0; i < 2; i++) {
        const __m256i *v = in + 4 * i;
        t[4 * i] = _mm256_unpacklo_epi32(v[0], v[1]), t[4 * i + 1] = _mm256_unpackhi_epi32(v[0], v[1]);
        t[4 * i + 2] = _mm256_unpacklo_epi32(v[2], v[3]), t[4 * i + 3] = _mm256_unpackhi_epi32(v[2], v[3]);
        u[4 * i] = _mm256_unpacklo_epi64(t[4 * i], t[4 * i + 2]), u[4 * i + 1] = _mm256_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm256_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm256_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int k = 0; k < 4; k++) {
        out[k] = _mm256_permute2x128_si256(u[k], u[4 + k], 0x20);
        out[4 + k] = _mm256_permute2x128_si256(u[k], u[4 + k], 0x31);
    }
}

/* A whole chunk of Q4_1 with its blocks in lanes: w[k] lane b holds values 4k..4k+3 of block
 * b (dword k of its unpacked values), taken from the nibbles directly: dword k of a block's qs
 * holds values 4k.. in its low nibbles and 16 + 4k.. in its high. */
HS_AVX2 INLINE void q4_1_blocks_in_lanes(const char *chunk, __m256i w[8]) {
    __m256i pairs[4]; /* blocks b and b + 4 */
    for (int b = 0; b < 4; b++)
        pairs[b] = _mm256_set_m128i(_mm_loadu_si128((const __m128i *)((const block_q4_1 *)chunk + b + 4)->qs),
                                    _mm_loadu_si128((const __m128i *)((const block_q4_1 *)chunk + b)->qs));
    const __m256i t0 = _mm256_unpacklo_epi32(pairs[0], pairs[1]), t1 = _mm256_unpackhi_epi32(pairs[0], pairs[1]);
    const __m256i t2 = _mm256_unpacklo_epi32(pairs[2], pairs[3]), t3 = _mm256_unpackhi_epi32(pairs[2], pairs[3]);
    const __m256i q[4] = {_mm256_unpacklo_epi64(t0, t2), _mm256_unpackhi_epi64(t0, t2), _mm256_unpacklo_epi64(t1, t3),
                          _mm256_unpackhi_epi64(t1, t3)};
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    for (int k = 0; k < 4; k++) {
        w[k] = _mm256_and_si256(q[k], low4);
        w[4 + k] = _mm256_and_si256(_mm256_srli_epi16(q[k], 4), low4);
    }
}

#define ALONE8_ROWS 8 /* rows a pass of rows_alone8 takes at most */
/* Rows up to which a 32-value type goes 8 features at a time (rows_alone8, in passes of up
 * to ALONE8_ROWS) rather than in groups, per kernel level: Q4_1's whole chunks take their
 * blocks in lanes, which at the AVX-512 VNNI level measured cheaper than a padded group's
 * tiles up to 12 rows (16 rows: the tiles); at AVX2 (vpmaddubsw's products) the tiles won at
 * 6 and 8 rows; the other types (unpacked blocks, not measured on a real file) and the AVX
 * VNNI level (not measured) below a group's PAD_FROM. */
#define Q4_1_ALONE8_MAX_vnni 12
#define Q4_1_ALONE8_MAX_avx_vnni (PAD_FROM - 1)
#define Q4_1_ALONE8_MAX_avx2 (PAD_FROM - 1)
#define ALONE8_MAX(SUFFIX, type) ((type) == HS_Q4_1 ? Q4_1_ALONE8_MAX_##SUFFIX : PAD_FROM - 1)

/* Fewer rows than a group, the 32-value types (Q5_0, Q4_1, Q5_1, IQ4_NL): 8 output features
 * [j, j + 8) at a time. Each feature's chunk is unpacked once and met by every row as
 * rows_major does; a row's 8 chunk terms are summed by chunk_sums8 and its 8 features
 * accumulate in the lanes of one vector (rows_major: a horizontal sum and a scalar add per
 * feature, through memory): the same bits. Defined per kernel level, on its block_sums. */
#define ROWS_ALONE8(ATTR, SUFFIX, DP4)                                                                             \
    ATTR INLINE void rows_alone8_##SUFFIX(const hs_matrix *w, const int type, const activations *a,            \
                                          const int r0, const int n, const int j, float *out) {                              \
        const int blocks = w->cols / HS_BLOCK, chunks = (blocks + SUB - 1) / SUB;                               \
        const size_t stride = hs_unpacked_row_bytes(type, w->cols);                                             \
        __m256 acc[ALONE8_ROWS], v[ALONE8_ROWS][8];                                                                     \
        for (int r = 0; r < n; r++) acc[r] = _mm256_setzero_ps();                                               \
        for (int c = 0; c < chunks; c++) {                                                                      \
            const int present = chunk_blocks(blocks, c);                                                        \
            __m256 x_scales[ALONE8_ROWS];                                                                          \
            __m256i x_sums[ALONE8_ROWS];                                                                           \
            /* a short chunk's missing blocks: scale and sum 0 (a masked load: a memcpy of a                   \
             * variable length here was a libc call a row a chunk, a fifth of a Q4_1 forward) */                \
            const __m256i present_lanes = first_lanes(present);                                                 \
            for (int r = 0; r < n; r++) {                                                                       \
                const size_t at = (size_t)(r0 + r) * blocks + (size_t)c * SUB;                                         \
                x_scales[r] = _mm256_maskload_ps(a->d + at, present_lanes);                                     \
                x_sums[r] = has_mins(type) ? _mm256_maskload_epi32((const int *)(a->sum + at), present_lanes)   \
                                           : _mm256_setzero_si256();                                            \
            }                                                                                                   \
            if (type == HS_Q4_1 && present == SUB) { /* blocks in lanes: no horizontal sums */                \
                __m256i xt[ALONE8_ROWS][8];                                                                        \
                for (int r = 0; r < n; r++) {                                                                   \
                    const int8_t *x = a->q + (size_t)(r0 + r) * w->cols + (size_t)c * HS_SUPER;                        \
                    __m256i xb[8];                                                                              \
                    for (int b = 0; b < SUB; b++) xb[b] = _mm256_loadu_si256((const __m256i *)(x + 32 * b));    \
                    transpose8x8_epi32(xb, xt[r]);                                                              \
                }                                                                                               \
                for (int t = 0; t < 8; t++) {                                                                   \
                    const char *chunk = chunk_at((const char *)w->data + stride * (size_t)(j + t), type, c);    \
                    for (size_t line = 0; line < chunk_bytes(type); line += 64)                                 \
                        _mm_prefetch(chunk + stride * 8 + line, _MM_HINT_T0);                                   \
                    unpacked u;                                                                                 \
                    u.blocks = SUB;                                                                             \
                    unpack_factors_avx2(chunk, type, &u);                                                       \
                    __m256i wt[8];                                                                              \
                    q4_1_blocks_in_lanes(chunk, wt);                                                            \
                    const __m256 d = _mm256_load_ps(u.d), offset = _mm256_load_ps(u.offset);                    \
                    for (int r = 0; r < n; r++) {                                                               \
                        __m256i products[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};                 \
                        for (int k = 0; k < 8; k++) products[k & 1] = DP4(products[k & 1], wt[k], xt[r][k]);    \
                        v[r][t] = block_terms(type, _mm256_cvtepi32_ps(_mm256_add_epi32(products[0], products[1])), \
                                              x_scales[r], x_sums[r], d, offset);                               \
                    }                                                                                           \
                }                                                                                               \
                for (int r = 0; r < n; r++) acc[r] = _mm256_add_ps(acc[r], chunk_sums8(v[r]));                   \
                continue;                                                                                       \
            }                                                                                                   \
            for (int t = 0; t < 8; t++) {                                                                       \
                const char *chunk = chunk_at((const char *)w->data + stride * (size_t)(j + t), type, c);        \
                for (size_t line = 0; line < chunk_bytes(type); line += 64) /* the stream 8 rows on */          \
                    _mm_prefetch(chunk + stride * 8 + line, _MM_HINT_T0);                                       \
                unpacked u;                                                                                     \
                unpack_avx2(chunk, type, present, &u);                                                          \
                const __m256 d = _mm256_load_ps(u.d), offset = _mm256_load_ps(u.offset);                        \
                for (int r = 0; r < n; r++) {                                                                   \
                    const int8_t *x = a->q + (size_t)(r0 + r) * w->cols + (size_t)c * HS_SUPER;                        \
                    __m256i sums[SUB];                                                                          \
                    for (int b = 0; b < SUB; b++)                                                               \
                        sums[b] = b < present                                                                   \
                                      ? block_sums_##SUFFIX(type, _mm256_load_si256((const __m256i *)(u.q + 32 * b)), \
                                                            _mm256_loadu_si256((const __m256i *)(x + 32 * b)))  \
                                      : _mm256_setzero_si256();                                                 \
                    v[r][t] = block_terms(type, _mm256_cvtepi32_ps(block_products(sums)), x_scales[r], x_sums[r], \
                                          d, offset);                                                           \
                }                                                                                               \
            }                                                                                                   \
            for (int r = 0; r < n; r++) acc[r] = _mm256_add_ps(acc[r], chunk_sums8(v[r]));                       \
        }                                                                                                       \
        for (int r = 0; r < n; r++) {                                                                           \
            float lanes[8];                                                                                     \
            _mm256_storeu_ps(lanes, acc[r]);                                                                    \
            memcpy(out + (size_t)(r0 + r) * w->rows + j, lanes, sizeof lanes);                                         \
        }                                                                                                       \
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
    if (small_blocks(type) && n <= ALONE8_MAX(SUFFIX, type)) {                                       \
        const int passes = (n + ALONE8_ROWS - 1) / ALONE8_ROWS;                              \
        for (; first + 8 <= end; first += 8)                                                 \
            for (int p = 0, r0 = 0; p < passes; p++) {                                       \
                const int m = pass_rows(n, r0, p, passes);                                   \
                ALONE8_ROWS_LITERAL(SUFFIX, type, r0, m)                                     \
                r0 += m;                                                                     \
            }                                                                                \
    }                                                                                        \
    if (first < end) {                                                                       \
        if (grouped_rows(n) >= GROUP)                                                        \
            features_typed_##SUFFIX(w, type, a, n, first, end, out);                         \
        else                                                                                 \
            rows_alone_typed_##SUFFIX(w, type, a, n, first, end, out);                       \
    }

/* rows_alone8 with its row count a literal (each compiled for its own: the rows' vectors stay
 * in registers) */
#define ALONE8_ROWS_LITERAL(SUFFIX, type, r0, m)                                             \
    switch (m) {                                                                             \
    case 1: rows_alone8_##SUFFIX(w, type, a, r0, 1, first, out); break;                      \
    case 2: rows_alone8_##SUFFIX(w, type, a, r0, 2, first, out); break;                      \
    case 3: rows_alone8_##SUFFIX(w, type, a, r0, 3, first, out); break;                      \
    case 4: rows_alone8_##SUFFIX(w, type, a, r0, 4, first, out); break;                      \
    case 5: rows_alone8_##SUFFIX(w, type, a, r0, 5, first, out); break;                      \
    case 6: rows_alone8_##SUFFIX(w, type, a, r0, 6, first, out); break;                      \
    case 7: rows_alone8_##SUFFIX(w, type, a, r0, 7, first, out); break;                      \
    default: rows_alone8_##SUFFIX(w, type, a, r0, m, first, out); break;                     \
    }

/* All n rows against output features [first, end): passes of up to two whole groups rows in
 * lanes, the last pass also taking the rows outside whole groups (fewer than PAD_FROM) one
 * by one; each chunk is unpacked once a pass. Literal types: each call is compiled for its
 * own. Defined per kernel level, on that level's rows_in_lanes and rows_major; its
 * hs_unpacked_features_##SUFFIX sends K-quant calls of 2 to SUPER8_MAX_ROWS rows 8 features in lanes
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
    ATTR void hs_unpacked_features_##SUFFIX(const hs_matrix *w, const activations *a, int n, int first,       \
                                            int end, float *out) {                                            \
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

#endif

#endif
