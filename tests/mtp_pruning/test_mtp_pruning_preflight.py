"""serve.sh's preflight (magpie/serving/preflight.py) on keep-sets, against a vLLM with the mtp_pruning
patch: it refuses what the server would refuse (naming the file and the rule), and a keep-set of
every id, before the ~10-minute weight load. The keep-set rules exist once, in the patch's
draft_vocab.py: the copy this checkout's patch creates (what tools use away from a server) is
the installed patched vLLM's, and refuses the same files with the same words."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from magpie.demo.demo_overlay import vllm_env
from magpie.serving import preflight
from tests.mtp_pruning.pruning_helpers import run_script, write_malformed_keep_sets

PACKAGE = Path(__file__).resolve().parent.parent.parent / "magpie"
VOCAB = 4096


def preflight_command(model, keep) -> list[str]:
    return [
        sys.executable,
        str(PACKAGE),
        "preflight",
        "--model",
        str(model),
        "--draft-vocab-path",
        str(keep),
        "--jit-check",
        "0",
    ]


def run_preflight(overlay, model, keep) -> subprocess.CompletedProcess:
    cmd = preflight_command(model, keep)
    return subprocess.run(cmd, env=vllm_env(overlay), capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def keep_sets(tmp_path_factory):
    return write_malformed_keep_sets(tmp_path_factory.mktemp("preflight-keep-sets"), VOCAB)


def test_preflight_refuses_a_keep_set_of_every_id(pruning_overlay, tiny_mtp_model, keep_sets):
    path, _ = keep_sets["identity"]
    proc = run_preflight(pruning_overlay, tiny_mtp_model, path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"DRAFT_VOCAB_PATH {path}: keeps all {VOCAB} ids of {tiny_mtp_model}'s vocabulary" in proc.stderr
    assert "unset DRAFT_VOCAB_PATH to draft with the full head" in proc.stderr


@pytest.mark.parametrize("case", ["duplicate", "out_of_range", "float", "missing", "pickle", "safetensors_no_offsets"])
def test_preflight_refuses_what_the_server_refuses_naming_file_and_rule(
    pruning_overlay, tiny_mtp_model, keep_sets, case
):
    path, message = keep_sets[case]
    proc = run_preflight(pruning_overlay, tiny_mtp_model, path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"serve.sh: refusing to start: DRAFT_VOCAB_PATH: draft_vocab_path {path}: " in proc.stderr
    assert message in proc.stderr
    assert not (path.parent / "CODE-RAN").exists()


@pytest.mark.parametrize(
    "case", ["npy_empty_descr", "npy_short", "npy_recursive", "safetensors_list_dtype", "sparse_pt", "uint64_huge"]
)
def test_preflight_refuses_once_crashing_files_with_one_line_naming_file_and_rule(
    pruning_overlay, tiny_mtp_model, keep_sets, case
):
    path, message = keep_sets[case]
    proc = run_preflight(pruning_overlay, tiny_mtp_model, path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert f"serve.sh: refusing to start: DRAFT_VOCAB_PATH: draft_vocab_path {path}: " in proc.stderr
    assert message in proc.stderr


def test_preflight_refuses_a_keep_set_claiming_gigabytes_without_reading_it(pruning_overlay, tiny_mtp_model, keep_sets):
    path, message = keep_sets["npy_huge"]
    assert path.stat().st_size > 2 << 30  # holes: what a reader that reads it all would load
    measured = [sys.executable, "-c", RSS_OF_CHILD, *preflight_command(tiny_mtp_model, path)]
    proc = subprocess.run(measured, env=vllm_env(pruning_overlay), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert message in proc.stderr and "more than the 4096 a keep-set can hold" in proc.stderr
    peak_kib = int(proc.stdout.rsplit("MAXRSS ", 1)[1])
    assert peak_kib < 1 << 20, f"preflight peaked at {peak_kib} KiB"  # torch alone is ~0.4 GiB; the file 2 GiB


# The peak resident memory of the command in argv (ru_maxrss of the waited-for children, KiB).
RSS_OF_CHILD = """
import resource, subprocess, sys
status = subprocess.run(sys.argv[1:]).returncode
print("MAXRSS", resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
sys.exit(status)
"""


def test_preflight_accepts_a_keep_set_one_short_of_every_id(pruning_overlay, tiny_mtp_model, tmp_path):
    path = tmp_path / "keep.npy"
    np.save(path, np.arange(1, VOCAB, dtype=np.int64))
    proc = run_preflight(pruning_overlay, tiny_mtp_model, path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"# keep-set: {path}: {VOCAB - 1} ids (99.98% of {VOCAB}), range [1, {VOCAB - 1}]" in proc.stdout


def test_preflight_refuses_a_relative_keep_set_path(pruning_overlay, tiny_mtp_model):
    proc = run_preflight(pruning_overlay, tiny_mtp_model, "keep.npy")
    assert proc.returncode == 1
    assert "DRAFT_VOCAB_PATH 'keep.npy' is relative; give an absolute path" in proc.stderr


def test_the_shipped_keep_set_rules_are_the_installed_patchs_and_refuse_the_same_files(pruning_overlay, keep_sets):
    installed = preflight.draft_vocab_module(str(pruning_overlay / "vllm"))
    shipped = preflight.shipped_draft_vocab_module()
    assert Path(shipped.__file__).read_text() == Path(installed.__file__).read_text()
    for case, (path, message) in keep_sets.items():
        refusals = []
        for module in (installed, shipped):
            with pytest.raises(preflight.Refused) as refused:
                preflight.read_keep_ids(str(path), VOCAB, module=module)
            refusals.append(str(refused.value))
        assert refusals[0] == refusals[1], case
        assert refusals[0].startswith(f"draft_vocab_path {path}: ") and message in refusals[0], case
    assert not (next(iter(keep_sets.values()))[0].parent / "CODE-RAN").exists()
    good = Path(next(iter(keep_sets.values()))[0].parent / "good.npy")
    np.save(good, np.array([2, 5, VOCAB - 1], dtype=np.int64))
    assert preflight.read_keep_ids(str(good), VOCAB).tolist() == [2, 5, VOCAB - 1]
    # Without a vocabulary size (a keep-set merged into another, build-keepset --union), every
    # rule but the upper bound still holds.
    np.save(good, np.array([2, 5, 10 * VOCAB], dtype=np.int64))
    assert preflight.read_keep_ids(str(good)).tolist() == [2, 5, 10 * VOCAB]


@pytest.mark.parametrize("case", ["unsorted", "duplicate", "float", "two_d", "pickle", "safetensors_no_offsets"])
def test_build_keepset_union_refuses_what_the_server_refuses_for_the_same_reason(
    pruning_overlay, keep_sets, tmp_path, case
):
    path, message = keep_sets[case]
    with pytest.raises(preflight.Refused) as server:  # the patched vLLM's own rules
        preflight.read_keep_ids(str(path), VOCAB, preflight.draft_vocab_module(str(pruning_overlay / "vllm")))
    counts = np.zeros(VOCAB, dtype=np.int64)
    counts[[10, 11]] = [3, 1]
    np.save(tmp_path / "counts.npy", counts)
    out = tmp_path / "keep.npy"
    status, _, err = run_script(
        "build_keepset", tmp_path / "counts.npy", "-o", out, "--no-special-ids", "--union", path
    )
    assert status == 1 and not out.exists()
    assert err.strip() == f"error: --union: {server.value}" and message in err
    assert not (path.parent / "CODE-RAN").exists()


@pytest.mark.parametrize(
    "text, needle",
    [("{not json", "not readable as JSON"), ("[1, 2]", "expected a JSON object"), ('{"text_config": 3}', "object")],
)
def test_preflight_alone_refuses_a_malformed_config_json_in_one_line(pruning_overlay, tmp_path, text, needle):
    """Issue 21 item 11, preflight run on its own (serve.sh's launch plan refuses first): a broken
    config.json is one line naming the file, exit 1, no traceback."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(text)
    keep = tmp_path / "keep.npy"
    keep.write_bytes(b"")
    proc = run_preflight(pruning_overlay, model, keep)
    assert proc.returncode == 1, proc.stderr
    assert f"{model / 'config.json'}: " in proc.stderr and needle in proc.stderr
    assert "Traceback" not in proc.stderr
