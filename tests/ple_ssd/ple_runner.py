"""Runs vLLM's Qwen4Exp PLE layer in a process of its own, for the ple-ssd tests.

The tests start this script with a patched vLLM overlay (or the pristine venv) on PYTHONPATH:

    python ple_runner.py forward CHECKPOINT OUT.pt [--ple-mmap] [--stage] [--tp-rank R --tp-size N --port P]
    python ple_runner.py memory  CHECKPOINT OUT.json
    python ple_runner.py config  CHECKPOINT OUT.json
    python ple_runner.py load    CHECKPOINT OUT.json [--ple-mmap] [--load-strategy eager] [--load-format dummy]

The layer is built the way vLLM builds it: a real `VllmConfig` from the checkpoint's
config.json (with `--hf-overrides`-equivalent `hf_overrides`), `Qwen4ExpPLELayer` from that
config, the checkpoint read through vLLM's own `safetensors_weights_iterator`, loaded with
`AutoWeightsLoader`, then `process_weights_after_loading`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import socket
import sys
import traceback
from pathlib import Path

import torch

PLE_PREFIX = "model.language_model.layers.0.ple."
LAYER_NAME = "model.layers.0.ple"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def make_vllm_config(checkpoint: str, ple_mmap: bool, load_strategy=None, load_format="auto", tp_size=1):
    from vllm.config import LoadConfig, ModelConfig, ParallelConfig, SchedulerConfig, VllmConfig

    model_config = ModelConfig(
        model=checkpoint,
        hf_overrides={"ple_mmap": True} if ple_mmap else {},
        dtype="bfloat16",
        max_model_len=2048,
    )
    return VllmConfig(
        model_config=model_config,
        load_config=LoadConfig(load_format=load_format, safetensors_load_strategy=load_strategy),
        parallel_config=ParallelConfig(tensor_parallel_size=tp_size),
        scheduler_config=SchedulerConfig(
            max_num_batched_tokens=1024, max_num_seqs=8, max_model_len=2048, is_encoder_decoder=False
        ),
    )


def init_distributed(vllm_config, rank=0, world_size=1, port=None):
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    init_distributed_environment(
        world_size=world_size,
        rank=rank,
        distributed_init_method=f"tcp://127.0.0.1:{port or free_port()}",
        local_rank=rank,
        backend="gloo",
    )
    initialize_model_parallel(world_size, 1)


def checkpoint_weights(vllm_config):
    """(name, tensor) of the PLE layer, through vLLM's default safetensors iterator."""
    from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator

    load_config = vllm_config.load_config
    files = sorted(str(p) for p in Path(vllm_config.model_config.model).glob("*.safetensors"))
    for name, tensor in safetensors_weights_iterator(files, False, load_config.safetensors_load_strategy):
        if name.startswith(PLE_PREFIX):
            yield name[len(PLE_PREFIX) :], tensor


def build_layer(vllm_config, load=True):
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.model_executor.models.utils import AutoWeightsLoader
    from vllm.models.qwen4_exp.nvidia.ple_layer import Qwen4ExpPLELayer
    from vllm.utils.torch_utils import set_default_torch_dtype

    config = vllm_config.model_config.hf_text_config
    with set_default_torch_dtype(vllm_config.model_config.dtype):  # as vLLM's model init does
        layer = Qwen4ExpPLELayer(config, vllm_config, layer_idx=0, ple_dense_layer_id=0, prefix=LAYER_NAME)
    if load:
        AutoWeightsLoader(layer).load_weights(checkpoint_weights(vllm_config))
        process_weights_after_loading(layer, vllm_config.model_config, torch.device("cpu"))
    return layer


