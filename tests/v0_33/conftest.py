"""Fixtures for the vLLM 0.33.0 tests (what of 0.33 runs here: tree_033.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tree_033 import overlay_033  # noqa: E402


@pytest.fixture(scope="session")
def overlays_033(tmp_path_factory) -> dict[str, Path]:
    """Three 0.33.0 trees: stock, with mtp-pruning/0001 only, and with the whole series."""
    root = tmp_path_factory.mktemp("vllm-0.33.0")
    return {
        "stock": overlay_033(root / "stock", []),
        "0001": overlay_033(root / "0001", ["mtp-pruning/0001"]),
        "series": overlay_033(root / "series", None),
    }
