"""Each release's draft_vocab module as its series ships it (0001's new file with 0002's
additions), on the CPU torch, without vLLM: the quantized pruned head's swap and its refusals, for
every series release with 0002 (0.33.0, 0.34.0, ...). The rest of the module is the 0.29 one,
tested in tests/mtp_pruning."""

from __future__ import annotations

import pytest
import torch

from tests.release_python.tree import PYTHON_RELEASES, series_of

MODULE = "vllm/v1/spec_decode/draft_vocab.py"


def _load_tool():
    from magpie import patches

    return patches


@pytest.fixture(scope="module", params=PYTHON_RELEASES)
def draft_vocab(request, tmp_path_factory):
    """The module as the release's whole series leaves it, imported from the patch files themselves."""
    release = request.param
    tool = _load_tool()
    text = None
    for name in ("mtp_pruning/0001-draft-vocab-pruning.patch", "mtp_pruning/0002-quantized-pruned-head.patch"):
        patch = tool.parse_patch(name, (series_of(release) / name).read_text())
        for fp in patch.files:
            if fp.path == MODULE:
                text = tool.apply_file(fp, text, reverse=False)
    module = f"draft_vocab_{release.replace('.', '_')}"
    path = tmp_path_factory.mktemp(module) / f"{module}.py"
    path.write_text(text)
    return tool.load_file(path, module)


class Head(torch.nn.Module):
    """The attributes of a ParallelLMHead the module reads (rows, shard range, weight)."""

    def __init__(self, rows: int, width: int, padded: int | None = None):
        super().__init__()
        self.org_vocab_size = rows
        self.weight = torch.nn.Parameter(torch.zeros(padded or rows, width), requires_grad=False)
        self.shard_indices = type("Shard", (), {"org_vocab_start_index": 0, "org_vocab_end_index": rows})()


def quantize_fp8_rows(head: Head, method: str) -> torch.nn.Module:
    """A per-row fp8 (e4m3) copy of `head`, the scheme of vLLM's "fp8" lm_head copy."""
    assert method == "fp8"
    weight = head.weight.data.float()
    scale = weight.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / torch.finfo(torch.float8_e4m3fn).max
    copy = Head(head.org_vocab_size, weight.shape[1], weight.shape[0])
    copy.weight = torch.nn.Parameter((weight / scale).to(torch.float8_e4m3fn), requires_grad=False)
    copy.register_buffer("weight_scale", scale)
    copy.source = [head]  # a list: not a submodule
    return copy


def build(draft_vocab, vocab=1000, width=32, keep=None):
    keep = torch.arange(3, vocab, 7) if keep is None else keep
    vocab_obj = draft_vocab.DraftVocab("/abs/keep.pt", keep, vocab)
    model = torch.nn.Module()
    model.lm_head = Head(vocab_obj.num_keep, width, padded=vocab_obj.num_keep + 5)
    vocab_obj.attach(model, model.lm_head)
    full = torch.randn(vocab, width, generator=torch.Generator().manual_seed(0))
    model.lm_head.weight.weight_loader(model.lm_head.weight, full)
    return vocab_obj, model, full, keep


def test_quantize_head_swaps_in_the_quantized_k_rows(draft_vocab):
    vocab, model, full, keep = build(draft_vocab)
    source = model.lm_head
    vocab.quantize_head(model, quantize_fp8_rows, "fp8")
    head = model.lm_head
    assert head is not source and head.source[0] is source and vocab.quantization == "fp8"
    assert head.weight.dtype == torch.float8_e4m3fn and head.org_vocab_size == keep.numel()
    # The quantized rows are the kept checkpoint rows (within fp8's precision), padding stays 0.
    dequantized = head.weight.float() * head.weight_scale
    assert torch.allclose(dequantized[: keep.numel()], full[keep], rtol=0.07, atol=1e-3)
    assert (dequantized[keep.numel() :] == 0).all()
    # The head in use is the quantized one now: confirm_head accepts it, once.
    vocab.confirm_head(model)
    # Draft argmax over the quantized rows maps to target ids of the keep-set (d2t).
    hidden = torch.randn(4, full.shape[1], generator=torch.Generator().manual_seed(1))
    best = (hidden @ dequantized[: keep.numel()].T).argmax(dim=-1)
    assert torch.equal(best + model.draft_id_to_target_id[best], keep[best])


def test_quantize_head_refuses_before_the_rows_are_loaded(draft_vocab):
    keep = torch.arange(0, 100, 2)
    vocab = draft_vocab.DraftVocab("/abs/keep.pt", keep, 100)
    model = torch.nn.Module()
    model.lm_head = Head(vocab.num_keep, 8)
    vocab.attach(model, model.lm_head)
    with pytest.raises(RuntimeError, match="quantized after its rows are loaded"):
        vocab.quantize_head(model, quantize_fp8_rows, "fp8")


def test_quantize_head_refuses_a_head_that_is_not_the_pruned_one(draft_vocab):
    vocab, model, _, _ = build(draft_vocab)
    model.lm_head = Head(1000, 32)  # e.g. the target's full head put in its place
    with pytest.raises(RuntimeError, match="not the pruned head any more"):
        vocab.quantize_head(model, quantize_fp8_rows, "fp8")


def test_quantize_head_refuses_a_copy_with_other_rows(draft_vocab):
    vocab, model, _, _ = build(draft_vocab)
    with pytest.raises(RuntimeError, match=r"quantized head has 7 rows, the keep-set 143"):
        vocab.quantize_head(model, lambda head, method: Head(7, 32), "fp8")


def test_without_a_pruned_head_there_is_nothing_to_quantize(draft_vocab):
    vocab = draft_vocab.DraftVocab("/abs/keep.pt", torch.arange(10), 100)
    with pytest.raises(RuntimeError, match="no pruned head on this rank"):
        vocab.quantize_head(torch.nn.Module(), quantize_fp8_rows, "fp8")
