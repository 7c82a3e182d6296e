/* The AVX-VNNI level's Q8_0 / Q4_0 kernels: vnni256.h's 256-bit kernels in vpdpbusd's VEX
 * form, for CPUs that have it without AVX-512 (Intel's client cores since Alder Lake). The
 * same exact integers and float steps as the AVX2 kernels: the same bits. */
#include "internal.h"
#include "transposes.h"
#include "kernels_x86.h"

#if HS_X86
/* vnni256.h's kernels in vpdpbusd's VEX form (AVX-VNNI) */
#define V256_ATTR HS_AVX_VNNI
#define V256_DPBUSD _mm256_dpbusd_avx_epi32
#define V256(name) name##_avx_vnni
#include "vnni256.h"
#undef V256_ATTR
#undef V256_DPBUSD
#undef V256

HS_AVX_VNNI void hs_quantized_features_avx_vnni(const hs_matrix *w, const activations *a, int n,
                                                int first, int end, float *out) {
    quantized_features_256_avx_vnni(w, a, n, first, end, out);
}
#endif
