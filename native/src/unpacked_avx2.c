/* The AVX2 kernels of the unpacked types (with FMA and F16C): unpacked_x86.h's kernels on
 * vpmaddubsw's pair sums (16-bit while they cannot overflow) and vpmaddwd; every integer exact
 * and every float step unpacked.h's recipe, so the portable recipe's integers and the same bits
 * at every x86 level. */
#include "unpacked.h"
#include "unpacked_x86.h"

#if HS_X86
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

BLOCK_IN_LANES(HS_AVX2, avx2)

SUPER_IN_LANES(HS_AVX2, avx2)

ROWS_IN_LANES(HS_AVX2, avx2)

/* acc + block b's products in pairs times its scale (scale16), in 8 int32 lanes. */
HS_AVX2 INLINE __m256i scaled_sums_avx2(const __m256i acc, const int type, const __m256i w, const __m256i x,
                                        const __m256i scale16) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pair_products(type, w, x), scale16));
}

/* Block b's products in pairs summed to 8 int32 lanes (lanes 0-3 the low half-block's). */
HS_AVX2 INLINE __m256i block_sums_avx2(const int type, const __m256i w, const __m256i x) {
    return _mm256_madd_epi16(pair_products(type, w, x), _mm256_set1_epi16(1));
}

ROWS_MAJOR(HS_AVX2, avx2)

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
ROWS_ALONE8(HS_AVX2, avx2, dp4_avx2)
/* Super-block calls of 2-5 rows go 8 features in lanes; from 6 rows vpmaddubsw's products made
 * groups of rows in lanes as fast or faster (heavy-100m Q4_K_M T(4) 7.56 -> 6.55 ms, T(7)
 * 9.05 against 10.62) */
FEATURES_IN_PASSES(HS_AVX2, avx2, 5)

#endif
