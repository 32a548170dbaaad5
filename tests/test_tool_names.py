"""Each tool's module is named after the tool (dashes as underscores), so `python3 magpie NAME`,
the console script `magpie-NAME` and the file a reader opens all say the same word."""

from __future__ import annotations

from pathlib import Path

from magpie import TOOLS

REPO = Path(__file__).resolve().parent.parent

# Tools whose module may keep another name, with the reason (none now).
NOT_YET: dict[str, str] = {}


def test_every_tools_module_is_named_after_the_tool():
    wrong = {
        name: module
        for name, module in TOOLS.items()
        if module.rsplit(".", 1)[1] != name.replace("-", "_") and NOT_YET.get(name) != module
    }
    assert not wrong, f"tools whose module has another name (rename the module, then magpie/tools.json): {wrong}"


def test_every_tools_module_is_a_file_of_the_package():
    missing = {
        name: module for name, module in TOOLS.items() if not (REPO / (module.replace(".", "/") + ".py")).is_file()
    }
    assert not missing, f"magpie/tools.json names modules with no file: {missing}"
