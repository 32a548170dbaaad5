"""Fixtures of the mtp_pruning tests: a vLLM overlay with only mtp_pruning applied (the patch stands
alone), the patch's machinery module loaded on its own, and keep-set files.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from magpie import patches
from magpie.demo.demo_overlay import make_overlay

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
SCRIPTS = REPO / "magpie" / "mtp_pruning"
DRAFT_VOCAB_MODULE = Path("vllm") / "v1" / "spec_decode" / "draft_vocab.py"


@pytest.fixture(scope="session")
def pruning_overlay(tmp_path_factory) -> Path:
    """The installed vLLM with mtp_pruning alone applied, through magpie/patches.py."""
    return make_overlay(tmp_path_factory.mktemp("vllm-mtp_pruning"), ["mtp_pruning"])


@pytest.fixture(scope="session")
def draft_vocab(pruning_overlay):
    """The patch's machinery module, imported from the overlay by path: it needs only torch."""
    return patches.load_file(pruning_overlay / DRAFT_VOCAB_MODULE, "draft_vocab_under_test")
