"""Runs vLLM's Qwen4Exp PLE layer in a process of its own, for the ple_ssd tests.

The tests start this script with a patched vLLM overlay (or the pristine venv) on PYTHONPATH:

    python ple_runner.py forward  CHECKPOINT OUT.pt [--ple-mmap [--stage]] [--tp-rank R --tp-size N --port P]
                                  [--stock-out STOCK.pt]   (the stock layer first, in the same process)
    python ple_runner.py memory      CHECKPOINT OUT.json
    python ple_runner.py config      CHECKPOINT OUT.json [--ple-mmap]
    python ple_runner.py refusals    CASES.json OUT.json
    python ple_runner.py fp8         CHECKPOINT OUT.json
    python ple_runner.py model_state CHECKPOINT OUT.pt     (patch 0002: Qwen4ExpModelState drives the stage)
    python ple_runner.py strategies  CHECKPOINT OUT.json   (--safetensors-load-strategy under ple_mmap)
    python ple_runner.py batch       JOBS.json  OUT.json   (several of the above in this one process)

The layer is built the way vLLM builds it: a real `VllmConfig` from the checkpoint's
config.json (`hf_overrides={"ple_mmap": True}` is what `--hf-overrides` sets), the
`Qwen4ExpPLELayer` from that config under the model dtype, the checkpoint read through vLLM's
own `safetensors_weights_iterator`, loaded with `AutoWeightsLoader`, then vLLM's
`process_weights_after_loading`.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import random
import re
import sys
import tempfile
import traceback
from pathlib import Path

import torch

PLE_PREFIX = "model.language_model.layers.0.ple."
LAYER_NAME = "model.layers.0.ple"
MAX_TOKENS = 1024

# Table settings that force each gather path of ple_mmap.py (default: thresholds as shipped).
VARIANTS = {
    "default": {},
    "dedup": {"direct_copy_max_rows": 0},  # every step sorted and deduplicated
    "pool": {"pool_min_rows": 0, "rows_per_task": 7},  # every gather over the thread pool, small tasks
    "tensor_hash": {"host_hash_max_tokens": 0},  # host hashing with tensor ops
    "calling_thread": {"pool_min_rows": 1 << 40},  # every gather in the calling thread
}


def make_vllm_config(checkpoint, ple_mmap, load_strategy=None, load_format="auto", tp_size=1, cudagraph_mode=None):
    from vllm.config import (
        CompilationConfig,
        LoadConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    model_config = ModelConfig(
        model=str(checkpoint),
        hf_overrides={"ple_mmap": True} if ple_mmap else {},
        dtype="bfloat16",
        max_model_len=2048,
    )
    return VllmConfig(
        model_config=model_config,
        load_config=LoadConfig(load_format=load_format, safetensors_load_strategy=load_strategy),
        parallel_config=ParallelConfig(tensor_parallel_size=tp_size),
        compilation_config=CompilationConfig(cudagraph_mode=cudagraph_mode),
        scheduler_config=SchedulerConfig(
            max_num_batched_tokens=MAX_TOKENS, max_num_seqs=8, max_model_len=2048, is_encoder_decoder=False
        ),
    )


def init_distributed(rank=0, world_size=1, port=None):
    from vllm.config import VllmConfig, get_current_vllm_config_or_none, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import model_parallel_is_initialized
    from vllm.utils.network_utils import get_open_port

    if model_parallel_is_initialized():  # an earlier layer or job of the same process
        from vllm.distributed import get_tensor_model_parallel_world_size

        assert get_tensor_model_parallel_world_size() == world_size, "one process, one tensor-parallel size"
        return
    if get_current_vllm_config_or_none() is None:
        with set_current_vllm_config(VllmConfig()):
            return init_distributed(rank, world_size, port)

    if world_size == 1 and port is None:
        # One rank: a rendezvous file of this process's own, no TCP port that a test running
        # beside this one could take between choosing it and binding it.
        rendezvous = tempfile.mktemp(prefix="ple-ssd-dist-")
        atexit.register(lambda: Path(rendezvous).unlink(missing_ok=True))
        method, ident = f"file://{rendezvous}", f"ple_ssd-test-pid{os.getpid()}"
    else:
        port = port or get_open_port()
        method, ident = f"tcp://127.0.0.1:{port}", f"ple_ssd-test-{port}"
    # The CPU worker sets this for its shared-memory communicator: one name per group.
    os.environ.setdefault("VLLM_DIST_IDENT", ident)
    init_distributed_environment(
        world_size=world_size,
        rank=rank,
        distributed_init_method=method,
        local_rank=rank,
        backend="gloo",
    )
    initialize_model_parallel(world_size, 1)


def checkpoint_weights(vllm_config, prefix=PLE_PREFIX):
    """(name, tensor) of one module, through vLLM's default safetensors iterator."""
    from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator

    files = sorted(str(p) for p in Path(vllm_config.model_config.model).glob("*.safetensors"))
    strategy = vllm_config.load_config.safetensors_load_strategy
    for name, tensor in safetensors_weights_iterator(files, False, strategy):
        if name.startswith(prefix):
            yield name[len(prefix) :], tensor


