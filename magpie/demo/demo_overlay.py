"""A patched vLLM beside the pristine one: a hard-link copy of the installed package, patched
through magpie/patches.py (the same tool users run), put first on a subprocess's PYTHONPATH.

The venv's own vllm package stays pristine, so one test run can compare stock and patched code.
The patch tool writes each changed file to a new inode and renames it into place, so a patch
never reaches the venv through a hard link.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from magpie import cli

# The patch tool beside this package (a checkout's, or the installed one with its series).
PATCH_TOOL = Path(__file__).resolve().parent.parent / "patches.py"


def installed_vllm_dir() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("vllm is not installed in this interpreter: run tests/env/setup.sh")
    return Path(list(spec.submodule_search_locations)[0])


def make_overlay(dest: str | os.PathLike, selectors: list[str] | None = None, patches_dir=None) -> Path:
    """Copy the installed vllm package into DEST/vllm (hard links) and apply SELECTORS.

    `selectors=None` applies the whole series; `[]` applies nothing (a pristine copy).
    """
    dest = Path(dest)
    if (dest / "vllm").exists():
        raise FileExistsError(f"{dest / 'vllm'} exists already")
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run(["cp", "-al", str(installed_vllm_dir()), str(dest / "vllm")], check=True)
    if selectors is None or selectors:
        cmd = [sys.executable, str(PATCH_TOOL), "apply", "--with-requires", "--target", str(dest)]
        if patches_dir is not None:
            cmd += ["--patches-dir", str(patches_dir)]
        proc = subprocess.run(cmd + list(selectors or []), capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"patches.py apply failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}")
    return dest


def vllm_env(overlay: str | os.PathLike | None = None, **extra: str) -> dict[str, str]:
    """Environment for a subprocess that runs vLLM on the CPU, offline, optionally patched."""
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        VLLM_CPU_KVCACHE_SPACE=env.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
    )
    if overlay is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(overlay)] + [p for p in [env.get("PYTHONPATH")] if p])
        # vLLM caches what it learns of a model class under VLLM_CACHE_ROOT/modelinfos, one file per
        # class that holds its source's hash: a patched copy and the installed package overwrite each
        # other's entry, and each miss inspects the class in a new Python that imports vLLM (~10 s
        # of CPU on two cores). The overlay's own cache root (beside it) keeps both; one you set wins.
        env.setdefault("VLLM_CACHE_ROOT", f"{os.path.abspath(overlay)}.vllm-cache")
    env.update(extra)
    return env


def main(argv: list[str] | None = None) -> int:
    parser = cli.parser(
        "magpie demo-overlay",
        None,
        description="Copy the installed vllm package into DEST/vllm (hard links; the installation stays "
        "stock) and apply the patch series there with magpie/patches.py; put DEST first on PYTHONPATH to "
        "run the patched copy.",
    )
    parser.add_argument("dest", help="a folder without a vllm/ in it")
    parser.add_argument("selectors", nargs="*", help="patches to apply (default: the whole series)")
    args = parser.parse_args(argv)
    try:
        print(make_overlay(args.dest, args.selectors or None))
    except (FileExistsError, RuntimeError) as exc:
        print(f"demo-overlay: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
