/* The AVX-VNNI level's kernels of the unpacked types: unpacked_x86.h's kernels on vpdpbusd's
 * and vpdpwssd's VEX forms, on 256-bit vectors (CPUs without AVX-512: Intel's client cores
 * since Alder Lake): the AVX2 kernels' passes and chunk tree, each four weights times the 8 rows
 * of a group in one vpdpbusd where AVX2 needs a vpmaddubsw and a 16-bit add (and the signs).
 * The signed values are biased to the unsigned side as in block_pair_vnni: the same integers,
 * the same float steps, the same bits. (Tiles of four weight rows, as at the VNNI level but
 * one row a vector, measured slower at 8 rows: docs/bench/native/avx-vnni.md.) */
#include "unpacked.h"
#include "unpacked_x86.h"

#include <limits.h>

#if HS_X86
HS_AVX_VNNI INLINE __m256i block_sums_avx_vnni(const int type, const __m256i w, const __m256i x) {
    if (has_mins(type)) return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), w, x);
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), _mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
}
HS_AVX_VNNI INLINE __m256i scaled_sums_avx_vnni(const __m256i acc, const int type, const __m256i w, const __m256i x,
                                                const __m256i scale16) {
    return _mm256_dpwssd_avx_epi32(acc, pair_products(type, w, x), scale16);
}
ROWS_MAJOR(HS_AVX_VNNI, avx_vnni)

/* block_sums_in_lanes_avx2's integers with vpdpbusd: two chains a group (Q6_K: one a
 * half-block, each taking its own scale), started at -bias times the activations' sums. */
HS_AVX_VNNI INLINE void block_sums_in_lanes_avx_vnni(const unpacked *u, const int type, const int c, const int b,
                                                     const int blocks, const activations *a, const int group,
                                                     const int count, __m256i sums[2]) {
    const size_t blk = (size_t)c * SUB + b;
    const int shift = unsigned_shift(type);
    int32_t biased[GROUP] __attribute__((aligned(32)));
    const int8_t *weights = u->q + 32 * b;
    if (shift) {
        _mm256_store_si256((__m256i *)biased, _mm256_add_epi8(_mm256_load_si256((const __m256i *)weights),
                                                              _mm256_set1_epi8((char)(1 << shift))));
        weights = (const int8_t *)biased;
    }
    __m256i chains[2][2];
    for (int g = 0; g < count; g++) {
        const size_t at = ((size_t)(group + g) * blocks + blk) * GROUP;
        const __m256i x_sums = _mm256_loadu_si256((const __m256i *)(a->grouped_sum + at));
        chains[g][0] = chains[g][1] = _mm256_setzero_si256();
        if (type == HS_Q6_K) {
            const __m256i half = _mm256_loadu_si256((const __m256i *)(a->grouped_half_sum + at));
            chains[g][0] = _mm256_sub_epi32(chains[g][0], _mm256_slli_epi32(half, shift));
            chains[g][1] = _mm256_sub_epi32(chains[g][1], _mm256_slli_epi32(_mm256_sub_epi32(x_sums, half), shift));
        } else if (shift) {
            chains[g][0] = _mm256_sub_epi32(chains[g][0], _mm256_slli_epi32(x_sums, shift));
        }
    }
    for (int k = 0; k < GROUP; k++) {
        const __m256i w = broadcast4(weights + 4 * k);
        const int chain = type == HS_Q6_K ? k / 4 : k & 1; /* else two chains: vpdpbusd waits for its sum */
        for (int g = 0; g < count; g++)
            chains[g][chain] = _mm256_dpbusd_avx_epi32(chains[g][chain], w, grouped_run(a, group + g, blocks, blk, k));
    }
    for (int g = 0; g < count; g++) {
        if (type == HS_Q6_K)
            sums[g] = _mm256_add_epi32(_mm256_mullo_epi32(chains[g][0], _mm256_set1_epi32(u->scale[2 * b])),
                                       _mm256_mullo_epi32(chains[g][1], _mm256_set1_epi32(u->scale[2 * b + 1])));
        else if (hs_unpacked_super(type))
            sums[g] = _mm256_mullo_epi32(_mm256_add_epi32(chains[g][0], chains[g][1]), _mm256_set1_epi32(u->iscale[b]));
        else
            sums[g] = _mm256_add_epi32(chains[g][0], chains[g][1]);
    }
}
BLOCK_IN_LANES(HS_AVX_VNNI, avx_vnni)
SUPER_IN_LANES(HS_AVX_VNNI, avx_vnni)
ROWS_IN_LANES(HS_AVX_VNNI, avx_vnni)
SUPER8_IN_LANES(HS_AVX_VNNI, avx_vnni, _mm256_dpbusd_avx_epi32, _mm256_dpbusd_avx_epi32, 1)
ROWS_ALONE(HS_AVX_VNNI, avx_vnni)
ROWS_ALONE8(HS_AVX_VNNI, avx_vnni, _mm256_dpbusd_avx_epi32)
/* Super-block calls of any width go 8 features in lanes (heavy-100m Q4_K_M T(4) 6.97 -> 4.99 ms,
 * T(12) 15.59 -> 11.96; 8 and 32 rows as fast as groups) */
FEATURES_IN_PASSES(HS_AVX_VNNI, avx_vnni, INT_MAX)
#endif