def load(module, vllm_config, prefix=PLE_PREFIX):
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.model_executor.models.utils import AutoWeightsLoader

    weights = checkpoint_weights(vllm_config, prefix)
    # AutoWeightsLoader hands a child's weights to its own load_weights, never the root's.
    if hasattr(module, "load_weights"):
        module.load_weights(weights)
    else:
        AutoWeightsLoader(module).load_weights(weights)
    process_weights_after_loading(module, vllm_config.model_config, torch.device("cpu"))
    return module


def build_layer(vllm_config, prefix=LAYER_NAME):
    from vllm.models.qwen4_exp.nvidia.ple_layer import Qwen4ExpPLELayer
    from vllm.utils.torch_utils import set_default_torch_dtype

    config = vllm_config.model_config.hf_text_config
    with set_default_torch_dtype(vllm_config.model_config.dtype):  # as vLLM's model init does
        layer = Qwen4ExpPLELayer(config, vllm_config, layer_idx=0, ple_dense_layer_id=0, prefix=prefix)
    return load(layer, vllm_config)


def make_steps(seed: int, vocab: int, eos: int):
    """Batches as the V2 runner shapes them: (input_ids, query_start_loc, ngram_context).

    Requests advance over several steps (prefill chunks, then decode steps of 1 token or
    4 as with MTP k=3), each step's n-gram context being the request's previous two tokens
    (EOS before its start); EOS appears inside requests; some steps end with empty padded
    requests or carry padded tokens past the last request, like FULL-graph batches.
    """
    rng = random.Random(seed)
    history: dict[int, list[int]] = {}
    layouts = [
        [37, 1, 4, 12],  # mixed prefill + decode
        [1, 1, 1, 1, 1, 1],  # plain decode
        [4, 4, 4],  # MTP k=3 verification
        [200],  # one long prefill chunk (3200 ids: the deduplicated path)
        [3, 0, 0],  # padded (empty) requests
        [9, 1, 4, 1, 30, 2, 4, 1],
    ]
    steps = []
    for step, lengths in enumerate(layouts * 2):
        tokens, starts, contexts = [], [0], []
        for req, length in enumerate(lengths):
            seen = history.setdefault((step % 3) * 10 + req, [])
            contexts.append(([eos, eos] + seen)[-2:])
            new = [eos if rng.random() < 0.08 else rng.randrange(vocab) for _ in range(length)]
            seen.extend(new)
            tokens.extend(new)
            starts.append(len(tokens))
        if step % 4 == 0:  # padded tokens past the last request
            tokens.extend(rng.randrange(vocab) for _ in range(rng.randint(1, 5)))
        steps.append(
            (
                torch.tensor(tokens, dtype=torch.int32),
                torch.tensor(starts, dtype=torch.int32),
                torch.tensor(contexts, dtype=torch.int32),
            )
        )
    return steps


