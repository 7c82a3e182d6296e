/* What the VNNI matrix kernels' block recipes reach on one core, data in L1/L2, against the
 * CPU's vpdpbusd peak (docs/bench/native/staged-weights.md).
 *
 *     gcc -O3 -march=native -Inative/src bench/c/staging_ceiling.c -o /tmp/staging && /tmp/staging
 *
 * 16 rows in lanes, Q8_0, 4 weight rows a tile, the kernel's float steps per block:
 *   "broadcast from a register": each weight row's block made unsigned in a register and its
 *     four-byte groups broadcast from there, a shuffle each (what gcc made of the kernels
 *     before staging: it kept the block in a register rather than reading the store back);
 *   "staged a block ahead": the same blocks stored while the block before is multiplied, and
 *     each group broadcast from memory: a load, no shuffle. vpdpbusd shares its port with
 *     the shuffles, not with loads.
 * 16 features in lanes, Q8_0 read in place: 16 weight rows' blocks transposed in registers,
 *   their scales gathered, m rows' four activations broadcast (features16_in_lanes_vnni). */
#include <stdint.h>
#include <stdio.h>
#include <time.h>

#include "internal.h"
#include "transposes.h"

typedef struct { uint16_t d; int8_t qs[32]; } __attribute__((packed)) block;
enum { BLOCKS = 32, WROWS = 256 };
static block weights[WROWS * BLOCKS];
static __m512i acts[BLOCKS][8]; /* 16 rows in lanes, per block and four values */
static int8_t rows[8][BLOCKS * 32] __attribute__((aligned(64)));
static float out[16 * WROWS];
static volatile float sink;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static void unsigned_into(const block *blk, int32_t to[8]) {
    _mm256_store_si256((__m256i *)to, _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)blk->qs),
                                                       _mm256_set1_epi8((char)0x80)));
}

static inline __m512 finish(const __m512i chains[2], const block *blk, __m512 acc) {
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(chains[0], chains[1])),
                           _mm512_set1_ps(_cvtsh_ss(blk->d) * 0.01f), acc);
}

static inline __m512 from_memory(const int32_t *w, int b, const block *blk, __m512 acc) {
    __m512i chains[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
    for (int k = 0; k < 8; k++)
        chains[k & 1] = _mm512_dpbusd_epi32(chains[k & 1], _mm512_set1_epi32(w[k]), acts[b][k]);
    return finish(chains, blk, acc);
}

static inline __m512 from_register(const block *blk, int b, __m512 acc) {
    const __m512i w = _mm512_castsi256_si512(_mm256_xor_si256(_mm256_loadu_si256((const __m256i *)blk->qs),
                                                              _mm256_set1_epi8((char)0x80)));
    __m512i chains[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
    for (int k = 0; k < 8; k++)
        chains[k & 1] = _mm512_dpbusd_epi32(chains[k & 1], _mm512_permutexvar_epi32(_mm512_set1_epi32(k), w), acts[b][k]);
    return finish(chains, blk, acc);
}

__attribute__((noinline)) static void rows16(int staged) {
    for (int j = 0; j < WROWS; j += 4) {
        __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
        int32_t buf[2][4][8] __attribute__((aligned(32)));
        if (staged)
            for (int t = 0; t < 4; t++) unsigned_into(&weights[(j + t) * BLOCKS], buf[0][t]);
        for (int b = 0; b < BLOCKS; b++) {
            if (staged && b + 1 < BLOCKS)
                for (int t = 0; t < 4; t++) unsigned_into(&weights[(j + t) * BLOCKS + b + 1], buf[(b + 1) & 1][t]);
            for (int t = 0; t < 4; t++) {
                const block *blk = &weights[(j + t) * BLOCKS + b];
                acc[t] = staged ? from_memory(buf[b & 1][t], b, blk, acc[t]) : from_register(blk, b, acc[t]);
            }
        }
        for (int t = 0; t < 4; t++) _mm512_storeu_ps(out + (j + t) * 16, acc[t]);
    }
}

__attribute__((noinline)) static void features16(int m) {
    const size_t stride = BLOCKS * sizeof(block);
    const __m512i at = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                          _mm512_set1_epi32((int)stride));
    for (int j = 0; j < WROWS; j += 16) {
        const char *base = (const char *)&weights[j * BLOCKS];
        __m512 acc[8];
        for (int r = 0; r < m; r++) acc[r] = _mm512_setzero_ps();
        for (int b = 0; b < BLOCKS; b++) {
            __m512i w[8];
            rows16_transposed(base + 34 * b + 2, stride, w);
            for (int k = 0; k < 8; k++) w[k] = _mm512_xor_si512(w[k], _mm512_set1_epi8((char)0x80));
            const __m512 scales = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_i32gather_epi32(at, base + 34 * b, 1)));
            for (int r = 0; r < m; r++) {
                const int32_t *x = (const int32_t *)(rows[r] + 32 * b);
                __m512i chains[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
                for (int k = 0; k < 8; k++)
                    chains[k & 1] = _mm512_dpbusd_epi32(chains[k & 1], w[k], _mm512_set1_epi32(x[k]));
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(chains[0], chains[1])),
                                         _mm512_mul_ps(_mm512_set1_ps(0.01f), scales), acc[r]);
            }
        }
        for (int r = 0; r < m; r++) _mm512_storeu_ps(out + r * WROWS + j, acc[r]);
    }
}

