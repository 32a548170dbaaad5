#!/usr/bin/env python3
"""Build FlashInfer kernels ahead of time from an installed `flashinfer-python` wheel.

FlashInfer's own `python -m flashinfer.aot` expects a source checkout (csrc/, 3rdparty/ next to
the package); the wheel carries the same sources under flashinfer/data/. This drives the same
machinery (flashinfer.aot.gen_all_modules -> flashinfer.jit.build_jit_specs -> ninja + nvcc)
against the installed package and copies each built module to OUT/<name>/<name>.so, the layout
of FlashInfer's `flashinfer_jit_cache` package (nix/flashinfer-aot.nix wraps it into one).

    FLASHINFER_CUDA_ARCH_LIST="12.1" CUDA_HOME=... MAX_JOBS=20 \
        python magpie flashinfer-aot --build-dir build --out-dir kernels --preset moe

Presets (what the Qwen3.8-Flash-Next NVFP4 server uses first; anything else stays JIT):
  moe   fused-MoE, GEMM and FP4 quantization modules, activation and misc kernels, no attention
        head-dim sweep, no communication or XQA kernels
  all   FlashInfer's own default AOT configuration (hours of compilation)
Needs nvcc (CUDA_HOME), a host compiler and ninja; no GPU, no network: FlashInfer's TensorRT-LLM
generators (SM100 MoE/GEMM/FMHA, MoE routing utilities) download prebuilt cubins while their
specs are generated; with FLASHINFER_NO_DOWNLOAD set they fail instead, and those modules are
left to the run-time JIT (stderr names them). Verified here only as far as `--list` (no nvcc
build was run on this 2-core machine).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

PRESETS = {
    "moe": {
        "fa2_head_dim": [],
        "fa3_head_dim": [],
        "use_sliding_window": [False],
        "use_logits_soft_cap": [False],
        "add_comm": False,
        "add_gemma": False,
        "add_oai_oss": False,
        "add_moe": True,
        "add_act": True,
        "add_misc": True,
        "add_xqa": False,
    },
    "all": {},
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n", 1)[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--build-dir", type=Path, required=True, help="ninja's work folder")
    parser.add_argument("--out-dir", type=Path, required=True, help="where <name>/<name>.so go")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="moe", help="which modules")
    parser.add_argument("--list", action="store_true", help="print the module names and build nothing")
    return parser.parse_args(argv)


class _LeftOut:
    """What a generator that needed a download returns instead of its spec: not a JitSpecNvcc,
    so it is filtered out below; it has a name because gen_all_modules de-duplicates by name."""

    def __init__(self, generator: str):
        self.name = f"left-out:{generator}"


def skip_downloading_generators(aot_module) -> list[str]:
    """Make the generators that need a download give up instead, and note which did.

    FlashInfer's TensorRT-LLM kernels (trtllm-gen MoE/GEMM/FMHA, and the MoE routing utilities)
    fetch prebuilt cubins and headers while their specs are generated. With FLASHINFER_NO_DOWNLOAD
    set, FlashInfer's get_artifact raises instead of downloading; each `gen_*` function that
    gen_all_modules calls is wrapped so that this error leaves its module to the run-time JIT.
    """
    os.environ["FLASHINFER_NO_DOWNLOAD"] = "1"
    left_out: list[str] = []

    def wrap(name, generator):
        def wrapped(*args, **kwargs):
            try:
                return generator(*args, **kwargs)
            except RuntimeError as e:
                if "FLASHINFER_NO_DOWNLOAD" not in str(e):
                    raise
                left_out.append(name)
                return _LeftOut(name)

        return wrapped

    for name, value in list(vars(aot_module).items()):
        if name.startswith("gen_") and name != "gen_all_modules" and callable(value):
            setattr(aot_module, name, wrap(name, value))
    return left_out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not os.environ.get("FLASHINFER_CUDA_ARCH_LIST"):
        print('error: set FLASHINFER_CUDA_ARCH_LIST (e.g. "12.1"); there is no GPU to ask', file=sys.stderr)
        return 2

    import flashinfer
    from flashinfer import aot
    from flashinfer.jit import env as jit_env
    from flashinfer.jit.core import JitSpecNvcc, build_jit_specs

    config = aot.get_default_config()
    config.update(PRESETS[args.preset])
    build_dir = args.build_dir.resolve()
    jit_env.FLASHINFER_WORKSPACE_DIR = build_dir
    jit_env.FLASHINFER_JIT_DIR = build_dir / "cached_ops"
    jit_env.FLASHINFER_GEN_SRC_DIR = build_dir / "generated"
    jit_env.FLASHINFER_JIT_DIR.mkdir(parents=True, exist_ok=True)
    jit_env.FLASHINFER_GEN_SRC_DIR.mkdir(parents=True, exist_ok=True)

    left_out = skip_downloading_generators(aot)
    capabilities = aot.detect_sm_capabilities()
    specs = aot.gen_all_modules(
        config["f16_dtype"],
        config["f8_dtype"],
        config["fa2_head_dim"],
        config["fa3_head_dim"],
        config["use_sliding_window"],
        config["use_logits_soft_cap"],
        capabilities,
        config["add_comm"],
        config["add_gemma"],
        config["add_oai_oss"],
        config["add_moe"],
        config["add_act"],
        config["add_misc"],
        config["add_xqa"],
    )
    # CuTe-DSL modules compile at run time by design; only nvcc modules are built here.
    specs = [spec for spec in specs if isinstance(spec, JitSpecNvcc)]
    names = [spec.name for spec in specs]
    if left_out:
        print(f"left to the run-time JIT (they download cubins): {', '.join(left_out)}", file=sys.stderr)
    if args.list:
        print("\n".join(names))
        return 0
    if not specs:
        print(f"error: preset {args.preset} selects no module for {capabilities}", file=sys.stderr)
        return 1

    print(f"building {len(specs)} FlashInfer modules for {os.environ['FLASHINFER_CUDA_ARCH_LIST']}", file=sys.stderr)
    started = time.monotonic()
    build_jit_specs(specs, verbose=True, skip_prebuilt=False)
    aot.copy_built_kernels(specs, args.out_dir)
    manifest = {
        "flashinfer": flashinfer.__version__,
        "cuda_arch_list": os.environ["FLASHINFER_CUDA_ARCH_LIST"],
        "preset": args.preset,
        "modules": names,
        "seconds": round(time.monotonic() - started),
    }
    (args.out_dir / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"built {len(specs)} modules in {manifest['seconds']} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
