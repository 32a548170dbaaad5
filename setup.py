"""Build glue beside pyproject.toml, for what a static table cannot say:

- the console scripts: one `magpie-<name> = <module>:main` per tool of magpie/tools.json (the one
  tool list; pyproject.toml declares `scripts` dynamic);
- the patch series: patches/ (the checkout's layout, `patches/vllm-<release>/`) is copied into the
  built package as magpie/patch_series/, where an installed magpie/patches.py finds it.
"""

from __future__ import annotations

import json
import os
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = os.path.dirname(os.path.abspath(__file__))
SHIPPED_SERIES = os.path.join("magpie", "patch_series")  # magpie/patches.py's SHIPPED_SERIES


def console_scripts() -> list[str]:
    with open(os.path.join(ROOT, "magpie", "tools.json"), encoding="utf-8") as f:
        tools = json.load(f)["tools"]
    return [f"magpie-{name} = magpie.__main__:console_{name.replace('-', '_')}" for name in tools]


class BuildWithSeries(build_py):
    """build_py, plus patches/ copied into the package. An editable install reads the checkout's
    patches/ in place, so it copies nothing."""

    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return
        source = os.path.join(ROOT, "patches")
        if not os.path.isfile(os.path.join(source, "README.md")):
            raise SystemExit(f"setup.py: {source} is missing: build from a checkout or its sdist")
        dest = os.path.join(self.build_lib, SHIPPED_SERIES)
        shutil.rmtree(dest, ignore_errors=True)
        shutil.copytree(source, dest)


setup(entry_points={"console_scripts": console_scripts()}, cmdclass={"build_py": BuildWithSeries})
