"""Run a release's own code for the MTP draft head: configuration, then the V2 draft loader.

Run by test_mtp_pruning.py in a subprocess whose PYTHONPATH puts a (patched) `vllm/` tree of a
series release (tree.py) first over the test venv. Per scenario (JSON: name, model, keep,
quantization, adaptive):

1. `EngineArgs(...).create_engine_config()`, as `vllm serve` builds it (Model Runner V2: the
   test sets VLLM_USE_V2_MODEL_RUNNER=1 for a release that still reads it, as the CPU platform
   would pick V1 there; 0.34+ has only V2);
2. with "load": `load_eagle_model` (the V2 MTP speculator's loader: it builds the real draft
   class from the checkpoint with vLLM's loader, then decides lm_head sharing and quantization);
   with "v1_share" also the V1 proposer's `_maybe_share_lm_head` on that draft, where the release
   still has one (0.34 removed it). Its target is the checkpoint's embedding and lm_head as vLLM
   layers: the only parts of the target that `load_eagle_model` reads (the Qwen3.5 target needs
   the release's compiled CPU ops, which are not here). Then `compute_logits` and
   `get_top_tokens` on fixed hidden states.

Also, once: whether the CUDA Qwen3.5 MTP classes (vllm/models/qwen3_5/nvidia/mtp.py, new in
0.34) import here and carry the pruning hook; they are not built (CUDA-only kernels).

Every outcome (or the error) is saved to --out with torch.save.

    python probe.py --out OUT.pt \\
        --scenario '{"name": "fp8", "model": DIR, "keep": K, "quantization": "fp8", "load": true}'
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch

# On a CPU with AMX tiles 0.33+ packs small bf16 linear weights with its own compiled op
# (torch.ops._C.convert_weight_packed), which the 0.29 build's _C here lacks: take the plain
# torch GEMM path it takes on any other CPU.
torch.cpu._is_amx_tile_supported = lambda: False


def pass_the_cpu_triton_gate() -> None:
    """0.34's CPU platform refuses an x86 CPU without Triton's CPU backend (triton-cpu) when it
    checks the config (`CpuPlatform.check_and_update_config`, vllm/platforms/cpu.py: "requires
    Triton (triton-cpu)"): its CPU model runner compiles Triton kernels. The test venv's triton
    has no CPU backend, so vLLM's HAS_TRITON is False here. Nothing this probe runs is a Triton
    kernel (configuration, the draft's load, its logits and argmax in torch), so that one check
    sees HAS_TRITON = True for the length of the call; everything else still sees False."""
    import vllm.triton_utils
    from vllm.platforms.cpu import CpuPlatform

    checked = CpuPlatform.check_and_update_config.__func__

    def check_and_update_config(cls, vllm_config) -> None:
        saved, vllm.triton_utils.HAS_TRITON = vllm.triton_utils.HAS_TRITON, True
        try:
            checked(cls, vllm_config)
        finally:
            vllm.triton_utils.HAS_TRITON = saved

    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)


def build_config(scenario: dict):
    """The VllmConfig (or, with "spec_only", only its SpeculativeConfig: adaptive verification
    also needs full CUDA graphs, which VllmConfig refuses on this CPU)."""
    from vllm.config import ParallelConfig
    from vllm.engine.arg_utils import EngineArgs

    spec = {"method": "mtp", "num_speculative_tokens": 2}
    if scenario.get("keep"):
        spec["draft_vocab_path"] = scenario["keep"]
    if scenario.get("quantization"):
        spec["draft_lm_head_quantization"] = scenario["quantization"]
    if scenario.get("adaptive"):
        spec["enable_adaptive_verification"] = True
    engine_args = EngineArgs(
        model=scenario["model"],
        max_model_len=256,
        enable_prefix_caching=False,
        enforce_eager=True,
        speculative_config=spec,
    )
    if scenario.get("spec_only"):
        return engine_args.create_speculative_config(engine_args.create_model_config(), ParallelConfig())
    return engine_args.create_engine_config()


def target_parts(model_dir: str):
    """The target's embedding and lm_head, as vLLM layers holding the checkpoint's tensors."""
    import torch.nn as nn
    from safetensors.torch import load_file
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    weights = load_file(os.path.join(model_dir, "model.safetensors"))
    vocab, hidden = weights["lm_head.weight"].shape
    target = nn.Module()
    target.model = nn.Module()
    target.model.embed_tokens = VocabParallelEmbedding(vocab, hidden, params_dtype=torch.bfloat16)
    target.model.embed_tokens.weight.data[:vocab].copy_(weights["model.embed_tokens.weight"])
    target.lm_head = ParallelLMHead(vocab, hidden, params_dtype=torch.bfloat16)
    target.lm_head.weight.data[:vocab].copy_(weights["lm_head.weight"])
    return target


def cuda_mtp_hooks() -> dict | str:
    """The CUDA Qwen3.5 MTP classes' pruning hook (draft_vocab.HOOK_ATTRIBUTE), imported only."""
    import importlib.util

    if importlib.util.find_spec("vllm.models.qwen3_5") is None:
        return "absent"
    try:
        from vllm.models.qwen3_5.nvidia import mtp
    except Exception as e:  # recorded: the test says what it expected
        return f"{type(e).__name__}: {e}"
    return {
        "file": mtp.__file__,
        **{
            name: getattr(getattr(mtp, name), "supports_draft_vocab_pruning", False)
            for name in ("Qwen3_5MTP", "Qwen3_5MoeMTP")
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", action="append", required=True, help="JSON; repeatable")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)

    import vllm
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    if os.environ.get("PROBE_CPU_TRITON_GATE") == "open":
        pass_the_cpu_triton_gate()
    results = {"vllm_version": vllm.__version__, "vllm_file": vllm.__file__, "cuda_qwen3_5_mtp": cuda_mtp_hooks()}
    initialized = False
    for scenario in map(json.loads, args.scenario):
        record: dict = {}
        results[scenario["name"]] = record
        try:
            config = build_config(scenario)
            spec = config if scenario.get("spec_only") else config.speculative_config
            record["config"] = {
                "draft_vocab_path": getattr(spec, "draft_vocab_path", None),
                "use_local_argmax_reduction": spec.use_local_argmax_reduction,
                "draft_lm_head_quantization": spec.draft_lm_head_quantization,
                "enable_adaptive_verification": spec.enable_adaptive_verification,
            }
            if not scenario.get("load"):
                continue
            with set_current_vllm_config(config):
                if not initialized:
                    init_distributed_environment(
                        world_size=1,
                        rank=0,
                        local_rank=0,
                        backend="gloo",
                        distributed_init_method=f"file://{tempfile.mktemp(prefix='probe-')}",
                    )
                    initialize_model_parallel(1, 1)
                    initialized = True
                from vllm.v1.worker.gpu.spec_decode.eagle.utils import load_eagle_model

                target = target_parts(scenario["model"])
                draft = load_eagle_model(target, config)
                hidden = torch.randn(
                    6, config.model_config.get_hidden_size(), generator=torch.Generator().manual_seed(7)
                )
                hidden = hidden.to(torch.bfloat16)
                with torch.inference_mode():
                    logits = draft.compute_logits(hidden)
                    top = draft.get_top_tokens(hidden)
                    try:  # as the multi-module MTP speculator (0.33+) calls it
                        record["top_step_1"] = draft.get_top_tokens(hidden, spec_step_idx=1)
                    except TypeError as e:
                        record["top_step_1"] = f"TypeError: {e}"
                head = draft.lm_head
                record.update(
                    shares_target_head=head is target.lm_head,
                    head_rows=int(head.org_vocab_size),
                    head_quant_method=type(head.quant_method).__name__,
                    head_weight_dtype=str(head.weight.dtype),
                    hidden=hidden,
                    logits=logits.float(),
                    top=top,
                )
                if scenario.get("v1_share"):
                    # The V1 proposer's own sharing decision, on the draft as V2 loaded it.
                    from types import SimpleNamespace

                    try:
                        from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer
                    except ImportError:  # 0.34+: no V1 model runner, no V1 proposer
                        record["v1_shares_target_head"] = "no V1 proposer"
                        continue
                    proposer = SimpleNamespace(model=draft)
                    SpecDecodeBaseProposer._maybe_share_lm_head(proposer, target)
                    record["v1_shares_target_head"] = draft.lm_head is target.lm_head
        except Exception as e:  # the outcome under test: saved, not raised
            record["error"] = f"{type(e).__name__}: {e}"
    torch.save(results, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
