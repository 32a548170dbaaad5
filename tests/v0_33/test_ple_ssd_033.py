"""ple_ssd for vLLM 0.33.0: Engram `offload_storage="mmap"` (patches/vllm-0.33.0/ple_ssd/0001).

What runs here (no GPU, no 0.33 CPU wheel): 0.33.0's own Python, patched or pristine, over the
test venv (tree_033.py), in a child process: this file run as a script. The child builds a real
Qwen4Exp checkpoint (config.json + safetensors files, the n-gram table in
`...ngram_embedding.shard_<i>.weight` tensors over several files), a real `VllmConfig` from it,
0.33's `Qwen4ExpNGramEmbedding` under that config, loads it with 0.33's own
`safetensors_weights_iterator` and `process_weights_after_loading`, and runs its `forward` (the
mmap table staged through `MmapNGramTable.stage`, or read by the direct lookup over a CPU view of
the mappings). The reference is the stock resident table (`cpu_offload=False`) of pristine
0.33.0: the pinned table (`cpu_offload=True`, upstream's default) needs CUDA (pinned memory, UVA,
a Triton kernel) and cannot run here. Not run here: Qwen4ExpModelState.prepare_inputs (the V2
runner's input batch), CUDA graphs, the side stream, the CUDA view of a mapping, FP8 lookups on
a GPU, TP > 1.

    python test_ple_ssd_033.py SCENARIO DIR OUT.json|OUT.pt [options]   (the child; see main())
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from magpie.demo.demo_model import qwen4_exp_text_config
from tests.v0_33.tree_033 import sdist_033

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
PATCH = REPO / "patches" / "vllm-0.33.0" / "ple_ssd" / "0001-engram-mmap-storage.patch"
TABLE_PREFIX = "model.layers.1.ple.ple_embedding."
PREFIX = "model.layers.1.ple.ple_embedding"
MAX_TOKENS = 256
HEAD_DIM, NGRAM_SIZE, HEADS_PER_NGRAM, EOS, VOCAB = 160, 3, 8, 2, 4096
NGRAM_HEADS = (NGRAM_SIZE - 1) * HEADS_PER_NGRAM
SHARDS, FILES = 16, 4


# --------------------------------------------------------------------------- the child process
def text_config(ngram_vocab_size_base: int) -> dict:
    """config.json of a tiny two-layer Qwen4Exp text model with PLE on layer 1."""
    return qwen4_exp_text_config(
        vocab_size=VOCAB,
        eos_token_id=EOS,
        bos_token_id=1,
        ple_layer_ids=[1],
        ple_embed_dim=NGRAM_HEADS * HEAD_DIM,
        ple_conv_kernel_size=4,
        ngram_size=NGRAM_SIZE,
        heads_per_ngram=HEADS_PER_NGRAM,
        ngram_vocab_size_base=ngram_vocab_size_base,
        make_ngram_vocab_size_divisible_by=128,
        split_ngram_parts=SHARDS,
    )


def build(out: Path, base: int, fp8: bool, nvfp4: bool, filler: int, drop: int | None = None) -> dict:
    """A checkpoint whose table layout is the one 0.33's own code computes."""
    import torch
    from safetensors.torch import save_file
    from vllm.models.qwen4_exp.nvidia.ngram_embedding import Qwen4ExpNGramEmbedding

    _, _, total = Qwen4ExpNGramEmbedding._make_vocab_layout(
        ngram_vocab_size_base=base, ngram_heads=NGRAM_HEADS, ple_dense_layer_id=1
    )
    rows = -(-total // 128) * 128
    shard_size = -(-rows // SHARDS)
    out.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(0)
    files: list[dict] = [{} for _ in range(FILES)]
    config = text_config(base)
    if fp8:
        config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
        files[0][TABLE_PREFIX + "ngram_embedding.weight_scale"] = torch.tensor(0.5, dtype=torch.float32)
    if nvfp4:
        config["ple_embedding_dtype"] = "nvfp4"
    for index in range(SHARDS):
        if index == drop:
            continue
        count = max(0, min(shard_size, rows - index * shard_size))
        shard = torch.randn(count, HEAD_DIM, generator=generator)
        dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
        target = files[index * FILES // SHARDS]
        target[f"{TABLE_PREFIX}ngram_embedding.shard_{index}.weight"] = shard.to(dtype)
        if filler:  # stands in for the other weights of the real checkpoint's files
            filler_rows = torch.randn(filler // 2, generator=generator).to(torch.bfloat16)
            target[f"{TABLE_PREFIX}ngram_embedding.shard_{index}.weight_filler"] = filler_rows
    weight_map = {}
    for number, tensors in enumerate(files, start=1):
        name = f"model-{number:05d}-of-{FILES:05d}.safetensors"
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return {"rows": rows, "table_bytes": rows * HEAD_DIM * (1 if fp8 else 2)}


def make_config(checkpoint: Path, engram: dict | None, strategy=None, load_format="auto"):
    from vllm.config import EngramConfig, LoadConfig, ModelConfig, SchedulerConfig, VllmConfig

    return VllmConfig(
        model_config=ModelConfig(model=str(checkpoint), dtype="bfloat16", max_model_len=512),
        load_config=LoadConfig(load_format=load_format, safetensors_load_strategy=strategy),
        engram_config=None if engram is None else EngramConfig(**engram),
        scheduler_config=SchedulerConfig(
            max_num_batched_tokens=MAX_TOKENS, max_num_seqs=8, max_model_len=512, is_encoder_decoder=False
        ),
    )


def init_distributed(config) -> None:
    import atexit
    import tempfile

    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import model_parallel_is_initialized

    if model_parallel_is_initialized():  # an earlier scenario of the same batch child
        return
    rendezvous = tempfile.mktemp(prefix="ple-033-")
    atexit.register(lambda: Path(rendezvous).unlink(missing_ok=True))
    with set_current_vllm_config(config):
        init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            backend="gloo",
            distributed_init_method=f"file://{rendezvous}",
        )
        initialize_model_parallel(1, 1)


def build_embedding(config):
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.models.qwen4_exp.nvidia.ngram_embedding import Qwen4ExpNGramEmbedding

    text = config.model_config.hf_text_config
    with set_current_vllm_config(config):
        return Qwen4ExpNGramEmbedding(
            text,
            int(text.ple_embed_dim),
            1,
            MAX_TOKENS,
            data_parallel_rank=0,
            prefix=PREFIX,
            quant_config=config.quant_config,
            params_dtype=torch.bfloat16,
        )


def load(embedding, config, checkpoint: Path) -> None:
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator

    files = sorted(str(p) for p in checkpoint.glob("*.safetensors"))
    strategy = config.load_config.safetensors_load_strategy
    weights = (
        (name[len(TABLE_PREFIX) :], tensor)
        for name, tensor in safetensors_weights_iterator(files, False, strategy)
        if name.startswith(TABLE_PREFIX) and not name.endswith("_filler")
    )
    with set_current_vllm_config(config):
        embedding.load_weights(weights)
        process_weights_after_loading(embedding, config.model_config, torch.device("cpu"))


def make_steps(seed: int, count: int, max_tokens: int):
    """Batches as the runner lays them out: requests of random lengths (EOS inside some), a
    context of the previous NGRAM_SIZE - 1 tokens per request, trailing empty requests."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    steps = []
    for step in range(count):
        num_reqs = int(torch.randint(1, 5, (1,), generator=generator))
        lengths = torch.randint(1, max_tokens // 4 + 1, (num_reqs,), generator=generator)
        if step % 3 == 0:
            lengths = torch.ones(num_reqs, dtype=torch.long)  # a decode step
        tokens = torch.randint(0, VOCAB, (int(lengths.sum()),), generator=generator)
        tokens[torch.rand(tokens.shape, generator=generator) < 0.05] = EOS
        qsl = torch.zeros(num_reqs + 3, dtype=torch.int32)
        qsl[1 : num_reqs + 1] = torch.cumsum(lengths, 0)
        qsl[num_reqs + 1 :] = qsl[num_reqs]
        context = torch.randint(0, VOCAB, (num_reqs + 2, NGRAM_SIZE - 1), generator=generator).int()
        context[num_reqs:] = EOS
        context[0, 0] = EOS
        steps.append((tokens.int(), qsl, context))
    return steps


def run_forward(embedding, steps, lookup: str) -> list:
    import torch

    hidden = torch.zeros(1)
    outputs = []
    table = getattr(embedding.ngram_embedding, "table", None)
    with torch.inference_mode():
        for tokens, qsl, context in steps:
            if lookup == "staged":
                table.stage(tokens, qsl, context)
            elif lookup == "direct":
                embedding.start_prefetch(tokens, qsl, context)
            hidden = torch.zeros(tokens.shape[0], 1)
            outputs.append(embedding(hidden, tokens, qsl, context).clone())
    return outputs


def cmd_forward(args) -> dict:
    import torch

    engram = {"cpu_offload": False} if args.storage == "device" else {"offload_storage": "mmap"}
    config = make_config(Path(args.dir), engram)
    init_distributed(config)
    embedding = build_embedding(config)
    load(embedding, config, Path(args.dir))
    table = getattr(embedding.ngram_embedding, "table", None)
    if args.lookup == "direct":
        embedding.ngram_embedding.select_lookup("direct")
    steps = make_steps(args.seed, 12, MAX_TOKENS)
    result = {
        "class": type(embedding.ngram_embedding).__name__,
        "weight_device": str(embedding.ngram_embedding.weight.device),
        "lookup_mode": getattr(embedding.ngram_embedding, "lookup_mode", None),
        "outputs": run_forward(embedding, steps, args.lookup),
    }
    # What Qwen4ExpPLELayer hands on: the rows in the activation dtype (FP8: times the scale).
    result["dequantized"] = [embedding.ngram_embedding.dequantize(rows, torch.bfloat16) for rows in result["outputs"]]
    if table is not None:
        # The host hashing the staging uses, against the model's own compute_ngram_ids.
        import numpy as np

        same = []
        for tokens, qsl, context in steps:
            model_ids = embedding.compute_ngram_ids(tokens, qsl, context)
            host = table.hasher.ids_numpy(tokens.numpy(), qsl.numpy(), context.numpy())
            same.append(bool(np.array_equal(model_ids.numpy(), host)))
            same.append(bool(torch.equal(model_ids, table.hasher.ids_tensor(tokens, qsl, context))))
        result["hasher_equal"] = same
        # A forward that reads rows no stage wrote is refused.
        if args.lookup == "staged":
            tokens, qsl, context = steps[0]
            try:
                embedding(torch.zeros(tokens.shape[0], 1), tokens, qsl, context)
                result["unstaged"] = "served"
            except RuntimeError as e:
                result["unstaged"] = str(e)
    torch.save(result, args.out)
    return {}


def smaps_file_rss(paths: set[str]) -> tuple[int, list[str]]:
    """Resident bytes of this process's mappings of the given files (smaps Rss), and the
    VmFlags of those mappings."""
    rss, flags, current = 0, [], None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5 and ":" not in fields[0]:
                current = fields[5] if len(fields) >= 6 else None
            elif fields[0] == "Rss:" and current in paths:
                rss += int(fields[1]) * 1024
            elif fields[0] == "VmFlags:" and current in paths:
                flags.append(" ".join(fields[1:]))
    return rss, flags


def rss_anon() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


def cmd_memory(args) -> dict:
    checkpoint = Path(args.dir)
    paths = {str(p.resolve()) for p in checkpoint.glob("*.safetensors")}
    engram = {"cpu_offload": False} if args.storage == "device" else {"offload_storage": "mmap"}
    config = make_config(checkpoint, engram)
    init_distributed(config)
    embedding = build_embedding(config)
    anon_before = rss_anon()
    load(embedding, config, checkpoint)
    loaded_rss, _ = smaps_file_rss(paths)
    # The files were just written, so the page cache holds them (in large folios, which a
    # fault maps whole). Dropped here, as a 102 GB table is not cached on a 121 GB box: a
    # step's faults then read what it needs, MADV_RANDOM (no readahead).
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    steps = make_steps(3, 4, 32)
    run_forward(embedding, steps, "staged" if args.storage == "mmap" else "none")
    rss, flags = smaps_file_rss(paths)
    table = getattr(embedding.ngram_embedding, "table", None)
    return {
        "anon_growth": rss_anon() - anon_before,
        "file_rss_loaded": loaded_rss,
        "file_rss": rss,
        "rows_read": sum(t.shape[0] for t, _, _ in steps) * NGRAM_HEADS,
        "page_size": os.sysconf("SC_PAGE_SIZE"),
        "random_flags": [f for f in flags if " rr" in f" {f}"],
        "released": getattr(table, "released_bytes", None),
    }


def cmd_config(args) -> dict:
    """Each case: the resolved Engram/load settings, or the error."""
    checkpoint = Path(args.dir)
    cases = {
        "default": ({}, None, "auto"),
        "engram_none": (None, None, "auto"),
        "mmap": ({"offload_storage": "mmap"}, None, "auto"),
        "mmap_lazy": ({"offload_storage": "mmap"}, "lazy", "auto"),
        "mmap_device": ({"offload_storage": "mmap", "cpu_offload": False}, None, "auto"),
        "mmap_shm": ({"offload_storage": "mmap", "dp_shared_memory": True}, None, "auto"),
        "mmap_thp": ({"offload_storage": "mmap", "use_thp": True}, None, "auto"),
        "mmap_eager": ({"offload_storage": "mmap"}, "eager", "auto"),
        "mmap_prefetch": ({"offload_storage": "mmap"}, "prefetch", "auto"),
        "mmap_torchao": ({"offload_storage": "mmap"}, "torchao", "auto"),
        "mmap_dummy": ({"offload_storage": "mmap"}, None, "dummy"),
        "bad_value": ({"offload_storage": "ssd"}, None, "auto"),
        # The V1 model runner: chosen by the variable, or by vLLM itself (no Triton on this CPU).
        "mmap_v1_by_env": ({"offload_storage": "mmap"}, None, "auto"),
        "mmap_v1_by_vllm": ({"offload_storage": "mmap"}, None, "auto"),
    }
    runner_env = {"mmap_v1_by_env": "0", "mmap_v1_by_vllm": None}
    out = {}
    for name, (engram, strategy, load_format) in cases.items():
        saved = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
        if name in runner_env:
            os.environ.pop("VLLM_USE_V2_MODEL_RUNNER", None)
            if runner_env[name] is not None:
                os.environ["VLLM_USE_V2_MODEL_RUNNER"] = runner_env[name]
        try:
            config = make_config(checkpoint, engram, strategy, load_format)
            out[name] = {
                "engram": None if config.engram_config is None else str(config.engram_config),
                "hash": None if config.engram_config is None else config.engram_config.compute_hash(),
                "strategy": config.load_config.safetensors_load_strategy,
            }
        except Exception as e:  # the outcome under test: recorded, not raised
            out[name] = {"error": f"{type(e).__name__}: {e}"}
        finally:
            if saved is not None:
                os.environ["VLLM_USE_V2_MODEL_RUNNER"] = saved
    return out


def cmd_build_error(args) -> dict:
    """Build (and load) an embedding; the error, if any."""
    engram = json.loads(args.engram)
    config = make_config(Path(args.dir), engram)
    init_distributed(config)
    try:
        embedding = build_embedding(config)
        load(embedding, config, Path(args.dir))
        return {"class": type(embedding.ngram_embedding).__name__}
    except Exception as e:  # the outcome under test
        return {"error": f"{type(e).__name__}: {e}"}


def cmd_ats(args) -> dict:
    from vllm.models.qwen4_exp.common.ple_mmap import choose_lookup, pageable_access_uses_host_page_tables

    return {
        "attribute_here": pageable_access_uses_host_page_tables(0),
        "decisions": {
            f"{device}/{value}": choose_lookup(device, value) for device in ("cuda", "cpu") for value in (None, 0, 1)
        },
    }


def cmd_builds(args) -> dict:
    """Several checkpoints, DIR/<name> per entry of --specs (build's result in DIR/<name>.json),
    in one process (one vLLM import)."""
    made = {}
    for name, spec in json.loads(args.specs).items():
        made[name] = build(
            Path(args.dir) / name,
            spec.get("base", 4000),
            spec.get("fp8", False),
            spec.get("nvfp4", False),
            spec.get("filler", 0),
            spec.get("drop"),
        )
        (Path(args.dir) / f"{name}.json").write_text(json.dumps(made[name], indent=1))
    return made


def cmd_batch(args) -> dict:
    """Several scenarios in this one process (one vLLM import), in order: --jobs is a JSON file
    of {name: argv of main()}. ple_runner's run_jobs runs them: each job's output goes to OUT.log
    beside its result, and its outcome is recorded, not raised, so that one failing job fails
    only the tests that read it: {name: None, or the traceback}."""
    from tests.ple_ssd.ple_runner import run_jobs

    jobs = json.loads(Path(args.jobs).read_text())
    return run_jobs({name: [argv, f"{argv[2]}.log"] for name, argv in jobs.items()}, main)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    scenarios = ["build", "builds", "forward", "memory", "config", "build_error", "ats", "batch"]
    parser.add_argument("scenario", choices=scenarios)
    parser.add_argument("dir")
    parser.add_argument("out")
    parser.add_argument("--base", type=int, default=4000, help="ngram_vocab_size_base (build)")
    parser.add_argument("--fp8", action="store_true")
    parser.add_argument("--nvfp4", action="store_true")
    parser.add_argument("--filler", type=int, default=0, help="bytes of a non-table tensor after each shard")
    parser.add_argument("--drop", type=int, default=None, help="leave this table shard out (build)")
    parser.add_argument("--storage", choices=["device", "mmap"], default="mmap")
    parser.add_argument("--lookup", choices=["none", "staged", "direct"], default="none")
    parser.add_argument("--engram", default="{}")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--specs", default="{}", help="builds: {name: build's options} for DIR/<name>")
    parser.add_argument("--jobs", default=None, help="batch: a JSON file of {name: argv of a scenario}")
    args = parser.parse_args(argv)
    if args.scenario == "build":
        result = build(Path(args.dir), args.base, args.fp8, args.nvfp4, args.filler, args.drop)
    else:
        result = globals()[f"cmd_{args.scenario}"](args)
    if args.scenario != "forward":
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


# --------------------------------------------------------------------------- the tests
def overlay(dest: Path, patched: bool) -> Path:
    """DEST/vllm: a hard-link copy of the 0.33.0 sdist's package, with the patch applied by
    `git apply` (which replaces files, so the sdist's links are never written through)."""
    dest.mkdir(parents=True)
    subprocess.run(["cp", "-al", str(sdist_033() / "vllm"), str(dest / "vllm")], check=True)
    if patched:
        subprocess.run(["git", "apply", "-p1", str(PATCH)], cwd=dest, check=True)
    return dest


def child(tree: Path, *args: str) -> None:
    # The 0.33 tree first, then the checkout (this file imports tests.v0_33 when run as a child).
    # Model Runner V2, as offload_storage='mmap' needs (this CPU has no Triton: vLLM would pick V1).
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(tree), str(REPO)]),
        VLLM_LOGGING_LEVEL="WARNING",
        VLLM_USE_V2_MODEL_RUNNER="1",
    )
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), *args], env=env, capture_output=True, text=True, cwd=tree
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