def run_steps(layer, vllm_config, steps, seed: int, stage: bool) -> dict:
    from vllm.forward_context import set_forward_context

    table = layer.ple_embedding.ngram_embedding
    generator = torch.Generator().manual_seed(seed)
    outputs = {"embeddings": [], "layer": [], "ngram_ids": []}
    with torch.no_grad(), set_forward_context(None, vllm_config):
        for input_ids, query_start_loc, ngram_context in steps:
            hidden = torch.randn(input_ids.numel(), layer.hc_hidden_size, generator=generator).to(torch.bfloat16)
            # stage: what Qwen4ExpModelState.prepare_inputs does before each forward (0002); each
            # read consumes the staged step, so the second read needs a stage of its own.
            if stage:
                table.stage(input_ids, query_start_loc, ngram_context)
            embeddings = layer.ple_embedding(input_ids, query_start_loc, ngram_context)
            if stage:
                table.stage(input_ids, query_start_loc, ngram_context)
            out = layer(hidden, input_ids, query_start_loc, ngram_context)
            outputs["embeddings"].append(embeddings.clone())
            outputs["layer"].append(out.clone())
            ids = layer.ple_embedding.compute_ngram_ids(input_ids, query_start_loc, ngram_context)
            outputs["ngram_ids"].append(ids)
    return outputs


def cmd_forward(args) -> dict:
    if args.stock_out:
        # The layer without ple_mmap first, in this process and its tensor-parallel group, before
        # any ple_mmap layer exists (so nothing of one can reach the stock outputs).
        forward(args, False, False, args.stock_out)
    return forward(args, args.ple_mmap, args.stage, args.out)


def forward(args, ple_mmap: bool, stage: bool, out) -> dict:
    from vllm.config import set_current_vllm_config

    vllm_config = make_vllm_config(args.checkpoint, ple_mmap, tp_size=args.tp_size)
    config = vllm_config.model_config.hf_text_config
    steps = make_steps(args.seed, config.vocab_size, config.eos_token_id)
    with set_current_vllm_config(vllm_config):
        init_distributed(args.tp_rank, args.tp_size, args.port)
        layer = build_layer(vllm_config)
        table = layer.ple_embedding.ngram_embedding
        results = {"table_type": type(table).__name__, "ple_mmap": bool(getattr(layer.ple_embedding, "ple_mmap", 0))}
        variants = args.variants.split(",") if results["ple_mmap"] else ["default"]
        settings = {name for variant in variants for name in VARIANTS[variant]}
        shipped = {name: getattr(table, name) for name in settings}
        for variant in variants:
            for name, value in {**shipped, **VARIANTS[variant]}.items():
                setattr(table, name, value)
            results[variant] = run_steps(layer, vllm_config, steps, args.seed, stage)
    torch.save(results, out)
    return {"variants": variants, "steps": len(steps), "table_type": results["table_type"]}


def read_status(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def smaps_mappings(start: int, end: int) -> list[tuple[int, int, str, list[str]]]:
    """(low, high, path, VmFlags) of every mapping overlapping [start, end)."""
    found = []
    header = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) \S+ \S+ \S+ \S+\s*(.*)$")
    current = None
    for line in open("/proc/self/smaps"):
        match = header.match(line)
        if match:
            low, high = int(match.group(1), 16), int(match.group(2), 16)
            current = (low, high, match.group(3).strip()) if low < end and high > start else None
        elif line.startswith("VmFlags:") and current is not None:
            found.append((*current, line.split()[1:]))
    return found


def mapped_rss(paths: set[str]) -> int:
    """Resident bytes of this process's mappings of the given files (smaps "Rss")."""
    total, current = 0, False
    for line in open("/proc/self/smaps"):
        fields = line.split()
        if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
            current = len(fields) >= 6 and fields[5] in paths
        elif current and fields[0] == "Rss:":
            total += int(fields[1]) * 1024
    return total


