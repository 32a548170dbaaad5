"""Fixtures for the vLLM 0.33.0 tests (what of 0.33 runs here: tree_033.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.v0_33.tree_033 import overlay_033  # noqa: E402


@pytest.fixture(scope="session")
def overlays_033(tmp_path_factory) -> dict[str, Path]:
    """Three 0.33.0 trees: stock, with mtp_pruning/0001 only, and with the whole series."""
    root = tmp_path_factory.mktemp("vllm-0.33.0")
    return {
        "stock": overlay_033(root / "stock", []),
        "0001": overlay_033(root / "0001", ["mtp_pruning/0001"]),
        "series": overlay_033(root / "series", None),
    }