def make_steps(seed: int, vocab: int, eos: int, max_tokens: int):
    """Batches as the V2 runner shapes them: (input_ids, query_start_loc, ngram_context).

    Requests advance over several steps (a prefill chunk, then decode steps of 1 or 4
    tokens as with MTP k=3), so each step's n-gram context is the request's previous two
    tokens; EOS appears inside requests; some steps carry empty padded requests and
    padded tokens past the last request, like FULL-graph batches.
    """
    rng = random.Random(seed)
    history: dict[int, list[int]] = {}
    steps = []
    layouts = [
        [37, 1, 4, 12],  # mixed prefill + decode
        [1, 1, 1, 1, 1, 1],  # plain decode
        [4, 4, 4],  # MTP k=3 verification
        [200],  # one long chunk
        [3, 0, 0],  # padded (empty) requests
        [9, 1, 4, 1, 30, 2, 4, 1],
    ]
    for step, lengths in enumerate(layouts * 2):
        requests = list(range(len(lengths)))
        tokens, starts, contexts = [], [0], []
        for req, length in zip(requests, lengths, strict=True):
            key = (step % 3) * 10 + req
            seen = history.setdefault(key, [])
            contexts.append(([eos, eos] + seen)[-2:])
            new = [eos if rng.random() < 0.08 else rng.randrange(vocab) for _ in range(length)]
            seen.extend(new)
            tokens.extend(new)
            starts.append(len(tokens))
        if step % 4 == 0:  # padded tokens past the last request
            tokens.extend(rng.randrange(vocab) for _ in range(rng.randint(1, 5)))
        assert len(tokens) <= max_tokens
        steps.append(
            (
                torch.tensor(tokens, dtype=torch.int32),
                torch.tensor(starts, dtype=torch.int32),
                torch.tensor(contexts, dtype=torch.int32),
            )
        )
    return steps


def cmd_forward(args) -> dict:
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context

    vllm_config = make_vllm_config(args.checkpoint, args.ple_mmap, tp_size=args.tp_size)
    with set_current_vllm_config(vllm_config):
        init_distributed(vllm_config, args.tp_rank, args.tp_size, args.port)
        layer = build_layer(vllm_config)
        table = layer.ple_embedding.ngram_embedding
        if args.fault_seconds is not None:  # 0: every gather past the probe rows goes to the pool
            table.fault_seconds = args.fault_seconds
            table.rows_per_task = 7
        if args.direct_copy_max_rows is not None:  # 0: every lookup deduplicates
            table.direct_copy_max_rows = args.direct_copy_max_rows
        if args.host_hash_max_tokens is not None:  # 0: hash with tensor ops
            table.host_hash_max_tokens = args.host_hash_max_tokens
        config = vllm_config.model_config.hf_text_config
        steps = make_steps(args.seed, config.vocab_size, config.eos_token_id, 1024)
        generator = torch.Generator().manual_seed(args.seed)
        outputs = {"embeddings": [], "layer": [], "ngram_ids": []}
        with torch.no_grad(), set_forward_context(None, vllm_config):
            for input_ids, query_start_loc, ngram_context in steps:
                hidden = torch.randn(input_ids.numel(), layer.hc_hidden_size, generator=generator)
                hidden = hidden.to(torch.bfloat16)
                if args.stage:
                    table.stage(input_ids, query_start_loc, ngram_context)
                embeddings = layer.ple_embedding(input_ids, query_start_loc, ngram_context)
                if args.stage:
                    table.stage(input_ids, query_start_loc, ngram_context)
                out = layer(hidden, input_ids, query_start_loc, ngram_context)
                outputs["embeddings"].append(embeddings.clone())
                outputs["layer"].append(out.clone())
                outputs["ngram_ids"].append(
                    layer.ple_embedding.compute_ngram_ids(input_ids, query_start_loc, ngram_context).clone()
                )
        outputs["ple_mmap"] = bool(getattr(layer.ple_embedding, "ple_mmap", False))
        outputs["table_type"] = type(table).__name__
    torch.save(outputs, args.out)
    return {"steps": len(steps), "table_type": outputs["table_type"]}


