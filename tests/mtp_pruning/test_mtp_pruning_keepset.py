"""The patch's machinery module (vllm/v1/spec_decode/draft_vocab.py) on its own: keep-set loading,
every validation rule, and the maps between draft rows and target ids. It imports only torch, so
it is loaded straight from the patched overlay without vLLM."""

from __future__ import annotations

import io
import re
import zipfile

import numpy as np
import pytest
import torch

from tests.mtp_pruning.pruning_helpers import MALFORMED_CASES, write_malformed_keep_sets

VOCAB = 4096


@pytest.fixture(scope="module")
def malformed(tmp_path_factory):
    return write_malformed_keep_sets(tmp_path_factory.mktemp("malformed"), VOCAB)


@pytest.mark.parametrize("case", MALFORMED_CASES)
def test_malformed_keep_set_is_refused_naming_file_and_rule(draft_vocab, malformed, case):
    path, message = malformed[case]
    with pytest.raises(draft_vocab.DraftVocabError) as info:
        draft_vocab.load_keep_ids(str(path), VOCAB)
    assert str(info.value).startswith(f"draft_vocab_path {path}: ")
    assert message in str(info.value)


def test_pickle_keep_set_runs_no_code(draft_vocab, malformed):
    path, _ = malformed["pickle"]
    marker = path.parent / "CODE-RAN"
    with pytest.raises(draft_vocab.DraftVocabError):
        draft_vocab.load_keep_ids(str(path), VOCAB)
    assert not marker.exists()
    # The file is a real attack: unrestricted unpickling does run it.
    torch.load(path, weights_only=False)
    assert marker.exists()
    marker.unlink()


def test_keep_set_formats_load_to_the_same_int64_ids(draft_vocab, tmp_path):
    from safetensors.torch import save_file

    ids = [0, 3, 17, 4095]
    torch.save(torch.tensor(ids, dtype=torch.int64), tmp_path / "keep.pt")
    np.save(tmp_path / "keep.npy", np.array(ids, dtype=np.int32))
    np.save(tmp_path / "keep-u16.npy", np.array(ids, dtype=np.uint16))
    save_file({"keep_ids": torch.tensor(ids, dtype=torch.int64)}, str(tmp_path / "keep.safetensors"))
    for name in ("keep.pt", "keep.npy", "keep-u16.npy", "keep.safetensors"):
        loaded = draft_vocab.load_keep_ids(str(tmp_path / name), VOCAB)
        assert loaded.dtype == torch.int64 and loaded.tolist() == ids, name


def test_a_uint64_keep_set_loads_like_int64(draft_vocab, tmp_path):
    from safetensors.torch import save_file

    ids = [0, 3, 17, 4095]
    np.save(tmp_path / "keep-u64.npy", np.array(ids, dtype=np.uint64))
    save_file({"keep_ids": torch.tensor(ids, dtype=torch.uint64)}, str(tmp_path / "keep-u64.safetensors"))
    torch.save(torch.tensor(ids, dtype=torch.uint64), tmp_path / "keep-u64.pt")
    for name in ("keep-u64.npy", "keep-u64.safetensors", "keep-u64.pt"):
        loaded = draft_vocab.load_keep_ids(str(tmp_path / name), VOCAB)
        assert loaded.dtype == torch.int64 and loaded.tolist() == ids, name


def test_a_keep_set_is_read_header_first_and_only_as_far_as_its_ids(draft_vocab, tmp_path):
    # A valid header followed by more bytes than it names: only the named ones are read.
    path = tmp_path / "keep.npy"
    np.save(path, np.array([2, 7], dtype=np.int64))
    with open(path, "ab") as f:
        f.write(b"\xff" * 4096)
    assert draft_vocab.load_keep_ids(str(path), VOCAB).tolist() == [2, 7]
    # A header that names more ids than the vocabulary has is refused before any data is read.
    np.save(path, np.arange(VOCAB + 1, dtype=np.int64))
    with pytest.raises(draft_vocab.DraftVocabError, match=f"holds {VOCAB + 1} ids .* more than the {VOCAB}"):
        draft_vocab.load_keep_ids(str(path), VOCAB)


def test_unknown_suffix_is_refused(draft_vocab, tmp_path):
    path = tmp_path / "keep.txt"
    path.write_text("1 2 3")
    with pytest.raises(draft_vocab.DraftVocabError, match=r"unsupported file type '.txt'; use one of .*\.json"):
        draft_vocab.load_keep_ids(str(path), VOCAB)