def cmd_memory(args) -> dict:
    """Load the layer from a checkpoint whose files hold other tensors too (`..._filler`, read
    the way the loader copies weights to the device), then look rows up: what stays mapped."""
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    vllm_config = make_vllm_config(args.checkpoint, True)
    config = vllm_config.model_config.hf_text_config
    steps = make_steps(args.seed, config.vocab_size, config.eos_token_id)
    files = {str(p) for p in Path(args.checkpoint).resolve().glob("*.safetensors")}

    def status():
        found = {field: read_status(field) for field in ("VmRSS", "RssAnon", "RssFile")}
        found["checkpoint_mappings_rss"] = mapped_rss(files)
        return found

    with set_current_vllm_config(vllm_config):
        init_distributed()
        status_before = status()
        from vllm.models.qwen4_exp.nvidia.ple_layer import Qwen4ExpPLELayer
        from vllm.utils.torch_utils import set_default_torch_dtype

        with set_default_torch_dtype(vllm_config.model_config.dtype):
            layer = Qwen4ExpPLELayer(config, vllm_config, layer_idx=0, ple_dense_layer_id=0, prefix=LAYER_NAME)
        filler_bytes = 0
        scratch = torch.empty(0, dtype=torch.bfloat16)

        def weights():
            nonlocal filler_bytes, scratch
            for name, tensor in checkpoint_weights(vllm_config):
                if name.endswith("_filler"):  # another module's weight: copied, as to the device
                    if scratch.numel() < tensor.numel():
                        scratch = torch.empty(tensor.numel(), dtype=tensor.dtype)
                    scratch[: tensor.numel()].copy_(tensor)
                    filler_bytes += tensor.numel() * tensor.element_size()
                    continue
                yield name, tensor

        from vllm.model_executor.models.utils import AutoWeightsLoader

        AutoWeightsLoader(layer).load_weights(weights())
        loaded_before_release = status()
        process_weights_after_loading(layer, vllm_config.model_config, torch.device("cpu"))
        del scratch
        status_loaded = status()
        table = layer.ple_embedding.ngram_embedding
        shards = []
        for index, shard in sorted(table.shards.items()):
            start = shard.data_ptr()
            end = start + shard.numel() * shard.element_size()
            page = os.sysconf("SC_PAGE_SIZE")
            mappings = smaps_mappings(start - start % page, end + (-end % page))
            shards.append(
                {
                    "index": index,
                    "bytes": end - start,
                    "paths": sorted({path for _, _, path, _ in mappings}),
                    "covered": bool(mappings)
                    and min(low for low, _, _, _ in mappings) <= start
                    and max(high for _, high, _, _ in mappings) >= end,
                    "rr": bool(mappings) and all("rr" in flags for _, _, _, flags in mappings),
                }
            )
        rows = 0
        with torch.no_grad(), set_forward_context(None, vllm_config):
            for input_ids, query_start_loc, ngram_context in steps:
                if args.stage:
                    table.stage(input_ids, query_start_loc, ngram_context)
                layer.ple_embedding(input_ids, query_start_loc, ngram_context)
                rows += input_ids.numel() * table.heads
        status_used = status()
    return {
        "table_bytes": table.mapped_bytes,
        "filler_bytes": filler_bytes,
        "released_bytes": getattr(table, "released_bytes", None),
        "page_size": os.sysconf("SC_PAGE_SIZE"),
        "before_load": status_before,
        "loaded_before_release": loaded_before_release,
        "after_load": status_loaded,
        "after_lookups": status_used,
        "rows_looked_up": rows,
        "row_bytes": table.row_bytes,
        "shards": shards,
        "describe": table.describe(),
    }


def cmd_config(args) -> dict:
    import vllm.models.qwen4_exp.nvidia.ple_layer  # noqa: F401  (registers the custom ops)
    from vllm.config import CompilationConfig
    from vllm.platforms import current_platform

    on_cpu = make_vllm_config(args.checkpoint, args.ple_mmap)
    # The CPU platform has no CUDA graphs and resolves every mode to NONE. Answer the one
    # platform question as CUDA platforms do, so that VllmConfig resolves the mode as on a GPU
    # (for this job only: a batch's later jobs get the CPU platform's answer back).
    platform = type(current_platform)
    own = platform.__dict__.get("support_static_graph_mode")
    platform.support_static_graph_mode = classmethod(lambda cls: True)
    try:
        default = make_vllm_config(args.checkpoint, args.ple_mmap)
        full = make_vllm_config(args.checkpoint, args.ple_mmap, cudagraph_mode="FULL_AND_PIECEWISE")
    finally:
        if own is None:
            del platform.support_static_graph_mode
        else:
            platform.support_static_graph_mode = own
    return {
        "cpu_platform_mode": on_cpu.compilation_config.cudagraph_mode.name,
        "cudagraph_mode": default.compilation_config.cudagraph_mode.name,
        "cudagraph_mode_when_full_requested": full.compilation_config.cudagraph_mode.name,
        "ple_mmap_in_text_config": bool(getattr(default.model_config.hf_text_config, "ple_mmap", False)),
        "splitting_ops": CompilationConfig._attention_ops,
        "mmap_lookup_op_registered": hasattr(torch.ops.vllm, "qwen4_exp_ple_mmap_lookup"),
    }


