"""The distribution installs under the one `hetspec` namespace and its commands work."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

import hetspec

pytestmark = pytest.mark.process

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SUBPACKAGES = ("protocol", "speculative", "workers", "daemon", "client", "models")
BUILD_LEFTOVERS = (".git", ".venv", "build", "*.egg-info", ".*_cache", ".hypothesis")


def run(*args: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(a) for a in args], capture_output=True, text=True, cwd=cwd, timeout=120, check=False
    )


def test_subpackages_import_from_their_top_level_folders(tmp_path: Path) -> None:
    code = (
        "import importlib, importlib.util\n"
        f"for name in {SUBPACKAGES!r}:\n"
        "    module = importlib.import_module('hetspec.' + name)\n"
        "    print(module.__file__)\n"
        "    assert importlib.util.find_spec(name) is None, f'bare {name!r} is importable'\n"
    )
    # From another directory, so the repository root is not on sys.path by accident.
    result = run(sys.executable, "-c", code, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    files = [Path(line) for line in result.stdout.split()]
    assert files == [REPO / name / "__init__.py" for name in SUBPACKAGES]


def test_wheel_holds_only_the_hetspec_namespace(tmp_path: Path) -> None:
    # Built from a copy: setuptools writes build/ and *.egg-info next to the sources.
    source = tmp_path / "source"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(*BUILD_LEFTOVERS))
    built = run(
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--no-deps",
        "--no-build-isolation",
        "-q",
        "-w",
        tmp_path / "dist",
        source,
    )
    assert built.returncode == 0, built.stderr
    (wheel,) = (tmp_path / "dist").glob("hetspec-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {name.split("/")[0] for name in names}
    assert top_level == {"hetspec", f"hetspec-{hetspec.__version__}.dist-info"}
    for name in SUBPACKAGES:  # every module, nested packages included
        for module in (REPO / name).rglob("*.py"):
            assert f"hetspec/{name}/{module.relative_to(REPO / name)}" in names
    for page_file in (REPO / "daemon" / "api" / "web").iterdir():  # the web page at /
        assert f"hetspec/daemon/api/web/{page_file.name}" in names

    # Imported from the unpacked wheel alone (no editable finder: -S skips .pth files).
    unpacked = tmp_path / "unpacked"
    zipfile.ZipFile(wheel).extractall(unpacked)
    site_packages = sysconfig.get_paths()["purelib"]
    code = (
        f"import sys, importlib, importlib.util; sys.path[:0] = [{str(unpacked)!r}, "
        f"{site_packages!r}]\n"
        f"for name in {SUBPACKAGES!r}:\n"
        "    assert importlib.import_module('hetspec.' + name).__file__.startswith(sys.path[0])\n"
        "    assert importlib.util.find_spec(name) is None\n"
        "from hetspec.daemon.cli import main\n"
    )
    result = run(sys.executable, "-S", "-c", code, cwd=tmp_path)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("command", ["hetspecd", "hetspec"])
def test_console_scripts_answer_help_and_version(command: str) -> None:
    help_result = run(BIN / command, "--help")
    assert help_result.returncode == 0, help_result.stderr
    assert help_result.stdout.startswith(f"usage: {command}")
    assert "hetspecd" in help_result.stdout

    version = run(BIN / command, "--version")
    assert version.returncode == 0
    assert version.stdout.strip() == f"{command} {hetspec.__version__}"


@pytest.mark.parametrize(("command", "args"), [("hetspecd", []), ("hetspec", ["health"])])
def test_bad_flag_is_one_usage_error_not_a_traceback(command: str, args: list[str]) -> None:
    result = run(BIN / command, *args, "--no-such-flag")
    assert result.returncode == 2
    assert "unrecognized arguments: --no-such-flag" in result.stderr
    assert "Traceback" not in result.stderr
