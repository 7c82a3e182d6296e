"""The one thing pyproject.toml cannot say: the native CPU kernels, an optional C extension.

``optional=True``: on a box without a C compiler (or without OpenMP) the install still
succeeds; the native runtime then says in one line that its kernels were not built, and the
other runtimes keep working.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "hetspec.native._hsnative",
            # one concern a file (native/src/internal.h lists them); selftest.c is the C
            # self-test's main (tests/test_native_cross.py), not part of the module
            sources=[
                "native/src/cpu.c",
                "native/src/weights.c",
                "native/src/activations.c",
                "native/src/matmul.c",
                "native/src/kernels_portable.c",
                "native/src/kernels_avx2.c",
                "native/src/kernels_vnni.c",
                "native/src/kernels_avx_vnni.c",
                "native/src/kernels_neon.c",
                "native/src/unpacked.c",
                "native/src/unpacked_avx2.c",
                "native/src/unpacked_vnni.c",
                "native/src/unpacked_avx_vnni.c",
                "native/src/unpacked_neon.c",
                "native/src/attention.c",
                "native/src/forward.c",
                "native/src/sequences.c",
                "native/src/sampling.c",
                "native/src/module.c",
            ],
            depends=[
                "native/src/hsnative.h",
                "native/src/internal.h",
                "native/src/kernels_x86.h",
                "native/src/transposes.h",
                "native/src/unpacked.h",
                "native/src/unpacked_x86.h",
                "native/src/vnni256.h",
            ],
            # -ffp-contract=off: no fused multiply-add the source did not ask for (width
            # invariance, see native/src/internal.h); SIMD paths are chosen at run time, not
            # by -march.
            extra_compile_args=["-O3", "-std=c11", "-fopenmp", "-ffp-contract=off"],
            extra_link_args=["-fopenmp"],
            optional=True,
        )
    ]
)
