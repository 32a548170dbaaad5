"""Helpers shared by the mtp_pruning tests."""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import struct
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent.parent.parent / "magpie" / "mtp_pruning"


def run_script(name: str, *args: str) -> tuple[int, str, str]:
    """Call a keep-set tool's main(argv) in this process; return (exit status, stdout, stderr)."""
    module = importlib.import_module(f"magpie.mtp_pruning.{name}")
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = module.main([str(a) for a in args])
    return status, out.getvalue(), err.getvalue()


class _RunsCodeWhenLoaded:
    """Unpickling this calls open(marker, "w"): a file appears if loading ever runs the file's code."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def write_malformed_keep_sets(folder: Path, vocab_size: int) -> dict[str, tuple[Path, str]]:
    """One keep-set file per rule broken: name -> (path, the fragment its refusal must contain).

    The "pickle" file would create `folder/CODE-RAN` if anything loaded it with unrestricted unpickling.
    """
    import numpy as np
    import torch

    folder.mkdir(parents=True, exist_ok=True)
    cases: dict[str, tuple[Path, str]] = {}

    def save(name: str, array, message: str, suffix: str = ".npy") -> None:
        path = folder / f"{name}{suffix}"
        if suffix == ".npy":
            np.save(path, array)
        else:
            torch.save(array, path)
        cases[name] = (path, message)

    save("float", torch.tensor([1.0, 2.0, 3.0]), "has dtype torch.float32; keep-set ids must be an integer", ".pt")
    save("bool", np.array([True, False]), "has dtype torch.bool; keep-set ids must be an integer")
    save("two_d", np.array([[1, 2], [3, 4]], dtype=np.int64), "must be 1-D, has shape (2, 2)")
    save("empty", np.array([], dtype=np.int64), "is empty")
    save("unsorted", np.array([5, 3, 9], dtype=np.int64), "is not sorted: id 3 at index 1 follows 5")
    save("duplicate", torch.tensor([1, 4, 4, 8]), "duplicate id 4 at indices 1 and 2", ".pt")
    save("negative", np.array([-1, 2, 3], dtype=np.int32), "id -1 at index 0 is negative")
    save("out_of_range", np.array([0, 7, vocab_size], dtype=np.int64), f"id {vocab_size} at index 2 is out of range")
    save("identity", np.arange(vocab_size, dtype=np.int64), f"keeps all {vocab_size} ids of the vocabulary")
    cases["missing"] = (folder / "missing.pt", "no such file")
    marker = folder / "CODE-RAN"
    save("pickle", {"ids": _RunsCodeWhenLoaded(marker)}, "refused: loading it would run code", ".pt")
    save("object_npy", np.array([1, "x"], dtype=object), "holds Python objects")
    # Hand-written .safetensors headers that parse as JSON but are not a tensor entry.
    for name, header in (
        ("safetensors_list_header", [1, 2]),
        ("safetensors_no_offsets", {"ids": {"dtype": "I64", "shape": [2]}}),
        ("safetensors_bad_shape", {"ids": {"dtype": "I64", "shape": [-2], "data_offsets": [0, 16]}}),
    ):
        raw = json.dumps(header).encode()
        path = folder / f"{name}.safetensors"
        path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(16))
        cases[name] = (path, "has an unreadable .safetensors header")
    # Files that once ended in a traceback, and one that claims gigabytes (a sparse file: no disk).
    list_dtype = b'{"ids": {"dtype": ["I64"], "shape": [2], "data_offsets": [0, 16]}}'
    for name, data, message in (
        ("npy_empty_descr", _npy(b"{'descr': '', 'fortran_order': False, 'shape': (3,), }", bytes(24)), "(dtype '')"),
        ("npy_short", b"\x93NUMPY\x02\x00\x10\x00", "is truncated: 10 bytes, shorter than a .npy header"),
        ("npy_recursive", _npy(b"{'descr': '<i8', 'shape': " + b"(" * 20000 + b")" * 20000 + b"}", b""), "unreadable"),
        ("npy_huge", _npy(b"{'descr': '<i8', 'shape': (268435456,), }", b""), "holds 268435456"),
        ("safetensors_recursive", _safetensors(b"[" * 30000 + b"]" * 30000), "unreadable .safetensors header"),
        ("safetensors_list_dtype", _safetensors(list_dtype), "has dtype ['I64']"),
    ):
        suffix = ".npy" if name.startswith("npy") else ".safetensors"
        path = folder / f"{name}{suffix}"
        path.write_bytes(data)
        cases[name] = (path, message)
    with open(folder / "npy_huge.npy", "r+b") as f:
        f.truncate(128 + 268435456 * 8)  # 2 GiB of holes: the header's data is all there
    save("sparse_pt", torch.tensor([1, 5, 9]).to_sparse(), "holds a torch.sparse_coo tensor", ".pt")
    save("expanded_pt", torch.zeros(1, dtype=torch.int64).expand(10**8), "holds 100000000 ids", ".pt")
    save("uint64_huge", np.array([1, 2**64 - 1], dtype=np.uint64), f"id {2**64 - 1} at index 1 is out of range")
    return cases


def _npy(header: bytes, body: bytes) -> bytes:
    """A .npy (format 1.0) with this header text, padded as numpy pads it, then BODY."""
    header += b" " * (-(10 + len(header) + 1) % 64) + b"\n"
    if len(header) >= 1 << 16:
        return b"\x93NUMPY\x02\x00" + struct.pack("<I", len(header)) + header + body
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header + body


def _safetensors(header: bytes) -> bytes:
    return struct.pack("<Q", len(header)) + header + bytes(16)


MALFORMED_CASES = [
    "float",
    "bool",
    "two_d",
    "empty",
    "unsorted",
    "duplicate",
    "negative",
    "out_of_range",
    "identity",
    "missing",
    "pickle",
    "object_npy",
    "safetensors_list_header",
    "safetensors_no_offsets",
    "safetensors_bad_shape",
    "npy_empty_descr",
    "npy_short",
    "npy_recursive",
    "npy_huge",
    "safetensors_recursive",
    "safetensors_list_dtype",
    "sparse_pt",
    "expanded_pt",
    "uint64_huge",
]


def qwen4_exp_dir(folder: Path, tokenizer_dir: Path, tied: bool, vocab_size: int = 4096, hidden_size: int = 64):
    """A two-layer Qwen4Exp text model's config.json with one MTP layer, and its head tensors (saved)."""
    import shutil

    import torch
    from safetensors.torch import save_file

    from magpie.demo.demo_model import qwen4_exp_text_config

    folder.mkdir(parents=True)
    config = qwen4_exp_text_config(
        vocab_size=vocab_size, hidden_size=hidden_size, tie_word_embeddings=tied, mtp_num_hidden_layers=1
    )
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, folder / name)
    generator = torch.Generator().manual_seed(1 + tied)
    tensors = {
        "model.embed_tokens.weight": torch.randn(vocab_size, hidden_size, generator=generator).to(torch.bfloat16)
    }
    if not tied:
        tensors["lm_head.weight"] = torch.randn(vocab_size, hidden_size, generator=generator).to(torch.bfloat16)
    save_file(tensors, str(folder / "model.safetensors"))
    return folder, tensors


def with_zero_tail_head_row(model: Path, dest: Path) -> Path:
    """A copy of the checkpoint MODEL whose lm_head's last row is zero (as a padded or unused id's
    often is): a keep-set of every id but that one gives a pruned head that, padded, equals the
    target's head. The embedding keeps its row."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(model, dest)
    tensors = load_file(str(dest / "model.safetensors"))
    tensors["lm_head.weight"][-1].zero_()
    save_file(tensors, str(dest / "model.safetensors"))
    return dest
