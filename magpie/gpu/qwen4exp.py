"""A tiny `Qwen4ExpForConditionalGeneration` checkpoint for the ple suite (gpu_harness.py --help).

`build_spec` (this machine, transformers >= 5.24 for its Qwen4Exp classes) instantiates
transformers' own `Qwen4ExpForConditionalGeneration` from a tiny config, so the tensor names
are the real ones, adds one MTP layer under the names vLLM's `Qwen4ExpMTP` reads, and stores
the names, shapes and (small) values as a spec. `materialize` (GPU machine) writes the
checkpoint: the PLE n-gram table (>= 1 GiB, 160-wide BF16 rows as the real model's) as
SHARDS `...ngram_embedding.shard_<i>.weight` tensors spread over FILES safetensors files,
each file also holding other tensors, interleaved.

The config: 2 decoder layers (GDN with PLE, then gated full attention, head_dim 128), 4
experts (2 per token) and a shared expert per layer, hyper-connections (hc_count 2), one MTP
layer. No QSA indexer (WITH_QSA says why).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent
TABLE_BASE = 220_000  # 16 heads x a prime just above it: 3.52 M rows x 320 B = 1.13 GB
SHARDS = 128
FILES = 4
NGRAM_HEADS, HEAD_DIM = 16, 160
VOCAB = 4096
# vLLM 0.29's QSA attention (Qwen4ExpQSAFlashAttentionImpl) needs the FlashAttention extension
# (_vllm_fa3_C.abi3.so, 153 MB: three more calls to carry), so the attention layers are plain
# full attention: transformers builds the indexer (its names stay the real ones), the spec
# drops it and the indexer_* fields.
WITH_QSA = False


def text_config(ngram_vocab_size_base: int = TABLE_BASE) -> dict:
    from magpie.demo import demo_model

    cfg = demo_model.qwen4_exp_text_config(
        vocab_size=VOCAB,
        bos_token_id=1,
        eos_token_id=2,
        head_dim=128,
        num_attention_heads=2,
        num_key_value_heads=1,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.5},
        indexer_n_heads=2,
        indexer_kv_heads=1,
        indexer_head_dim=128,
        indexer_budget=2048,
        indexer_compress_ratio=4,
        ple_layer_ids=[1],
        ple_embed_dim=NGRAM_HEADS * HEAD_DIM,
        ple_conv_kernel_size=4,
        ngram_size=3,
        heads_per_ngram=8,
        ngram_vocab_size_base=ngram_vocab_size_base,
        make_ngram_vocab_size_divisible_by=128,
        split_ngram_parts=SHARDS,
        mtp_num_hidden_layers=1,
        # vLLM 0.34's CUDA hyper-connection packs input_mix_weight_down and block_inject_weight
        # into one linear padded to 16 rows, and its loader leaves a padding shard unloaded
        # ("weights were not initialized": H200, 2026-12-03): keep hc_lowrank + hc_count = 16.
        hc_lowrank=14,
        # The ple-scale-034 suite's 16,384-token prompt (0.34 refuses max_model_len above this).
        max_position_embeddings=32_768,
    )
    cfg.pop("architectures")
    cfg.pop("torch_dtype")
    return cfg


VISION = {
    "depth": 1,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "out_hidden_size": 64,
    "patch_size": 16,
    "temporal_patch_size": 2,
    "spatial_merge_size": 2,
    "deepstack_visual_indexes": [],
}


def _mtp_names(model_state: dict, num_layers: int) -> dict:
    """The MTP block: fc_embedding / fc_hidden / pre-fc norms / final HC mixer, and one decoder
    layer shaped as the last (full-attention, QSA) layer: vLLM builds it as full_attention."""
    out = {}
    hidden = model_state["model.language_model.embed_tokens.weight"].shape[1]
    mixer = "model.language_model.hyper_connection_mixer."
    src_layer = f"model.language_model.layers.{num_layers - 1}."
    for name, tensor in model_state.items():
        if name.startswith(src_layer) and ".ple." not in name:
            out["mtp.layers.0." + name[len(src_layer) :]] = tensor.clone()
        elif name.startswith(mixer):
            out["mtp.hyper_connection_mixer." + name[len(mixer) :]] = tensor.clone()
    import torch

    out["mtp.fc_embedding.weight"] = torch.randn(hidden, hidden) * 0.02
    out["mtp.fc_hidden.weight"] = torch.randn(hidden, hidden) * 0.02
    hc = model_state[mixer + "hc_norm.weight"].shape[0]
    out["mtp.pre_fc_norm_embedding.weight"] = torch.zeros(hidden)
    out["mtp.pre_fc_norm_hidden.weight"] = torch.zeros(hc)
    return out


def build_spec(out: Path, seed: int = 0) -> Path:
    import torch
    from safetensors.torch import save_file
    from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpConfig
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpForConditionalGeneration

    torch.manual_seed(seed)
    # Build with a small table (the spec keeps only its shape rule); the GPU side writes it.
    config = Qwen4ExpConfig(text_config=text_config(ngram_vocab_size_base=1000), vision_config=VISION)
    model = Qwen4ExpForConditionalGeneration(config).to(torch.bfloat16)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    table_name = next(k for k in state if k.endswith("ngram_embedding.weight"))
    table_prefix = table_name[: -len("weight")]
    del state[table_name]
    with torch.no_grad():
        for name, tensor in state.items():
            if tensor.is_floating_point() and name.endswith("norm.weight"):
                state[name] = (torch.randn(tensor.shape) * 0.1).to(tensor.dtype)
    state.update({k: v.to(torch.bfloat16) for k, v in _mtp_names(state, config.text_config.num_hidden_layers).items()})
    if not WITH_QSA:
        state = {k: v for k, v in state.items() if ".indexer." not in k}
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "small.safetensors"))
    full = Qwen4ExpConfig(text_config=text_config(), vision_config=VISION).to_dict()
    full["architectures"] = ["Qwen4ExpForConditionalGeneration"]
    full["text_config"]["output_gate_type"] = "sigmoid"  # vLLM's default; transformers writes null
    # vLLM's V1 MTP proposer reads config.image_token_index (transformers writes *_token_id).
    full["image_token_index"], full["video_token_index"] = full["image_token_id"], full["video_token_id"]
    if not WITH_QSA:
        for field in (
            "indexer_n_heads",
            "indexer_kv_heads",
            "indexer_head_dim",
            "indexer_budget",
            "indexer_compress_ratio",
        ):
            full["text_config"].pop(field, None)
    # transformers renames a QSA layer "indexed_attention"; vLLM (and the real config) say
    # "full_attention" with the indexer_* fields set.
    full["text_config"]["layer_types"] = [
        "full_attention" if t == "indexed_attention" else t for t in full["text_config"]["layer_types"]
    ]
    full["text_config"]["mtp_num_hidden_layers"] = 1
    full["torch_dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(full, indent=1))
    (out / "spec.json").write_text(
        json.dumps({"kind": "qwen4exp", "table_prefix": table_prefix, "shards": SHARDS, "files": FILES})
    )
    from magpie.demo import demo_model

    demo_model.train_tokenizer(out / "tok", VOCAB)
    for f in (out / "tok").iterdir():
        shutil.move(str(f), out / f.name)
    (out / "tok").rmdir()
    return out


def table_rows(config: dict) -> int:
    """Padded row count of the n-gram table, as vLLM's Qwen4ExpNGramEmbedding computes it."""
    from vllm.models.qwen4_exp.nvidia.ple_layer import Qwen4ExpNGramEmbedding

    text = config["text_config"]
    heads = (text["ngram_size"] - 1) * text["heads_per_ngram"]
    _, _, total = Qwen4ExpNGramEmbedding._make_vocab_layout(
        ngram_vocab_size_base=text["ngram_vocab_size_base"], ngram_heads=heads, ple_dense_layer_id=0
    )
    div = text["make_ngram_vocab_size_divisible_by"]
    return -(-total // div) * div


def materialize(spec: Path, out: Path, seed: int = 0, rows: int | None = None, table_base: int | None = None) -> Path:
    """Write the checkpoint (GPU machine: ~1.2 GB, ~15 s; with table_base=3,400,000 a 17.4 GB
    table). Shard i goes to file i % FILES, and the small tensors are dealt round-robin over the
    files too, so every file interleaves table shards with other tensors."""
    import torch
    from safetensors.torch import load_file, save_file

    meta = json.loads((spec / "spec.json").read_text())
    config = json.loads((spec / "config.json").read_text())
    if table_base:  # a larger table: vLLM derives the row count from this field, so it is rewritten
        config["text_config"]["ngram_vocab_size_base"] = table_base
    small = load_file(str(spec / "small.safetensors"))
    rows = rows or table_rows(config)
    shards, files = meta["shards"], meta["files"]
    shard_rows = -(-rows // shards)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(seed)
    per_file: list[dict] = [{} for _ in range(files)]
    for i, (name, tensor) in enumerate(sorted(small.items())):
        per_file[i % files][name] = tensor
    out.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for f in range(files):
        tensors = per_file[f]
        for i in range(f, shards, files):
            count = max(0, min(shard_rows, rows - i * shard_rows))
            shard = torch.randn(count, HEAD_DIM, generator=gen, device=device).to(torch.bfloat16).cpu()
            tensors[f"{meta['table_prefix']}shard_{i}.weight"] = shard
        name = f"model-{f + 1:05d}-of-{files:05d}.safetensors"
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    for f in spec.iterdir():
        if f.name not in ("spec.json", "small.safetensors", "config.json"):
            shutil.copy(f, out / f.name)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out


def main(argv: list[str] | None = None) -> int:
    """`python -m magpie.gpu.qwen4exp SPEC OUT`: materialize() in a process of its own, so the
    carried vLLM tree (for table_rows) comes first on its PYTHONPATH, not on the harness's sys.path."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    if len(args) not in (2, 3) or (len(args) == 3 and not args[2].isdigit()):
        print("usage: python -m magpie.gpu.qwen4exp SPEC_DIR OUT_DIR [NGRAM_VOCAB_SIZE_BASE]", file=sys.stderr)
        return 2
    materialize(Path(args[0]), Path(args[1]), table_base=int(args[2]) if len(args) == 3 else None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