def child_json(tree: Path, tmp: Path, *args: str) -> dict:
    out = tmp / f"{args[0]}-{hashlib.sha1(' '.join(args).encode()).hexdigest()[:8]}.json"
    child(tree, args[0], args[1], str(out), *args[2:])
    return json.loads(out.read_text())


class Batch:
    """Scenarios run by one child (one vLLM import) of a tree, in order; `batch(name)` is one
    job's JSON or torch result, or fails the calling test with that job's traceback."""

    def __init__(self, tree: Path, folder: Path, jobs: dict[str, list[str]]):
        self.argv, self.outs = {}, {}
        for name, (scenario, target, *options) in jobs.items():
            self.outs[name] = folder / f"{name}.{'pt' if scenario == 'forward' else 'json'}"
            self.argv[name] = [scenario, target, str(self.outs[name]), *options]
        (folder / "jobs.json").write_text(json.dumps(self.argv, indent=1))
        child(tree, "batch", str(folder), str(folder / "batch.json"), "--jobs", str(folder / "jobs.json"))
        self.errors = json.loads((folder / "batch.json").read_text())

    def __call__(self, name: str):
        out = self.outs[name]
        if self.errors[name] is not None:
            log = Path(f"{out}.log").read_text()[-3000:]
            pytest.fail(f"{' '.join(self.argv[name])} failed in its batch child:\n{log}\n{self.errors[name]}")
        return torch.load(out) if out.suffix == ".pt" else json.loads(out.read_text())