def read_status(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def smaps_flags(start: int, end: int) -> list[tuple[int, int, str, list[str]]]:
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


def cmd_memory(args) -> dict:
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context

    vllm_config = make_vllm_config(args.checkpoint, True)
    with set_current_vllm_config(vllm_config):
        init_distributed(vllm_config)
        rss_before = read_status("VmRSS")
        layer = build_layer(vllm_config)
        rss_loaded = read_status("VmRSS")
        table = layer.ple_embedding.ngram_embedding
        shards = []
        checkpoint = str(Path(args.checkpoint).resolve())
        for index, shard in sorted(table.shards.items()):
            start = shard.data_ptr()
            end = start + shard.numel() * shard.element_size()
            page = 4096
            mappings = smaps_flags(start - start % page, end + (-end % page))
            shards.append(
                {
                    "index": index,
                    "bytes": end - start,
                    "paths": sorted({path for _, _, path, _ in mappings}),
                    "covered": min(low for low, _, _, _ in mappings) <= start
                    and max(high for _, high, _, _ in mappings) >= end,
                    "rr": all("rr" in flags for _, _, _, flags in mappings),
                    "flags": sorted({" ".join(flags) for _, _, _, flags in mappings}),
                }
            )
        config = vllm_config.model_config.hf_text_config
        steps = make_steps(args.seed, config.vocab_size, config.eos_token_id, 1024)
        touched_rows = 0
        with torch.no_grad(), set_forward_context(None, vllm_config):
            for input_ids, query_start_loc, ngram_context in steps:
                layer.ple_embedding(input_ids, query_start_loc, ngram_context)
                touched_rows += input_ids.numel() * table.heads
        rss_used = read_status("VmRSS")
    return {
        "checkpoint": checkpoint,
        "table_bytes": table.mapped_bytes,
        "rss_before": rss_before,
        "rss_after_load": rss_loaded,
        "rss_after_lookups": rss_used,
        "rows_looked_up": touched_rows,
        "shards": shards,
        "describe": table.describe(),
    }


def cmd_config(args) -> dict:
    from vllm.config import CompilationConfig
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP
    from vllm.platforms import current_platform

    vllm_config = make_vllm_config(args.checkpoint, args.ple_mmap)
    final_mode = vllm_config.compilation_config.cudagraph_mode.name
    # The CPU platform turns CUDA graphs off after the model hook has run; apply the
    # Qwen4Exp hook again to a default CompilationConfig to read what it asks for.
    vllm_config.compilation_config = CompilationConfig()
    MODELS_CONFIG_MAP[vllm_config.model_config.architecture].verify_and_update_config(vllm_config)
    hook_mode = vllm_config.compilation_config.cudagraph_mode
    splitting = CompilationConfig._attention_ops
    return {
        "platform_final_mode": final_mode,
        "platform": type(current_platform).__name__,
        "hook_mode": None if hook_mode is None else hook_mode.name,
        "ple_mmap_in_text_config": bool(getattr(vllm_config.model_config.hf_text_config, "ple_mmap", False)),
        "mmap_lookup_splitting_op": "vllm::qwen4_exp_ple_mmap_lookup" in splitting,
        "ngram_ids_splitting_op": "vllm::qwen4_exp_compute_ple_ngram_ids" in splitting,
        "mmap_lookup_op_registered": hasattr(torch.ops.vllm, "qwen4_exp_ple_mmap_lookup")
        if _import_ple_layer()
        else None,
    }


def _import_ple_layer() -> bool:
    import vllm.models.qwen4_exp.nvidia.ple_layer  # noqa: F401  (registers the custom ops)

    return True


def cmd_load(args) -> dict:
    """Build and load the layer; report the error a refusal raises (or success)."""
    from vllm.config import set_current_vllm_config

    try:
        vllm_config = make_vllm_config(args.checkpoint, args.ple_mmap, args.load_strategy, args.load_format)
    except Exception as exc:  # the config hook's refusal
        return {"stage": "config", "error": type(exc).__name__, "message": str(exc)}
    with set_current_vllm_config(vllm_config):
        init_distributed(vllm_config)
        try:
            if args.bypass_hook:
                vllm_config.model_config.hf_text_config.ple_mmap = True
            build_layer(vllm_config)
        except Exception as exc:
            return {
                "stage": "load",
                "error": type(exc).__name__,
                "message": str(exc),
                "traceback": traceback.format_exc(),
            }
    return {"stage": "done", "error": None}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["forward", "memory", "config", "load"])
    parser.add_argument("checkpoint")
    parser.add_argument("out")
    parser.add_argument("--ple-mmap", action="store_true")
    parser.add_argument("--stage", action="store_true", help="stage rows before each forward (patch 0002)")
    parser.add_argument("--direct-copy-max-rows", type=int, default=None)
    parser.add_argument("--fault-seconds", type=float, default=None, help="0: memmove over the pool")
    parser.add_argument("--host-hash-max-tokens", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tp-rank", type=int, default=0)
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--port", type=int, default=None)
    parser.add_argument("--load-strategy", default=None)
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--bypass-hook", action="store_true", help="set ple_mmap after the config hook ran")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    result = {"forward": cmd_forward, "memory": cmd_memory, "config": cmd_config, "load": cmd_load}[args.mode](args)
    if args.mode != "forward":
        Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({"mode": args.mode, "pid": os.getpid(), **{k: v for k, v in result.items() if k != "shards"}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
