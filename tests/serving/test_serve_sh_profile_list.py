"""serve.sh's --help lists the profiles from the files of profiles/ (one file is all a profile needs):
a file added to the folder appears with its description and values, and every shipped one does.
Bash and awk only, well under a second."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from magpie.serving import launch
from magpie.serving.process import SERVE_SH

MINE = """\
# my-box: a profile of my own for a test. It says more after the first sentence.
# A second line of the same paragraph.
#
#: ple: true
max-num-seqs: 3
speculative-config:
  method: mtp
  num_speculative_tokens: 2
"""


def _help(serve_sh: Path) -> str:
    proc = subprocess.run(["bash", str(serve_sh), "--help"], capture_output=True, text=True, timeout=30, check=False)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def _entries(text: str) -> dict[str, str]:
    """Profile name -> its entry (description and value lines) in the help's Profiles block."""
    block = text[text.index("\nProfiles (") :].split("\n  PROFILE=/path/x.yaml", 1)[0]
    entries: dict[str, str] = {}
    name = None
    for line in block.splitlines()[3:]:
        if line.startswith("  ") and not line.startswith("   "):
            name = line.split()[0]
            entries[name] = line
        elif name is not None:
            entries[name] += "\n" + line
    return entries


def test_help_lists_every_shipped_profile_file():
    entries = _entries(_help(SERVE_SH))
    assert sorted(entries) == launch.available_profiles()
    assert "max-model-len=65536" in entries["seed-gb10"] and "ple=true" in entries["seed-gb10"]
    assert "one H200 (141 GB of HBM, host memory separate)" in entries["hopper"]


def test_a_profile_file_added_to_the_folder_is_listed(tmp_path):
    copy = tmp_path / "serving"
    shutil.copytree(Path(launch.PROFILE_DIR), copy / "profiles")
    shutil.copy(SERVE_SH, copy / "serve.sh")
    (copy / "profiles" / "my-box.yaml").write_text(MINE)
    entries = _entries(_help(copy / "serve.sh"))
    assert sorted(entries) == sorted([*launch.available_profiles(), "my-box"])
    mine = entries["my-box"]
    assert mine.splitlines()[0].split(None, 1)[1] == "a profile of my own for a test"
    for value in ("ple=true", "max-num-seqs=3", "speculative-config.num_speculative_tokens=2"):
        assert value in mine, mine