def test_a_json_list_of_ids_loads_sorted(draft_vocab, tmp_path):
    path = tmp_path / "keep.json"
    path.write_text("[4000, 7, 3]")  # as community recipes pass keep-sets around: unsorted
    ids = draft_vocab.load_keep_ids(str(path), VOCAB)
    assert ids.dtype == torch.int64 and ids.tolist() == [3, 7, 4000]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"ids": [1, 2]}', "holds a JSON object; a .json keep-set is a list of integer ids"),
        ("[1, 2.0]", "entry 1 is 2.0, not an integer id"),
        ("[1, true]", "entry 1 is True, not an integer id"),
        ("[1, 2", "is not valid JSON"),
        ("[1, 1]", "duplicate id 1"),
        ("[1, 4096]", "out of range"),
        ("[]", "is empty"),
    ],
)
def test_a_json_keep_set_that_is_not_a_list_of_ids_is_refused(draft_vocab, tmp_path, text, message):
    path = tmp_path / "keep.json"
    path.write_text(text)
    with pytest.raises(draft_vocab.DraftVocabError, match=f"draft_vocab_path {path}: .*{re.escape(message)}"):
        draft_vocab.load_keep_ids(str(path), VOCAB)


def test_a_pt_that_would_inflate_past_a_keep_set_is_refused_before_torch_load(draft_vocab, tmp_path, monkeypatch):
    # torch.save's entries recompressed with DEFLATE: 32 MiB of zeros in a file of about 33 KB.
    buffer = io.BytesIO()
    torch.save(torch.zeros(1 << 22, dtype=torch.int64), buffer)
    source = zipfile.ZipFile(io.BytesIO(buffer.getvalue()))
    path = tmp_path / "bomb.pt"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as out:
        for info in source.infolist():
            out.writestr(info.filename, source.read(info.filename))
    assert path.stat().st_size < 100_000  # under the file-size bound of a 4096-id keep-set

    def no_load(*args, **kwargs):
        raise AssertionError("torch.load was called")

    monkeypatch.setattr(torch, "load", no_load)  # the module's own torch: refused before loading
    with pytest.raises(draft_vocab.DraftVocabError, match="zip entries that inflate to .*it was not loaded"):
        draft_vocab.load_keep_ids(str(path), VOCAB)


def test_a_pt_that_is_not_a_zip_is_refused(draft_vocab, tmp_path):
    path = tmp_path / "legacy.pt"
    torch.save(torch.tensor([1, 2]), path, _use_new_zipfile_serialization=False)
    with pytest.raises(draft_vocab.DraftVocabError, match="not a zip-format torch.save file"):
        draft_vocab.load_keep_ids(str(path), VOCAB)


def test_d2t_offsets_map_draft_rows_to_target_ids(draft_vocab):
    keep = torch.tensor([2, 5, 6, 100])
    d2t = draft_vocab.draft_to_target_offsets(keep)
    assert d2t.tolist() == [2, 4, 4, 97]
    rows = torch.arange(4)
    assert (rows + d2t[rows]).tolist() == keep.tolist()
    vocab = draft_vocab.DraftVocab("keep.pt", keep, 128)
    assert vocab.to_target_ids(torch.tensor([3, 0, 1])).tolist() == [100, 2, 5]
    assert vocab.describe() == "MTP draft vocab pruned: 4 of 128 ids (3.12%), keep-set keep.pt"


def test_expanded_logits_argmax_equals_mapped_draft_argmax(draft_vocab):
    keep = torch.tensor([1, 7, 8, 30, 31, 63])
    vocab = draft_vocab.DraftVocab("keep.pt", keep, 64)
    draft_logits = torch.randn(5, keep.numel(), generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    full = vocab.expand_logits(draft_logits)
    assert full.shape == (5, 64) and full.dtype == torch.bfloat16
    outside = torch.ones(64, dtype=torch.bool)
    outside[keep] = False
    assert torch.isneginf(full[:, outside]).all()
    assert torch.equal(full[:, keep], draft_logits)
    assert torch.equal(full.argmax(-1), vocab.to_target_ids(draft_logits.argmax(-1)))
    assert vocab.expand_logits(None) is None
