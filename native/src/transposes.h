/* The block transposes that the features-in-lanes kernels (kernels_*.c, unpacked_*.c) and
 * bench/c/staging_ceiling.c share (x86; include after internal.h). */
#ifndef HS_TRANSPOSES_H
#define HS_TRANSPOSES_H

#if HS_X86
/* The first two steps of an 8 x 8 transpose of int32, within each 128-bit lane, for 256- and
 * 512-bit vectors alike (W: _mm256 or _mm512, TYPE its integer vector): from v[0..7],
 * u[4 * i + m] gets, in each 128-bit lane, dword m of that lane of v[4i .. 4i + 3]. */
#define TRANSPOSE_LANES_4X4(W, TYPE, v, u)                                                   \
    do {                                                                                     \
        TYPE t_[8];                                                                          \
        for (int i_ = 0; i_ < 4; i_++) {                                                     \
            t_[2 * i_] = W##_unpacklo_epi32((v)[2 * i_], (v)[2 * i_ + 1]);                   \
            t_[2 * i_ + 1] = W##_unpackhi_epi32((v)[2 * i_], (v)[2 * i_ + 1]);               \
        }                                                                                    \
        for (int i_ = 0; i_ < 2; i_++) {                                                     \
            (u)[4 * i_] = W##_unpacklo_epi64(t_[4 * i_], t_[4 * i_ + 2]);                    \
            (u)[4 * i_ + 1] = W##_unpackhi_epi64(t_[4 * i_], t_[4 * i_ + 2]);                \
            (u)[4 * i_ + 2] = W##_unpacklo_epi64(t_[4 * i_ + 1], t_[4 * i_ + 3]);            \
            (u)[4 * i_ + 3] = W##_unpackhi_epi64(t_[4 * i_ + 1], t_[4 * i_ + 3]);            \
        }                                                                                    \
    } while (0)

/* v[f] lane k -> v[k] lane f, for 8 vectors of 8 int32. */
HS_AVX2 INLINE void transpose_8x8_epi32(__m256i v[8]) {
    __m256i u[8];
    TRANSPOSE_LANES_4X4(_mm256, __m256i, v, u);
    for (int i = 0; i < 4; i++) {
        v[i] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x20);
        v[i + 4] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x31);
    }
}

/* 8 rows' 32 bytes at first + stride * f (f = 0..7), transposed: lane f of v[k] holds row f's
 * k-th four bytes. */
HS_AVX2 INLINE void rows8_transposed(const char *first, const size_t stride, __m256i v[8]) {
    for (int f = 0; f < 8; f++) v[f] = _mm256_loadu_si256((const __m256i *)(first + stride * f));
    transpose_8x8_epi32(v);
}

/* 16 rows' 32 bytes at first + stride * f (f = 0..15), transposed: lane f of w[k] holds row
 * f's k-th four bytes. Rows go in as [f | f + 4] pairs, f = 0-3 and 8-11, so that after the
 * unpacks the 128-bit lanes' order is the rows' own. */
HS_VNNI INLINE void rows16_transposed(const char *first, const size_t stride, __m512i w[8]) {
    for (int i = 0; i < 8; i++) {
        const int f = i < 4 ? i : i + 4;
        w[i] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(first + stride * f))),
                                  _mm256_loadu_si256((const __m256i *)(first + stride * (f + 4))), 1);
    }
    __m512i u[8];
    TRANSPOSE_LANES_4X4(_mm512, __m512i, w, u);
    for (int i = 0; i < 4; i++) {
        w[i] = _mm512_shuffle_i32x4(u[i], u[i + 4], 0x88);
        w[i + 4] = _mm512_shuffle_i32x4(u[i], u[i + 4], 0xDD);
    }
}
#endif

#endif