@pytest.fixture(scope="module")
def trees(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ple-033")
    return {"stock": overlay(root / "stock", False), "patched": overlay(root / "patched", True)}


CHECKPOINTS = {
    "bf16": {},
    "fp8": {"fp8": True},
    "nvfp4": {"nvfp4": True},
    "filler": {"base": 20000, "filler": 65536},
    "missing_shard": {"drop": 5},
}
MMAP = '{"offload_storage": "mmap"}'


# Each tree's scenarios run in one child of their own (a vLLM import costs ~16 s here), each
# job's outcome recorded apart; the memory scenario does not (see test_table_is_not_resident_after_steps).
@pytest.fixture(scope="module")
def stock_runs(trees, tmp_path_factory) -> tuple[dict[str, Path], Batch]:
    """The checkpoints (built first, by the stock tree), then pristine 0.33.0's scenarios: its
    resident table (cpu_offload=False) per table format, its config cases, its default build."""
    root = tmp_path_factory.mktemp("ple-033-ckpt")
    paths = {name: root / name for name in CHECKPOINTS}
    bf16 = str(paths["bf16"])
    jobs = {
        "builds": ["builds", str(root), "--specs", json.dumps(CHECKPOINTS)],
        **{f"forward_{f}": ["forward", str(paths[f]), "--storage", "device"] for f in ("bf16", "fp8")},
        "config": ["config", bf16],
        "default_build": ["build_error", bf16, "--engram", "{}"],
    }
    batch = Batch(trees["stock"], tmp_path_factory.mktemp("stock-runs"), jobs)
    batch("builds")
    return paths, batch


@pytest.fixture(scope="module")
def checkpoints(stock_runs) -> dict[str, Path]:
    return stock_runs[0]


@pytest.fixture(scope="module")
def stock(stock_runs) -> Batch:
    return stock_runs[1]


@pytest.fixture(scope="module")
def patched(trees, checkpoints, tmp_path_factory) -> Batch:
    """The patched tree's scenarios; the builds that end in an error last."""
    folder = tmp_path_factory.mktemp("patched-runs")
    bf16 = str(checkpoints["bf16"])
    jobs = {
        "config": ["config", bf16],
        "ats": ["ats", str(folder)],
        "forward_device_bf16": ["forward", bf16, "--storage", "device"],
        **{
            f"forward_{f}_{lookup}": ["forward", str(checkpoints[f]), "--lookup", lookup]
            for f in ("bf16", "fp8")
            for lookup in ("staged", "direct")
        },
        "default_build": ["build_error", bf16, "--engram", "{}"],
        "nvfp4_build": ["build_error", str(checkpoints["nvfp4"]), "--engram", MMAP],
        "missing_shard_build": ["build_error", str(checkpoints["missing_shard"]), "--engram", MMAP],
    }
    return Batch(trees["patched"], folder, jobs)


def file_digests(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in root.rglob("*") if p.is_file()
    }


def test_patch_applies_and_reverts_byte_identical_on_the_sdist(tmp_path):
    tree = tmp_path / "tree"
    tree.mkdir()
    subprocess.run(["cp", "-r", str(sdist_033() / "vllm"), str(tree)], check=True)
    before = file_digests(tree)
    subprocess.run(["git", "apply", "--check", "-p1", str(PATCH)], cwd=tree, check=True)
    subprocess.run(["git", "apply", "-p1", str(PATCH)], cwd=tree, check=True)
    changed = {k for k, v in file_digests(tree).items() if before.get(k) != v}
    assert changed == {
        "vllm/config/engram.py",
        "vllm/config/vllm.py",
        "vllm/models/qwen4_exp/common/ngram_embedding.py",
        "vllm/models/qwen4_exp/common/ple_hash.py",
        "vllm/models/qwen4_exp/common/ple_mmap.py",
        "vllm/models/qwen4_exp/common/ple_rows.py",
        "vllm/models/qwen4_exp/nvidia/model_state.py",
        "vllm/models/qwen4_exp/nvidia/ngram_embedding.py",
    }
    subprocess.run(["git", "apply", "-R", "-p1", str(PATCH)], cwd=tree, check=True)
    assert file_digests(tree) == before


def test_patch_header_names_target_activation_and_what_needs_a_gb10():
    header = PATCH.read_text().split("\ndiff --git", 1)[0]
    for field in ("Description:", "Target: vllm 0.33.0", "Requires: none", "Activation:", "offload_storage"):
        assert field in header, field
    assert "GB10" in header and "not run" in header.lower()


@pytest.mark.slow
def test_config_activation_refusals_and_the_default_hash(stock, patched):
    stock, patched = stock("config"), patched("config")
    # Not activated: the EngramConfig upstream creates by default hashes as in stock 0.33.0.
    assert "offload_storage='pinned'" in patched["default"]["engram"], patched["default"]
    assert patched["default"]["hash"] == stock["default"]["hash"]
    assert patched["default"]["strategy"] is None
    assert stock["mmap"]["error"].startswith("ValidationError"), stock["mmap"]  # stock has no such field
    assert "offload_storage='mmap'" in patched["mmap"]["engram"]
    assert patched["mmap"]["hash"] != patched["default"]["hash"]
    assert patched["mmap"]["strategy"] == "lazy"  # unset: set so (no auto-prefetch on NFS)
    assert patched["mmap_lazy"]["strategy"] == "lazy"
    expect = {
        "mmap_device": "cpu_offload=False",
        "mmap_shm": "dp_shared_memory=True",
        "mmap_thp": "use_thp",
        "mmap_eager": "--safetensors-load-strategy eager",
        "mmap_prefetch": "--safetensors-load-strategy prefetch",
        "mmap_torchao": "--safetensors-load-strategy torchao",
        "mmap_dummy": "--load-format dummy",
        "bad_value": "offload_storage",
    }
    for case, words in expect.items():
        assert words in patched[case].get("error", ""), (case, patched[case])
    runner_cases = {"mmap_v1_by_env": "VLLM_USE_V2_MODEL_RUNNER=0 selects it", "mmap_v1_by_vllm": "vLLM picked it"}
    for case, why in runner_cases.items():
        error = patched[case].get("error", "")
        assert "Engram offload_storage='mmap' needs Model Runner V2" in error, (case, patched[case])
        assert why in error and "Set VLLM_USE_V2_MODEL_RUNNER=1" in error, error
    # log_check sees the request in the line 0.33 prints of the resolved configuration (the patched
    # config's own str()): requested, not confirmed until a table line of the patch follows.
    from magpie.measure import log_check

    engine = "INFO [core.py:100] Initializing a V1 LLM engine (v0.33.0) with config: model='/m'"
    for engram, state in ((patched["mmap"]["engram"], "requested, not confirmed"), (stock["default"]["engram"], "off")):
        lines = [engine, f"INFO [vllm.py:1490] Resolved Engram configuration: {engram}"]
        assert log_check.check(lines)["features"]["ple_mmap"]["state"] == state, engram


@pytest.mark.slow
def test_ats_detection_is_none_on_this_cpu_and_the_decision_needs_cuda_and_host_page_tables(patched):
    result = patched("ats")
    assert result["attribute_here"] is None  # no CUDA device here: guarded, not an error
    assert result["decisions"] == {
        "cuda/None": "staged",
        "cuda/0": "staged",  # e.g. the H200 VM: a kernel cannot read a file mapping there
        "cuda/1": "direct",  # GB10 / GH200 with ATS
        "cpu/None": "staged",
        "cpu/0": "staged",
        "cpu/1": "staged",
    }


@pytest.mark.slow
def test_inactive_patched_layer_is_bit_identical_to_stock(stock, patched):
    stock_bf16 = stock("forward_bf16")
    patched = patched("forward_device_bf16")
    assert patched["class"] == stock_bf16["class"] == "Qwen4ExpPLEDeviceEmbedding"
    assert len(stock_bf16["outputs"]) == 12
    for left, right in zip(stock_bf16["outputs"], patched["outputs"], strict=True):
        assert torch.equal(left.view(torch.int16), right.view(torch.int16))


@pytest.mark.slow
def test_default_config_still_picks_upstreams_pinned_table(stock, patched):
    """On this CPU the pinned table cannot be allocated; stock and patched fail identically,
    in upstream's pinned class (the patch does not divert the default)."""
    stock, patched = stock("default_build"), patched("default_build")
    assert stock == patched, (stock, patched)


@pytest.mark.slow
@pytest.mark.parametrize("lookup", ["staged", "direct"])
@pytest.mark.parametrize("table_format", ["bf16", "fp8"])
def test_mmap_table_rows_equal_the_stock_table_bit_for_bit(stock, patched, lookup, table_format):
    """Staged: MmapNGramTable.stage (as Qwen4ExpModelState.prepare_inputs calls it), then the
    layer's forward. Direct: the GPU path's device ops (start_prefetch's lookup_direct, then
    finalize_prefetch) run on a CPU view of the mappings."""
    stock = stock(f"forward_{table_format}")
    mmap = patched(f"forward_{table_format}_{lookup}")
    assert mmap["class"] == "Qwen4ExpPLEMmapEmbedding"
    assert mmap["weight_device"] == "meta"  # no copy of the table anywhere
    assert mmap["lookup_mode"] == lookup
    assert all(mmap["hasher_equal"]), mmap["hasher_equal"]
    dtype = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}[table_format]
    assert len(stock["outputs"]) == len(mmap["outputs"]) == 12
    for step, (left, right) in enumerate(zip(stock["outputs"], mmap["outputs"], strict=True)):
        assert left.dtype == right.dtype == dtype
        assert torch.equal(left.view(torch.uint8), right.view(torch.uint8)), f"step {step}"
    for left, right in zip(stock["dequantized"], mmap["dequantized"], strict=True):
        assert right.dtype == torch.bfloat16
        assert torch.equal(left.view(torch.int16), right.view(torch.int16))
    if lookup == "staged":
        assert "not staged for it" in mmap["unstaged"], mmap["unstaged"]


