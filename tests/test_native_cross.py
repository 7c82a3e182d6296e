"""The native kernels' C self-test (native/src/selftest.c): natively, and for aarch64 under
qemu-user, where the NEON dot-product kernels cannot run otherwise here.

Each run checks, for Q8_0 and Q4_0 weights and 1..33 rows on 1 and 2 threads, exact integer
products at every kernel level the (emulated) CPU offers, the same bits for a row alone and
among others, and on aarch64 the same bits as the portable kernels; for the unpacked types
(Q4_K, Q5_K, Q6_K, Q5_0, Q4_1, Q5_1, IQ4_NL, IQ4_XS), products within int8 activations' error
of the dequantized rows and the same bits at every level and width (on aarch64 their sdot
path against the portable one).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.process

SOURCES = Path(__file__).resolve().parents[1] / "native" / "src"
FLAGS = [
    "-O2",
    "-std=c11",
    "-fopenmp",
    "-ffp-contract=off",
    f"-I{SOURCES}",
    # every kernel source and the self-test's main; module.c is only the Python module's
    *sorted(str(path) for path in SOURCES.glob("*.c") if path.name != "module.c"),
    "-lm",
]


def build(compiler: str, output: Path, *extra: str) -> None:
    result = subprocess.run(
        [compiler, *FLAGS, *extra, "-o", str(output)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr


def run(command: list[str]) -> list[str]:
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout.splitlines()


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")
def test_the_kernels_self_test_passes_on_this_cpu(tmp_path) -> None:
    build("gcc", tmp_path / "selftest")
    lines = run([str(tmp_path / "selftest")])
    assert lines[0].startswith("kernel level ")
    assert lines[-1] == "ok"


CROSS = shutil.which("aarch64-linux-gnu-gcc")
QEMU = shutil.which("qemu-aarch64")


@pytest.mark.skipif(
    CROSS is None or QEMU is None,
    reason="needs Debian's gcc-aarch64-linux-gnu and qemu-user (.ci/run installs "
    "them where it can)",
)
def test_the_aarch64_kernels_pass_under_qemu(tmp_path) -> None:
    binary = tmp_path / "selftest-aarch64"
    build(CROSS, binary, "-static")
    # a CPU with the dot product (ARMv8.2+: the NEON kernels) and one without (portable C)
    assert run([QEMU, "-cpu", "max", str(binary)]) == ["kernel level 1", "ok"]
    assert run([QEMU, "-cpu", "cortex-a53", str(binary)]) == ["kernel level 0", "ok"]
