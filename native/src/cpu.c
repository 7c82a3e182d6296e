/* Which kernel levels this CPU runs, and the level a call gets (hs_simd_level,
 * hs_simd_supported, hs_simd_for). Every kernel is compiled for its level by a target
 * attribute (internal.h), never by -march, so one build runs on any CPU of its architecture and
 * each call takes the best level the CPU has at or below its cap. */
#include "internal.h"

#if HS_X86
/* AVX-VNNI: CPUID leaf 7, sub-leaf 1, EAX bit 4 (compilers' CPU-feature builtins name it
 * unevenly), read once when the library loads and never written again: in a VM CPUID traps to
 * the hypervisor (12 us a call measured here), too much for every forward and draft token. */
static int avx_vnni_present;

__attribute__((constructor)) static void read_avx_vnni(void) {
    unsigned eax, ebx, ecx, edx;
    avx_vnni_present = __get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx) && (eax >> 4 & 1);
}
#endif

int hs_simd_supported(int level) {
#if HS_X86
    __builtin_cpu_init();
    const int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                     __builtin_cpu_supports("f16c");
    const int avx512_vnni = avx2 && __builtin_cpu_supports("avx512f") &&
                            __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw") &&
                            __builtin_cpu_supports("avx512vnni");
    switch (level) {
    case HS_SIMD_PORTABLE: return 1;
    case HS_SIMD_AVX2: return avx2;
    case HS_SIMD_AVX_VNNI: return avx2 && avx_vnni_present; /* its kernels use the VEX form */
    case HS_SIMD_VNNI: return avx512_vnni;
    default: return 0;
    }
#elif HS_ARM
    if (level == HS_SIMD_DOTPROD) return (getauxval(AT_HWCAP) & HWCAP_ASIMDDP) != 0;
    return level == HS_SIMD_PORTABLE;
#else
    return level == HS_SIMD_PORTABLE;
#endif
}

int hs_simd_for(int cap) {
#if HS_X86
    const int top = HS_SIMD_VNNI;
#elif HS_ARM
    const int top = HS_SIMD_DOTPROD;
#else
    const int top = HS_SIMD_PORTABLE;
#endif
    int level = cap >= 0 && cap < top ? cap : top;
    while (level > 0 && !hs_simd_supported(level)) level--;
    return level;
}

int hs_simd_level(void) { return hs_simd_for(-1); }
