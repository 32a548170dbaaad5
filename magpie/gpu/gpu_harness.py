#!/usr/bin/env python3
"""Run the real vLLM, with this repo's patch series applied, on a GPU machine that has torch but
no package registry, and takes a bounded amount of data per call.

(Over 800 lines, one file: on the GPU machine it runs from the checkout under the machine's own
python3 with nothing installed, and prepare, stage and run share one manifest format.)

The release is the table's `gpu_harness` row (magpie/releases.json; `prepare --release` picks
another release with a series). vLLM's CUDA kernels (`_C_stable_libtorch.abi3.so`,
`_moe_C_stable_libtorch.abi3.so`) are built against libtorch's stable ABI, so they run on the
machine's own torch; what travels is, each xz'd in a folder of its own under .gpu-harness/:

  c      the C kernels from the release's pinned x86_64 wheel
  moe    the MoE kernels (MoE models: Qwen4Exp)
  site   vLLM's Python tree from that wheel, patched with magpie/patches.py from the series as
         committed (git archive HEAD), the pure-Python packages the machine's image lacks (DEPS;
         versions and hashes from the release's requirements file, checked by pip), a stand-in
         for the FlashAttention extension, and the suite's small models or model specs

The wheel's sha256 is checked against the release's requirements file
(requirements/<system>.txt for the default release, requirements/vllm-<release>/ for others).

Commands
  prepare   (this machine, with the test environment's Python: .venv/bin/python magpie ...)
            build .gpu-harness/{c,moe,site}: what the calls carry (--suite mtp|ple picks the
            models the site folder carries; --parts, --dest, --wheel, --release).
  stage     (GPU machine) move carried folders to $GPUH_ROOT (/tmp/gpuh), check their sha256s
            against their manifests, unpack; a site part may come over several calls.
  models    (GPU machine) write a suite's large checkpoints there (they never travel).
  run       (GPU machine) run a suite's configurations (magpie/gpu/suites.py), each one process
            (magpie/gpu/worker.py) with a timeout inside --budget; write $OUT/results.json,
            $OUT/summary.txt and $OUT/log.txt (every process's log). Stops when a
            configuration's vLLM does not start (--keep-going to go on); --skip-done and --only
            resume.
  summary   (anywhere) re-read a results.json and print the comparisons.
  list      print the configurations of each suite.

Results: $OUT/results.json holds, per configuration, the engine's settings as vLLM resolved
them (runner, cudagraph mode, compile mode), the counts of vLLM's own per-step CUDA-graph
decisions and FULL-graph replays, the checks' figures, the log lines that prove which path
ran (runner, cudagraph mode, backends, the patches' own lines) and, for a failure, the log
excerpt that says why. Copy the figures to the optimization's results folder with
`summary --write-to`.

Example (the mtp suite; the folders prepare writes travel to the GPU machine with the checkout):

    .venv/bin/python magpie gpu-harness prepare --suite mtp          # here
    python3 magpie gpu-harness stage .gpu-harness/site \
         && python3 magpie gpu-harness models --suite mtp             # there, first call
    python3 magpie gpu-harness stage .gpu-harness/c \
         && python3 magpie gpu-harness run --suite mtp --budget 540   # there, second call

When the C kernels and the checkout pass a call's 64 MiB (prepare says so), prepare also writes
them as two pieces: carry .gpu-harness/c-1 with the first call and .gpu-harness/c-2 with the
second, whose `stage .gpu-harness/c-2` joins them (the machine keeps the first while warm).

docs/gpu-harness.md: the machine this is made for (a lent H200), the chain of calls that fits
its limits, what each suite costs, and how to add a configuration.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from magpie import cli, files, releases
from magpie.gpu import proof, suites

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
# The machine's system: the wheel, its kernels and the packages carried are x86_64's.
SYSTEM = "x86_64-linux"


def requirements_of(release: str) -> Path:
    """The release's pinned closure for pip --require-hashes (its sha256s check every wheel)."""
    return REPO / releases.requirements_file(release, SYSTEM)


def wheel_name(release: str) -> str:
    """The file name of the release's pinned vLLM wheel (its nix/pins entry)."""
    path = REPO / releases.pins_file(release, SYSTEM)
    try:
        return json.loads(path.read_text())["wheels"]["vllm"]["filename"]
    except (OSError, KeyError, ValueError) as exc:
        raise HarnessError(
            f"{path}: no pinned vllm wheel ({exc}); run `python3 magpie pin-wheels --release {release}`"
        ) from exc


