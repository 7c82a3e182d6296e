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
            sources=["native/src/hsnative.c", "native/src/unpacked.c", "native/src/module.c"],
            depends=[
                "native/src/hsnative.h",
                "native/src/internal.h",
                "native/src/transposes.h",
                "native/src/vnni256.h",
            ],
            # -ffp-contract=off: no fused multiply-add the source did not ask for (width
            # invariance, see hsnative.c); SIMD paths are chosen at run time, not by -march.
            extra_compile_args=["-O3", "-std=c11", "-fopenmp", "-ffp-contract=off"],
            extra_link_args=["-fopenmp"],
            optional=True,
        )
    ]
)
