"""Every tool of the package shows its help without a server."""

from __future__ import annotations

import stat

from magpie import TOOLS
from tests.serving.helpers import MEASURE, run_tool


def test_tools_show_help_without_a_server():
    for name in TOOLS:  # every tool of the package, through its entry point as users run it
        proc = run_tool(name, "--help", timeout=60)
        assert proc.returncode == 0 and "usage:" in proc.stdout, name
    assert (MEASURE / "run_suite.sh").stat().st_mode & stat.S_IXUSR
