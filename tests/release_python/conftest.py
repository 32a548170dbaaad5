"""Fixtures for the tests that run a series release's own Python (tree.py says what runs here)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.release_python.tree import overlay


@pytest.fixture(scope="session")
def release_overlays(tmp_path_factory):
    """overlays(release) -> three trees of that release, made once per session: "stock", "0001"
    (mtp_pruning/0001 only) and "series" (the whole series)."""
    made: dict[str, dict[str, Path]] = {}

    def overlays(release: str) -> dict[str, Path]:
        if release not in made:
            root = tmp_path_factory.mktemp(f"vllm-{release}")
            made[release] = {
                "stock": overlay(release, root / "stock", []),
                "0001": overlay(release, root / "0001", ["mtp_pruning/0001"]),
                "series": overlay(release, root / "series", None),
            }
        return made[release]

    return overlays
