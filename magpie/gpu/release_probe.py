#!/usr/bin/env python3
"""Probe whether a vLLM release imports on the lent H200's image (torch 2.11.0+cu130, triton
3.6.0, Python 3.12), step by step, to the first failing import (issue 19 item 2).

What travels is the release's Python tree from its pinned x86_64 wheel (sha256 checked against
the release's x86_64 requirements file, magpie/releases.py requirements_file), without the compiled kernels and the Rust
front-end (their names and sizes go in the manifest), patched with the release's committed
series (magpie/patches.py apply), plus the pinned packages of the release's closure that the
H200 image (as /work/.library/device/KINDS.md lists it) lacks, except those that link torch or
CUDA, which cannot run against the image's torch anyway (listed, with the reason, in the
manifest). Reuses magpie/gpu/gpu_harness.py's download, hash, unzip and tar.xz functions.

Commands
  prepare   (this machine) build .gpu-harness/v<release>/{site.tar.xz,manifest.json}; prints
            the bundle size and the device call (command + carry list).
  probe     (GPU machine) check and unpack site.tar.xz into /tmp/probe<release>, then run the
            import steps in a child python3 with PYTHONPATH=/tmp/probe<release>/site, each step
            on its own (an exception is recorded and the next step runs; a child that dies or
            hangs is restarted at the next step), and write $OUT/probe-<release>.json (schema
            magpie/gpu-probe/1) and a one-line-per-step table. The kernel libraries are not
            carried, so `vllm._custom_ops` is expected to warn or fail and torch.ops._C to hold
            no vLLM ops: the step records which.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path

from magpie import cli, files, releases
from magpie.gpu import gpu_harness as harness

REPO = harness.REPO
KINDS_MD = Path("/work/.library/device/KINDS.md")
SCHEMA = "magpie/gpu-probe/1"
# Left out of the tree: compiled code and build inputs (their names and sizes go in the manifest).
EXCLUDE_PREFIXES = ("vllm/third_party/", "vllm/vllm-rs")
# Closure packages not carried: they link torch or CUDA (the image's torch is 2.11, these are
# built for the release's torch) or only serve them; z3-solver is tilelang's (300 MB).
NOT_CARRIED = {
    "cuda-python": "CUDA bindings (the image has cuda-bindings)",
    "cuda-tile": "CUDA kernels",
    "fastsafetensors": "links CUDA",
    "flashinfer-python": "CUDA kernels built for the release's torch",
    "humming-kernels": "CUDA kernels",
    "instanttensor": "links CUDA",
    "nccl-extensions": "links NCCL",
    "nccl4py": "links NCCL",
    "pynvvideocodec": "video decoding, links CUDA",
    "quack-kernels": "CUDA kernels",
    "tilelang": "kernel compiler, links CUDA",
    "tokenspeed-mla": "CUDA kernels",
    "tokenspeed-triton": "a Triton build of its own (the image has triton 3.6.0)",
    "torch-c-dlpack-ext": "links torch",
    "torchcodec": "links torch",
    "z3-solver": "tilelang's solver (large)",
}
NOT_CARRIED_PREFIXES = ("nvidia-",)


class ProbeError(Exception):
    pass


def pins_file(release: str) -> Path:
    """The release's x86_64 requirements file (the release table's layout: harness.requirements_of)."""
    return harness.requirements_of(release)


def image_packages(kinds: Path = KINDS_MD) -> tuple[set[str], dict[str, str]]:
    """(names, {name: version}) of the H200 image's Python packages as KINDS.md lists them."""
    text = kinds.read_text()
    m = re.search(r"Packages: ([^\n]+)", text)
    if not m:
        raise ProbeError(f"{kinds}: no 'Packages: ...' line (the image's package list)")
    names = {_norm(n) for n in m.group(1).rstrip(".").split(",") if n.strip()}
    versions: dict[str, str] = {}
    row = re.search(r"\| pip list, as a session saw it \|([^\n]+)", text)
    if row:
        listed = row.group(1).split("names it asked for:")[-1]
        for name, version in re.findall(r"([A-Za-z0-9_.-]+) (\d[\w.+]*)", listed):
            versions[_norm(name)] = version
    return names, versions


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name.strip()).lower()


