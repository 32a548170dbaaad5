"""Tiny but real models for tests: a byte-level BPE tokenizer and a Qwen3.5 text model with MTP.

Everything is built locally (no hub access): the tokenizer is trained on generated sentences,
the model uses transformers' own `Qwen3_5ForCausalLM` so the config fields and tensor names are
the real ones, and the MTP block's tensors carry the names of the real Qwen3.5 checkpoints.

Facts of vLLM 0.29.0's CPU path that shape the model: bf16 only ("CPU GDN attention requires
BF16"); linear-attention head dims must be 64 or 128 (32 fails on the first request).

Two weight variants:
- "random": random weights. No draft is ever accepted, and greedy texts can flip between runs
  with different batch shapes (near-tied bf16 logits): never compare texts on it.
- "increment": every layer's output projection is zero, so the residual stream is the embedding
  of the last token; `lm_head` row t+1 equals embedding row t, so greedy decoding continues
  "next id = previous id + 1" with well separated logits; the MTP block's `fc` passes the next
  token's embedding through, so it drafts exactly what the target will emit (all accepted).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import sys
from pathlib import Path

from magpie import cli

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

HIDDEN = 256
INTERMEDIATE = 512
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 64
LINEAR_KEY_HEADS, LINEAR_VALUE_HEADS = 2, 4  # linear attention (GDN): 128-wide key and value heads
LAYERS = 4  # three linear-attention layers, then one full-attention layer, repeated


@contextlib.contextmanager
def layer_shape(**sizes):
    """Build with other layer sizes (e.g. the GPU harness's real-size layers): HIDDEN=2560, ...
    for the duration of the block; the module's defaults come back after it."""
    unknown = [name for name in sizes if name not in _SHAPE_NAMES]
    if unknown:
        raise ValueError(f"layer_shape: unknown size(s) {unknown}; known: {', '.join(_SHAPE_NAMES)}")
    saved = {name: globals()[name] for name in sizes}
    globals().update(sizes)
    try:
        yield
    finally:
        globals().update(saved)


_SHAPE_NAMES = (
    "HIDDEN",
    "INTERMEDIATE",
    "HEADS",
    "KV_HEADS",
    "HEAD_DIM",
    "LINEAR_KEY_HEADS",
    "LINEAR_VALUE_HEADS",
    "LAYERS",
)


def _corpus(lines: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    subjects = "the cat|a dog|my friend|the teacher|our team|the engineer|a student|the company|the server".split("|")
    verbs = "sees|builds|finds|writes|reads|opens|follows|explains|changes|measures|returns|sorts".split("|")
    objects = "the red house|a long letter|an old book|a bright idea|the final number|a list|the function".split("|")
    extras = "quickly|today|again|carefully|in the garden|before dinner|with great care|for a long time".split("|")
    words = (
        "one two three four five six seven eight nine ten time year people way day thing world life hand "
        "part child place work week case point number group problem fact question answer system program "
        "water money story month book word business issue side kind head house service friend power hour "
        "def return import class self print value list dict int str for while if else None True False"
    ).split()
    text = []
    for _ in range(lines):
        sentence = f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)} {rng.choice(extras)}"
        if rng.random() < 0.5:
            sentence += ", " + " ".join(rng.choice(words) for _ in range(rng.randint(2, 8)))
        sentence = sentence[0].upper() + sentence[1:] + rng.choice([".", ".", "!", "?"])
        if rng.random() < 0.3:
            sentence += f" {rng.randint(0, 100000)}"
        text.append(sentence)
    return text


def train_tokenizer(out_dir: str | os.PathLike, vocab_size: int = 4096) -> Path:
    """Train a byte-level BPE tokenizer offline and save it as a HF tokenizer folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(12000), trainer=trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token=None
    )
    hf.chat_template = CHAT_TEMPLATE
    hf.model_max_length = 4096
    hf.save_pretrained(out)
    return out


def _mtp_tensors(generator, dtype, mtp_layers: int) -> dict:
    import torch

    def rnd(*shape, std=0.02):
        return (torch.randn(*shape, generator=generator) * std).to(dtype)

    def norm(n):
        return (torch.randn(n, generator=generator) * 0.1).to(dtype)

    tensors = {
        "mtp.fc.weight": rnd(HIDDEN, 2 * HIDDEN),
        "mtp.norm.weight": norm(HIDDEN),
        "mtp.pre_fc_norm_embedding.weight": norm(HIDDEN),
        "mtp.pre_fc_norm_hidden.weight": norm(HIDDEN),
    }
    for i in range(mtp_layers):
        p = f"mtp.layers.{i}."
        tensors.update(
            {
                p + "input_layernorm.weight": norm(HIDDEN),
                p + "post_attention_layernorm.weight": norm(HIDDEN),
                p + "self_attn.q_proj.weight": rnd(HEADS * HEAD_DIM * 2, HIDDEN),  # query + output gate
                p + "self_attn.k_proj.weight": rnd(KV_HEADS * HEAD_DIM, HIDDEN),
                p + "self_attn.v_proj.weight": rnd(KV_HEADS * HEAD_DIM, HIDDEN),
                p + "self_attn.o_proj.weight": rnd(HIDDEN, HEADS * HEAD_DIM),
                p + "self_attn.q_norm.weight": norm(HEAD_DIM),
                p + "self_attn.k_norm.weight": norm(HEAD_DIM),
                p + "mlp.gate_proj.weight": rnd(INTERMEDIATE, HIDDEN),
                p + "mlp.up_proj.weight": rnd(INTERMEDIATE, HIDDEN),
                p + "mlp.down_proj.weight": rnd(HIDDEN, INTERMEDIATE),
            }
        )
    return tensors


def _make_increment(weights: dict, vocab_size: int, seed: int) -> None:
    """Rewrite `weights` in place into the "next id = previous id + 1" model (module docstring)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    embeddings = torch.randn(vocab_size, HIDDEN, generator=generator)
    weights["model.embed_tokens.weight"] = embeddings.to(torch.bfloat16)
    weights["lm_head.weight"] = torch.roll(embeddings, shifts=1, dims=0).to(torch.bfloat16)  # row j = E[j-1]
    for name in list(weights):
        if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")):
            weights[name] = torch.zeros_like(weights[name])
        elif "linear_attn.norm.weight" in name:  # gated RMSNorm: plain weight, 1 = identity
            weights[name] = torch.ones_like(weights[name])
        elif name.endswith("norm.weight") or "layernorm" in name:  # (1 + w) RMSNorm: 0 = identity
            weights[name] = torch.zeros_like(weights[name])
    eye = torch.eye(HIDDEN)
    weights["mtp.fc.weight"] = torch.cat([eye, torch.zeros(HIDDEN, HIDDEN)], dim=1).to(torch.bfloat16)


