"""The release table (magpie/releases.json) for tests: parametrize over its releases instead of
writing them out, and find a release's series and pristine sdist tree.

    from tests.releases import each_series, sdist_tree, series_dir

    @each_series
    def test_the_series_applies(release):
        tree = sdist_tree(release)          # .cache/sdist/vllm-<release> (tests/env/setup.sh)
        ...series_dir(release)...           # patches/vllm-<release>

The markers are evaluated when pytest collects the module, from the table MAGPIE_RELEASES names
(default: magpie/releases.json), so a row added to the table is collected with no test edit.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from magpie import releases

REPO = Path(__file__).resolve().parent.parent
SDIST_DIR = REPO / ".cache" / "sdist"

# `release` over every release with a series, oldest first (ids: the release, e.g. "0.33.0").
each_series = pytest.mark.parametrize("release", releases.series_releases())
# The same without the default release (the flake's suffixed outputs, e.g. `_0_33`).
each_other_series = pytest.mark.parametrize("release", releases.other_series_releases())
# Every release whose sdist tests/env/setup.sh unpacks (`test_sdist`).
each_test_sdist = pytest.mark.parametrize("release", releases.sdists_for_tests())


def series_dir(release: str) -> Path:
    """patches/vllm-<release>: the release's series folder (its `series` file and patches)."""
    return REPO / "patches" / f"vllm-{release}"


def sdist_tree(release: str) -> Path:
    """The pristine sdist tree of a `test_sdist` release, failing with the command that makes it."""
    if release not in releases.sdists_for_tests():
        pytest.fail(f"vLLM {release} has no `test_sdist` in {releases.table_path()}: setup.sh does not fetch it")
    tree = SDIST_DIR / f"vllm-{release}"
    if not (tree / "vllm" / "__init__.py").exists():
        pytest.fail(f"{tree} is missing: run tests/env/setup.sh (tests/run.sh does)")
    return tree