@pytest.mark.slow
def test_nvfp4_table_is_refused_with_the_reason(patched):
    patched = patched("nvfp4_build")
    assert "NVFP4" in patched.get("error", ""), patched
    assert "offload_storage='pinned'" in patched["error"]


@pytest.mark.slow
def test_table_is_not_resident_after_steps(trees, checkpoints, tmp_path):
    # Two fresh children, one after the other, not jobs of the batches: RssAnon growth and the
    # files' resident pages are measured in a process that has loaded nothing else, and the
    # stock child's reads of the files must not refill the page cache while the mmap child steps.
    info = json.loads((checkpoints["filler"].parent / "filler.json").read_text())
    stock = child_json(trees["stock"], tmp_path, "memory", str(checkpoints["filler"]), "--storage", "device")
    mmap = child_json(trees["patched"], tmp_path, "memory", str(checkpoints["filler"]), "--storage", "mmap")
    table = info["table_bytes"]
    # Stock: the whole table copied into anonymous memory.
    assert stock["anon_growth"] >= 0.9 * table, (stock, table)
    # mmap: no copy, and of the files' mappings only the pages of the rows read are resident.
    assert mmap["anon_growth"] < 0.1 * table, (mmap, table)
    print(json.dumps({"table_bytes": table, "stock": stock, "mmap": mmap}, indent=1))
    assert mmap["file_rss_loaded"] < 0.05 * table, (mmap, table)  # loading mapped almost nothing
    step_pages = (mmap["file_rss"] - mmap["file_rss_loaded"]) / mmap["page_size"]
    assert step_pages <= 2 * mmap["rows_read"], (mmap, table)  # about one page per row read
    assert mmap["file_rss"] < 0.05 * table, (mmap, table)
    assert mmap["random_flags"], mmap  # MADV_RANDOM on the shard mappings
    assert mmap["released"] > 0, mmap  # the filler tensors' pages were released


@pytest.mark.slow
def test_missing_shard_is_refused_by_index(patched):
    patched = patched("missing_shard_build")
    assert "checkpoint shards [5] (of 16) were not found" in patched.get("error", ""), patched


if __name__ == "__main__":
    raise SystemExit(main())
