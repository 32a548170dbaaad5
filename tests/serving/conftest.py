"""Fixtures for the Flash-Next tools' tests (the servers themselves are module fixtures of the
test module that uses them: a start costs about two minutes of CI on two cores)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.serving.helpers import FIXTURES


@pytest.fixture(scope="session")
def gsm8k_fixture() -> Path:
    return FIXTURES / "gsm8k_fixture.jsonl"