def qwen35_config(vocab_size: int, eos_id: int):
    """transformers' Qwen3_5TextConfig at the module's current sizes (layer_shape)."""
    from transformers import Qwen3_5TextConfig

    pattern = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
    return Qwen3_5TextConfig(
        vocab_size=vocab_size,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        layer_types=[pattern[i % 4] for i in range(LAYERS)],
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_num_key_heads=LINEAR_KEY_HEADS,
        linear_num_value_heads=LINEAR_VALUE_HEADS,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=eos_id,
        initializer_range=0.02,
    )


def write_config(config, mtp_layers: int, out: Path) -> None:
    """config.json as vLLM reads a Qwen3.5 + MTP checkpoint."""
    config_dict = config.to_dict()
    config_dict["architectures"] = ["Qwen3_5ForCausalLM"]
    config_dict["mtp_num_hidden_layers"] = mtp_layers
    config_dict["mtp_use_dedicated_embeddings"] = False
    config_dict["torch_dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(config_dict, indent=2))


def build_tiny_qwen35(
    out_dir: str | os.PathLike,
    tokenizer_dir: str | os.PathLike,
    variant: str = "increment",
    vocab_size: int = 4096,
    mtp_layers: int = 1,
    seed: int = 0,
) -> Path:
    """Write a HF model folder: config.json, model.safetensors (target + `mtp.*`), tokenizer files.

    `vocab_size` may exceed the tokenizer's (e.g. the real 248,320 ids): the extra rows are never
    produced by the tokenizer but are real rows of the embedding and the head.
    """
    import shutil

    import torch
    from safetensors.torch import save_file
    from transformers import Qwen3_5ForCausalLM

    if variant not in ("increment", "random"):
        raise ValueError(f"variant must be 'increment' or 'random', not {variant!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    tokenizer_eos = json.loads((Path(tokenizer_dir) / "tokenizer.json").read_text())["added_tokens"]
    eos_id = next(t["id"] for t in tokenizer_eos if t["content"] == "<|im_end|>")
    config = qwen35_config(vocab_size, eos_id)
    config.architectures = ["Qwen3_5ForCausalLM"]
    model = Qwen3_5ForCausalLM(config).to(torch.bfloat16)
    with torch.no_grad():
        for name, param in model.named_parameters():
            # HF initialises the (1 + w) norms to 0; mildly random norms keep outputs non-degenerate.
            if "linear_attn.norm" in name:
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            elif name.endswith("norm.weight"):
                param.normal_(0.0, 0.1)
    weights = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
    weights.update(_mtp_tensors(torch.Generator().manual_seed(seed + 1), torch.bfloat16, mtp_layers))
    if variant == "increment":
        _make_increment(weights, vocab_size, seed + 2)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    write_config(config, mtp_layers, out)
    for name in os.listdir(tokenizer_dir):
        shutil.copy(Path(tokenizer_dir) / name, out / name)
    return out


def qwen4_exp_text_config(**overrides) -> dict:
    """config.json fields of a tiny two-layer Qwen4Exp text model (GDN + full attention, 4 experts,
    hidden 64): the real field names, scaled down. Tests add what they exercise (PLE, MTP)."""
    config = {
        "architectures": ["Qwen4ExpForCausalLM"],
        "model_type": "qwen4_exp_text",
        "torch_dtype": "bfloat16",
        "vocab_size": 4096,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "layer_types": ["linear_attention", "full_attention"],
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 2,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "eos_token_id": 2,
        "tie_word_embeddings": False,
        "hc_count": 2,
        "hc_lowrank": 8,
    }
    config.update(overrides)
    return config


COMMAND_DOC = """Build a tiny Qwen3.5 + MTP model folder and its tokenizer here (nothing is downloaded): a
BPE tokenizer trained on a generated corpus in TOKENIZER, the model (config.json,
model.safetensors with the mtp.* weights, the tokenizer files) in MODEL.

    python3 magpie demo-model /tmp/tiny/tokenizer /tmp/tiny/model --variant increment
"""


def main(argv: list[str] | None = None) -> int:
    parser = cli.parser("magpie demo-model", COMMAND_DOC)
    parser.add_argument("tokenizer", help="folder for the trained tokenizer")
    parser.add_argument("model", help="folder for the model")
    parser.add_argument("--variant", default="increment", help="weights: increment (predictable) or random")
    parser.add_argument("--vocab-size", type=int, default=4096, help="lm_head rows (the tokenizer gets at most 4096)")
    args = parser.parse_args(argv)
    tokenizer = train_tokenizer(args.tokenizer, min(args.vocab_size, 4096))
    print("model:", build_tiny_qwen35(args.model, tokenizer, variant=args.variant, vocab_size=args.vocab_size))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
