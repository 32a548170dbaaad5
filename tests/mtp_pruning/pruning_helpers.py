"""Helpers shared by the mtp-pruning tests."""

from __future__ import annotations

import contextlib
import importlib
import io
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent.parent.parent / "scripts" / "mtp_pruning"


def run_script(name: str, *args: str) -> tuple[int, str, str]:
    """Call a keep-set tool's main(argv) in this process; return (exit status, stdout, stderr)."""
    sys.path.insert(0, str(SCRIPTS))
    try:
        module = importlib.import_module(name)
    finally:
        sys.path.remove(str(SCRIPTS))
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


def write_malformed_keepsets(folder: Path, vocab_size: int) -> dict[str, tuple[Path, str]]:
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
    save("two_d", np.array([[1, 2], [3, 4]], dtype=np.int64), "must be 1-D, has shape (2, 2)")
    save("empty", np.array([], dtype=np.int64), "is empty")
    save("unsorted", np.array([5, 3, 9], dtype=np.int64), "is not sorted: id 3 at index 1 follows 5")
    save("duplicate", torch.tensor([1, 4, 4, 8]), "duplicate id 4 at indices 1 and 2", ".pt")
    save("negative", np.array([-1, 2, 3], dtype=np.int32), "id -1 at index 0 is negative")
    save("out_of_range", np.array([0, 7, vocab_size], dtype=np.int64), f"id {vocab_size} at index 2 is out of range")
    cases["missing"] = (folder / "missing.pt", "no such file")
    marker = folder / "CODE-RAN"
    save("pickle", {"ids": _RunsCodeWhenLoaded(marker)}, "refused: loading it would run code", ".pt")
    save("object_npy", np.array([1, "x"], dtype=object), "holds Python objects")
    return cases
