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
    # the benchmark takes its prompts from the demo models' held-out files (models/corpus.py)
    "client": {"hetspec", "hetspec.protocol", "hetspec.models"},
}
# Heavy compute runtimes belong to the worker processes alone (and to models/, whose training
# and export scripts are build tooling that no process of the daemon imports).
RUNTIME_MODULES = {"torch", "llama_cpp", "transformers"}
MAY_IMPORT_RUNTIMES = {"workers", "models"}


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


@pytest.mark.process
def test_daemon_and_client_load_without_torch_or_llama_cpp() -> None:
    code = (
        "import sys, hetspec.daemon.cli, hetspec.client.cli, hetspec.protocol\n"
        "import hetspec.speculative.tree, hetspec.speculative.sampling\n"
        "print(sorted(m for m in ('torch', 'llama_cpp') if m in sys.modules))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert result.stdout.strip() == "[]"