RELEASE = releases.gpu_harness_release()
PINS = requirements_of(RELEASE)
DEST = REPO / ".gpu-harness"
CALL_LIMIT = 64 * 1024 * 1024
KERNELS = {"c": "_C_stable_libtorch.abi3.so", "moe": "_moe_C_stable_libtorch.abi3.so"}
# Left out of the site tree: flash-attn (TRITON_ATTN is used), the Rust front-end, CUDA headers
# for JIT builds, the kernel libraries (their own calls) and other optional kernels.
WHEEL_EXCLUDE = (
    "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so",  # its Python files are needed (model imports), not these
    "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so",
    "vllm/third_party/fmha_sm100/",
    "vllm/third_party/deep_gemm/",
    "vllm/vllm-rs",
    "vllm/_C_stable_libtorch.abi3.so",
    "vllm/_moe_C_stable_libtorch.abi3.so",
    "vllm/_flashkda_C.abi3.so",
    "vllm/_flashmla_C.abi3.so",
)
# Packages vLLM imports that the H200 image lacks (versions and hashes from PINS).
DEPS = (
    "pydantic pydantic-core annotated-types typing-inspection msgspec pyzmq cbor2 blake3 cachetools pybase64 "
    "setproctitle ijson partial-json-parser python-json-logger openai jiter sniffio httpx2 httpcore2 truststore "
    "idna anyio typing-extensions fastapi starlette compressed-tensors loguru depyf astor dill lark "
    "openai-harmony llguidance xgrammar outlines-core apache-tvm-ffi"
).split()
# From a release on, what changes in DEPS: `add`, packages carried at the release's pinned
# versions; `drop`, packages the release no longer pins. A later release inherits both.
# 0.33.0: its metadata asks for oss-harmony (openai_harmony's module, vocabularies embedded) in
# place of openai-harmony (requirements/common.txt of the 0.29.0 and 0.33.0 sdists; 0.33's pins
# have no openai-harmony). 0.34.0: packages the image has at a version that release's metadata
# refuses (the 0.34.0 import probe, FACTS: the image's huggingface_hub 1.33.0, tokenizers 0.23.2,
# setuptools 81.0.0, older aiohttp, pillow, filelock, certifi; its transformers 5.17.0 refuses
# huggingface_hub 2.x at import: the H200 run of 2026-12-02).
DEPS_FROM = {
    "0.33.0": {"add": ["oss-harmony"], "drop": ["openai-harmony"]},
    "0.34.0": {
        "add": "huggingface-hub tokenizers aiohttp pillow filelock certifi setuptools transformers".split(),
        "drop": [],
    },
}


def deps_for(release: str) -> list[str]:
    """DEPS as changed by DEPS_FROM at `release` and every release before it."""
    deps = list(DEPS)
    for since, change in sorted(DEPS_FROM.items(), key=lambda item: releases.key(item[0])):
        if releases.key(since) <= releases.key(release):
            deps = [d for d in deps if d not in change["drop"]] + [a for a in change["add"] if a not in deps]
    return deps


GPUH = Path(os.environ.get("GPUH_ROOT", "/tmp/gpuh"))


class HarnessError(Exception):
    pass


WHEEL_NAME = wheel_name(RELEASE)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def pinned(pins: Path = PINS) -> dict[str, tuple[str, list[str]]]:
    """name -> (version, [sha256 ...]) from a pip-compile style requirements file."""
    out: dict[str, tuple[str, list[str]]] = {}
    current = None
    for raw in pins.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("--hash=sha256:") and current:
            out[current][1].append(line.split(":", 1)[1].rstrip(" \\"))
            continue
        spec = line.rstrip(" \\").split(";")[0].strip()
        if "==" in spec:
            name, version = spec.split("==", 1)
            current = name.strip().lower().replace("_", "-")
            out[current] = (version.strip(), [])
            rest = line.split("--hash=sha256:")[1:]
            out[current][1].extend(h.strip(" \\") for h in rest)
    return out


def check_wheel(wheel: Path, pins: Path = PINS) -> str:
    """Refuse a vLLM wheel whose sha256 is not the one PINS gives for vllm."""
    if not wheel.is_file():
        raise HarnessError(f"{wheel}: no such file (prepare downloads it when --wheel is not given)")
    version, hashes = pinned(pins).get("vllm", (None, []))
    if not hashes:
        raise HarnessError(f"{pins}: no pinned hash for vllm")
    digest = sha256(wheel)
    if digest not in hashes:
        raise HarnessError(
            f"{wheel}: sha256 {digest} is not the pinned vllm=={version} hash in {pins} "
            f"({', '.join(hashes)}): use the wheel the project pins"
        )
    return digest


def pip_download(specs: list[str], dest: Path, require_hashes_file: Path | None = None) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("PIP_FIND_LINKS", "PIP_CONSTRAINT")}
    env["PIP_CONFIG_FILE"] = os.devnull
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:"]
    cmd += ["--python-version", "3.12", "--implementation", "cp", "-d", str(dest)]
    for n in (5, 17, 24, 26, 27, 28, 31, 34):
        cmd += ["--platform", f"manylinux_2_{n}_x86_64"]
    cmd += ["--platform", "manylinux2014_x86_64", "--platform", "manylinux1_x86_64", "--platform", "any"]
    if require_hashes_file is not None:
        cmd += ["--require-hashes", "-r", str(require_hashes_file)]
    cmd += specs
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise HarnessError(f"pip download failed ({proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}")


def unzip_into(wheel: Path, dest: Path, exclude: tuple[str, ...] = ()) -> int:
    import zipfile

    count = 0
    with zipfile.ZipFile(wheel) as zf:
        for info in zf.infolist():
            if any(info.filename.startswith(x) for x in exclude) or "/__pycache__/" in info.filename:
                continue
            zf.extract(info, dest)
            count += 1
    return count


# x86 branch/call filter before LZMA2: 0.34.0's _C kernels xz to 58.37 MB instead of 58.92, which
# keeps the kernels' call (they and the checkout) within the 64 MiB a call carries.
XZ_FILTERS = [{"id": lzma.FILTER_X86}, {"id": lzma.FILTER_LZMA2, "preset": 9 | lzma.PRESET_EXTREME}]


def xz_file(src: Path, dst: Path) -> None:
    with open(src, "rb") as f, lzma.open(dst, "wb", filters=XZ_FILTERS) as out:
        shutil.copyfileobj(f, out, 1 << 20)


