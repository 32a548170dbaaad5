"""Build the tiny Qwen3.5 target and its MTP draft the way vLLM's V2 runner does, and dump the draft head.

Run by test_draft_head.py in a subprocess whose PYTHONPATH puts a patched vLLM overlay first, once
per tensor-parallel rank (gloo on the CPU). For each scenario it builds the target with vLLM's
`get_model`, then the draft with `load_eagle_model` (the V2 runner's MTP path, which decides
whether the draft shares the target's lm_head), and saves from rank 0:

- the draft head's rows (gathered over TP ranks), whether the draft kept its own head;
- `compute_logits` and `get_top_tokens` of the draft on fixed hidden states.

    python draft_head_probe.py --model DIR --keep KEEP.pt --tp 2 --rank 0 --port 29555 --out OUT.pt
"""

from __future__ import annotations

import argparse
import json

import torch


def build(model_dir: str, keep: str | None, tp: int):
    from vllm.engine.arg_utils import EngineArgs

    spec = {"method": "mtp", "num_speculative_tokens": 2}
    if keep:
        spec["draft_vocab_path"] = keep
    return EngineArgs(
        model=model_dir,
        max_model_len=256,
        enable_prefix_caching=False,
        enforce_eager=True,
        tensor_parallel_size=tp,
        speculative_config=spec,
    ).create_engine_config()


def sleep_level_2_round_trip(draft) -> dict | None:
    """What drafting reads after vLLM's sleep level 2 and wake-up, None without a keep-set.

    Level 2 frees the device memory the model was built in without a backup; gpu_worker.py saves
    the draft's named buffers to host memory first and copies them back in place on wake-up. This
    does the same on the CPU, with the freed memory overwritten (-7) in between.
    """
    vocab = getattr(draft, "draft_vocab", None)
    if vocab is None:
        return None
    saved = {name: buffer.cpu().clone() for name, buffer in draft.named_buffers()}
    with torch.no_grad():
        for tensor in [*(b for _, b in draft.named_buffers()), vocab._keep_ids_on_device]:
            tensor.fill_(-7)
        for name, buffer in draft.named_buffers():
            if name in saved:
                buffer.data.copy_(saved[name].data)
    rows = torch.arange(vocab.num_keep)
    return {
        "to_target_ids": vocab.to_target_ids(rows),
        "d2t_target_ids": rows + draft.draft_id_to_target_id[rows],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--scenario", action="append", required=True, help="JSON {name, model, keep}; repeatable")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)

    from vllm.config import set_current_vllm_config
    from vllm.distributed import (
        init_distributed_environment,
        initialize_model_parallel,
        tensor_model_parallel_all_gather,
    )
    from vllm.model_executor.model_loader import get_model
    from vllm.v1.worker.gpu.spec_decode.eagle.utils import load_eagle_model

    scenarios = [json.loads(s) for s in args.scenario]
    results = {}
    first = build(scenarios[0]["model"], scenarios[0].get("keep"), args.tp)
    with set_current_vllm_config(first):
        init_distributed_environment(
            world_size=args.tp,
            rank=args.rank,
            distributed_init_method=f"tcp://127.0.0.1:{args.port}",
            local_rank=args.rank,
            backend="gloo",
        )
        initialize_model_parallel(args.tp, 1)
    for i, scenario in enumerate(scenarios):
        config = first if i == 0 else build(scenario["model"], scenario.get("keep"), args.tp)
        with set_current_vllm_config(config):
            target = get_model(vllm_config=config)
            draft = load_eagle_model(target, config)
            hidden = torch.randn(5, config.model_config.get_hidden_size(), generator=torch.Generator().manual_seed(7))
            hidden = hidden.to(torch.bfloat16)
            with torch.inference_mode():
                logits = draft.compute_logits(hidden)
                top = draft.get_top_tokens(hidden)
                rows = draft.lm_head.weight.data
                if args.tp > 1:  # gathered shards hold padding rows: reorder to vocab order
                    rows = tensor_model_parallel_all_gather(rows, dim=0)
                    rows = rows[draft.lm_head.get_sharded_to_full_mapping()]
                rows = rows[: draft.lm_head.org_vocab_size]
        results[scenario["name"]] = {
            "sleep_level_2": sleep_level_2_round_trip(draft),
            "own_head": draft.lm_head is not target.lm_head,
            "has_own_lm_head": getattr(draft, "has_own_lm_head", None),
            "head_rows": int(draft.lm_head.org_vocab_size),
            "rows": rows.float(),
            "hidden": hidden,
            "logits": None if logits is None else logits.float(),
            "top": top,
        }
    if args.rank == 0:
        torch.save(results, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
