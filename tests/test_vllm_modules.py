"""magpie/vllm_modules/ as ordinary Python: each source imports on its own (torch, numpy and the
standard library; no vLLM) and its functions run. The same code, as each series ships it, is what
tests/ple_ssd, tests/mtp_pruning, tests/release_python and tests/v0_33 run inside real vLLM trees; check-sources
(tests/test_patch_tool.py) holds the patches to these files."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from magpie import releases
from magpie.vllm_modules import draft_vocab, ple_mmap, sources

REPO = Path(__file__).resolve().parent.parent


def test_the_sources_import_without_vllm():
    probe = "import sys, magpie.vllm_modules.ple_mmap, magpie.vllm_modules.draft_vocab; "
    probe += "print(sorted(m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')))"
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr
    # Imported as it is, a source is the newest release's module (its last release block).
    assert ple_mmap.LOG_NAME == "engram mmap" and ple_mmap.THREAD_PREFIX == "engram_mmap"


def test_the_direct_lookup_is_chosen_only_where_the_gpu_reads_host_page_tables():
    assert ple_mmap.choose_lookup("cuda", 1) == "direct"
    assert ple_mmap.choose_lookup("cuda", 0) == "staged"
    assert ple_mmap.choose_lookup("cuda", None) == "staged"
    assert ple_mmap.choose_lookup("cpu", 1) == "staged"


def test_a_tensor_view_at_an_address_reads_the_memory_there():
    data = np.arange(16, dtype=np.int32)
    view = ple_mmap.tensor_at(data.ctypes.data, data.size, 4, torch.device("cpu"))
    assert view.tolist() == list(range(16))


def test_a_keep_set_file_maps_draft_ids_to_target_ids(tmp_path):
    keep = np.array([0, 3, 7, 20], dtype=np.int64)
    path = tmp_path / "keep.npy"
    np.save(path, keep)
    ids = draft_vocab.load_keep_ids(str(path), vocab_size=32)
    assert ids.tolist() == keep.tolist()
    offsets = draft_vocab.draft_to_target_offsets(ids)
    assert (torch.arange(4) + offsets).tolist() == keep.tolist()  # d2t[i] = keep[i] - i


def test_a_keep_set_outside_the_vocabulary_is_refused_naming_the_file(tmp_path):
    path = tmp_path / "keep.npy"
    np.save(path, np.array([1, 40], dtype=np.int64))
    with pytest.raises(draft_vocab.DraftVocabError, match="keep.npy"):
        draft_vocab.load_keep_ids(str(path), vocab_size=32)


@pytest.mark.parametrize(
    "name, allowed",
    [
        ("ple_mmap.py", {"numpy", "torch"}),
        ("ple_hash.py", {"numpy", "torch"}),
        ("ple_rows.py", {"torch"}),
        ("draft_vocab.py", {"torch"}),
    ],
)
@pytest.mark.parametrize("release", releases.series_releases())
def test_each_shipped_module_imports_only_torch_numpy_and_the_standard_library(name, allowed, release):
    """As each series ships it (numpy: a vLLM dependency): the module runs on its own, outside vLLM."""
    series = REPO / "patches" / f"vllm-{release}"
    listed = [ln.strip() for ln in (series / "series").read_text().splitlines() if ln.strip() and ln[0] != "#"]
    if not any(f"/{name}\n" in (series / entry).read_text() for entry in listed):
        pytest.skip(f"the {release} series does not ship {name}")
    text = sources.render_module((REPO / "magpie" / "vllm_modules" / name).read_text(), release)
    roots = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            roots.add(node.module.split(".")[0])
    assert roots - sys.stdlib_module_names == allowed
