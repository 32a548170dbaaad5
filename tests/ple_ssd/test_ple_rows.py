"""magpie/vllm_modules/ple_rows.py on real safetensors files (written with the safetensors
library): the rows it gathers are byte-identical to the rows read from the file directly, for
BF16, FP8 and NVFP4 (packed bytes + FP8 block-scale plane) tables split into shards over two
files, on the warm path (pages resident) and the cold one (pages evicted with
posix_fadvise(DONTNEED), both prefetch modes).
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from magpie.vllm_modules import ple_rows

SHARDS, SHARD_ROWS = 4, 3001  # the last shard holds fewer rows


def _tensors(path: Path) -> dict[str, tuple[int, int]]:
    """name -> (absolute byte offset, byte length), read from the safetensors header."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    return {
        name: (8 + size + meta["data_offsets"][0], meta["data_offsets"][1] - meta["data_offsets"][0])
        for name, meta in header.items()
        if name != "__metadata__"
    }


def _write_table(tmp: Path, planes: dict[str, tuple[torch.dtype, int]], rows: int):
    """Shards of every plane, the even shards in one file and the odd ones in another, with a
    filler tensor first so the tables do not start at an aligned offset."""
    gen = torch.Generator().manual_seed(7)
    tables = {}
    for plane, (dtype, width) in planes.items():
        raw = torch.randint(
            0,
            256,
            (rows, width * torch.finfo(dtype).bits // 8 if dtype.is_floating_point else width),
            generator=gen,
            dtype=torch.uint8,
        )
        tables[plane] = raw.view(dtype) if dtype.is_floating_point else raw
    files = {0: {"filler": torch.arange(13, dtype=torch.int16)}, 1: {"filler": torch.arange(5, dtype=torch.int16)}}
    for i in range(SHARDS):
        for plane, table in tables.items():
            files[i % 2][f"ngram_embedding.shard_{i}.{plane}"] = table[i * SHARD_ROWS : (i + 1) * SHARD_ROWS].clone()
    paths = []
    for k, tensors in files.items():
        path = tmp / f"model-{k:05d}.safetensors"
        save_file(tensors, str(path))
        paths.append(path)
    gathers = {}
    for plane, table in tables.items():
        row_bytes = table.view(torch.uint8).shape[1]
        shards = {}
        for i in range(SHARDS):
            path = paths[i % 2]
            offset, nbytes = _tensors(path)[f"ngram_embedding.shard_{i}.{plane}"]
            shards[i] = (str(path), offset, nbytes // row_bytes)
        gathers[plane] = shards
    return tables, paths, gathers


def _direct(paths_shards, plane_shards, ids, row_bytes):
    """The rows read with plain file reads, one by one."""
    out = []
    for i in ids.tolist():
        path, offset, _ = plane_shards[i // SHARD_ROWS]
        with open(path, "rb") as f:
            f.seek(offset + (i % SHARD_ROWS) * row_bytes)
            out.append(f.read(row_bytes))
    return b"".join(out)


def _evict(paths):
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages are not dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


PLANES = {
    "bf16": {"weight": (torch.bfloat16, 160)},
    "fp8": {"weight": (torch.float8_e4m3fn, 160)},
    "nvfp4": {"weight": (torch.uint8, 80), "weight_scale": (torch.float8_e4m3fn, 10)},
}


@pytest.mark.parametrize("kind", list(PLANES))
@pytest.mark.parametrize("cold,prefetch", [(False, "fadvise"), (True, "fadvise"), (True, "populate")])
# A decode step (the Python-int path), a cold step read by preads (under 4,096 rows) and a
# chunk gathered through the mapping.
@pytest.mark.parametrize("count", [16, 64, 512, 8192])
def test_rows_identical_to_file(tmp_path, kind, cold, prefetch, count):
    rows = SHARDS * SHARD_ROWS - 1000
    tables, paths, shards = _write_table(tmp_path, PLANES[kind], rows)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randperm(rows, generator=gen)[: count - 2]
    ids = torch.cat([ids, torch.tensor([0, rows - 1])]).unique()  # sorted, as stage_rows passes
    shard, local = ids // SHARD_ROWS, ids % SHARD_ROWS
    for plane, table in tables.items():
        ple_rows.check_plane_dtype(plane, table.dtype)
        row_bytes = table.view(torch.uint8).shape[1]
        gather = ple_rows.RowGather(shards[plane], row_bytes, SHARD_ROWS, prefetch=prefetch, threads=3)
        try:
            if cold:
                _evict(paths)
            else:
                gather.read_rows(shard, local, torch.empty(ids.numel(), row_bytes, dtype=torch.uint8))
            out = torch.empty(ids.numel(), row_bytes, dtype=torch.uint8)
            gather.read_rows(shard, local, out)
            assert gather.last_cold is cold
            assert out.numpy().tobytes() == _direct(paths, shards[plane], ids, row_bytes)
            assert torch.equal(out, table.view(torch.uint8)[ids])
        finally:
            gather.close()


def test_refusals(tmp_path):
    with pytest.raises(ValueError, match="disk_offload_gather serves BF16, FP8 and NVFP4.*float16"):
        ple_rows.check_plane_dtype("weight", torch.float16)
    tables, paths, shards = _write_table(tmp_path, PLANES["bf16"], SHARDS * SHARD_ROWS)
    gather = ple_rows.RowGather(shards["weight"], 320, SHARD_ROWS)
    try:
        for n in (3, 600):  # the small-step path and the tensor path refuse alike
            shard = torch.arange(n) * SHARDS // n
            local = torch.arange(n) % SHARD_ROWS
            local[-1] = SHARD_ROWS
            with pytest.raises(IndexError, match="out of range"):
                gather.read_rows(shard, local, torch.empty(n, 320, dtype=torch.uint8))
            shard[-1] = 0
            local[-1] = 2
            with pytest.raises(ValueError, match="sorted by shard"):
                gather.read_rows(shard, local, torch.empty(n, 320, dtype=torch.uint8))
    finally:
        gather.close()
    truncated = dict(shards["weight"])
    path, offset, n = truncated[3]
    truncated[3] = (path, offset, n + 10_000)
    with pytest.raises(ValueError, match="truncated"):
        ple_rows.RowGather(truncated, 320, SHARD_ROWS)