def cmd_refusals(args) -> dict:
    """Each case: build the config and load the layer; report what was refused, and how."""
    from vllm.config import set_current_vllm_config

    cases = json.loads(Path(args.checkpoint).read_text())
    init_distributed()
    results = {}
    for case in cases:
        try:
            vllm_config = make_vllm_config(
                case["checkpoint"], True, case.get("load_strategy"), case.get("load_format", "auto")
            )
        except Exception as exc:  # the config hook's refusal
            results[case["name"]] = {"stage": "config", "error": type(exc).__name__, "message": str(exc)}
            continue
        with set_current_vllm_config(vllm_config):
            if case.get("load_strategy_after_hook"):  # a load path that escapes the hook's check
                vllm_config.load_config.safetensors_load_strategy = case["load_strategy_after_hook"]
            try:
                layer = build_layer(vllm_config)
                if case.get("reload"):  # reload_weights / waking up from sleep level 2: the
                    # table's shards handed to the loaded n-gram embedding a second time
                    load(layer.ple_embedding, vllm_config, PLE_PREFIX + "ple_embedding.")
            except Exception as exc:
                results[case["name"]] = {
                    "stage": "load",
                    "error": type(exc).__name__,
                    "message": str(exc),
                    "traceback": traceback.format_exc()[-3000:],
                }
                continue
        results[case["name"]] = {"stage": "done", "error": None}
    return results


def cmd_fp8(args) -> dict:
    """Stock FP8 table (resident, global weight_scale) against the ple_mmap one, in one process."""
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context
    from vllm.models.qwen4_exp.nvidia.ple_layer import Qwen4ExpNGramEmbedding, Qwen4ExpPLELayer

    init_distributed()
    outputs = {}
    for ple_mmap in (False, True):
        vllm_config = make_vllm_config(args.checkpoint, ple_mmap)
        config = vllm_config.model_config.hf_text_config
        with set_current_vllm_config(vllm_config):
            embedding = Qwen4ExpNGramEmbedding(
                config,
                config.ple_embed_dim,
                0,
                MAX_TOKENS,
                8,
                prefix=LAYER_NAME + ".ple_embedding",
                layer_name=LAYER_NAME,
                quant_config=vllm_config.quant_config,
                params_dtype=torch.bfloat16,
            )
            try:
                load(embedding, vllm_config, PLE_PREFIX + "ple_embedding.")
            except ValueError as exc:
                return {"ple_mmap": ple_mmap, "error": type(exc).__name__, "message": str(exc)}
            holder = torch.nn.Module()
            holder.ple_embedding = embedding
            vllm_config.compilation_config.static_forward_context[LAYER_NAME] = holder
            holder._get_embedding_weight_scale = lambda holder=holder: Qwen4ExpPLELayer._get_embedding_weight_scale(
                holder
            )
            rows, dequantized = [], []
            with torch.no_grad(), set_forward_context(None, vllm_config):
                for step in make_steps(args.seed, config.vocab_size, config.eos_token_id):
                    if ple_mmap and args.stage:
                        embedding.ngram_embedding.stage(*step)
                    out = embedding(*step)
                    rows.append(out.view(torch.uint8).clone())
                    dequantized.append(Qwen4ExpPLELayer._dequantize_embeddings(holder, out, torch.bfloat16).clone())
            outputs[ple_mmap] = {
                "dtype": str(out.dtype),
                "scale": holder._get_embedding_weight_scale().float().tolist(),
                "rows": rows,
                "dequantized": dequantized,
                "table_type": type(embedding.ngram_embedding).__name__,
            }
    stock, mapped = outputs[False], outputs[True]
    return {
        "stock_table": stock["table_type"],
        "mmap_table": mapped["table_type"],
        "dtypes": [stock["dtype"], mapped["dtype"]],
        "scales": [stock["scale"], mapped["scale"]],
        "rows_equal": all(torch.equal(a, b) for a, b in zip(stock["rows"], mapped["rows"], strict=True)),
        "dequantized_equal": all(
            torch.equal(a.view(torch.int16), b.view(torch.int16))
            for a, b in zip(stock["dequantized"], mapped["dequantized"], strict=True)
        ),
        "steps": len(stock["rows"]),
    }


