"""ple_ssd for vLLM 0.34.0: Engram `disk_offload_gather` (patches/vllm-0.34.0/ple_ssd/0001) over
upstream's `disk_offload`.

What runs here (no GPU, no 0.34 CPU wheel): 0.34.0's own Python from the pristine sdist, patched
by magpie/patches.py into a hard-link copy, over the test venv's dependencies, in a child process
(this file run as a script). The child writes a real Qwen4Exp checkpoint (config.json and
safetensors files; the n-gram table as `...ngram_embedding.shard_<i>.weight` tensors, NVFP4 also
`...shard_<i>.weight_scale`, spread over several files), builds 0.34's own
`Qwen4ExpNGramEmbedding` three ways (the resident table, `cpu_offload=False`; upstream's
`disk_offload`; `disk_offload` + `disk_offload_gather`), loads them with 0.34's
`safetensors_weights_iterator` and `process_weights_after_loading`, stages steps with 0.34's
`stage_checkpoint_rows` and compares the staged bytes with the resident table's rows of the same
ids (BF16, FP8, NVFP4 with its scale plane), warm and after evicting the files, and the BF16
forward with the resident table's forward. Upstream's `verify_model_config` refuses
`disk_offload` off CUDA, so the disk-offload `EngramConfig` is set on the built VllmConfig here;
the refusals of the patch (EngramConfig's validator, `verify_load_config`) are run directly.
Not run here: the model runner, CUDA graphs, pinned buffers, the NVFP4 decode (Triton).

    python test_ple34.py SCENARIO DIR OUT.json [options]   (the child; see main())
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import py_compile
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.releases import sdist_tree

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
TOOL = REPO / "magpie" / "patches.py"
PATCH = REPO / "patches" / "vllm-0.34.0" / "ple_ssd" / "0001-disk-offload-gather.patch"
TABLE_PREFIX = "model.layers.1.ple.ple_embedding."
SHARDS, FILES = 16, 4


# --------------------------------------------------------------------------- the child process
def _config_json(out: Path, kind: str) -> None:
    from tests.v0_33.test_ple_ssd_033 import text_config

    config = text_config(3000)
    config["split_ngram_parts"] = SHARDS
    if kind != "bf16":
        config["ple_embedding_dtype"] = {"fp8": "float8_e4m3fn", "nvfp4": "nvfp4"}[kind]
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=1))


def _write_checkpoint(out: Path, embedding) -> None:
    """Shards of the table planes the built layer expects, over FILES files, random bytes (no
    NaN/Inf patterns for float planes); the layer's other parameters as small constants."""
    import torch
    from safetensors.torch import save_file

    table = embedding.ngram_embedding
    planes = (
        ("weight", "weight_scale")
        if type(table.embedding_method).__name__.endswith("NvFp4EmbeddingMethod")
        else ("weight",)
    )
    rows = table.org_vocab_size
    shard_size = -(-rows // embedding.split_ngram_parts)
    generator = torch.Generator().manual_seed(0)
    files: list[dict] = [{} for _ in range(FILES)]
    for plane in planes:
        param = getattr(table, plane)
        for index in range(embedding.split_ngram_parts):
            count = max(0, min(shard_size, rows - index * shard_size))
            if param.dtype == torch.uint8:
                data = torch.randint(0, 256, (count, param.shape[1]), generator=generator, dtype=torch.uint8)
            else:
                data = (torch.rand(count, param.shape[1], generator=generator) * 2 - 1).to(param.dtype)
            files[index * FILES // SHARDS][f"{TABLE_PREFIX}ngram_embedding.shard_{index}.{plane}"] = data
            # stands in for the other weights of a real checkpoint's files
            files[index * FILES // SHARDS][f"{TABLE_PREFIX}filler_{plane}_{index}"] = torch.ones(333, dtype=torch.int8)
    for name, param in table.named_parameters():
        if name not in planes:
            files[0][f"{TABLE_PREFIX}ngram_embedding.{name}"] = torch.full(param.shape, 0.5, dtype=param.dtype)
    for number, tensors in enumerate(files, start=1):
        save_file(tensors, str(out / f"model-{number:05d}-of-{FILES:05d}.safetensors"), metadata={"format": "pt"})


def _make_config(checkpoint: Path, engram: dict):
    """0.34's VllmConfig for the checkpoint. 0.34's CPU platform refuses x86 without triton-cpu
    (the venv has none); the layers built here run no Triton, so the check is passed by saying
    Triton is present while the configuration is built, and restored after."""
    import vllm.triton_utils

    from tests.v0_33.test_ple_ssd_033 import make_config

    saved = vllm.triton_utils.HAS_TRITON
    vllm.triton_utils.HAS_TRITON = True
    try:
        return make_config(checkpoint, engram)
    finally:
        vllm.triton_utils.HAS_TRITON = saved


def _load(embedding, config, checkpoint: Path, strategy=None) -> None:
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator

    files = sorted(str(p) for p in checkpoint.glob("*.safetensors"))
    weights = (
        (name[len(TABLE_PREFIX) :], tensor)
        for name, tensor in safetensors_weights_iterator(files, False, strategy)
        if name.startswith(TABLE_PREFIX) and "filler_" not in name
    )
    with set_current_vllm_config(config):
        embedding.load_weights(weights)
        process_weights_after_loading(embedding, config.model_config, torch.device("cpu"))


def _evict(checkpoint: Path, embeddings) -> None:
    for embedding in embeddings:
        for gather in getattr(embedding.ngram_embedding, "_gathers", {}).values():
            gather.unmap_pages()
    for path in checkpoint.glob("*.safetensors"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cmd_rows(args) -> dict:
    """Staged bytes of upstream's disk_offload and of the gather against the resident table."""
    import torch
    from vllm.config import EngramConfig, set_current_vllm_config
    from vllm.models.qwen4_exp.nvidia.ngram_embedding import stage_checkpoint_rows

    from tests.v0_33.test_ple_ssd_033 import build_embedding, init_distributed, make_steps

    checkpoint = Path(args.dir)
    _config_json(checkpoint, args.kind)
    config = _make_config(checkpoint, {"cpu_offload": False})
    init_distributed(config)
    resident = build_embedding(config)
    _write_checkpoint(checkpoint, resident)
    _load(resident, config, checkpoint)
    built = {}
    # The gather stages first: upstream's reads would bring an evicted step's pages back.
    for name, engram in (
        ("gather", {"disk_offload": True, "disk_offload_gather": True}),
        ("upstream", {"disk_offload": True}),
    ):
        config.engram_config = EngramConfig(**engram)  # verify_model_config refuses it off CUDA
        with set_current_vllm_config(config):
            built[name] = build_embedding(config)
        _load(built[name], config, checkpoint)
    table = resident.ngram_embedding
    planes = list(built["gather"].ngram_embedding._planes)
    result = {
        "kind": args.kind,
        "planes": planes,
        "classes": {k: type(v.ngram_embedding).__name__ for k, v in built.items()},
    }
    result["gathers"] = sorted(built["gather"].ngram_embedding._gathers)
    result["upstream_fds"] = len(built["upstream"].ngram_embedding._fds)
    checks = []
    steps = make_steps(args.seed, 6, 256)
    with torch.inference_mode():
        for number, (tokens, qsl, context) in enumerate(steps):
            cold = number % 2 == 1
            if cold:
                _evict(checkpoint, built.values())
            ids = resident.compute_ngram_ids(tokens, qsl, context)
            n = tokens.shape[0]
            step = {"tokens": n, "cold": cold}
            for name, embedding in built.items():
                stage_checkpoint_rows([(embedding, embedding.ngram_embedding)], tokens, qsl, context)
                for plane in planes:
                    staged = embedding.ngram_embedding._planes[plane][0][:n]
                    want = getattr(table, plane)[ids]
                    step[f"{name}_{plane}"] = bool(torch.equal(staged.view(torch.uint8), want.view(torch.uint8)))
            if cold:
                step["gather_cold_path"] = all(g.last_cold for g in built["gather"].ngram_embedding._gathers.values())
            if args.kind != "nvfp4":
                hidden = torch.zeros(n, 1)
                want = resident(hidden, tokens, qsl, context)
                got = built["gather"](hidden, tokens, qsl, context)
                step["forward_equal"] = bool(torch.equal(got.view(torch.uint8), want.view(torch.uint8)))
            checks.append(step)
    result["steps"] = checks
    # A forward whose rows were never staged: the gather refuses, upstream serves its buffers.
    config.engram_config = EngramConfig(disk_offload=True, disk_offload_gather=True)
    with set_current_vllm_config(config):
        fresh = build_embedding(config)
    _load(fresh, config, checkpoint)
    tokens, qsl, context = steps[0]
    try:
        fresh.ngram_embedding.staged_rows(tokens.shape[0])
        result["unstaged"] = "served"
    except RuntimeError as e:
        result["unstaged"] = str(e)
    fresh.ngram_embedding.mark_dummy_rows(tokens.shape[0])
    if args.kind == "bf16":  # after a dummy step's mark, the forward runs (NVFP4 decode needs Triton)
        fresh.ngram_embedding.staged_rows(tokens.shape[0])
        result["dummy_ok"] = True
    return result


def cmd_config(args) -> dict:
    """EngramConfig cases through the patched (or pristine) class: factors or the error."""
    from vllm.config import EngramConfig, LoadConfig

    out = {}
    cases = {
        "default": {},
        "disk_offload": {"disk_offload": True},
        "gather": {"disk_offload": True, "disk_offload_gather": True},
        "gather_alone": {"disk_offload_gather": True},
    }
    for name, fields in cases.items():
        try:
            out[name] = {"factors": {k: str(v) for k, v in EngramConfig(**fields).compile_factors().items()}}
        except Exception as e:  # the outcome under test
            out[name] = {"error": f"{type(e).__name__}: {e}"}
    if "disk_offload_gather" in EngramConfig.__dataclass_fields__:
        out["str_gather"] = str(EngramConfig(**cases["gather"]))
    if hasattr(EngramConfig, "verify_load_config"):
        for strategy in (None, "lazy", "eager", "prefetch", "torchao"):
            for name, fields in (("gather", cases["gather"]), ("disk_offload", cases["disk_offload"])):
                key = f"load_{name}_{strategy}"
                try:
                    EngramConfig(**fields).verify_load_config(LoadConfig(safetensors_load_strategy=strategy))
                    out[key] = "ok"
                except ValueError as e:
                    out[key] = str(e)
    return out


def cmd_dtype(args) -> dict:
    """A float16 table with the gather: refused when the layer is built."""
    import torch
    from vllm.config import EngramConfig, set_current_vllm_config
    from vllm.models.qwen4_exp.nvidia.ngram_embedding import Qwen4ExpNGramEmbedding

    from tests.v0_33.test_ple_ssd_033 import init_distributed

    checkpoint = Path(args.dir)
    _config_json(checkpoint, "bf16")
    config = _make_config(checkpoint, {"cpu_offload": False})
    init_distributed(config)
    config.engram_config = EngramConfig(disk_offload=True, disk_offload_gather=True)
    text = config.model_config.hf_text_config
    try:
        with set_current_vllm_config(config):
            Qwen4ExpNGramEmbedding(
                text, int(text.ple_embed_dim), 1, 256, data_parallel_rank=0, prefix="p", params_dtype=torch.float16
            )
        return {"error": None}
    except ValueError as e:
        return {"error": str(e)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=["rows", "config", "dtype", "batch"])
    parser.add_argument("dir", help="batch: a JSON file of {name: [argv of a scenario, its log file]}")
    parser.add_argument("out")
    parser.add_argument("--kind", default="bf16", choices=["bf16", "fp8", "nvfp4"])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    # vLLM's own logging setup leaves it at WARNING here: the patch's INFO lines are asserted.
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s: %(message)s")
    logging.getLogger("vllm").setLevel(logging.INFO)
    if args.scenario == "batch":  # the scenarios in this one process (one vLLM import), each logged apart
        from tests.ple_ssd.ple_runner import run_jobs

        result = run_jobs(json.loads(Path(args.dir).read_text()), main)
    else:
        result = globals()[f"cmd_{args.scenario}"](args)
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


# --------------------------------------------------------------------------- the tests
def _sdist() -> Path:
    return sdist_tree("0.34.0")


def _overlay(dest: Path, patched: bool) -> Path:
    dest.mkdir(parents=True)
    subprocess.run(["cp", "-al", str(_sdist() / "vllm"), str(dest / "vllm")], check=True)
    if patched:
        cmd = [sys.executable, str(TOOL), "apply", "--with-requires", "--target", str(dest), "ple_ssd"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    return dest


@pytest.fixture(scope="module")
def trees(tmp_path_factory):
    root = tmp_path_factory.mktemp("v034")
    return {"patched": _overlay(root / "patched", True), "stock": _overlay(root / "stock", False)}


def _batch(tree: Path, folder: Path, jobs: dict[str, tuple[str, ...]]) -> dict[str, dict]:
    """The jobs ({name: (scenario, *options)}) run in one child of the tree, each in a folder of
    its own and with its own log: {name: result, its log under "_log"; or its "_error"}."""
    argvs = {}
    for name, (scenario, *options) in jobs.items():
        (folder / name).mkdir()
        argv = [scenario, str(folder / name / "ckpt"), str(folder / name / "out.json"), *options]
        argvs[name] = (argv, str(folder / name / "log.txt"))
    (folder / "jobs.json").write_text(json.dumps(argvs, indent=1))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), str(REPO)]), "VLLM_LOGGING_LEVEL": "INFO"}
    proc = subprocess.run(
        [sys.executable, str(Path(__file__)), "batch", str(folder / "jobs.json"), str(folder / "report.json")],
        capture_output=True,
        text=True,
        env=env,
        cwd=folder,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    report = json.loads((folder / "report.json").read_text())
    results = {}
    for name in jobs:
        log = (folder / name / "log.txt").read_text()
        if report[name] is None:
            results[name] = {**json.loads((folder / name / "out.json").read_text()), "_log": log}
        else:
            results[name] = {"_error": f"{' '.join(argvs[name][0])} failed:\n{log[-3000:]}\n{report[name]}"}
    return results


JOBS = {
    "patched": {
        "config": ("config",),
        "dtype": ("dtype",),
        **{f"rows_{kind}": ("rows", "--kind", kind) for kind in ("bf16", "fp8", "nvfp4")},
    },
    "stock": {"config": ("config",)},
}


@pytest.fixture(scope="module")
def child(trees, tmp_path_factory):
    """child(tree, scenario, *options): the result of that run. Each tree's runs (JOBS) are jobs
    of one child process (a vLLM import costs ~16 s here); a job that failed fails only its tests."""
    runs: dict[str, dict] = {}

    def run(tree: Path, scenario: str, *options: str) -> dict:
        which = "patched" if tree == trees["patched"] else "stock"
        names = [name for name, job in JOBS[which].items() if job == (scenario, *options)]
        assert names, f"no job {(scenario, *options)} in JOBS[{which!r}]"
        if which not in runs:
            runs[which] = _batch(tree, tmp_path_factory.mktemp(f"v034-{which}"), JOBS[which])
        result = runs[which][names[0]]
        if "_error" in result:
            pytest.fail(result["_error"])
        return result

    return run


def test_patch_applies_to_pristine_sdist_compiles_and_reverts(tmp_path):
    tree = tmp_path / "tree"
    tree.mkdir()
    subprocess.run(["cp", "-r", str(_sdist() / "vllm"), str(tree / "vllm")], check=True)
    touched = [line[6:] for line in PATCH.read_text().splitlines() if line.startswith("+++ b/")]
    before = {p: (tree / p).read_bytes() for p in touched if (tree / p).exists()}
    assert "vllm/models/qwen4_exp/nvidia/ple_rows.py" not in before
    for action in ("check", "apply"):
        proc = subprocess.run(
            [sys.executable, str(TOOL), action, "--with-requires", "--target", str(tree), "ple_ssd"],
            capture_output=True,
            text=True,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
    proc = subprocess.run(
        [sys.executable, str(TOOL), "status", "--json", "--target", str(tree)], capture_output=True, text=True
    )
    states = {p["name"]: p["state"] for p in json.loads(proc.stdout)["patches"]}
    assert states["ple_ssd/0001-disk-offload-gather.patch"] == "applied", states
    for path in touched:
        py_compile.compile(str(tree / path), doraise=True)
        assert path not in before or (tree / path).read_bytes() != before[path]
    proc = subprocess.run(
        [sys.executable, str(TOOL), "revert", "--target", str(tree), "ple_ssd"], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert {p: (tree / p).read_bytes() for p in before} == before
    assert not (tree / "vllm/models/qwen4_exp/nvidia/ple_rows.py").exists()


def test_shipped_gather_module_is_the_source():
    proc = subprocess.run([sys.executable, str(TOOL), "check-sources"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = PATCH.read_text()
    assert "+++ b/vllm/models/qwen4_exp/nvidia/ple_rows.py" in text
    assert 'Activation: --engram-config \'{"disk_offload": true, "disk_offload_gather": true}\'' in text


@pytest.mark.slow
def test_config_refusals_and_inert_default(trees, child):
    patched = child(trees["patched"], "config")
    stock = child(trees["stock"], "config")
    # Inert: the compile factors of every configuration upstream accepts are upstream's.
    for case in ("default", "disk_offload", "gather"):
        assert "error" not in patched[case], patched[case]
    assert patched["default"]["factors"] == stock["default"]["factors"]
    assert patched["disk_offload"]["factors"] == stock["disk_offload"]["factors"]
    assert patched["gather"]["factors"] == stock["disk_offload"]["factors"]
    assert "error" in stock["gather_alone"] or "disk_offload_gather" not in json.dumps(stock["default"])
    error = patched["gather_alone"]["error"]
    assert "disk_offload_gather requires disk_offload" in error and '"disk_offload": true' in error
    for strategy in ("eager", "prefetch", "torchao"):
        message = patched[f"load_gather_{strategy}"]
        assert "disk_offload_gather" in message and f"--safetensors-load-strategy {strategy}" in message
        assert "use --safetensors-load-strategy lazy" in message
        assert patched[f"load_disk_offload_{strategy}"] == "ok"  # upstream's own path untouched
    assert patched["load_gather_None"] == patched["load_gather_lazy"] == "ok"


def _proof_logs() -> dict[str, str]:
    return dict(
        line[len("Proof-Log: ") :].split(": ", 1)
        for line in PATCH.read_text().splitlines()
        if line.startswith("Proof-Log: ")
    )


@pytest.mark.slow
def test_proof_log_lines_match_what_the_patched_vllm_prints(trees, child):
    logs = _proof_logs()
    assert set(logs) == {"ple_hook", "ple_active", "ple_staging"}
    config = child(trees["patched"], "config")
    # VllmConfig logs "Resolved Engram configuration: %s" with str(EngramConfig).
    assert re.search(logs["ple_hook"], "Resolved Engram configuration: " + config["str_gather"])
    rows = child(trees["patched"], "rows", "--kind", "nvfp4")
    match = next(m for m in (re.search(logs["ple_active"], line) for line in rows["_log"].splitlines()) if m)
    assert match.group("planes") == "weight, weight_scale"
    assert match.group("how") == "rows staged before each forward"  # magpie log-check's wording
    staging = (
        "Engram disk_offload_gather: Qwen4ExpModelState.prepare_inputs stages PLE rows for 2 layer(s), "
        "gathered from the mappings"
    )
    source = (trees["patched"] / "vllm/models/qwen4_exp/nvidia/model_state.py").read_text()
    assert '"stages PLE rows for %d layer(s), gathered from the mappings"' in source
    assert re.search(logs["ple_staging"], staging).group("n") == "2"


@pytest.mark.slow
def test_unsupported_dtype_is_refused_when_built(trees, child):
    result = child(trees["patched"], "dtype")
    assert result["error"] and "disk_offload_gather serves BF16, FP8 and NVFP4" in result["error"]
    assert "torch.float16" in result["error"] and "disk_offload_gather=false" in result["error"]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["bf16", "fp8", "nvfp4"])
def test_gathered_rows_equal_the_resident_table_warm_and_cold(trees, child, kind):
    result = child(trees["patched"], "rows", "--kind", kind)
    assert result["classes"] == {
        "gather": "Qwen4ExpPLEDiskOffloadEmbedding",
        "upstream": "Qwen4ExpPLEDiskOffloadEmbedding",
    }
    assert result["planes"] == (["weight", "weight_scale"] if kind == "nvfp4" else ["weight"])
    assert result["gathers"] == sorted(result["planes"]) and result["upstream_fds"] == FILES
    assert any(s["cold"] for s in result["steps"]) and any(not s["cold"] for s in result["steps"])
    for step in result["steps"]:
        for plane in result["planes"]:
            assert step[f"gather_{plane}"], (plane, step)
            assert step[f"upstream_{plane}"], (plane, step)
        if step["cold"]:
            assert step["gather_cold_path"], step
        if kind != "nvfp4":
            assert step["forward_equal"], step
    assert "found 0 staged PLE rows" in result["unstaged"] and "prepare_inputs" in result["unstaged"]
    assert "Engram disk_offload_gather: PLE rows gathered from the mapped checkpoint shards" in result["_log"]


if __name__ == "__main__":
    sys.exit(main())
