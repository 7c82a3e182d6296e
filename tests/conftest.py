"""Suite-wide settings: GPU tests skip, with the reason, when CUDA is absent."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_tests = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_tests:
        return
    import torch  # noqa: PLC0415 - only paid for when a GPU test was collected

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device: torch.cuda.is_available() is False here")
    for item in gpu_tests:
        item.add_marker(skip)


@pytest.fixture(scope="session")
def heavy(tmp_path_factory: pytest.TempPathFactory):
    """heavy-100m with every GGUF type, built once per session (about 6 s on 2 cores)."""
    from hetspec.models.heavy import DEFAULT_TYPES, ensure_heavy  # noqa: PLC0415

    return ensure_heavy("100m", DEFAULT_TYPES, tmp_path_factory.mktemp("cache"), quiet=True)