def tar_xz(src_dir: Path, dst: Path, arcname: str) -> None:
    """tar | xz -9 (the xz program, all cores, where it exists; else Python's lzma, one core)."""
    xz = shutil.which("xz")
    if xz:
        with open(dst, "wb") as out:
            tar = subprocess.Popen(
                [
                    "tar",
                    "-C",
                    str(src_dir.parent),
                    "-cf",
                    "-",
                    "--transform",
                    f"s,^{src_dir.name},{arcname},",
                    src_dir.name,
                ],
                stdout=subprocess.PIPE,
            )
            comp = subprocess.run([xz, "-9", "-T0", "-c"], stdin=tar.stdout, stdout=out)
            tar.stdout.close()
            if tar.wait() != 0 or comp.returncode != 0:
                raise HarnessError(f"tar | xz of {src_dir} failed")
        return
    with lzma.open(dst, "wb", preset=9) as raw, tarfile.open(fileobj=raw, mode="w") as tar:
        tar.add(src_dir, arcname=arcname)


# The first piece of the C kernels rides with the site's call when the whole file and the checkout
# pass a call's 64 MiB (0.34.0: 58.4 MB of kernels beside a 9 MB checkout was refused).
FIRST_PIECE = 8 * 1024 * 1024


def write_pieces(out: Path, name: str, manifest: dict) -> None:
    """OUT/NAME also as two pieces, OUT-1/NAME.1 (FIRST_PIECE bytes) and OUT-2/NAME.2 (the rest,
    with the manifest): carry OUT-1 beside the site in one call and OUT-2 in the next; `stage OUT-2`
    joins them and checks the joined file against the manifest's sha256."""
    first, second = out.parent / f"{out.name}-1", out.parent / f"{out.name}-2"
    for folder in (first, second):
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
    with open(out / name, "rb") as src:
        (first / f"{name}.1").write_bytes(src.read(FIRST_PIECE))
        with open(second / f"{name}.2", "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    pieces = {name: [f"../{first.name}/{name}.1", f"{name}.2"]}
    files.atomic_write_json(second / "manifest.json", {**manifest, "pieces": pieces})
    mib = FIRST_PIECE / 2**20
    print(f"[prepare] {out.name} also as pieces: {first.name}/ ({mib:.0f} MiB) and {second.name}/", flush=True)


def join_pieces(folder: Path, manifest: dict) -> None:
    """Join the pieces a manifest lists (write_pieces) into FOLDER, unless the file is there."""
    for name, pieces in manifest.get("pieces", {}).items():
        if (folder / name).exists():
            continue
        paths = [folder / piece for piece in pieces]
        missing = [str(p) for p in paths if not p.is_file()]
        if missing:
            raise HarnessError(
                f"{folder}: piece {', '.join(missing)} not on this machine; carry its folder in an "
                "earlier call of this machine (docs/gpu-harness.md, the pieces of the C kernels)"
            )
        with open(folder / name, "wb") as dst:
            for path in paths:
                with open(path, "rb") as src:
                    shutil.copyfileobj(src, dst, 1 << 20)
        print(f"[stage] joined {len(paths)} pieces into {folder / name}", flush=True)


def checkout_bytes() -> int:
    """Bytes of what a call sends besides the carried folders: tracked + untracked-not-ignored,
    each file rounded up to a 4 KiB block (the device's count is at least that: a call of 63.9 MiB
    by file sizes alone was refused)."""
    proc = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    )
    total = 0
    for name in proc.stdout.decode().split("\0"):
        path = REPO / name
        if name and path.is_file():
            total += -(-path.stat().st_size // 4096) * 4096
    return total


def git_state() -> dict:
    def git(*args):
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout.strip()

    return {
        "commit": git("rev-parse", "HEAD"),
        "patches_uncommitted_edits_left_out": bool(git("status", "--porcelain", "--", "patches")),
        "patches_commit": git("log", "-1", "--format=%H %cI %s", "--", "patches"),
    }


def write_manifest(folder: Path, extra: dict) -> dict:
    sums = {p.name: {"bytes": p.stat().st_size, "sha256": sha256(p)} for p in sorted(folder.iterdir())}
    sums.pop("manifest.json", None)
    manifest = {"schema": "gpu-harness/manifest/1", "files": sums, **extra}
    files.atomic_write_json(folder / "manifest.json", manifest)
    return manifest


# What prepare's site part imports on this machine (the suites' models are built with them).
PREPARE_NEEDS = ("torch", "transformers", "safetensors", "numpy", "tokenizers")


def check_prepare_python(parts: list[str], python: str = sys.executable) -> None:
    """Refuse before any download when this interpreter cannot build the site's models."""
    import importlib.util

    if "site" not in parts:
        return
    missing = [name for name in PREPARE_NEEDS if importlib.util.find_spec(name) is None]
    if missing:
        venv = REPO / ".venv" / "bin" / "python"
        hint = (
            f"{venv} magpie gpu-harness prepare ..." if venv.exists() else "tests/env/setup.sh first (it makes .venv)"
        )
        raise HarnessError(
            f"{python} has no {', '.join(missing)}: prepare builds the suites' models with them; "
            f"run it with the test environment's Python: {hint} (--parts c,moe alone need only the standard library)"
        )


def cmd_prepare(args) -> int:
    check_prepare_python(args.parts.split(","))
    release, pins = args.release, requirements_of(args.release)
    dest = Path(args.dest)
    dl = dest / "dl"
    dl.mkdir(parents=True, exist_ok=True)
    name = wheel_name(release)
    wheel = Path(args.wheel) if args.wheel else dl / name
    if not args.wheel and not wheel.exists():
        print(f"[prepare] downloading vllm=={release} ({name}, ~300 MB)", flush=True)
        pip_download([f"vllm=={release}"], dl)
    digest = check_wheel(wheel, pins)
    print(f"[prepare] {wheel.name}: sha256 {digest} matches {pins.relative_to(REPO)}", flush=True)
    state = git_state()
    print(f"[prepare] patches as committed at HEAD {state['commit'][:12]}; last patch commit {state['patches_commit']}")
    if state["patches_uncommitted_edits_left_out"]:
        print("[prepare] note: patches/ has uncommitted edits in the working tree; they are NOT carried", flush=True)
    work = dest / f"work-{os.getpid()}"  # one per run: two prepares never share a work tree
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    parts = args.parts.split(",")
    common = {"release": release, "wheel": wheel.name, "wheel_sha256": digest, "git": state, "prepared_utc": _utc()}
    for part in ("c", "moe"):
        if part not in parts:
            continue
        out = dest / part
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        import zipfile

        with zipfile.ZipFile(wheel) as zf:
            zf.extract("vllm/" + KERNELS[part], work / part)
        so = work / part / "vllm" / KERNELS[part]
        print(f"[prepare] xz {so.name} ({so.stat().st_size / 1e6:.1f} MB), ~1 min", flush=True)
        xz_file(so, out / (KERNELS[part] + ".xz"))
        manifest = write_manifest(out, {**common, "part": part, "so": KERNELS[part], "so_sha256": sha256(so)})
        if part == "c":
            write_pieces(out, KERNELS[part] + ".xz", manifest)
    if "site" in parts:
        site = work / "site"
        n = unzip_into(wheel, site, WHEEL_EXCLUDE)
        print(f"[prepare] vLLM tree: {n} files from the wheel", flush=True)
        deps = _deps(dl / "deps", pins, release)
        for w in sorted((dl / "deps").glob("*.whl")):
            unzip_into(w, site)
        print(f"[prepare] {len(deps)} pinned wheels unpacked into the tree (pip checked their hashes)", flush=True)
        write_fa2_stand_in(site)
        if write_flashinfer_stand_in(site, release):
            print("[prepare] flashinfer: a torch stand-in of flashinfer.norm (magpie/gpu/stand_in)", flush=True)
        # The committed series (HEAD), never uncommitted edits of the working tree.
        archive = subprocess.run(["git", "archive", "HEAD", "patches"], cwd=REPO, capture_output=True, check=True)
        (work / "committed").mkdir()
        subprocess.run(["tar", "-x", "-C", str(work / "committed")], input=archive.stdout, check=True)
        proc = subprocess.run(
            [
                sys.executable,
                str(REPO / "magpie" / "patches.py"),
                "apply",
                "--target",
                str(site),
                "--patches-dir",
                str(work / "committed" / "patches"),
            ],
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            raise HarnessError(f"patches.py apply failed:\n{proc.stdout}{proc.stderr}")
        print("[prepare] " + proc.stdout.strip().replace("\n", "\n[prepare] "), flush=True)
        if args.suite == "ple":
            _variant_files(wheel, site, work, "site-0001", ["ple_ssd/0001", "mtp_pruning"])
        for cache in site.rglob("__pycache__"):
            shutil.rmtree(cache, ignore_errors=True)
        if args.suite == "mtp":
            from magpie.gpu import models

            print("[prepare] tiny Qwen3.5 + MTP models, keep-sets, the big model's spec", flush=True)
            models.build_small(work / "models")
        else:
            from magpie.gpu import qwen4exp

            print("[prepare] the tiny Qwen4Exp's spec (the checkpoint is written on the GPU machine)", flush=True)
            qwen4exp.build_spec(work / "models" / "q4e-spec")
        out = dest / "site"
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        print("[prepare] xz the site tree and the models, ~1-2 min", flush=True)
        tar_xz(site, out / "site.tar.xz", "site")
        tar_xz(work / "models", out / "models.tar.xz", "models")
        for variant in sorted(work.glob("variant-*")):
            tar_xz(variant, out / f"{variant.name}.tar.xz", variant.name)
        write_manifest(
            out, {**common, "part": "site", "suite": args.suite, "deps": deps, "patches_applied": proc.stdout.strip()}
        )
    shutil.rmtree(work, ignore_errors=True)
    base = checkout_bytes()
    print(f"[prepare] the checkout sends {base / 1e6:.1f} MB with every call", flush=True)
    for part in ("c", "moe", "site"):
        folder = dest / part
        if folder.is_dir():
            size = sum(p.stat().st_size for p in folder.iterdir())
            print(f"[prepare] .gpu-harness/{part}: {size / 1e6:.1f} MB", flush=True)
    calls = {"mtp": {"c": ["c"], "site": ["site"]}, "ple": {"c": ["c"], "moe+site": ["moe", "site"]}}

    def part_dir(name: str) -> Path:  # c and moe may sit in the default folder, the site in --dest
        return dest / name if (dest / name).is_dir() else DEST / name

    for label, names in calls[args.suite].items():
        size = base + sum(p.stat().st_size for n in names if part_dir(n).is_dir() for p in part_dir(n).iterdir())
        if size <= CALL_LIMIT:
            verdict = "fits"
        elif label == "moe+site":
            verdict = "too large for one call: carry the site's files over two calls (--help, ple suite)"
        elif label == "c" and part_dir("c-2").is_dir():
            verdict = "too large for one call: carry c-1 with the site's call, then c-2 (stage .gpu-harness/c-2)"
        else:
            verdict = "TOO LARGE for one call"
        print(f"[prepare] call carrying {label}: {size / 2**20:.1f} MiB of 64 MiB: {verdict}", flush=True)
        if size > CALL_LIMIT and not verdict.startswith("too large for one call"):
            return 1
    return 0


def write_fa2_stand_in(tree: Path) -> None:
    fa2 = tree / "vllm" / "vllm_flash_attn" / "_vllm_fa2_C.py"
    fa2.parent.mkdir(parents=True, exist_ok=True)
    fa2.write_text("# stand-in (gpu harness): FA2 not carried; configurations use TRITON_ATTN\n")


# From this release on, vLLM's CUDA Qwen3.5 and Qwen4Exp models call flashinfer.norm for every
# RMSNorm; FlashInfer (JIT with nvcc, or flashinfer-cubin) cannot come to the lent machine.
FLASHINFER_STAND_IN_FROM = "0.34.0"
STAND_IN = HERE / "stand_in"


def write_flashinfer_stand_in(tree: Path, release: str) -> bool:
    """Copy the torch stand-in of flashinfer.norm (magpie/gpu/stand_in/flashinfer) into TREE for a
    release that needs it; False (nothing written) for an older release."""
    if releases.key(release) < releases.key(FLASHINFER_STAND_IN_FROM):
        return False
    shutil.copytree(STAND_IN / "flashinfer", tree / "flashinfer", ignore=shutil.ignore_patterns("__pycache__"))
    return True


def _variant_files(wheel: Path, site: Path, work: Path, name: str, selectors: list[str]) -> None:
    """The vllm/ files in which a tree patched with SELECTORS only differs from SITE (the whole
    series), saved under work/variant-NAME; the GPU side hard-links SITE and swaps them in."""
    import filecmp

    other = work / f"tree-{name}"
    unzip_into(wheel, other, WHEEL_EXCLUDE)
    write_fa2_stand_in(other)
    cmd = [sys.executable, str(REPO / "magpie" / "patches.py"), "apply", "--target", str(other)]
    cmd += ["--patches-dir", str(work / "committed" / "patches"), *selectors]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise HarnessError(f"patches.py apply {selectors} failed:\n{proc.stdout}{proc.stderr}")
    out = work / f"variant-{name}"
    changed = []
    for path in sorted((other / "vllm").rglob("*.py")):
        rel = path.relative_to(other)
        if not (site / rel).exists() or not filecmp.cmp(path, site / rel, shallow=False):
            (out / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, out / rel)
            changed.append(str(rel))
    gone = [
        str(p.relative_to(site)) for p in (site / "vllm").rglob("*.py") if not (other / p.relative_to(site)).exists()
    ]
    out.mkdir(parents=True, exist_ok=True)  # also when no file differs (0.34's one ple patch)
    (out / "GONE").write_text("\n".join(gone))
    print(f"[prepare] {name} ({' '.join(selectors)}): differ {changed}, absent {gone}", flush=True)
    shutil.rmtree(other)


def _utc() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _deps(dest: Path, pins_path: Path = PINS, release: str = RELEASE) -> list[str]:
    pins = pinned(pins_path)
    lines, specs = [], []
    for name in deps_for(release):
        if name not in pins:
            raise HarnessError(f"{pins_path}: {name} is not pinned; drop it from DEPS or pin it")
        version, hashes = pins[name]
        lines.append(f"{name}=={version} " + " ".join(f"--hash=sha256:{h}" for h in hashes))
        specs.append(f"{name}=={version}")
    dest.mkdir(parents=True, exist_ok=True)
    req = dest / "requirements.txt"
    req.write_text("\n".join(lines) + "\n")
    pip_download([], dest, req)
    return specs


# ---------------------------------------------------------------------------------- GPU side


def cmd_stage(args) -> int:
    GPUH.mkdir(parents=True, exist_ok=True)
    for folder in map(Path, args.folders):
        manifest = json.loads((folder / "manifest.json").read_text())
        part = manifest["part"]
        join_pieces(folder, manifest)
        # A site part may come over two calls (carry names single files: the models in one call,
        # the vLLM tree in the next, when the tree and the MoE kernels together pass 64 MiB).
        present = [name for name in manifest["files"] if (folder / name).exists()]
        absent = [name for name in manifest["files"] if name not in present]
        if not present or (absent and part in KERNELS):
            raise HarnessError(f"{folder}: {', '.join(absent)} not carried (its manifest lists them)")
        for name in present:
            digest = sha256(folder / name)
            if digest != manifest["files"][name]["sha256"]:
                raise HarnessError(
                    f"{folder / name}: sha256 {digest}, manifest says {manifest['files'][name]['sha256']}: "
                    "transfer broken"
                )
        if absent:
            print(f"[stage] {folder}: not in this call: {', '.join(absent)} (stage them from another)", flush=True)
        files.atomic_write_json(GPUH / f"manifest-{part}.json", manifest)
        if part in KERNELS:
            so = GPUH / "kernels" / manifest["so"]
            so.parent.mkdir(parents=True, exist_ok=True)
            with lzma.open(folder / (manifest["so"] + ".xz"), "rb") as f, open(so, "wb") as out:
                shutil.copyfileobj(f, out, 1 << 20)
            if sha256(so) != manifest["so_sha256"]:
                raise HarnessError(f"{so}: sha256 differs from the wheel's")
            print(f"[stage] {so} ({so.stat().st_size / 1e6:.1f} MB) sha256 = the wheel's", flush=True)
        else:
            names = ["site.tar.xz", "models.tar.xz"] + sorted(p.name for p in folder.glob("variant-*.tar.xz"))
            for name in [n for n in names if n in present]:
                target = GPUH / name.split(".")[0]
                shutil.rmtree(target, ignore_errors=True)
                with tarfile.open(folder / name, "r:xz") as tar:
                    tar.extractall(GPUH, filter="fully_trusted")
                print(f"[stage] unpacked {name} into {target}", flush=True)
            print(f"[stage] patches: {manifest.get('patches_applied', '?')}", flush=True)
            print(f"[stage] prepared from commit {manifest['git']['commit']}", flush=True)
    site = GPUH / "site" / "vllm"
    for so in (GPUH / "kernels").glob("*.so") if (GPUH / "kernels").is_dir() else []:
        if site.is_dir() and not (site / so.name).exists():
            os.link(so, site / so.name)
            print(f"[stage] {so.name} -> {site}", flush=True)
    return 0


def staged_release() -> str:
    """The release of the staged site (its manifest, written by `stage`); the table's
    gpu_harness release when none is staged."""
    manifest = GPUH / "manifest-site.json"
    if manifest.is_file():
        return json.loads(manifest.read_text()).get("release") or RELEASE
    return RELEASE


def run_env(release: str | None = None) -> dict:
    """The workers' environment. VLLM_USE_V2_MODEL_RUNNER=1 where the release still has the
    switch (before 0.34.0); from 0.34.0 the V2 runner is the only one and the variable is left
    unset (=1 only warns there, any other value raises)."""
    release = release or staged_release()
    env = {k: v for k, v in os.environ.items() if k != "VLLM_USE_V2_MODEL_RUNNER"}
    if releases.has_runner_switch(release):
        env["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    if releases.key(release) >= releases.key(FLASHINFER_STAND_IN_FROM):
        # The site carries a stand-in of flashinfer.norm only: vLLM's has_flashinfer() must keep
        # saying no, which it does when FlashInfer's JIT finds no nvcc (the H200 image has one).
        env["CUDA_HOME"] = "/nonexistent/cuda-toolkit-hidden-by-the-gpu-harness"
    env.update(
        PYTHONPATH=str(GPUH / "site"),
        GPUH_MODELS=str(GPUH / "models"),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        PYTHONUNBUFFERED="1",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        VLLM_USE_FLASHINFER_SAMPLER="0",
        TRITON_CACHE_AUTOTUNING="1",
        VLLM_CACHE_ROOT=str(GPUH / "vllm_cache"),
        TOKENIZERS_PARALLELISM="false",
    )
    return env


def evict_table(model_dir: Path) -> dict:
    """Drop the table's pages from the page cache before a cold or bounded run: posix_fadvise
    DONTNEED over the shards' byte ranges (no process maps them now). The rest of the page cache
    (Python, torch and vLLM's libraries) stays where it was charged, so a bounded worker's cgroup
    is charged for the table's pages it reads, not for libraries read again."""
    from magpie.serving import ple_warmup

    ranges = ple_warmup.table_ranges(str(model_dir), ple_warmup.DEFAULT_PATTERN)
    ple_warmup.evict(ranges)
    return {"fadvise_dontneed": True, "table_after": ple_warmup.status(ranges)}


def bounded_cgroup(name: str, limit: int, proc: Path = Path("/proc/self")) -> dict:
    """A memory cgroup for one worker with its limit at LIMIT bytes (no swap): the page cache the
    worker faults in is charged to it and reclaimed inside it. cgroup v2 (memory.max) where the
    memory controller is there, else cgroup v1's memory hierarchy (memory.limit_in_bytes).

    v2 in a container whose cgroup holds processes: the memory controller can be enabled for
    children only after those processes move to a leaf of their own (the no-internal-processes
    rule); done here, on the lent machine only. Returns {"path", "version", ...} or {"error"}."""
    from magpie.serving import cgroup

    errors = []
    mount, own = cgroup.cgroup2_mount(str(proc / "mountinfo")), cgroup.own_cgroup2_path(str(proc / "cgroup"))
    parent = Path(mount) / own.lstrip("/") if mount and own is not None else None
    if parent is not None and "memory" in _read(parent / "cgroup.controllers").split():
        try:
            moved = 0
            if "memory" not in _read(parent / "cgroup.subtree_control").split():
                try:
                    (parent / "cgroup.subtree_control").write_text("+memory\n")
                except OSError:
                    rest = parent / "gpuh-rest"
                    rest.mkdir(exist_ok=True)
                    for pid in _read(parent / "cgroup.procs").split():
                        try:
                            (rest / "cgroup.procs").write_text(pid + "\n")
                            moved += 1
                        except OSError:
                            pass
                    (parent / "cgroup.subtree_control").write_text("+memory\n")
            child = parent / f"gpuh-{name}"
            child.mkdir(exist_ok=True)
            (child / "memory.max").write_text(f"{limit}\n")
            if (child / "memory.swap.max").exists():
                (child / "memory.swap.max").write_text("0\n")
            return {"path": str(child), "version": 2, "limit": limit, "processes_moved_to_leaf": moved}
        except OSError as e:
            errors.append(f"cgroup v2 under {parent}: {e.strerror} ({e.filename})")
    else:
        errors.append("cgroup v2: no memory controller" + (f" at {parent}" if parent else " (not mounted)"))
    for line in _read(proc / "cgroup").splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" not in controllers.split(","):
            continue
        v1 = Path("/sys/fs/cgroup/memory") / path.lstrip("/")
        try:
            child = v1 / f"gpuh-{name}"
            child.mkdir(exist_ok=True)
            (child / "memory.limit_in_bytes").write_text(f"{limit}\n")
            if (child / "memory.memsw.limit_in_bytes").exists():
                (child / "memory.memsw.limit_in_bytes").write_text(f"{limit}\n")
            return {"path": str(child), "version": 1, "limit": limit}
        except OSError as e:
            errors.append(f"cgroup v1 under {v1}: {e.strerror} ({e.filename})")
    return {"error": "; ".join(errors) or "no memory cgroup found"}


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def bound_limit(cfg: dict, results_dir: Path) -> dict:
    """memory.max for a bounded run: the reference run's anonymous and shared memory (its
    RssAnon + RssShmem, from its result) plus page_cache_fraction of the table's bytes."""
    from magpie.serving import ple_warmup

    ref = json.loads((results_dir / f"{cfg['bound_after']}.json").read_text())
    mem = ref[cfg["checks"][0]]["memory"]
    anon = sum(int(mem.get(k, "0 kB").split()[0]) * 1024 for k in ("RssAnon", "RssShmem"))
    ranges = ple_warmup.table_ranges(str(GPUH / "models" / cfg["model"]), ple_warmup.DEFAULT_PATTERN)
    table = sum(end - start for _, _, start, end in ranges)
    cache = int(cfg["page_cache_fraction"] * table)
    kernel = 512 << 20  # page tables, slab and socket memory are charged to the cgroup too
    return {
        "limit": anon + cache + kernel,
        "anon_of_reference": anon,
        "page_cache_bytes": cache,
        "kernel_allowance": kernel,
        "table_bytes": table,
    }


def run_one(cfg: dict, timeout: int, logs: Path, env: dict, cgroup: str | None = None) -> dict:
    logs.mkdir(parents=True, exist_ok=True)
    cfg_path = logs / f"{cfg['name']}.json"
    cfg_path.write_text(json.dumps(cfg))
    log_path = logs / f"{cfg['name']}.log"
    t0 = time.time()

    def enter_cgroup():  # in the child, before exec: everything the worker starts stays inside
        Path(cgroup, "cgroup.procs").write_text(f"{os.getpid()}\n")

    with open(log_path, "w") as log:
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "magpie.gpu.worker", str(cfg_path)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={
                    **env,
                    **cfg.get("env", {}),
                    "PYTHONPATH": os.pathsep.join([str(GPUH / cfg.get("site", "site")), str(REPO)]),
                },
                timeout=timeout,
                preexec_fn=enter_cgroup if cgroup else None,
            )
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    text = log_path.read_text(errors="replace")
    result = proof.parse_result(text) or {"config": cfg["name"], "ok": False}
    result.update(rc=rc, wall_s=round(time.time() - t0, 1), timeout_s=timeout, proof=proof.log_proof(text))
    if rc != 0 or not result.get("ok"):
        result["failure_excerpt"] = proof.failure_excerpt(text)
    return result


def make_reverted_site(name: str) -> None:
    """SITE hard-linked, with the files of variant-NAME (prepare: the same wheel tree patched
    with fewer patches) swapped in as new files."""
    target = GPUH / name
    if target.is_dir():
        return
    variant = GPUH / f"variant-{name}"
    if not variant.is_dir():
        raise HarnessError(f"{variant}: not staged (prepare --suite ple writes variant-{name}.tar.xz)")
    subprocess.run(["cp", "-al", str(GPUH / "site"), str(target)], check=True)
    count = 0
    for path in variant.rglob("*.py"):
        dest = target / path.relative_to(variant)
        dest.unlink(missing_ok=True)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, dest)
        count += 1
    for rel in filter(None, (variant / "GONE").read_text().splitlines()):
        (target / rel).unlink(missing_ok=True)
    print(f"[run] {name}: {count} files swapped in from {variant.name}", flush=True)


def cmd_run(args) -> int:
    out = Path(os.environ.get("OUT", GPUH / "out"))
    out.mkdir(parents=True, exist_ok=True)
    results_dir = GPUH / "results"
    results_dir.mkdir(parents=True, exist_ok=True)
    release = staged_release()
    env = run_env(release)
    configs = list(suites.SUITES[args.suite])
    if args.only:
        configs = [c for c in configs if c["name"] in args.only.split(",")]
    for cfg in list(configs):
        why = suites.not_on_release(cfg, release)
        if why:
            print(f"[run] SKIP {cfg['name']}: {why}", flush=True)
            configs.remove(cfg)
    if args.prepare_models:
        suites.prepare_models(args.suite, GPUH / "models")
    for site in sorted({c["site"] for c in configs if c.get("site")}):
        make_reverted_site(site)
    t_start = time.time()
    for cfg in configs:
        done = results_dir / f"{cfg['name']}.json"
        if args.skip_done and done.exists():
            continue
        left = args.budget - (time.time() - t_start)
        if left < cfg.get("min_s", 45):
            print(f"[run] SKIP {cfg['name']}: {left:.0f} s left of the budget", flush=True)
            continue
        timeout = int(min(cfg.get("timeout_s", 240), left))
        setup: dict = {}
        if cfg.get("evict_table"):
            setup["evict"] = evict_table(GPUH / "models" / cfg["model"])
            print(f"[run] {cfg['name']}: table evicted: {json.dumps(setup['evict'])}", flush=True)
        cgroup = None
        if cfg.get("page_cache_fraction"):
            setup["bound"] = bound_limit(cfg, results_dir)
            setup["cgroup"] = bounded_cgroup(cfg["name"], setup["bound"]["limit"])
            cgroup = setup["cgroup"].get("path")
            # Without a cgroup the run is a cold start with an unbounded cache: named as such.
            print(f"[run] {cfg['name']}: {json.dumps(setup)}", flush=True)
        print(f"[run] {cfg['name']} (timeout {timeout} s) ...", flush=True)
        result = run_one(cfg, timeout, GPUH / "logs", env, cgroup=cgroup)
        if setup:
            result["setup"] = setup
        files.atomic_write_json(done, result, indent=None)
        print("[run] " + proof.one_line(result), flush=True)
        if not result.get("ok") and "init_s" not in result and not args.keep_going:
            # vLLM did not start: the next configurations would most likely fail the same way.
            print(f"[run] STOP: {cfg['name']} failed before vLLM was up; the excerpt says why", flush=True)
            for line in result.get("failure_excerpt", [])[-12:]:
                print("[run]   " + line, flush=True)
            break
    collect(out)
    return 0


def collect(out: Path) -> None:
    """Everything so far, as at most 4 files under $OUT (the tool brings back 8)."""
    results = {}
    for path in sorted((GPUH / "results").glob("*.json")):
        results[path.stem] = json.loads(path.read_text())
    manifests = {p.stem: json.loads(p.read_text()) for p in GPUH.glob("manifest-*.json")}
    doc = {"schema": "gpu-harness/results/1", "written_utc": _utc(), "machine": proof.machine(), "manifests": manifests}
    doc["results"] = results
    doc["comparisons"] = proof.compare(results)
    files.atomic_write_json(out / "results.json", doc)
    files.atomic_write_text(out / "summary.txt", proof.summary_text(doc))
    with files.atomic_open(out / "log.txt") as log:
        for path in sorted((GPUH / "logs").glob("*.log")):
            text = path.read_text(errors="replace")
            log.write(f"===== {path.stem} ({len(text)} chars; last 400,000 kept) =====\n{text[-400_000:]}\n")
    print((out / "summary.txt").read_text(), flush=True)


def cmd_models(args) -> int:
    suites.prepare_models(args.suite, GPUH / "models")
    return 0


def cmd_summary(args) -> int:
    files.check_output(args.write_to, args.force, what="--write-to")
    doc = json.loads(Path(args.results).read_text())
    doc["comparisons"] = proof.compare(doc["results"])
    print(proof.summary_text(doc))
    if args.write_to:
        files.atomic_write_json(args.write_to, doc)
        print(f"wrote {args.write_to}", file=sys.stderr)
    return 0


def cmd_list(args) -> int:
    for suite, configs in suites.SUITES.items():
        print(f"{suite}:")
        for cfg in configs:
            print(f"  {cfg['name']:<22} {cfg.get('about', '')}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = cli.parser("magpie gpu-harness", __doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("prepare", help="build .gpu-harness/{c,moe,site} here (needs pip to reach the registry)")
    p.add_argument("--wheel", help="the release's pinned wheel (default: download it into .gpu-harness/dl)")
    p.add_argument(
        "--release",
        default=RELEASE,
        choices=releases.series_releases(),
        help="the vLLM release carried (default: %(default)s, the table's gpu_harness row)",
    )
    p.add_argument("--dest", default=str(DEST), help="output folder, ignored by git (default: %(default)s)")
    p.add_argument("--parts", default="c,moe,site", help="comma list of c, moe, site (default: %(default)s)")
    p.add_argument("--suite", default="mtp", choices=("mtp", "ple"), help="whose models the site folder carries")
    p = sub.add_parser("stage", help="GPU machine: check and unpack carried folders into /tmp/gpuh")
    p.add_argument("folders", nargs="+")
    p = sub.add_parser("run", help="GPU machine: run a suite's configurations")
    p.add_argument("--suite", required=True, choices=sorted(suites.SUITES))
    p.add_argument("--budget", type=int, default=540, help="seconds for all configurations (default: %(default)s)")
    p.add_argument("--only", help="comma list of configuration names")
    p.add_argument("--skip-done", action="store_true", help="skip configurations with a result in /tmp/gpuh")
    p.add_argument("--keep-going", action="store_true", help="go on after a configuration whose vLLM did not start")
    p.add_argument("--prepare-models", action="store_true", help="materialize the suite's large models first")
    p = sub.add_parser("models", help="GPU machine: write the suite's large checkpoints (they never travel)")
    p.add_argument("--suite", required=True, choices=sorted(suites.SUITES))
    p = sub.add_parser("summary", help="print the comparisons of a results.json")
    p.add_argument("results")
    p.add_argument("--write-to", metavar="JSON", help="also write the results with the comparisons recomputed here")
    cli.add_force(p, "the --write-to file")
    sub.add_parser("list", help="list the suites' configurations")
    args = parser.parse_args(argv)
    try:
        return {
            "prepare": cmd_prepare,
            "stage": cmd_stage,
            "run": cmd_run,
            "models": cmd_models,
            "summary": cmd_summary,
            "list": cmd_list,
        }[args.command](args)
    except HarnessError as exc:
        print(f"gpu_harness.py {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
