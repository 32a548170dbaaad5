# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Draft-vocabulary pruning for MTP speculative decoding.

An MTP draft normally projects onto the target's full vocabulary: on a
248,320-id vocabulary that is a 1.2-2.5 GB GEMV read once per draft token.
Generated text concentrates on a small share of the ids, so the draft can
propose from a K-row slice of the head (the "keep-set"). The target still
verifies every proposal with its full head, so the output never changes; a
token outside the keep-set only costs acceptance.

Activation: ``--speculative-config '{"method": "mtp", ...,
"draft_vocab_path": "/abs/keep.pt"}'``. A keep-set is a sorted 1-D tensor of
unique integer target ids, stored as ``.pt`` (``torch.save``; read with
``weights_only=True``), ``.npy`` or ``.safetensors`` (both parsed here without
unpickling anything), or ``.json`` (a list of integer ids, as keep-sets are
passed around; sorted on reading).

Draft row ``i`` is target id ``keep_ids[i]``; ``draft_id_to_target_id[i] =
keep_ids[i] - i`` is the offset convention of vLLM's ``LocalArgmaxMixin``
(Eagle3's ``d2t``).

This module imports only torch and the standard library: the model files
construct vLLM's layers and call in here for the keep-set, the row slice and
the id maps.
"""

from __future__ import annotations

import ast
import json
import logging
import math
import os
import pickle
import struct
from collections.abc import Iterable, Iterator

import torch

logger = logging.getLogger(__name__)

# Draft architectures whose model classes carry the pruning hooks.
PRUNABLE_MTP_ARCHITECTURES = ("Qwen3_5MTP", "Qwen3_5MoeMTP", "Qwen4ExpMTP")
# Set to True on each hooked model class. vLLM picks a model class per platform
# (Qwen4ExpMTP: qwen4_exp/nvidia/mtp.py on CUDA and CPU, qwen4_exp/amd/mtp.py on
# ROCm), so the configuration checks the class it will build, not the name.
HOOK_ATTRIBUTE = "supports_draft_vocab_pruning"
KEEPSET_SUFFIXES = (".pt", ".npy", ".safetensors", ".json")
_INTEGER_DTYPES = (
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.uint16,
    torch.uint32,
    torch.uint64,
)
# numpy / safetensors dtype codes -> torch dtypes (little-endian only).
_NPY_DTYPES = {
    "i1": torch.int8,
    "i2": torch.int16,
    "i4": torch.int32,
    "i8": torch.int64,
    "u1": torch.uint8,
    "u2": torch.uint16,
    "u4": torch.uint32,
    "u8": torch.uint64,
    "f2": torch.float16,
    "f4": torch.float32,
    "f8": torch.float64,
    "b1": torch.bool,
}
_SAFETENSORS_DTYPES = {
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "U8": torch.uint8,
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "BOOL": torch.bool,
}


class DraftVocabError(ValueError):
    """A keep-set file that cannot be used; the message names the file and the rule."""


def _error(path: str, problem: str) -> DraftVocabError:
    return DraftVocabError(f"draft_vocab_path {path}: {problem}")


# What a reader takes from a file, checked before it is read: a header of at most
# MAX_HEADER_BYTES (numpy writes ~128 bytes, a one-tensor .safetensors header
# ~100), and data for at most max_ids ids (the vocabulary: one id per entry), so
# a file that claims gigabytes (a sparse file costs no disk) is refused unread.
MAX_HEADER_BYTES = 1 << 16
# max_ids when the caller knows no vocabulary: above any real one (Qwen3.5: 248,320).
MAX_IDS = 1 << 24
# A .pt keep-set is a zip of the ids and a short pickle: its ids plus this much.
_PT_OVERHEAD_BYTES = 1 << 20
# torch.save writes about six zip entries (the pickle, the storages, versions).
_PT_MAX_ENTRIES = 256
# A .json keep-set: at most this many bytes per id ("248319, ") plus a margin.
_JSON_BYTES_PER_ID = 24


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _count_ids(path: str, shape: tuple[int, ...], max_ids: int) -> int:
    count = math.prod(shape)
    if count > max_ids:
        raise _error(
            path,
            f"holds {count} ids (shape {shape}), more than the {max_ids} a keep-set "
            "can hold (at most one per vocabulary id); it was not read",
        )
    return count


def _read_span(f, path: str, offset: int, nbytes: int, file_size: int, what: str):
    """Exactly NBYTES at OFFSET of the open file F, or refuse as truncated."""
    if offset + nbytes > file_size:
        raise _error(
            path,
            f"is truncated: {what} needs {nbytes} bytes at offset {offset}, the "
            f"file has {file_size} bytes",
        )
    f.seek(offset)
    data = f.read(nbytes)
    if len(data) != nbytes:
        raise _error(path, f"is truncated: {what} ended after {len(data)} bytes")
    return data


def _valid_shape(shape) -> bool:
    return all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape)


def _read_npy(path: str, max_ids: int) -> torch.Tensor:
    """Parse a .npy file (format versions 1-3) without numpy and without unpickling.

    The header is read and checked first; then only the data it names.
    """
    file_size = os.path.getsize(path)
    with open(path, "rb") as f:
        prefix = f.read(12)
        if prefix[:6] != b"\x93NUMPY":
            raise _error(path, "is not a .npy file (bad magic bytes)")
        major = prefix[6] if len(prefix) > 6 else 0
        start = 10 if major == 1 else 12
        if major not in (1, 2, 3):
            raise _error(path, f"unsupported .npy format version {major}")
        if len(prefix) < start:
            raise _error(
                path, f"is truncated: {len(prefix)} bytes, shorter than a .npy header"
            )
        (header_len,) = struct.unpack_from("<H" if major == 1 else "<I", prefix, 8)
        if header_len > MAX_HEADER_BYTES:
            raise _error(
                path,
                f"has a .npy header of {header_len} bytes; a keep-set's is under "
                f"{MAX_HEADER_BYTES} (save it with numpy.save)",
            )
        raw = _read_span(f, path, start, header_len, file_size, "the .npy header")
        try:
            header = ast.literal_eval(raw.decode("utf-8" if major == 3 else "latin1"))
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError) as e:
            raise _error(
                path,
                f"has an unreadable .npy header ({e.__class__.__name__}: {e})",
            ) from None
        if not isinstance(header, dict):
            raise _error(path, "has an unreadable .npy header (not a dict)")
        descr, shape = header.get("descr"), header.get("shape")
        if not isinstance(shape, tuple) or not _valid_shape(shape):
            raise _error(path, f"has an unreadable .npy header (shape {shape!r})")
        if isinstance(descr, list) or (
            isinstance(descr, str) and descr.lstrip("<>|=")[:1] in ("O", "V")
        ):
            raise _error(
                path,
                f"holds Python objects or records (dtype {descr!r}); reading them "
                "would mean unpickling, which is refused: save a plain integer array "
                "(numpy int64)",
            )
        if not isinstance(descr, str) or not descr.lstrip("<>|="):
            raise _error(path, f"has an unreadable .npy header (dtype {descr!r})")
        if descr[0] == ">":
            raise _error(
                path, f"is big-endian ({descr!r}); save it little-endian (numpy int64)"
            )
        code = descr.lstrip("<|=")
        if code not in _NPY_DTYPES:
            raise _error(
                path,
                f"has dtype {descr!r}; keep-set ids must be an integer dtype "
                "(save int64)",
            )
        dtype = _NPY_DTYPES[code]
        count = _count_ids(path, shape, max_ids)
        if count == 0:
            return torch.empty(shape, dtype=dtype)
        body = _read_span(
            f,
            path,
            start + header_len,
            count * _element_size(dtype),
            file_size,
            f"shape {shape} of {descr}",
        )
    flat = torch.frombuffer(bytearray(body), dtype=dtype)
    if header.get("fortran_order") and len(shape) > 1:
        return flat.reshape(tuple(reversed(shape))).permute(
            *reversed(range(len(shape)))
        )
    return flat.reshape(shape)


def _read_safetensors(path: str, max_ids: int) -> torch.Tensor:
    """Parse a one-tensor .safetensors file (a JSON header and raw bytes: no pickle).

    The header is read and checked first; then only the tensor's bytes.
    """
    file_size = os.path.getsize(path)
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise _error(path, "is not a .safetensors file (too short)")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > MAX_HEADER_BYTES:
            raise _error(
                path,
                f"has a .safetensors header of {header_len} bytes; a keep-set's "
                f"is under {MAX_HEADER_BYTES}",
            )
        raw = _read_span(f, path, 8, header_len, file_size, "the .safetensors header")
        try:
            header = json.loads(raw)
        except (ValueError, UnicodeDecodeError, RecursionError) as e:
            raise _error(
                path,
                f"has an unreadable .safetensors header ({e.__class__.__name__}: {e})",
            ) from None
        if not isinstance(header, dict):
            raise _error(
                path, "has an unreadable .safetensors header (not a JSON object)"
            )
        tensors = {k: v for k, v in header.items() if k != "__metadata__"}
        if len(tensors) != 1:
            raise _error(
                path,
                f"must hold exactly one tensor, found {len(tensors)} "
                f"({', '.join(sorted(tensors))})",
            )
        (info,) = tensors.values()
        if not isinstance(info, dict):
            raise _error(
                path, f"has an unreadable .safetensors header (tensor entry {info!r})"
            )
        code, shape, offsets = (
            info.get("dtype"),
            info.get("shape"),
            info.get("data_offsets"),
        )
        if not isinstance(shape, list) or not _valid_shape(shape):
            raise _error(
                path, f"has an unreadable .safetensors header (shape {shape!r})"
            )
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not _valid_shape(offsets)
            or offsets[0] > offsets[1]
        ):
            raise _error(
                path,
                f"has an unreadable .safetensors header (data_offsets {offsets!r})",
            )
        if not isinstance(code, str) or code not in _SAFETENSORS_DTYPES:
            raise _error(
                path,
                f"has dtype {code!r}; keep-set ids must be an integer dtype "
                "(save int64)",
            )
        shape = tuple(shape)
        dtype = _SAFETENSORS_DTYPES[code]
        count = _count_ids(path, shape, max_ids)
        nbytes = count * _element_size(dtype)
        if offsets[1] - offsets[0] != nbytes:
            raise _error(
                path,
                f"is inconsistent: shape {shape} of {code} is {nbytes} bytes, its "
                f"data_offsets span {offsets[1] - offsets[0]}",
            )
        if count == 0:
            return torch.empty(shape, dtype=dtype)
        body = _read_span(
            f, path, 8 + header_len + offsets[0], nbytes, file_size, "the tensor"
        )
    return torch.frombuffer(bytearray(body), dtype=dtype).reshape(shape)


def _check_pt_zip(path: str, limit: int, max_ids: int) -> None:
    """Refuse a .pt whose zip entries would inflate past LIMIT bytes, unread.

    A DEFLATE entry of half a megabyte can inflate to hundreds of megabytes
    inside torch.load; the sizes every entry inflates to are in the zip's
    central directory, read here before any entry is.
    """
    import zipfile

    try:
        with zipfile.ZipFile(path) as archive:
            entries = archive.infolist()
    except zipfile.BadZipFile:
        raise _error(
            path,
            "is not a zip-format torch.save file (the format of torch.save since "
            "PyTorch 1.6); save the keep-set with torch.save(torch.tensor(ids, "
            "dtype=torch.int64), path), or as .npy",
        ) from None
    inflated = sum(entry.file_size for entry in entries)
    if len(entries) > _PT_MAX_ENTRIES or inflated > limit:
        raise _error(
            path,
            f"has {len(entries)} zip entries that inflate to {inflated} bytes, more "
            f"than a .pt keep-set of at most {max_ids} ids takes ({limit} "
            "bytes); it was not loaded",
        )


def _read_pt(path: str, max_ids: int) -> torch.Tensor:
    """Read a torch.save'd tensor with PyTorch's restricted unpickler.

    ``weights_only=True`` is explicit, so no environment variable can turn it
    off: a file whose pickle names any callable but tensor rebuilding is refused
    before anything in it runs. A file larger than max_ids int64 ids and a zip's
    overhead, or whose entries would inflate to more (the zip's central
    directory says), is refused unread.
    """
    file_size = os.path.getsize(path)
    limit = max_ids * 8 + _PT_OVERHEAD_BYTES
    if file_size > limit:
        raise _error(
            path,
            f"is {file_size} bytes, more than a .pt keep-set of at most {max_ids} "
            f"ids takes ({limit}); it was not read",
        )
    _check_pt_zip(path, limit, max_ids)
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        lines = str(e).strip().splitlines()
        reason = next(
            (x for x in lines if "unsupported" in x.lower()), lines[0] if lines else ""
        )
        raise _error(
            path,
            "refused: loading it would run code or build objects other than "
            f"tensors (torch.load, weights_only=True: {reason.strip()}); save the "
            "keep-set with torch.save(torch.tensor(ids, dtype=torch.int64), path) "
            "or as .npy",
        ) from None
    except Exception as e:
        raise _error(
            path,
            f"could not be read as a torch.save'd tensor ({e.__class__.__name__}: {e})",
        ) from None
    if not isinstance(obj, torch.Tensor):
        raise _error(path, f"must hold a single tensor, found {type(obj).__name__}")
    _check_dense(obj, path)
    # A view (expand: stride 0) can claim far more ids than its storage holds.
    _count_ids(path, tuple(obj.shape), max_ids)
    return obj


def _read_json(path: str, max_ids: int) -> torch.Tensor:
    """A JSON list of integer ids (as keep-sets are passed around), sorted.

    No pickle: json parses it. A file larger than max_ids ids could take is
    refused unread; anything but a list of integers is refused naming the
    first entry that is not one.
    """
    file_size = os.path.getsize(path)
    limit = max_ids * _JSON_BYTES_PER_ID + _PT_OVERHEAD_BYTES
    if file_size > limit:
        raise _error(
            path,
            f"is {file_size} bytes, more than a JSON list of at most {max_ids} "
            f"ids takes ({limit}); it was not read",
        )
    with open(path, "rb") as f:
        raw = f.read(limit + 1)
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise _error(
            path,
            f"is not valid JSON ({e.__class__.__name__}: {e}); a .json keep-set "
            "is a list of integer ids, e.g. [0, 5, 17]",
        ) from None
    if not isinstance(value, list):
        kind = "object" if isinstance(value, dict) else type(value).__name__
        raise _error(
            path,
            f"holds a JSON {kind}; a .json keep-set is a list of integer ids, "
            "e.g. [0, 5, 17]",
        )
    for at, item in enumerate(value):
        if type(item) is not int:
            raise _error(
                path,
                f"entry {at} is {item!r}, not an integer id; a .json keep-set is "
                "a list of integer ids, e.g. [0, 5, 17]",
            )
        if not -(2**63) <= item < 2**63:
            raise _error(path, f"id {item} at index {at} is out of range")
    _count_ids(path, (len(value),), max_ids)
    return torch.sort(torch.tensor(value, dtype=torch.int64)).values


def _check_dense(ids: torch.Tensor, path: str) -> None:
    if ids.layout != torch.strided or ids.is_quantized:
        kind = "a quantized" if ids.is_quantized else f"a {ids.layout}"
        raise _error(
            path,
            f"holds {kind} tensor; a keep-set is a plain (dense) integer tensor "
            "(save ids.to_dense(), int64)",
        )


def read_keepset_file(path: str, max_ids: int = MAX_IDS) -> torch.Tensor:
    """The raw tensor stored in a keep-set file (not yet validated).

    Header first: a file that would hold more than ``max_ids`` ids (pass the
    vocabulary size) is refused before its data is read.
    """
    if not os.path.isfile(path):
        raise _error(
            path,
            (
                "no such file (every worker opens it: it must exist on each node)"
                if not os.path.exists(path)
                else "is not a regular file (give the keep-set file itself)"
            ),
        )
    suffix = os.path.splitext(path)[1].lower()
    readers = {
        ".npy": _read_npy,
        ".safetensors": _read_safetensors,
        ".pt": _read_pt,
        ".json": _read_json,
    }
    if suffix not in readers:
        raise _error(
            path,
            f"unsupported file type {suffix or '(none)'!r}; "
            f"use one of {', '.join(KEEPSET_SUFFIXES)}",
        )
    try:
        return readers[suffix](path, max_ids)
    except OSError as e:
        raise _error(path, f"could not be read ({e.strerror or e})") from None


def _as_int64(ids: torch.Tensor, vocab_size: int, path: str) -> torch.Tensor:
    """IDS as int64. torch has no max or comparison for uint16/32/64: uint64 ids
    are reinterpreted, and one at or above 2**63 (negative as int64) is out of
    range."""
    if ids.dtype == torch.uint64:
        signed = ids.contiguous().view(torch.int64)
        huge = torch.nonzero(signed < 0)
        if huge.numel():
            at = int(huge[0])
            raise _error(
                path,
                f"id {int(signed[at]) + 2**64} at index {at} is out of range; ids "
                f"must lie in [0, {vocab_size})",
            )
        return signed
    return ids.to(device="cpu", dtype=torch.int64)


def validate_keep_ids(ids: torch.Tensor, vocab_size: int, path: str) -> torch.Tensor:
    """Check every keep-set rule and return the ids as a CPU int64 tensor.

    Rules, in order: a dense tensor of an integer dtype, 1-D, non-empty, strictly
    ascending (sorted, no duplicates), every id in [0, vocab_size), fewer ids
    than vocab_size.
    """
    _check_dense(ids, path)
    if ids.dtype not in _INTEGER_DTYPES:
        raise _error(
            path,
            f"has dtype {ids.dtype}; keep-set ids must be an integer dtype "
            "(save int64)",
        )
    if ids.dim() != 1:
        raise _error(
            path,
            f"must be 1-D, has shape {tuple(ids.shape)} (save a flat array of ids)",
        )
    if ids.numel() == 0:
        raise _error(path, "is empty; a keep-set needs at least one id")
    ids = _as_int64(ids.cpu(), vocab_size, path).contiguous()
    steps = ids[1:] - ids[:-1]
    if steps.numel() and int(steps.min()) <= 0:
        at = int(torch.nonzero(steps <= 0)[0])
        if int(steps[at]) == 0:
            raise _error(
                path,
                f"duplicate id {int(ids[at])} at indices {at} and {at + 1}; "
                "ids must be unique",
            )
        raise _error(
            path,
            f"is not sorted: id {int(ids[at + 1])} at index {at + 1} follows "
            f"{int(ids[at])}; ids must be strictly ascending "
            "(build_keepset.py writes them sorted)",
        )
    if int(ids[0]) < 0:
        raise _error(
            path,
            f"id {int(ids[0])} at index 0 is negative; "
            f"ids must lie in [0, {vocab_size})",
        )
    if int(ids[-1]) >= vocab_size:
        at = int(torch.nonzero(ids >= vocab_size)[0])
        raise _error(
            path,
            f"id {int(ids[at])} at index {at} is out of range; ids must lie in "
            f"[0, {vocab_size}) (vocab_size of the draft model's config, the rows "
            "of its lm_head)",
        )
    if ids.numel() == vocab_size:
        # Sorted, unique and in range: this is every id, and a head of every row
        # is the full head: pruning it would only cost the row copy at load.
        raise _error(
            path,
            f"keeps all {vocab_size} ids of the vocabulary, so nothing is pruned; "
            "drop draft_vocab_path to draft with the full head, or build a "
            "smaller keep-set (build_keepset.py --coverage 0.99)",
        )
    return ids


def load_keep_ids(path: str, vocab_size: int) -> torch.Tensor:
    """Read and validate a keep-set file.

    Raises DraftVocabError (a ValueError) naming the file and the rule broken.
    """
    return validate_keep_ids(read_keepset_file(path, vocab_size), vocab_size, path)


def keeps_own_lm_head(model: torch.nn.Module) -> bool:
    """Whether the draft MODEL must keep its lm_head rather than share the target's.

    A draft built with a keep-set (``draft_vocab_path``) always does. vLLM's
    proposers share the target's head when the draft's padded head weight is
    torch.equal to the target's, and a K-row head can be: K = V - 1 ids whose
    dropped rows are zero in the checkpoint pad to the same rows. The V1
    proposer (``_maybe_share_lm_head``) and the V2 loader (``load_eagle_model``)
    ask this first, so the configuration decides, not the weights.
    """
    return isinstance(getattr(model, "draft_vocab", None), DraftVocab)


def check_model_class(model_cls: type, architecture: str, platform: str) -> None:
    """Refuse a draft model class that carries no pruning hook.

    ``model_cls`` is the class vLLM's registry resolves ``architecture`` to on
    ``platform`` (e.g. ROCm builds Qwen4ExpMTP from qwen4_exp/amd/mtp.py, which
    this patch does not change): a keep-set would be silently ignored there.
    """
    if getattr(model_cls, HOOK_ATTRIBUTE, False) is not True:
        raise ValueError(
            f"draft_vocab_path is not supported for the MTP draft {architecture} "
            f"on this platform ({platform}): vLLM builds it from "
            f"{model_cls.__module__}.{model_cls.__qualname__}, which has no "
            "draft-vocab pruning hook, so the keep-set would be ignored. Drop "
            "draft_vocab_path on this platform (the hooked classes: "
            "qwen3_5_mtp.Qwen3_5MTP/Qwen3_5MoeMTP everywhere, "
            "qwen4_exp.nvidia.mtp.Qwen4ExpMTP on CUDA and CPU)"
        )


def draft_to_target_offsets(keep_ids: torch.Tensor) -> torch.Tensor:
    """d2t[i] = keep_ids[i] - i, so that target_id = draft_id + d2t[draft_id]."""
    return keep_ids - torch.arange(
        keep_ids.numel(), dtype=keep_ids.dtype, device=keep_ids.device
    )


class DraftVocab:
    """A validated keep-set and what the draft model needs from it.

    The model builds a K-row head (K = ``num_keep``) and calls :meth:`attach`;
    the head's rows are then filled from the checkpoint's full head at load
    (:meth:`load_head_rows`), and draft outputs are mapped back to target ids
    (:meth:`to_target_ids`, :meth:`expand_logits`).
    """

    def __init__(self, path: str, keep_ids: torch.Tensor, vocab_size: int):
        self.path = path
        self.keep_ids = keep_ids
        self.vocab_size = vocab_size
        self.num_keep = int(keep_ids.numel())
        self.tie_word_embeddings = False
        self._head: torch.nn.Module | None = None
        self._keep_ids_on_device = keep_ids
        self._rows_loaded = False
        self._head_confirmed = False

    @classmethod
    def from_speculative_config(
        cls, speculative_config, vocab_size: int
    ) -> DraftVocab | None:
        """The keep-set of ``speculative_config.draft_vocab_path``; None when unset."""
        path = getattr(speculative_config, "draft_vocab_path", None)
        if path is None:
            return None
        return cls(path, load_keep_ids(path, vocab_size), vocab_size)

    @property
    def fraction(self) -> float:
        return self.num_keep / self.vocab_size

    def describe(self) -> str:
        return (
            f"MTP draft vocab pruned: {self.num_keep} of {self.vocab_size} ids "
            f"({100 * self.fraction:.2f}%), keep-set {self.path}"
        )

    def place(self, device: torch.device) -> None:
        """Keep the ids that drafting indexes on DEVICE (attach: the head's device).

        Copied once here, so drafting (CUDA graphs) never copies host-to-device.
        """
        self._keep_ids_on_device = self.keep_ids.to(device)

    # Building the draft head -------------------------------------------------

    def attach(
        self,
        model: torch.nn.Module,
        lm_head: torch.nn.Module,
        tie_word_embeddings: bool = False,
    ) -> None:
        """Make ``lm_head`` (a K-row ParallelLMHead on ``model``) the draft head.

        Sets ``has_own_lm_head`` (the proposers' sharing checks also ask
        :func:`keeps_own_lm_head`, true for this model), registers the
        ``draft_id_to_target_id`` offsets used by
        ``LocalArgmaxMixin.get_top_tokens``, and routes the checkpoint's full
        ``lm_head.weight`` through a loader that copies only the kept rows.
        """
        num_rows = getattr(lm_head, "org_vocab_size", None)
        if num_rows != self.num_keep:
            raise RuntimeError(
                f"pruned draft head has {num_rows} rows, the keep-set {self.num_keep}"
            )
        self._head = lm_head
        self.tie_word_embeddings = tie_word_embeddings
        weight = lm_head.weight
        model.has_own_lm_head = True
        self.place(weight.device)
        # Both device tensors that drafting reads are buffers of the model:
        # vLLM's sleep level 2 discards device memory and restores the draft's
        # named buffers on wake-up (gpu_worker.py), which must include them.
        model.register_buffer(
            "draft_keep_ids", self._keep_ids_on_device, persistent=False
        )
        model.register_buffer(
            "draft_id_to_target_id",
            draft_to_target_offsets(self._keep_ids_on_device),
            persistent=False,
        )
        shard = lm_head.shard_indices
        rows = self.keep_ids[shard.org_vocab_start_index : shard.org_vocab_end_index]

        def load_head_rows(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
            self.load_head_rows(param, loaded_weight, rows)

        weight.weight_loader = load_head_rows
        logger.info(self.describe())

    def load_head_rows(
        self, param: torch.Tensor, loaded_weight: torch.Tensor, rows: torch.Tensor
    ) -> None:
        """Copy the full head's rows ``rows`` (this shard's kept ids) into ``param``."""
        if loaded_weight.dim() != 2 or loaded_weight.shape[0] < self.vocab_size:
            raise ValueError(
                f"draft_vocab_path {self.path}: the checkpoint's head has shape "
                f"{tuple(loaded_weight.shape)}, expected at least {self.vocab_size} "
                "rows to slice from"
            )
        if loaded_weight.shape[1] != param.shape[1]:
            raise ValueError(
                f"draft_vocab_path {self.path}: the checkpoint's head is "
                f"{loaded_weight.shape[1]} wide, the draft head {param.shape[1]}"
            )
        picked = loaded_weight.index_select(0, rows.to(loaded_weight.device))
        param.data[: picked.shape[0]].copy_(picked)
        param.data[picked.shape[0] :].zero_()
        self._rows_loaded = True

    def with_head_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor]],
        embed_name: str = "model.embed_tokens.weight",
        head_name: str = "lm_head.weight",
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Feed the pruned head from the embedding when the word embeddings are tied.

        A tied checkpoint has no separate head: the kept rows are sliced from
        the embedding into the draft's own K-row head.
        """
        for name, tensor in weights:
            yield name, tensor
            if self.tie_word_embeddings and name == embed_name:
                yield head_name, tensor

    def check_loaded(self) -> None:
        """Refuse a draft head whose rows were never filled from a checkpoint head."""
        if self._head is not None and not self._rows_loaded:
            raise ValueError(
                f"draft_vocab_path {self.path}: the checkpoint gave the MTP draft "
                "no lm_head weight to slice the kept rows from (expected "
                "lm_head.weight, or the embedding when tie_word_embeddings is set)"
            )

    # Using the draft head ----------------------------------------------------

    def confirm_head(self, model: torch.nn.Module) -> None:
        """On first use, prove the head in use is the pruned one.

        vLLM's proposers decide after load whether the draft shares the target's
        head; a replaced head would silently ignore the keep-set, so that is an
        error here, and the kept head is logged once.
        """
        if self._head_confirmed:
            return
        head = getattr(model, "lm_head", None)
        if head is not self._head:
            rows = getattr(head, "org_vocab_size", "?")
            raise RuntimeError(
                f"draft_vocab_path {self.path}: the MTP draft's lm_head was "
                f"replaced after load (now {type(head).__name__} with {rows} rows, "
                f"the pruned head has {self.num_keep}), so proposals would ignore "
                "the keep-set; the proposer must ask draft_vocab.keeps_own_lm_head "
                "before it shares the target's head"
            )
        self._head_confirmed = True
        logger.info(
            "MTP draft vocab pruned head in use: %s.lm_head has %d rows, "
            "not the target's %d (lm_head sharing left it in place)",
            type(model).__name__,
            self.num_keep,
            self.vocab_size,
        )

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Map draft row indices to target token ids (LocalArgmaxMixin: via d2t)."""
        return self._keep_ids_on_device[draft_ids]

    def expand_logits(self, logits: torch.Tensor | None) -> torch.Tensor | None:
        """K-wide draft logits -> target-vocab logits, -inf outside the keep-set.

        For consumers that need the full vocabulary (draft probabilities for
        probabilistic rejection sampling, a plain argmax over target ids).
        """
        if logits is None:  # non-driver TP rank after the gather
            return None
        full = logits.new_full((*logits.shape[:-1], self.vocab_size), float("-inf"))
        full.index_copy_(logits.dim() - 1, self._keep_ids_on_device, logits)
        return full
