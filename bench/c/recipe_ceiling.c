/* The ceiling of the native Q8_0 kernel's instruction recipe on this CPU, one core, data in L1.
 *
 *     gcc -O3 -mavx2 -mfma bench/c/recipe_ceiling.c -o /tmp/ceiling && /tmp/ceiling
 *
 * Each 32 multiply-adds of rows-in-lanes cost: a broadcast of 4 weights, a load of 8 rows' 4
 * activations, |w| (sign), x * sign(w) (sign), maddubs, madd (widening) and an add. Without
 * VNNI the two signs compete with the multiplies; the recipe's rate here bounds what any
 * kernel built from it reaches. For comparison: the same without the signs (exact only for
 * unsigned-times-signed products, e.g. Q4_0 against offset activations), and 16-bit sums. */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <time.h>

static int8_t weights[34 * 32] __attribute__((aligned(64)));
static int8_t activations[16 * 256] __attribute__((aligned(64)));

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

__attribute__((noinline)) static __m256i run(long repeats, int recipe) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i total = _mm256_setzero_si256();
    for (long r = 0; r < repeats; r++)
        for (int b = 0; b < 32; b++) {
            __m256i sum = _mm256_setzero_si256();
            for (int k = 0; k < 8; k++) {
                const __m256i w = _mm256_castps_si256(
                    _mm256_broadcast_ss((const float *)(weights + 34 * b + 2 + 4 * k)));
                const __m256i x =
                    _mm256_loadu_si256((const __m256i *)(activations + 256 * (b & 15) + 32 * k));
                if (recipe == 0)
                    sum = _mm256_add_epi32(sum, _mm256_madd_epi16(_mm256_maddubs_epi16(
                        _mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w)), ones));
                else if (recipe == 1)
                    sum = _mm256_add_epi32(sum, _mm256_madd_epi16(_mm256_maddubs_epi16(x, w), ones));
                else
                    sum = _mm256_add_epi16(sum, _mm256_maddubs_epi16(x, w));
            }
            total = _mm256_add_epi32(total, sum);
        }
    return total;
}

int main(void) {
    for (int i = 0; i < (int)sizeof weights; i++) weights[i] = (int8_t)(i * 7);
    for (int i = 0; i < (int)sizeof activations; i++) activations[i] = (int8_t)(i * 13);
    const char *names[] = {"Q8_0 recipe: sign, sign, maddubs, madd, add",
                           "without the signs: maddubs, madd, add",
                           "16-bit sums: maddubs, add"};
    for (int recipe = 0; recipe < 3; recipe++) {
        double best = 0;
        for (int round = 0; round < 5; round++) { /* best of 5: a shared VM's noise */
            const long repeats = 40000;
            run(100, recipe);
            const double start = now();
            const __m256i z = run(repeats, recipe);
            const double rate = repeats * 32.0 * 256 / (now() - start) / 1e9;
            if (rate > best) best = rate;
            if (_mm256_extract_epi32(z, 1) == 42) puts("");
        }
        printf("%-46s %6.1f G multiply-adds/s on one core\n", names[recipe], best);
    }
    return 0;
}