def requires_dist(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        lines = zf.read(meta).decode().splitlines()
    return [line.split(":", 1)[1].strip() for line in lines if line.startswith("Requires-Dist:")]


def image_conflicts(reqs: list[str], versions: dict[str, str]) -> dict[str, str]:
    """{name: why} for requirements the image's recorded versions do not satisfy."""
    from packaging.requirements import Requirement
    from packaging.version import Version

    env = {"platform_machine": "x86_64", "platform_system": "Linux", "python_version": "3.12", "extra": ""}
    out = {}
    for text in reqs:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        have = versions.get(_norm(req.name))
        if have and not req.specifier.contains(Version(have.split("+")[0]), prereleases=True):
            out[_norm(req.name)] = f"image has {have}, the release requires {req.specifier}"
    return out


def choose_deps(pins: dict, image: set[str]) -> tuple[list[str], dict[str, str]]:
    carried, left = [], {}
    for name in sorted(pins):
        if name == "vllm" or name in image:
            continue
        why = NOT_CARRIED.get(name) or ("CUDA libraries" if name.startswith(NOT_CARRIED_PREFIXES) else None)
        if why:
            left[name] = why
        else:
            carried.append(name)
    return carried, left


def cmd_prepare(args) -> int:
    release = args.release
    dest = Path(args.dest or harness.DEST / f"v{release.replace('.', '')[:3]}")
    pins_path = pins_file(release)
    dl = dest / "dl"
    dl.mkdir(parents=True, exist_ok=True)
    if args.wheel:
        wheel = Path(args.wheel)
    else:
        found = sorted(dl.glob(f"vllm-{release}-*manylinux*x86_64.whl"))
        if not found:
            print(f"[prepare] downloading vllm=={release} (manylinux x86_64, ~340 MB)", flush=True)
            harness.pip_download([f"vllm=={release}"], dl)
            found = sorted(dl.glob(f"vllm-{release}-*manylinux*x86_64.whl"))
        if not found:
            raise ProbeError(f"{dl}: pip left no vllm-{release} manylinux x86_64 wheel")
        wheel = found[0]
    if pins_path.is_file():
        pins = harness.pinned(pins_path)
        digest = harness.check_wheel(wheel, pins_path)
        pin_note = f"pinned: matches {pins_path.relative_to(REPO)}"
    else:
        pins = {}
        digest = harness.sha256(wheel)
        pin_note = f"UNPINNED: no {pins_path.relative_to(REPO)}; sha256 as downloaded"
    print(f"[prepare] {wheel.name}: sha256 {digest} ({pin_note})", flush=True)
    with zipfile.ZipFile(wheel) as zf:
        left_out = {
            i.filename: i.file_size
            for i in zf.infolist()
            if i.filename.endswith(".so") or (i.filename.startswith("vllm/vllm-rs") and not i.is_dir())
        }
        third_party = sum(i.file_size for i in zf.infolist() if i.filename.startswith("vllm/third_party/"))
    exclude = tuple(sorted(set(EXCLUDE_PREFIXES) | set(left_out)))
    work = Path(tempfile.mkdtemp(prefix="probe-prepare-", dir=dest))
    try:
        site = work / "site"
        n = harness.unzip_into(wheel, site, exclude)
        print(f"[prepare] vLLM tree: {n} files; left out {len(left_out)} compiled files", flush=True)
        names, versions = image_packages()
        reqs = requires_dist(wheel)
        conflicts = image_conflicts(reqs, versions)
        carried, not_carried = choose_deps(pins, names) if pins else ([], {})
        specs = [f"{name}=={pins[name][0]}" for name in carried]
        if carried:
            req = dl / "deps" / "requirements.txt"
            req.parent.mkdir(parents=True, exist_ok=True)
            req.write_text(
                "".join(
                    f"{name}=={pins[name][0]} " + " ".join(f"--hash=sha256:{h}" for h in pins[name][1]) + "\n"
                    for name in carried
                )
            )
            harness.pip_download([], req.parent, req)
            wanted = {_norm(s.split("==")[0]) for s in specs}
            for w in sorted(req.parent.glob("*.whl")):
                if _norm(w.name.split("-")[0]) in wanted:
                    harness.unzip_into(w, site)
        print(f"[prepare] {len(carried)} pinned packages unpacked (pip checked their hashes)", flush=True)
        archive = subprocess.run(["git", "archive", "HEAD", "patches"], cwd=REPO, capture_output=True, check=True)
        (work / "committed").mkdir()
        subprocess.run(["tar", "-x", "-C", str(work / "committed")], input=archive.stdout, check=True)
        cmd = [sys.executable, str(REPO / "magpie" / "patches.py"), "apply", "--target", str(site)]
        cmd += ["--patches-dir", str(work / "committed" / "patches"), "--series", release]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise ProbeError(f"patches.py apply failed:\n{proc.stdout}{proc.stderr}")
        print("[prepare] " + proc.stdout.strip().replace("\n", "\n[prepare] "), flush=True)
        for cache in list(site.rglob("__pycache__")):
            shutil.rmtree(cache, ignore_errors=True)
        for old in ("site.tar.xz", "manifest.json"):
            (dest / old).unlink(missing_ok=True)
        print("[prepare] xz the site tree, ~1-2 min", flush=True)
        harness.tar_xz(site, dest / "site.tar.xz", "site")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    bundle = dest / "bundle"  # only the carried files, so the manifest lists exactly those
    shutil.rmtree(bundle, ignore_errors=True)
    bundle.mkdir()
    os.replace(dest / "site.tar.xz", bundle / "site.tar.xz")
    manifest = harness.write_manifest(
        bundle,
        {
            "part": "release-probe",
            "release": release,
            "wheel": wheel.name,
            "wheel_sha256": digest,
            "wheel_pin": pin_note,
            "git": harness.git_state(),
            "prepared_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "compiled_left_out": left_out,
            "third_party_left_out_bytes": third_party,
            "deps_carried": specs,
            "deps_not_carried": not_carried,
            "image_version_conflicts": conflicts,
            "patches_applied": proc.stdout.strip(),
        },
    )
    size = manifest["files"]["site.tar.xz"]["bytes"]
    base = harness.checkout_bytes()
    rel = bundle.relative_to(REPO)
    print(f"[prepare] {rel}/site.tar.xz: {size / 1e6:.1f} MB; with the checkout {(size + base) / 2**20:.1f} MiB of 64")
    for name, why in conflicts.items():
        print(f"[prepare] image conflict: {name}: {why}")
    print("[prepare] device call:")
    print(f'  carry ["{rel}/site.tar.xz", "{rel}/manifest.json"]')
    print(f"  command: python3 -m magpie.gpu.release_probe probe --bundle {rel} 2>&1 | tee $OUT/probe-console.txt")
    return 0 if size + base <= harness.CALL_LIMIT else 1


# ---------------------------------------------------------------------------------- GPU side

# The child: runs steps [start:] of a JSON list, appending one JSON line per step to RESULTS
# (flushed before the next step starts, so a crash loses only the step that crashed).
CHILD = r"""
import json, sys, time, traceback, warnings
steps = json.load(open(sys.argv[1]))
out = open(sys.argv[2], "a")
ns = {}
for index in range(int(sys.argv[3]), len(steps)):
    name, code = steps[index]
    out.write(json.dumps({"index": index, "started": name}) + "\n"); out.flush()
    rec = {"index": index, "name": name, "code": code}
    t0 = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            ns.pop("result", None)
            exec(compile(code, "<step %s>" % name, "exec"), ns)
            rec["ok"] = True
            if "result" in ns:
                rec["result"] = json.loads(json.dumps(ns["result"], default=str))
        except BaseException as exc:
            rec["ok"] = False
            frames = traceback.extract_tb(exc.__traceback__)[-6:]
            rec["error"] = {
                "type": type(exc).__module__ + "." + type(exc).__qualname__,
                "message": str(exc)[:2000],
                "missing_module": getattr(exc, "name", None) if isinstance(exc, ImportError) else None,
                "frames": ["%s:%s in %s: %s" % (f.filename, f.lineno, f.name, f.line) for f in frames],
            }
    rec["seconds"] = round(time.monotonic() - t0, 3)
    rec["warnings"] = ["%s: %s" % (w.category.__name__, str(w.message)[:300]) for w in caught[:8]]
    out.write(json.dumps(rec) + "\n"); out.flush()
"""

VERSIONS = """
import platform, sys, torch, triton
result = {
    "python": sys.version.split()[0], "platform": platform.platform(),
    "torch": torch.__version__, "torch_cuda": torch.version.cuda, "triton": triton.__version__,
    "cuda_available": torch.cuda.is_available(),
    "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
}
"""
REQUIREMENTS = """
import importlib.metadata as md
from packaging.requirements import Requirement
result = {}
for text in md.requires("vllm") or []:
    req = Requirement(text)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    try:
        dist = md.distribution(req.name)
        have, where = dist.version, str(dist.locate_file(""))
    except md.PackageNotFoundError:
        have, where = None, None
    ok = have is not None and req.specifier.contains(have, prereleases=True)
    result[req.name] = {"wants": str(req.specifier), "has": have, "ok": ok, "from": where}
"""
CUSTOM_OPS = """
import torch
import vllm._custom_ops
names = torch._C._dispatch_get_all_op_names()
result = {ns: sum(1 for n in names if n.startswith(ns + "::")) for ns in ("_C", "_moe_C", "_C_cache_ops")}
"""

STEPS = [
    ("import vllm", "import vllm\nresult = vllm.__version__"),
    ("versions", VERSIONS),
    ("requirements", REQUIREMENTS),
    ("vllm.envs", "import vllm.envs"),
    ("vllm.config", "import vllm.config"),
    ("LLM, SamplingParams", "from vllm import LLM, SamplingParams"),
    ("qwen3_5", "import vllm.model_executor.models.qwen3_5"),
    ("qwen3_5_mtp", "import vllm.model_executor.models.qwen3_5_mtp"),
    ("qwen4_exp model", "import vllm.models.qwen4_exp.nvidia.model"),
    ("qwen4_exp mtp", "import vllm.models.qwen4_exp.nvidia.mtp"),
    ("qwen4_exp model_state", "import vllm.models.qwen4_exp.nvidia.model_state"),
    ("patch draft_vocab", "import vllm.v1.spec_decode.draft_vocab"),
    ("patch ple_mmap", "import vllm.models.qwen4_exp.common.ple_mmap"),
    ("patch ngram_embedding", "import vllm.models.qwen4_exp.nvidia.ngram_embedding"),
    ("_custom_ops + torch.ops._C (no .so carried)", CUSTOM_OPS),
    ("V2 model runner", "import vllm.v1.worker.gpu.model_runner"),
]


def run_steps(steps: list, site: Path | None, deadline_s: float, python: str = sys.executable) -> list[dict]:
    """Run STEPS in child Pythons (PYTHONPATH=SITE first when given), in order; an exception is a
    failed step and the next one runs; a child that dies or passes the deadline is recorded as
    the failure of the step it was in, and a fresh child goes on from the next step."""
    results: dict[int, dict] = {}
    env = dict(os.environ)
    if site is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(site)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    end = time.monotonic() + deadline_s
    with tempfile.TemporaryDirectory(prefix="probe-steps-") as tmp:
        spec, log = Path(tmp) / "steps.json", Path(tmp) / "results.jsonl"
        spec.write_text(json.dumps(steps))
        start = 0
        while start < len(steps):
            left = end - time.monotonic()
            if left <= 0:
                for i in range(start, len(steps)):
                    results[i] = _failed(steps[i], "NotRun", "the probe's deadline passed before this step")
                break
            proc = subprocess.Popen(
                [python, "-c", CHILD, str(spec), str(log), str(start)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            try:
                output, _ = proc.communicate(timeout=left)
                why = f"the child exited with status {proc.returncode}"
            except subprocess.TimeoutExpired:
                proc.kill()
                output, _ = proc.communicate()
                why = f"the probe's deadline ({deadline_s:.0f} s) passed"
            started = None
            for line in log.read_text().splitlines():
                rec = json.loads(line)
                if "started" in rec:
                    started = rec["index"]
                else:
                    results[rec["index"]] = rec
            if started is not None and started not in results:  # the child died or hung inside it
                results[started] = _failed(steps[started], "ChildDied", why, (output or "")[-3000:])
            done = [i for i in results if i >= start]
            start = max(done) + 1 if done else len(steps)
            if not done:
                for i in range(len(steps)):
                    results.setdefault(i, _failed(steps[i], "ChildDied", why, (output or "")[-3000:]))
    return [results[i] for i in sorted(results)]


def _failed(step, kind: str, message: str, tail: str = "") -> dict:
    return {
        "name": step[0],
        "code": step[1],
        "ok": False,
        "error": {"type": kind, "message": message, "frames": [], "output_tail": tail},
    }


def table(steps: list[dict]) -> str:
    width = max(len(s["name"]) for s in steps)
    lines = []
    for s in steps:
        if s["ok"]:
            res = s.get("result")
            if isinstance(res, dict) and res and all(isinstance(v, dict) and "ok" in v for v in res.values()):
                unmet = [f"{k} {v['wants']} (has {v['has']})" for k, v in res.items() if not v["ok"]]
                detail = f"{len(res) - len(unmet)}/{len(res)} met; unmet: {', '.join(unmet) or 'none'}"[:400]
            else:
                detail = "" if res is None else (res if isinstance(res, str) else json.dumps(res))[:150]
            if s.get("warnings"):
                detail += f" [{len(s['warnings'])} warning(s): {s['warnings'][0][:120]}]"
            lines.append(f"{s['name']:<{width}}  ok    {s.get('seconds', 0):6.2f}s  {detail}")
        else:
            err = s["error"]
            where = err["frames"][-1] if err["frames"] else ""
            msg = err["message"].replace("\n", " ")[:200]
            lines.append(f"{s['name']:<{width}}  FAIL  {s.get('seconds', 0):6.2f}s  {err['type']}: {msg} @ {where}")
    return "\n".join(lines)


def cmd_probe(args) -> int:
    t0 = time.monotonic()
    bundle = Path(args.bundle)
    manifest = json.loads((bundle / "manifest.json").read_text())
    release = manifest["release"]
    tar = bundle / "site.tar.xz"
    digest = harness.sha256(tar)
    if digest != manifest["files"]["site.tar.xz"]["sha256"]:
        raise ProbeError(f"{tar}: sha256 {digest}, manifest says {manifest['files']['site.tar.xz']['sha256']}")
    root = Path(args.root or f"/tmp/probe{release.replace('.', '')[:3]}")
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    with tarfile.open(tar, "r:xz") as t:
        t.extractall(root, filter="fully_trusted")
    print(f"[probe] unpacked {tar} into {root} in {time.monotonic() - t0:.1f} s", flush=True)
    steps = run_steps(STEPS, root / "site", args.deadline - (time.monotonic() - t0))
    by_name = {s["name"]: s for s in steps}
    out = Path(args.out or os.environ.get("OUT") or ".")
    out.mkdir(parents=True, exist_ok=True)
    report = {
        "schema": SCHEMA,
        "release": release,
        "machine": {"hostname": platform.node(), "platform": platform.platform(), "python": sys.version.split()[0]},
        "versions": by_name.get("versions", {}).get("result"),
        "vllm_version": by_name.get("import vllm", {}).get("result"),
        "bundle": {
            k: manifest.get(k) for k in ("wheel", "wheel_sha256", "wheel_pin", "git", "deps_carried", "patches_applied")
        },
        "first_failure": next((s["name"] for s in steps if not s["ok"]), None),
        "steps": steps,
        "seconds": round(time.monotonic() - t0, 2),
    }
    path = out / f"probe-{release}.json"
    files.atomic_write_json(path, report)
    print(table(steps))
    print(f"[probe] first failing step: {report['first_failure']}; wrote {path} ({report['seconds']} s)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = cli.parser("python3 -m magpie.gpu.release_probe", __doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("prepare", help="build .gpu-harness/v<release>/bundle here (pip reaches the registry)")
    p.add_argument("--release", required=True, choices=releases.series_releases(), help="e.g. 0.33.0")
    p.add_argument("--wheel", help="the release's manylinux x86_64 wheel (default: download into DEST/dl)")
    p.add_argument("--dest", help="output folder, ignored by git (default: .gpu-harness/v<major><minor>)")
    p = sub.add_parser("probe", help="GPU machine: unpack a bundle and run the import steps")
    p.add_argument("--bundle", required=True, help="the folder holding site.tar.xz and manifest.json")
    p.add_argument("--root", help="where to unpack (default: /tmp/probe<major><minor>)")
    p.add_argument("--out", help="where probe-<release>.json goes (default: $OUT, else .)")
    p.add_argument("--deadline", type=float, default=55.0, help="seconds for all of it (default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        return {"prepare": cmd_prepare, "probe": cmd_probe}[args.command](args)
    except (ProbeError, harness.HarnessError) as exc:
        print(f"release_probe {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
