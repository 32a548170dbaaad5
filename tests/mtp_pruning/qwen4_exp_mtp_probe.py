"""Build vLLM's Qwen4ExpMTP draft with a keep-set on the CPU and dump its head and outputs.

Run by test_mtp_pruning_qwen4_exp.py in a subprocess with a patched overlay first on PYTHONPATH:

    python qwen4_exp_mtp_probe.py KEEP.npy MODEL_DIR OUT.pt [MODEL_DIR OUT.pt ...]

The configuration is built as `vllm serve` builds it (EngineArgs with the speculative config);
the draft (`Qwen4ExpMTP`, from the speculative config's draft model config) is constructed
through vLLM's `initialize_model` and given the checkpoint's head and embedding through its own
`load_weights` (the tiny checkpoint holds only those two tensors: the test is about the head),
then vLLM's `process_weights_after_loading`.
"""

from __future__ import annotations

import sys

import torch


def build_config(model_dir: str, keep: str):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(
        model=model_dir,
        max_model_len=256,
        enforce_eager=True,
        enable_prefix_caching=False,
        speculative_config={"method": "mtp", "num_speculative_tokens": 1, "draft_vocab_path": keep},
    ).create_engine_config()


def probe(config, model_dir: str, out: str) -> None:
    from safetensors.torch import load_file
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model, process_weights_after_loading
    from vllm.utils.torch_utils import set_default_torch_dtype

    draft_config = config.speculative_config.draft_model_config
    with set_current_vllm_config(config):
        with set_default_torch_dtype(torch.bfloat16), torch.device("cpu"):
            model = initialize_model(vllm_config=config, model_config=draft_config)
        loaded = model.load_weights(iter(load_file(f"{model_dir}/model.safetensors").items()))
        process_weights_after_loading(model, draft_config, torch.device("cpu"))
        hidden = torch.randn(3, draft_config.get_hidden_size(), generator=torch.Generator().manual_seed(3))
        hidden = hidden.to(torch.bfloat16)
        with torch.inference_mode():
            logits = model.compute_logits(hidden)
            top = model.get_top_tokens(hidden)
    torch.save(
        {
            "architecture": type(model).__name__,
            "has_own_lm_head": getattr(model, "has_own_lm_head", None),
            "loaded": sorted(loaded),
            "rows": model.lm_head.weight.data[: model.lm_head.org_vocab_size].float(),
            "hidden": hidden,
            "logits": logits.float(),
            "top": top,
        },
        out,
    )


def main(keep: str, *pairs: str) -> int:
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.utils.network_utils import get_open_port

    configs = [
        (build_config(model_dir, keep), model_dir, out) for model_dir, out in zip(pairs[::2], pairs[1::2], strict=True)
    ]
    port = get_open_port()
    with set_current_vllm_config(configs[0][0]):
        init_distributed_environment(1, 0, f"tcp://127.0.0.1:{port}", 0, "gloo")
        initialize_model_parallel(1, 1)
    for config, model_dir, out in configs:
        probe(config, model_dir, out)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