def cmd_model_state(args) -> dict:
    """Patch 0002 as the V2 runner drives it: Qwen4ExpModelState.prepare_inputs (which stages)
    before each forward, prepare_dummy_inputs before warm-up/capture forwards; and what happens
    when a forward runs without them, or the model has no ple_mmap table."""
    import dataclasses
    from types import SimpleNamespace

    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context
    from vllm.models.qwen4_exp.nvidia.model_state import Qwen4ExpModelState
    from vllm.v1.worker.gpu.input_batch import InputBatch, InputBuffers

    vllm_config = make_vllm_config(args.checkpoint, True)
    config = vllm_config.model_config.hf_text_config
    steps = make_steps(args.seed, config.vocab_size, config.eos_token_id)
    cpu = torch.device("cpu")
    report: dict = {"layer": [], "qsl_types": []}
    with set_current_vllm_config(vllm_config):
        init_distributed()
        layer = build_layer(vllm_config)
        table = layer.ple_embedding.ngram_embedding
        model = torch.nn.Module()
        model.layer = layer  # the model state finds the tables in model.modules()
        state = Qwen4ExpModelState(vllm_config, model, None, cpu)
        max_reqs = state.max_num_reqs
        # The request state's two device tensors that _prepare_ngram_context reads (the real
        # RequestState keeps all_token_ids in CUDA UVA memory, which a CPU has not).
        req_states = SimpleNamespace(
            num_computed_tokens=SimpleNamespace(gpu=torch.zeros(max_reqs, dtype=torch.int32)),
            all_token_ids=SimpleNamespace(gpu=torch.zeros(max_reqs, 64, dtype=torch.int32)),
        )
        stage = table.stage

        def recording_stage(input_ids, query_start_loc, ngram_context, query_start_loc_host=None):
            report["qsl_types"].append(type(query_start_loc_host).__name__)
            return stage(input_ids, query_start_loc, ngram_context, query_start_loc_host=query_start_loc_host)

        table.stage = recording_stage
        buffers = InputBuffers(max_reqs, MAX_TOKENS, cpu)
        generator = torch.Generator().manual_seed(args.seed)
        with torch.no_grad(), set_forward_context(None, vllm_config):
            for input_ids, query_start_loc, ngram_context in steps:
                hidden = torch.randn(input_ids.numel(), layer.hc_hidden_size, generator=generator).to(torch.bfloat16)
                num_reqs = query_start_loc.numel() - 1
                batch = InputBatch.make_dummy(num_reqs, input_ids.numel(), buffers)
                batch.input_ids.copy_(input_ids)
                batch = dataclasses.replace(
                    batch, query_start_loc=query_start_loc.clone(), query_start_loc_np=query_start_loc.numpy().copy()
                )
                # Each request's previous tokens, where _prepare_ngram_context gathers them from.
                req_states.all_token_ids.gpu[:num_reqs, :2] = ngram_context
                req_states.num_computed_tokens.gpu[:num_reqs] = 2
                inputs = state.prepare_inputs(batch, req_states)
                out = layer(hidden, batch.input_ids, inputs["query_start_loc"], inputs["ngram_context"])
                report["layer"].append(out.clone())
            # A forward with no prepare_inputs before it (a runner path that skipped it).
            try:
                layer(hidden, batch.input_ids, inputs["query_start_loc"], inputs["ngram_context"])
                report["unstaged_forward"] = None
            except RuntimeError as exc:
                report["unstaged_forward"] = str(exc)
            # The same under a CUDA graph replay, where only the device-side check runs.
            state.prepare_inputs(batch, req_states)
            table.check_staged()
            try:
                table.check_staged_device()
                report["unstaged_replay"] = None
            except RuntimeError as exc:
                report["unstaged_replay"] = str(exc)
            # Warm-up and capture forwards after prepare_dummy_inputs: any number of reads.
            dummy = state.prepare_dummy_inputs(2, 4)
            dummy_ids = torch.zeros(4, dtype=torch.int32)
            dummy_hidden = torch.zeros(4, layer.hc_hidden_size, dtype=torch.bfloat16)
            for _ in range(3):
                layer(dummy_hidden, dummy_ids, dummy["query_start_loc"], dummy["ngram_context"])
            report["dummy_reads"] = 3
        # ple_mmap set, but a model without a ple_mmap table.
        try:
            Qwen4ExpModelState(vllm_config, torch.nn.Module(), None, cpu)
            report["no_table"] = None
        except RuntimeError as exc:
            report["no_table"] = str(exc)
    torch.save(report, args.out)
    return {"steps": len(steps)}


