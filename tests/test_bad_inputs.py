"""Ordinary mistakes given to the keep-set and analysis tools, run as users run them (`python3
magpie TOOL ...` in a subprocess, on real files): each answered with one line that names the input
and the fix and a non-zero exit, never a traceback; outputs that collide, ranges past the
vocabulary, a .pt that inflates, a log with no evidence, refused before any work."""

from __future__ import annotations

import gzip
import http.server
import io
import json
import os
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "magpie"
VOCAB = 4096


def magpie(*args, env=None, cwd=None, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(PACKAGE), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        cwd=cwd,
        env={**os.environ, **(env or {})},
    )


def max_rss_mib(*args) -> tuple[subprocess.CompletedProcess, float]:
    """Run `python3 magpie ARGS` as the only child of a fresh Python, and its peak RSS (MiB)."""
    probe = (
        "import resource, subprocess, sys\n"
        "p = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
        "sys.stdout.write(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss) + '\\n' + p.stderr)\n"
        "sys.exit(p.returncode)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe, sys.executable, str(PACKAGE), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    rss_kib, _, stderr = proc.stdout.partition("\n")
    return subprocess.CompletedProcess(proc.args, proc.returncode, "", stderr), int(rss_kib) / 1024


def assert_one_line(proc: subprocess.CompletedProcess, *words: str, codes=(1,)) -> str:
    """The run failed with `codes`, its stderr one line (no traceback) holding every one of `words`."""
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    if lines and lines[0].startswith("usage:"):  # argparse's usage block, then its one error line
        lines = lines[-1:]
    assert proc.returncode in codes, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    assert len(lines) == 1, proc.stderr
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


@pytest.fixture(scope="module")
def bad(tmp_path_factory) -> Path:
    """A folder of inputs, good and bad."""
    root = tmp_path_factory.mktemp("bad-inputs")
    counts = np.zeros(VOCAB, dtype=np.int64)
    counts[:100] = np.arange(100, 0, -1)
    np.save(root / "counts.npy", counts)
    np.save(root / "short.npy", counts[:10])
    (root / "cut.npy").write_bytes((root / "counts.npy").read_bytes()[:200])  # the header, then cut
    (root / "text.npy").write_text("not an array\n")
    (root / "trunc.json").write_text('{"records": [')
    (root / "list.json").write_text("[1, 2]\n")
    (root / "gsm8k.jsonl").write_text('{"question": "1+1?", "answer": "#### 2"}\n')
    (root / "events.json").write_text('{"traceEvents": [1, 2]}')
    (root / "huge-header").mkdir()  # a safetensors header claiming 1 TiB
    (root / "huge-header" / "model.safetensors").write_bytes((1 << 40).to_bytes(8, "little") + b"{}")
    (root / "cut-header").mkdir()
    (root / "cut-header" / "model.safetensors").write_bytes(b"abc")
    (root / "folder").mkdir()
    (root / "model").mkdir()
    (root / "model" / "config.json").write_text(json.dumps({"vocab_size": VOCAB}))
    (root / "model-trunc").mkdir()
    (root / "model-trunc" / "config.json").write_text('{"vocab_size": 40')
    (root / "model-list").mkdir()
    (root / "model-list" / "config.json").write_text("[4096]")
    (root / "trace.json.gz").write_bytes(gzip.compress(b'{"traceEvents": [')[:-12])
    (root / "random.log").write_bytes(np.random.default_rng(7).bytes(1 << 20))
    # A .pt of 4M int64 zeros (32 MiB), its entries recompressed with DEFLATE: a 33 KB file.
    buffer = io.BytesIO()
    torch.save(torch.zeros(1 << 22, dtype=torch.int64), buffer)
    source = zipfile.ZipFile(io.BytesIO(buffer.getvalue()))
    with zipfile.ZipFile(root / "bomb.pt", "w", zipfile.ZIP_DEFLATED) as out:
        for info in source.infolist():
            out.writestr(info.filename, source.read(info.filename))
    (root / "ids.json").write_text("[4000, 7, 3]\n")
    (root / "ids-object.json").write_text('{"ids": [1, 2]}\n')
    return root


KEEPSET = ("build-keepset", "--no-special-ids", "-o")

# (case, arguments with {d} for the folder of inputs, words the one line holds, exit codes)
CASES = [
    ("keepset-missing-counts", [*KEEPSET, "{d}/k1.npy", "{d}/nope.npy"], ["nope.npy", "no such file"], (1,)),
    ("keepset-folder-counts", [*KEEPSET, "{d}/k1.npy", "{d}/folder"], ["folder", "is a folder"], (1,)),
    ("keepset-text-counts", [*KEEPSET, "{d}/k1.npy", "{d}/text.npy"], ["text.npy", "not a counts .npy"], (1,)),
    ("keepset-cut-counts", [*KEEPSET, "{d}/k1.npy", "{d}/cut.npy"], ["cut.npy", "not a counts .npy"], (1,)),
    ("keepset-sizes-differ", [*KEEPSET, "{d}/k1.npy", "{d}/counts.npy", "{d}/short.npy"], ["short.npy", "slots"], (2,)),
    ("keepset-model-cut-json", [*KEEPSET, "{d}/k1.npy", "{d}/counts.npy", "--model", "{d}/model-trunc"],
     ["config.json", "not valid JSON"], (1,)),
    ("keepset-model-list-json", [*KEEPSET, "{d}/k1.npy", "{d}/counts.npy", "--model", "{d}/model-list"],
     ["config.json", "an array, not an object"], (1,)),
    ("keepset-holdout-size", [*KEEPSET, "{d}/k1.npy", "{d}/counts.npy", "--holdout", "{d}/short.npy"],
     ["--holdout", "short.npy", "slots"], (1,)),
    ("keepset-union-cut-json", [*KEEPSET, "{d}/k1.npy", "{d}/counts.npy", "--union", "{d}/trunc.json"],
     ["trunc.json", "JSON"], (1,)),
    ("keepset-output-under-file", [*KEEPSET, "{d}/text.npy/k.npy", "{d}/counts.npy"],
     ["text.npy", "not a folder"], (1,)),
    ("count-tokens-add-to-size", ["count-tokens", "{d}/list.json", "-o", "{d}/c.npy", "--vocab-size", "4096",
     "--add-to", "{d}/short.npy", "--tokenizer", "{d}/nope-tokenizer", "--quiet"],
     ["--add-to", "short.npy", "slots"], (1,)),
    ("log-check-missing", ["log-check", "{d}/nope.log"], ["nope.log", "no such file"], (1,)),
    ("log-check-folder", ["log-check", "{d}/folder"], ["folder", "is a folder"], (1,)),
    ("trace-split-cut-gzip", ["trace-split", "{d}/trace.json.gz"], ["trace.json.gz"], (1, 2)),
    ("trace-split-events-not-objects", ["trace-split", "{d}/events.json"], ["events.json", "not an object"], (2,)),
    ("trace-split-empty-folder", ["trace-split", "{d}/folder"], ["no .json", "folder"], (2,)),
    ("ple-warmup-huge-header", ["ple-warmup", "status", "{d}/huge-header"], ["model.safetensors"], (1, 2)),
    ("ple-warmup-cut-header", ["ple-warmup", "status", "{d}/cut-header"], ["model.safetensors"], (1, 2)),
    ("trace-split-missing", ["trace-split", "{d}/nope.json"], ["nope.json"], (1, 2)),
    ("gsm8k-missing-dataset", ["gsm8k", "--url", "http://127.0.0.1:9", "--dataset", "{d}/nope.jsonl"],
     ["nope.jsonl", "no such file"], (1,)),
    ("gsm8k-folder-dataset", ["gsm8k", "--url", "http://127.0.0.1:9", "--dataset", "{d}/folder"],
     ["folder"], (1,)),
    ("gsm8k-url-without-scheme", ["gsm8k", "--url", "127.0.0.1:9", "--dataset", "{d}/gsm8k.jsonl"],
     ["--url", "http://127.0.0.1:9"], (2,)),
    ("fit-keepset-missing-model", ["fit-keepset", "{d}/list.json", "--model", "{d}/nope", "-o", "{d}/f.npy"],
     ["--model", "nope", "no such folder"], (1,)),
    ("bench-pruned-missing-keepset", ["bench-pruned", "--model", "{d}/model", "--keepset", "{d}/nope.npy",
     "--log-dir", "{d}/logs-a"], ["--keepset", "nope.npy", "no such file"], (1,)),
    ("bench-pruned-bad-keepset", ["bench-pruned", "--model", "{d}/model", "--keepset", "{d}/ids-object.json",
     "--log-dir", "{d}/logs-b"], ["--keepset", "ids-object.json", "list of integer ids"], (1,)),
    ("bench-pruned-cut-prompts", ["bench-pruned", "--model", "{d}/model", "--keepset", "{d}/ids.json",
     "--prompts", "{d}/trunc.json", "--log-dir", "{d}/logs-c"], ["--prompts", "trunc.json", "not JSON"], (1,)),
]  # fmt: skip


@pytest.mark.parametrize(("args", "words", "codes"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_an_ordinary_mistake_is_one_line_naming_the_input(bad, args, words, codes):
    proc = magpie(*(a.format(d=bad) for a in args))
    assert_one_line(proc, *words, codes=codes)
    assert not any((bad / name).exists() for name in ("k1.npy", "c.npy", "f.npy"))  # nothing written
    for logs in ("logs-a", "logs-b", "logs-c"):  # bench-pruned started no server: no server log
        assert not list((bad / logs).glob("*.log")) if (bad / logs).exists() else True


def test_the_traceback_is_shown_when_asked_for(bad):
    proc = magpie(*KEEPSET, bad / "k1.npy", bad / "folder", env={"MAGPIE_TRACEBACK": "1"})
    assert proc.returncode == 1 and "Traceback" in proc.stderr and "InputError" in proc.stderr


def test_a_console_script_entry_point_runs_under_the_same_runner(bad):
    code = "import sys; from magpie.__main__ import console_log_check as c; sys.argv[0] = 'magpie-log-check'; c()"
    proc = subprocess.run(
        [sys.executable, "-c", code, str(bad / "folder")], capture_output=True, text=True, cwd=REPO, check=False
    )
    assert_one_line(proc, "magpie log-check", "folder", "is a folder")


# ------------------------------------------------------------------ outputs that collide
def test_build_keepset_refuses_outputs_that_are_one_file(bad, tmp_path):
    proc = magpie(*KEEPSET, tmp_path / "keep.npy", bad / "counts.npy", "--summary", tmp_path / "keep.npy")
    assert_one_line(proc, "--output and --summary", "keep.npy")
    assert not (tmp_path / "keep.npy").exists()
    (tmp_path / "link.npy").symlink_to(tmp_path / "keep.npy")  # one file by another name
    proc = magpie(*KEEPSET, tmp_path / "keep.npy", bad / "counts.npy", "--summary", tmp_path / "link.npy")
    assert_one_line(proc, "--output and --summary")


def test_build_keepset_refuses_an_output_that_is_its_input_even_with_force(bad, tmp_path):
    counts = tmp_path / "counts.npy"
    counts.write_bytes((bad / "counts.npy").read_bytes())
    before = counts.read_bytes()
    proc = magpie(*KEEPSET, counts, counts, "--force")
    assert_one_line(proc, "--output", "is also the input counts")
    assert counts.read_bytes() == before


# ------------------------------------------------------------------ bounded before materialised
def test_extra_ids_past_the_vocabulary_are_refused_before_any_array_is_built(bad, tmp_path):
    proc, rss = max_rss_mib(*KEEPSET, tmp_path / "k.npy", bad / "counts.npy", "--extra-ids", "0-30000000")
    assert_one_line(proc, "--extra-ids", "0-30000000", f"[0, {VOCAB})")
    assert rss < 400, rss  # the old code built 30M Python ints first: 3.4 GB
    assert not (tmp_path / "k.npy").exists()


def test_a_pt_that_inflates_past_a_keep_set_is_refused_unloaded(bad, tmp_path):
    assert (bad / "bomb.pt").stat().st_size < 100_000
    proc = magpie(*KEEPSET, tmp_path / "k.npy", bad / "counts.npy", "--union", bad / "bomb.pt")
    line = assert_one_line(proc, "bomb.pt", "inflate", "not loaded")
    assert "holds 4194304 ids" not in line  # the old check, after torch.load had inflated it


def test_a_json_list_of_ids_is_a_keep_set(bad, tmp_path):
    out = tmp_path / "k.npy"
    proc = magpie(*KEEPSET, out, bad / "counts.npy", "--union", bad / "ids.json", "--coverage", "0.01")
    assert proc.returncode == 0, proc.stderr
    keep = np.load(out)
    assert {3, 7, 4000} <= set(keep.tolist()) and list(keep) == sorted(keep)


# ------------------------------------------------------------------ log-check
def test_log_check_concludes_nothing_from_no_evidence(bad):
    proc = magpie("log-check", bad / "random.log", "--expect", "ple_mmap=off")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "ple_mmap: expected off" in proc.stderr and "no evidence" in proc.stderr, proc.stderr
    result = json.loads(magpie("log-check", bad / "random.log", "--json").stdout)
    assert result["features"]["ple_mmap"]["state"] == "unknown"


def test_log_check_streams_a_large_log(tmp_path):
    log = tmp_path / "one-line.log"
    with open(log, "wb") as f:  # 64 MiB without a line break: read whole, 3x that at least
        for _ in range(64):
            f.write(b"x" * (1 << 20))
    proc, rss = max_rss_mib("log-check", log)
    assert proc.returncode == 0, proc.stderr
    assert rss < 120, rss


class _Server(http.server.BaseHTTPRequestHandler):
    """/health answers; /v1/models answers with what the test put in `models`."""

    models = b""

    def do_GET(self):
        body = b"ok" if self.path == "/health" else self.models
        self.send_response(200 if self.path in ("/health", "/v1/models") else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("models", [b"<html>not vLLM</html>", b'{"data": []}', b"[1]"], ids=["html", "empty", "list"])
def test_gsm8k_names_the_server_when_v1_models_lists_no_model(bad, models):
    handler = type("Handler", (_Server,), {"models": models})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        proc = magpie("gsm8k", "--url", url, "--dataset", bad / "gsm8k.jsonl")
        line = assert_one_line(proc, f"{url}/v1/models lists no model", codes=(2,))
        assert "gsm8k.jsonl" not in line  # the dataset was fine: the server's reply was not
    finally:
        server.shutdown()
