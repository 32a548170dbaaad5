"""Tiny models and keep-sets for the GPU harness (see gpu_harness.py --help).

Small models are built here, on the CPU machine, with magpie/demo/demo_model.py (the real config
fields and tensor names) and travel with the patched site tree. Models too large to travel
(the 248,320-id vocabulary at hidden 2560, the >= 1 GiB PLE table) travel as a *spec*: the
config, the tokenizer, every tensor's name/shape/dtype, and the values of the small tensors;
`materialize` writes the checkpoint on the GPU machine from it.

Model kinds (names used by the configurations in gpu_harness.py):
- `inc`: Qwen3.5 + 1 MTP layer, "increment" weights (demo_model), 4,096 ids, hidden 256:
  greedy continues next id = previous id + 1 and the draft drafts exactly that.
- `soft`: `inc` with the head scaled by SOFT_SCALE, so that at temperature 0.7 the next id is
  previous + 1 with probability ~0.66 and otherwise spread over the vocabulary: a real
  distribution to sample from, with the draft still proposing previous + 1.
- `big`: the increment model with the real 248,320-id vocabulary and Flash-Next's hidden size
  2560 (its head is 248,320 x 2560 BF16 = 1.27 GB, as Flash-Next's), built on the GPU machine.
- `scale`: `big` with real-size layers (SCALE_SHAPE: Qwen3.5-4B's layer sizes at hidden 2560)
  and SCALE_LAYERS of them, so that a decode step is GPU-bound on the H200 and the draft head is a
  share of it as on a GB10 (issue 18). The same increment weights (every output projection zero:
  the same GEMMs at the same cost, exact outputs). ~17 GB, written on the GPU machine only.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent
SOFT_SCALE = 0.025
BIG_VOCAB = 248_320
BIG_HIDDEN = 2560
SMALL_NUMEL = 1 << 16  # tensors up to this size travel with their values in a spec

# Prompts of the greedy checks: prompt i is ids start_i .. start_i + 4 + i; GREEDY_TOKENS follow.
GREEDY_STARTS = (100, 500, 1000, 1500, 2000, 2500, 3000, 3500)
GREEDY_TOKENS = 64
# ids 3700..3958 appear in no prompt and no greedy continuation (max 3500 + 11 + 64 = 3575).
MISS_RANGE = (3700, 3959)
# The big model's keep-set (K = 10,000) and its prompts: every continuation stays inside it.
BIG_KEEP = (100, 10_100)
BIG_STARTS = (200, 2200, 4200, 6200)
# Qwen3.5-4B's layer sizes (hidden 2560): full attention 16 x 256 query heads (+ output gate),
# 4 KV heads; GDN 16 key / 32 value heads of 128; MLP 9216. ~110 M parameters a layer.
SCALE_SHAPE = {
    "HIDDEN": BIG_HIDDEN,
    "INTERMEDIATE": 9216,
    "HEADS": 16,
    "KV_HEADS": 4,
    "HEAD_DIM": 256,
    "LINEAR_KEY_HEADS": 16,
    "LINEAR_VALUE_HEADS": 32,
}
SCALE_LAYERS = 64
SCALE_FILES = 4


def _demo_model():
    from magpie.demo import demo_model

    return demo_model


def keep_sets(vocab: int = 4096) -> dict:
    """name -> sorted int64 ids. `cover` holds every id the greedy checks use, `miss` none of
    them, `even` every other id (the increment model then accepts position 0 exactly when the
    next id is even and never position 1), `allbut0` every id but 0 (a keep-set of every id is
    refused): the draft is the unpruned one's except after id 4095, whose increment is id 0, so
    same-seed sampling must give the same text up to a 4095."""
    import numpy as np

    return {
        "cover": np.arange(0, 4000, dtype=np.int64),
        "miss": np.arange(*MISS_RANGE, dtype=np.int64),
        "even": np.arange(0, vocab, 2, dtype=np.int64),
        "allbut0": np.arange(1, vocab, dtype=np.int64),
        "big10k": np.arange(*BIG_KEEP, dtype=np.int64),
    }


def build_small(out: Path) -> dict:
    """Build `inc`, `soft`, the tokenizer, the keep-sets and the `big` spec under OUT."""
    import numpy as np
    import torch
    from safetensors.torch import load_file, save_file

    tm = _demo_model()
    out.mkdir(parents=True, exist_ok=True)
    tok = tm.train_tokenizer(out / "tokenizer")
    inc = tm.build_tiny_qwen35(out / "inc", tok, "increment", 4096)
    soft = out / "soft"
    shutil.copytree(inc, soft)
    weights = load_file(str(soft / "model.safetensors"))
    weights["lm_head.weight"] = (weights["lm_head.weight"].float() * SOFT_SCALE).to(torch.bfloat16)
    save_file(weights, str(soft / "model.safetensors"), metadata={"format": "pt"})
    keeps = out / "keep"
    keeps.mkdir(exist_ok=True)
    for name, ids in keep_sets().items():
        np.save(keeps / f"{name}.npy", ids)
    build_big_spec(out / "big-spec", tok)
    return {"inc": str(inc), "soft": str(soft), "keep": str(keeps)}


def build_big_spec(out: Path, tokenizer_dir: Path) -> Path:
    """Spec of the 248,320-id / hidden-2560 increment model (materialized on the GPU machine)."""
    from safetensors.torch import load_file, save_file

    tm = _demo_model()
    saved = tm.HIDDEN
    tmp = out.parent / (out.name + ".tmp")
    try:
        tm.HIDDEN = BIG_HIDDEN
        tm.build_tiny_qwen35(tmp, tokenizer_dir, "random", 4096)
    finally:
        tm.HIDDEN = saved
    weights = load_file(str(tmp / "model.safetensors"))
    out.mkdir(parents=True, exist_ok=True)
    shapes, small = {}, {}
    for name, tensor in weights.items():
        shapes[name] = {"shape": list(tensor.shape), "dtype": str(tensor.dtype).replace("torch.", "")}
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            shapes[name]["shape"][0] = BIG_VOCAB
        elif tensor.numel() <= SMALL_NUMEL:
            small[name] = tensor
    save_file(small, str(out / "small.safetensors"))
    config = json.loads((tmp / "config.json").read_text())
    config["vocab_size"] = BIG_VOCAB
    (out / "config.json").write_text(json.dumps(config, indent=1))
    (out / "spec.json").write_text(json.dumps({"kind": "qwen35-increment", "hidden": BIG_HIDDEN, "tensors": shapes}))
    for name in tokenizer_dir.iterdir():
        shutil.copy(name, out / name.name)
    shutil.rmtree(tmp)
    return out


def materialize_big(spec: Path, out: Path, seed: int = 0) -> Path:
    """Write the `big` checkpoint from its spec (run on the GPU machine: ~3 GB, ~20 s)."""
    import torch
    from safetensors.torch import load_file, save_file

    tm = _demo_model()
    meta = json.loads((spec / "spec.json").read_text())
    small = load_file(str(spec / "small.safetensors"))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(seed)
    weights = {}
    for name, info in meta["tensors"].items():
        if name in small:
            weights[name] = small[name]
        elif name not in ("model.embed_tokens.weight", "lm_head.weight"):
            shape = info["shape"]
            weights[name] = (torch.randn(*shape, generator=gen, device=device) * 0.02).to(torch.bfloat16).cpu()
    vocab = meta["tensors"]["lm_head.weight"]["shape"][0]
    saved = tm.HIDDEN
    try:
        tm.HIDDEN = meta["hidden"]
        tm._make_increment(weights, vocab, seed + 2)
    finally:
        tm.HIDDEN = saved
    out.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.contiguous() for k, v in weights.items()}, str(out / "model.safetensors"), metadata={"format": "pt"}
    )
    for name in spec.iterdir():
        if name.name not in ("spec.json", "small.safetensors"):
            shutil.copy(name, out / name.name)
    return out


def materialize_scale(tokenizer_dir: Path, out: Path, layers: int = SCALE_LAYERS, seed: int = 0) -> Path:
    """Write the `scale` checkpoint (GPU machine: ~17 GB in SCALE_FILES files, index beside).

    Names and shapes come from transformers' own Qwen3_5ForCausalLM built on the meta device
    (no memory), the values from a seeded generator on the GPU, then the increment rewrite."""
    import torch
    from safetensors.torch import save_file
    from transformers import Qwen3_5ForCausalLM

    tm = _demo_model()
    eos_id = next(
        t["id"]
        for t in json.loads((tokenizer_dir / "tokenizer.json").read_text())["added_tokens"]
        if t["content"] == "<|im_end|>"
    )
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(seed)
    with tm.layer_shape(**SCALE_SHAPE, LAYERS=layers):
        config = tm.qwen35_config(BIG_VOCAB, eos_id)
        with torch.device("meta"):
            shapes = {name: tuple(t.shape) for name, t in Qwen3_5ForCausalLM(config).state_dict().items()}
        weights = {}
        for name, shape in shapes.items():
            if name in ("model.embed_tokens.weight", "lm_head.weight"):
                continue  # written by the increment rewrite
            weights[name] = (torch.randn(*shape, generator=gen, device=device) * 0.02).to(torch.bfloat16).cpu()
        weights.update(tm._mtp_tensors(torch.Generator().manual_seed(seed + 1), torch.bfloat16, 1))
        tm._make_increment(weights, BIG_VOCAB, seed + 2)
        out.mkdir(parents=True, exist_ok=True)
        tm.write_config(config, 1, out)
    names = sorted(weights)
    weight_map = {}
    for f in range(SCALE_FILES):
        part = {name: weights[name].contiguous() for name in names[f::SCALE_FILES]}
        file_name = f"model-{f + 1:05d}-of-{SCALE_FILES:05d}.safetensors"
        save_file(part, str(out / file_name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file_name))
    total = sum(t.numel() * t.element_size() for t in weights.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    for path in tokenizer_dir.iterdir():
        shutil.copy(path, out / path.name)
    return out
