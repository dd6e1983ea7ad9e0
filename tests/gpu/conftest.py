"""Tests marked ``gpu`` skip, with the reason, where torch sees no CUDA device; the integration tier's
process fixtures (`spawn`, `cli`, `wait_for`, `start_bootstrap`) serve the tests here that run `join`."""

from __future__ import annotations

import pytest
import torch

from tests.integration.conftest import cli, spawn, start_bootstrap, wait_for  # noqa: F401 (fixtures)


def cuda_missing_reason() -> str | None:
    """Why the CUDA tests cannot run here, or None when they can."""
    if torch.cuda.is_available():
        return None
    return (
        f"no CUDA device: torch {torch.__version__} (built with CUDA {torch.version.cuda or 'none'}) "
        "sees none; run scripts/gpu_check.sh on a GPU machine (docs/gpu.md)"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = cuda_missing_reason()
    if reason is None:
        return
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(pytest.mark.skip(reason=reason))
