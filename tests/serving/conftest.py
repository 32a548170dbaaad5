"""Fixtures for the Flash-Next tools' tests. A server start costs about two minutes of CI on two
cores: a module that only sends a server requests asks tests/conftest.py's session pool
(`vllm_servers`, `mtp3_server`) for it; a module that tests serve.sh's or the server's own start
and stop starts its own, as a module fixture."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.serving.helpers import FIXTURES


@pytest.fixture(scope="session")
def gsm8k_fixture() -> Path:
    return FIXTURES / "gsm8k_fixture.jsonl"