__attribute__((noinline)) static __m512i peak(long n) {
    __m512i c[12];
    for (int i = 0; i < 12; i++) c[i] = _mm512_set1_epi32(i);
    const __m512i a = _mm512_set1_epi8(1), b = _mm512_set1_epi8(2);
    for (long i = 0; i < n; i++)
        for (int j = 0; j < 12; j++) c[j] = _mm512_dpbusd_epi32(c[j], a, b);
    for (int j = 1; j < 12; j++) c[0] = _mm512_add_epi32(c[0], c[j]);
    return c[0];
}

static double best_rate(void (*run)(int), int arg, double macs) {
    double best = 0;
    for (int round = 0; round < 7; round++) { /* best of 7: a shared VM's noise */
        run(arg);
        const double start = now();
        for (int i = 0; i < 200; i++) run(arg);
        const double rate = 200 * macs / (now() - start) / 1e9;
        best = rate > best ? rate : best;
    }
    sink = out[3];
    return best;
}

int main(void) {
    for (int i = 0; i < WROWS * BLOCKS; i++) {
        weights[i].d = (uint16_t)(0x2000 + (i & 255));
        for (int k = 0; k < 32; k++) weights[i].qs[k] = (int8_t)(i * 7 + k * 13);
    }
    for (int b = 0; b < BLOCKS; b++)
        for (int k = 0; k < 8; k++) acts[b][k] = _mm512_set1_epi32(b * 31 + k);
    for (int r = 0; r < 8; r++)
        for (int i = 0; i < BLOCKS * 32; i++) rows[r][i] = (int8_t)(r + i * 3);
    double top = 0;
    for (int round = 0; round < 5; round++) {
        const double start = now();
        const __m512i z = peak(10000000);
        const double rate = 10000000.0 * 12 * 64 / (now() - start) / 1e9;
        top = rate > top ? rate : top;
        if (_mm_cvtsi128_si32(_mm512_castsi512_si128(z)) == 42) puts("");
    }
    printf("vpdpbusd peak (512-bit, 12 chains)          %6.1f G multiply-adds/s\n", top);
    const double macs16 = (double)WROWS * BLOCKS * 32 * 16;
    printf("16 rows in lanes, broadcast from a register %6.1f\n", best_rate(rows16, 0, macs16));
    printf("16 rows in lanes, staged a block ahead       %6.1f\n", best_rate(rows16, 1, macs16));
    for (int m = 2; m <= 8; m *= 2)
        printf("16 features in lanes, in place, %d rows       %6.1f\n", m,
               best_rate(features16, m, (double)WROWS * BLOCKS * 32 * m));
    return 0;
}
