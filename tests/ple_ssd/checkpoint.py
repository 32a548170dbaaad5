"""A scaled-down Qwen3.8-Flash-Next PLE checkpoint: the real config fields and tensor names,
16 hashed heads of 160 dims (the real row width), the n-gram table split into
`...ngram_embedding.shard_<i>.weight` tensors spread over several safetensors files.

Only the PLE layer's tensors are written (the tests build `Qwen4ExpPLELayer`, not the whole
model). The table size is set by `ngram_vocab_size_base`: each of the 16 heads gets a prime
number of rows just above it, so 62,500 gives ~1.0 M rows x 320 B = ~320 MB of table.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from magpie.demo.demo_model import qwen4_exp_text_config

PLE_PREFIX = "model.language_model.layers.0.ple."
TABLE_PREFIX = PLE_PREFIX + "ple_embedding.ngram_embedding."
HIDDEN, HC_COUNT, VOCAB, EOS = 64, 2, 4096, 2
NGRAM_SIZE, HEADS_PER_NGRAM, HEAD_DIM = 3, 8, 160
NGRAM_HEADS = (NGRAM_SIZE - 1) * HEADS_PER_NGRAM


def text_config(ngram_vocab_size_base: int, split_ngram_parts: int) -> dict:
    """A Qwen4Exp text config: two layers (GDN + full attention), PLE on the first."""
    return qwen4_exp_text_config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        eos_token_id=EOS,
        bos_token_id=1,
        hc_count=HC_COUNT,
        ple_layer_ids=[1],
        ple_embed_dim=NGRAM_HEADS * HEAD_DIM,
        ple_conv_kernel_size=4,
        ngram_size=NGRAM_SIZE,
        heads_per_ngram=HEADS_PER_NGRAM,
        ngram_vocab_size_base=ngram_vocab_size_base,
        make_ngram_vocab_size_divisible_by=128,
        split_ngram_parts=split_ngram_parts,
    )


def table_rows(ngram_vocab_size_base: int) -> int:
    """Padded row count, as Qwen4ExpNGramEmbedding computes it (pristine vLLM's own code)."""
    from vllm.models.qwen4_exp.nvidia.ple_layer import Qwen4ExpNGramEmbedding

    _, _, total = Qwen4ExpNGramEmbedding._make_vocab_layout(
        ngram_vocab_size_base=ngram_vocab_size_base, ngram_heads=NGRAM_HEADS, ple_dense_layer_id=0
    )
    return -(-total // 128) * 128


def build_ple_checkpoint(
    out_dir: Path,
    *,
    ngram_vocab_size_base: int = 62_500,
    split_ngram_parts: int = 16,
    num_files: int = 4,
    table_dtype: torch.dtype = torch.bfloat16,
    drop_shards: tuple[int, ...] = (),
    bad_shape_shard: int | None = None,
    extra_shard_index: int | None = None,
    fp8_scale: float | None = None,
    filler_bytes_per_shard: int = 0,
    seed: int = 0,
) -> Path:
    """Write config.json, N safetensors files and their index; return `out_dir`.

    The table's values are random and distinct per row; the failure knobs
    (`drop_shards`, `bad_shape_shard`, `extra_shard_index`, `fp8_scale=None` with an FP8
    table) make the broken checkpoints the refusal tests need. `filler_bytes_per_shard` puts a
    non-table tensor `...shard_<i>.weight_filler` right after each shard in its file (names sort
    so), standing in for the other weights of the real checkpoint's files.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    rows = table_rows(ngram_vocab_size_base)
    shard_size = -(-rows // split_ngram_parts)
    hc_hidden = HIDDEN * HC_COUNT
    embed_dim = NGRAM_HEADS * HEAD_DIM

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator) * scale).to(torch.bfloat16)

    small = {
        PLE_PREFIX + "key_proj.weight": randn(hc_hidden, embed_dim, scale=0.02),
        PLE_PREFIX + "value_proj.weight": randn(HIDDEN, embed_dim, scale=0.02),
        PLE_PREFIX + "norm_key.weight": randn(hc_hidden, scale=0.1),
        PLE_PREFIX + "norm_query.weight": randn(hc_hidden, scale=0.1),
        PLE_PREFIX + "norm_conv.weight": randn(hc_hidden, scale=0.1),
        PLE_PREFIX + "conv1d.weight": randn(hc_hidden, 1, 4, scale=0.3),
    }
    if fp8_scale is not None:
        small[TABLE_PREFIX + "weight_scale"] = torch.tensor(fp8_scale, dtype=torch.float32)
    files: list[dict[str, torch.Tensor]] = [{} for _ in range(num_files)]
    files[0].update(small)
    for index in range(split_ngram_parts):
        if index in drop_shards:
            continue
        count = max(0, min(shard_size, rows - index * shard_size)) - (index == bad_shape_shard)
        shard = torch.randn(count, HEAD_DIM, generator=generator)
        files[index * num_files // split_ngram_parts][f"{TABLE_PREFIX}shard_{index}.weight"] = shard.to(table_dtype)
        if filler_bytes_per_shard:
            filler = torch.randn(filler_bytes_per_shard // 2, generator=generator).to(torch.bfloat16)
            files[index * num_files // split_ngram_parts][f"{TABLE_PREFIX}shard_{index}.weight_filler"] = filler
    if extra_shard_index is not None:
        files[-1][f"{TABLE_PREFIX}shard_{extra_shard_index}.weight"] = randn(shard_size, HEAD_DIM)

    weight_map = {}
    for number, tensors in enumerate(files, start=1):
        name = f"model-{number:05d}-of-{num_files:05d}.safetensors"
        save_file(tensors, str(out_dir / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
    (out_dir / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1)
    )
    config = text_config(ngram_vocab_size_base, split_ngram_parts)
    if table_dtype == torch.float8_e4m3fn:
        config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    (out_dir / "config.json").write_text(json.dumps(config, indent=1))
    return out_dir
