"""Shared fixtures: the pinned vLLM (pristine sdist, installed package, patched overlays), a tiny
Qwen3.5 + MTP model with a tokenizer trained here, and real vLLM servers on 127.0.0.1.

The suite runs under the test venv's interpreter (tests/env/setup.sh); tests/run.sh does both.
"""

from __future__ import annotations

from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent

from magpie import releases  # noqa: E402
from magpie.demo.overlay import installed_vllm_dir, make_overlay, vllm_env  # noqa: E402
from magpie.demo.tiny_models import build_tiny_qwen35, train_tokenizer  # noqa: E402
from magpie.serving.process import VllmServer  # noqa: E402
from tests.releases import sdist_tree  # noqa: E402

# The release the test venv's vLLM is and the flake's default: the release table's default row.
VLLM_VERSION = releases.default()


@pytest.fixture(scope="session")
def sdist_root() -> Path:
    """The pristine source tree of the table's default release (read-only: copy it before
    changing anything)."""
    return sdist_tree(VLLM_VERSION)


@pytest.fixture(scope="session")
def sdist_028_root() -> Path:
    """The pristine vLLM 0.28.0 source tree: the "wrong version" for conflict tests."""
    return sdist_tree("0.28.0")


@pytest.fixture(scope="session")
def site_packages() -> Path:
    """The test venv's site-packages folder holding the installed (pristine) vllm package."""
    return installed_vllm_dir().parent


@pytest.fixture(scope="session")
def patched_vllm(tmp_path_factory) -> Path:
    """An overlay with the whole real patch series applied; put it first on PYTHONPATH."""
    return make_overlay(tmp_path_factory.mktemp("patched-vllm"))


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    return train_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="session")
def tiny_mtp_model(tmp_path_factory, tokenizer_dir) -> Path:
    """Tiny Qwen3.5 + MTP whose greedy continuation is next id = previous id + 1 (all drafts accepted)."""
    return build_tiny_qwen35(tmp_path_factory.mktemp("tiny-mtp") / "model", tokenizer_dir, variant="increment")


@pytest.fixture(scope="session")
def tiny_random_model(tmp_path_factory, tokenizer_dir) -> Path:
    """Tiny Qwen3.5 + MTP with random weights (never compare texts on it)."""
    return build_tiny_qwen35(tmp_path_factory.mktemp("tiny-random") / "model", tokenizer_dir, variant="random")


@pytest.fixture
def vllm_server_factory(tmp_path):
    """Start real vLLM servers; every server started is stopped at teardown."""
    started: list[VllmServer] = []

    def start(model, extra_args=(), env=None, timeout=600, **kwargs) -> VllmServer:
        server = VllmServer(
            model, list(extra_args), env=env or vllm_env(), log_path=tmp_path / f"server{len(started)}.log", **kwargs
        )
        started.append(server)
        return server.start(timeout=timeout)

    yield start
    for server in started:
        server.stop()