def cmd_strategies(args) -> dict:
    """Each --safetensors-load-strategy under ple_mmap: refused, or the strategy the loader gets,
    and whether vLLM's iterator then prefetches every file when it believes the checkpoint is on
    NFS (the filesystem probe answers "nfs"; the prefetch itself is recorded, not run)."""
    from vllm.model_executor.model_loader import weight_utils

    files = sorted(str(p) for p in Path(args.checkpoint).glob("*.safetensors"))
    prefetched: list[list[str]] = []
    saved = weight_utils._get_fs_type, weight_utils._prefetch_all_checkpoints  # put back after (batch)
    weight_utils._get_fs_type = lambda paths: "nfs"
    weight_utils._prefetch_all_checkpoints = lambda paths, **kwargs: prefetched.append(list(paths))
    try:
        return strategy_outcomes(args, weight_utils, files, prefetched)
    finally:
        weight_utils._get_fs_type, weight_utils._prefetch_all_checkpoints = saved


def strategy_outcomes(args, weight_utils, files, prefetched) -> dict:
    results = {}
    for strategy in (None, "lazy", "prefetch", "eager", "torchao"):
        key = str(strategy)
        try:
            vllm_config = make_vllm_config(args.checkpoint, args.ple_mmap, strategy)
        except Exception as exc:  # the config hook's refusal
            results[key] = {"refused": str(exc)}
            continue
        effective = vllm_config.load_config.safetensors_load_strategy
        if effective in ("eager", "torchao"):
            results[key] = {"strategy": effective}
            continue
        before = len(prefetched)
        for _ in weight_utils.safetensors_weights_iterator(files, False, effective):
            pass
        results[key] = {"strategy": effective, "prefetched_files": sum(map(len, prefetched[before:]))}
    return results


def run_jobs(jobs: dict, main) -> dict:
    """Jobs ({name: [argv of main, log file]}) run one after the other in this process: one vLLM
    import for all. Each job's stdout and stderr (file descriptors 1 and 2, so vLLM's log lines
    too) go to its own log file; its outcome is recorded, not raised, so that a failing job fails
    only the tests that read it: {name: None, or the traceback}. (test_ple34.py's child too.)"""
    report = {}
    for name, (argv, log_path) in jobs.items():
        sys.stdout.flush()
        sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        with open(log_path, "w") as log:
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
            try:
                main(argv)
                report[name] = None
            except BaseException:  # noqa: BLE001  (argparse exits too: recorded for the job's test)
                report[name] = traceback.format_exc()[-6000:]
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os.dup2(saved[0], 1)
                os.dup2(saved[1], 2)
                os.close(saved[0])
                os.close(saved[1])
    return report


def cmd_batch(args) -> dict:
    return run_jobs(json.loads(Path(args.checkpoint).read_text()), main)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    modes = ["forward", "memory", "config", "refusals", "fp8", "model_state", "strategies", "batch"]
    parser.add_argument("mode", choices=modes)
    parser.add_argument("checkpoint", help="checkpoint folder (refusals: a JSON file of cases; batch: of jobs)")
    parser.add_argument("out")
    parser.add_argument("--ple-mmap", action="store_true")
    parser.add_argument("--stage", action="store_true", help="stage rows before each forward (patch 0002)")
    parser.add_argument("--variants", default="default", help=f"with --ple-mmap: some of {','.join(VARIANTS)}")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tp-rank", type=int, default=0)
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--port", type=int, default=None)
    parser.add_argument("--stock-out", default=None, help="forward: the stock layer's outputs first, to this file")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    modes = {"forward": cmd_forward, "memory": cmd_memory, "config": cmd_config}
    modes.update(refusals=cmd_refusals, fp8=cmd_fp8, model_state=cmd_model_state, strategies=cmd_strategies)
    modes.update(batch=cmd_batch)
    result = modes[args.mode](args)
    if args.mode not in ("forward", "model_state"):
        Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({"mode": args.mode, "pid": os.getpid()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
