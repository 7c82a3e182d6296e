"""The layout is the architecture: who may import whom is checked here, statically and live."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Folder -> the other hetspec packages its code may import. protocol/ depends on nothing of
# ours; workers/ and daemon/ depend on protocol/, never on each other (the daemon spawns
# workers). `hetspec` is the root package: the version and the logging setup.
ALLOWED = {
    "hetspec": set(),
    "protocol": set(),
    "speculative": {"hetspec.protocol"},
    # training builds the runtime's own model classes (the draft head, the target's loader)
    "models": {"hetspec.workers", "hetspec.protocol"},
    # the native kernels: C code and its bindings, for the workers alone (GGUF headers are
    # read by protocol's reader, which the daemon uses too)
    "native": {"hetspec.protocol"},
    "workers": {"hetspec", "hetspec.protocol", "hetspec.speculative", "hetspec.native"},
    "daemon": {"hetspec", "hetspec.protocol", "hetspec.speculative"},
    # the shell client's `hetspec bench` is the bench's front door (bench/compare.py)
    "client": {"hetspec", "hetspec.protocol", "hetspec.bench"},
    # every benchmark: may import anything of ours; nothing imports it but the shell client
    "bench": {
        "hetspec",
        "hetspec.protocol",
        "hetspec.speculative",
        "hetspec.workers",
        "hetspec.native",
        "hetspec.daemon",
        "hetspec.client",
        "hetspec.models",
    },
}
# Heavy compute runtimes belong to the worker processes alone (and to models/, whose training
# and export scripts are build tooling that no process of the daemon imports).
RUNTIME_MODULES = {"torch", "llama_cpp", "transformers"}
MAY_IMPORT_RUNTIMES = {"workers", "models", "bench"}

# Within a package: subpackage -> the sibling subpackages (or top-level modules, as "module.py")
# it may import. The decoding loop knows workers only as clients; the pure algorithms layer as
# verify < drafting < control, and FlowSpec's tree uses verification alone.
SUBPACKAGES = {
    "daemon": {
        "decode": {"supervision"},
        "supervision": {"config.py", "load"},
        "load": {"config.py", "supervision"},
        "pipeline": {"config.py", "decode", "supervision"},
        "api": {"decode", "load", "supervision", "pipeline", "metrics.py", "service.py"},
    },
    "speculative": {
        "verify": set(),
        "drafting": {"verify"},
        "control": {"drafting", "verify"},
        "flow": {"verify"},
        "constrain": {"verify"},
    },
    "workers": {
        "runtimes": set(),
        "tools": {"runtimes", "process.py"},
    },
}


def imported_modules(path: Path) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            modules.add(node.module)
    return modules


def owning_package(module: str) -> str:
    """`hetspec.daemon.cli` -> `hetspec.daemon`; `hetspec.logs` -> `hetspec`."""
    parts = module.split(".")
    sub = ".".join(parts[:2])
    return sub if len(parts) > 1 and sub.split(".")[1] in ALLOWED else "hetspec"


@pytest.mark.parametrize("folder", sorted(ALLOWED))
def test_folder_imports_only_what_the_architecture_allows(folder: str) -> None:
    itself = "hetspec" if folder == "hetspec" else f"hetspec.{folder}"
    files = sorted((REPO / folder).rglob("*.py"))
    assert files, f"{folder}/ has no Python code"
    for path in files:
        for module in imported_modules(path):
            top = module.split(".")[0]
            assert top not in set(ALLOWED) - {"hetspec"}, (
                f"{path.relative_to(REPO)} imports bare {module!r}; use hetspec.{module}"
            )
            if top == "hetspec":
                assert owning_package(module) in ALLOWED[folder] | {itself}, (
                    f"{path.relative_to(REPO)} imports {module}, which {folder}/ may not use"
                )
            if folder not in MAY_IMPORT_RUNTIMES:
                assert top not in RUNTIME_MODULES, (
                    f"{path.relative_to(REPO)} imports {top}: only worker processes may"
                )


@pytest.mark.parametrize("package", sorted(SUBPACKAGES))
def test_subpackages_import_only_the_siblings_they_may(package: str) -> None:
    rules = SUBPACKAGES[package]
    assert {p.name for p in (REPO / package).iterdir() if (p / "__init__.py").exists()} == set(
        rules
    ), f"{package}/: a subpackage without a rule here (or a rule without a subpackage)"
    for sub, allowed in rules.items():
        for path in sorted((REPO / package / sub).rglob("*.py")):
            for module in imported_modules(path):
                parts = module.split(".")
                if parts[:2] != ["hetspec", package] or len(parts) < 3 or parts[2] == sub:
                    continue
                target = parts[2] if len(parts) > 3 else f"{parts[2]}.py"
                if (REPO / package / parts[2]).is_dir():
                    target = parts[2]
                assert target in allowed, (
                    f"{path.relative_to(REPO)} imports {module}, which {package}/{sub}/ may not use"
                )


def test_only_the_shell_client_imports_the_bench() -> None:
    for folder in sorted(set(ALLOWED) - {"bench"}):
        for path in sorted((REPO / folder).rglob("*.py")):
            if path.relative_to(REPO).as_posix() == "client/cli.py":
                continue
            for module in imported_modules(path):
                assert not module.startswith("hetspec.bench"), (
                    f"{path.relative_to(REPO)} imports {module}: benchmarks are imported by nothing"
                )


def test_no_two_modules_share_a_name() -> None:
    """One name, one module: a reader who meets ``sampling`` knows which one is meant. Entry
    points (cli.py, __main__.py, config.py of the daemon and the torch model) are exempt."""
    exempt = {"__init__.py", "__main__.py", "cli.py", "runtime.py", "config.py", "model.py"}
    seen: dict[str, Path] = {}
    for folder in sorted(ALLOWED):
        for path in sorted((REPO / folder).rglob("*.py")):
            if path.name in exempt:
                continue
            other = seen.setdefault(path.name, path)
            assert other == path, f"{path.relative_to(REPO)} and {other.relative_to(REPO)}"


@pytest.mark.process
def test_daemon_and_client_load_without_torch_or_llama_cpp() -> None:
    code = (
        "import sys, hetspec.daemon.cli, hetspec.client.cli, hetspec.protocol\n"
        "import hetspec.speculative.verify.tree, hetspec.speculative.verify.distributions\n"
        "print(sorted(m for m in ('torch', 'llama_cpp') if m in sys.modules))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert result.stdout.strip() == "[]"
