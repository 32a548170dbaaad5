"""magpie/mtp_pruning/bench_draft_head.py without a GPU: its arguments, the H200 command in its
docstring, the fp8 arithmetic of vLLM 0.33's fp8 head copy against a float reference, and every
timed path run for real on the CPU (torch's CPU `_scaled_mm` takes the same row-wise scales)."""

from __future__ import annotations

import importlib
import shlex
import statistics
import time

import pytest
import torch

from magpie import files

FP8_MAX = 448.0


@pytest.fixture(scope="module")
def bench():
    return importlib.import_module("magpie.mtp_pruning.bench_draft_head")


def test_docstring_has_one_h200_command_that_parses(bench):
    lines = [line for line in bench.__doc__.splitlines() if line.startswith("H200: ")]
    assert len(lines) == 1
    argv = shlex.split(lines[0][len("H200: ") :])
    assert argv[:3] == ["python3", "magpie", "bench-draft-head"]
    args = bench.build_parser().parse_args(argv[3:])
    assert args.output.startswith("$OUT/") and args.output.endswith(".json")
    args.output = None  # $OUT exists only on the GPU machine
    assert bench.check_args(args) is None


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--keep", "248320"], "--keep 248320: a keep-set size must lie in [1, --vocab-size 248320)"),
        (["--keep", "0"], "--keep 0: a keep-set size must lie in"),
        (["--batch", "0"], "--batch [0]: batch sizes must be at least 1"),
        (["--hidden-size", "100"], "a hidden size that is a multiple of 16"),
        (["--vocab-size", "1000"], "--vocab-size 1000: the fp8 GEMM needs a multiple of 16 rows"),
        (["--patch", "/nonexistent.patch"], "--patch /nonexistent.patch: no such file"),
        (["--output", "/nonexistent-dir/x.json"], "--output /nonexistent-dir/x.json: folder /nonexistent-dir does not"),
    ],
)
def test_bad_arguments_are_refused_naming_the_option(bench, capsys, argv, message):
    assert bench.main(argv) == 2
    assert message in capsys.readouterr().err


def test_without_a_gpu_it_says_so(bench, capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert bench.main([]) == 2
    assert "error: needs a CUDA GPU" in capsys.readouterr().err


def test_row_quantization_matches_the_float_reference(bench):
    weight = (torch.randn(96, 64, generator=torch.Generator().manual_seed(1)) * 0.02).to(torch.bfloat16)
    weight[5] = 0  # a padding row
    weight[7] *= 1e-6  # a row whose scale would fall under vLLM's minimum
    q, scale = bench.quantize_rows(weight)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (96, 1) and scale.dtype == torch.float32
    w = weight.double()
    amax = w.abs().amax(-1, keepdim=True)
    expected_scale = torch.clamp(amax / FP8_MAX, min=1 / (FP8_MAX * 512))
    torch.testing.assert_close(scale.double(), expected_scale, rtol=1e-7, atol=0)
    assert torch.equal(q[5].float(), torch.zeros(64)) and float(scale[5]) == pytest.approx(1 / (FP8_MAX * 512))
    # Each value is the nearest e4m3 value of w / scale: within half a step (2^-4 relative, 2^-10 subnormal).
    scaled = w / scale.double()
    error = (q.double() - scaled).abs()
    assert bool((error <= scaled.abs() * 2.0**-4 + 2.0**-10).all())
    full_rows = [r for r in range(96) if r not in (5, 7)]
    assert torch.equal(q.float().abs().amax(-1)[full_rows], torch.full((94,), FP8_MAX))  # amax maps to 448


def test_pruned_rows_quantize_to_the_full_heads_kept_rows(bench):
    full = (torch.randn(512, 32, generator=torch.Generator().manual_seed(2)) * 0.02).to(torch.bfloat16)
    keep = torch.tensor([3, 10, 11, 200, 511])
    q_full, s_full = bench.quantize_rows(full)
    q_kept, s_kept = bench.quantize_rows(full[keep])
    assert torch.equal(q_kept.float(), q_full[keep].float()) and torch.equal(s_kept, s_full[keep])


def test_token_quantization_matches_the_float_reference(bench):
    hidden = torch.randn(5, 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    hidden[2] = 0
    q, scale = bench.quantize_tokens(hidden, torch.tensor(FP8_MAX))
    x = hidden.double()
    expected_scale = torch.clamp(x.abs().amax(-1, keepdim=True) / FP8_MAX, min=1 / (FP8_MAX * 512))
    torch.testing.assert_close(scale.double(), expected_scale, rtol=1e-7, atol=0)
    scaled = x / scale.double()
    assert bool(((q.double() - scaled).abs() <= scaled.abs() * 2.0**-4 + 2.0**-10).all())


def test_fp8_logits_approximate_the_bf16_logits_and_equal_the_exact_fp8_products(bench):
    generator = torch.Generator().manual_seed(4)
    weight = (torch.randn(256, 64, generator=generator) * 0.02).to(torch.bfloat16)
    hidden = torch.randn(3, 64, generator=generator).to(torch.bfloat16)
    head = bench.Fp8Head(weight)
    q_h, s_h = bench.quantize_tokens(hidden, torch.tensor(FP8_MAX))
    got = bench.fp8_matmul(q_h, s_h, head.q, head.scale_row)
    assert got.dtype == torch.bfloat16 and got.shape == (3, 256)
    exact = bench.fp8_reference_logits(q_h, s_h, head.q, head.scale)
    torch.testing.assert_close(got.double(), exact, rtol=2**-7, atol=1e-6)  # bf16 rounding of the output
    bf16 = hidden.double() @ weight.double().T
    relative = (exact - bf16).norm() / bf16.norm()
    assert relative < 0.05, f"fp8 logits {relative:.3f} off the bf16 ones"


def cpu_timer(steps, replays, trials):
    """Runs each step for real (eager, on the CPU), timed with perf_counter."""
    results = []
    for _ in range(trials):
        start = time.perf_counter()
        for i in range(replays):
            steps[i % len(steps)]()
        results.append((time.perf_counter() - start) * 1000 / replays)
    return statistics.median(results), statistics.median(results)


def test_every_path_runs_checks_and_lands_in_the_summary_on_cpu(bench):
    argv = ["--vocab-size", "4096", "--hidden-size", "64", "--keep", "100", "1000", "--batch", "1", "3"]
    args = bench.build_parser().parse_args(
        argv + ["--replays", "4", "--trials", "1", "--cold-bytes", "2e5", "--no-fused"]
    )
    assert bench.check_args(args) is None
    result = bench.measure(args, torch.device("cpu"), cpu_timer)
    assert result["schema"] == "magpie/bench-draft-head/2" and files.schema_of(result["schema"]) == (
        "bench-draft-head",
        2,
    )
    assert list(result) == [
        "schema",
        "device",
        "torch",
        "settings",
        "fp8_batch_rows",
        "fp8_gemm",
        "fused_quant",
        "fp8_error",
        "seconds",
        "check",
        "summary",
        "failures",
        "records",
    ]
    assert result["fp8_error"] is None and result["failures"] == []
    timed = {(r["path"], r["rows"], r["batch"]) for r in result["records"]}
    for batch in (1, 3):
        for path in ("full", "full-gemv", "full-fp8", "full-fp8-gemm"):
            assert (path, 4096, batch) in timed
        for k in (100, 1000):
            for path in ("pruned-argmax", "pruned-full-vocab", "pruned-gemv", "pruned-fp8-argmax", "pruned-fp8-gemm"):
                assert (path, k, batch) in timed
        assert ("act-quant", None, batch) in timed
    pruned_fp8 = next(r for r in result["records"] if r["path"] == "pruned-fp8-argmax" and r["rows"] == 100)
    assert pruned_fp8["padded_rows"] == 128 and pruned_fp8["dtype"] == "fp8" and pruned_fp8["weight_copies"] > 1
    assert pruned_fp8["weight_gb"] == pytest.approx((128 * 64 + 128 * 4) / 1e9)
    assert len(result["summary"]) == 4
    entry = next(e for e in result["summary"] if e["keep"] == 1000 and e["batch"] == 3)
    assert set(entry["ms"]) == {"full bf16", "full fp8 (eager quant)", "pruned bf16", "pruned fp8 (eager quant)"}
    by_path = {(r["path"], r["rows"], r["batch"]): r["graph_ms"] for r in result["records"]}
    expected = by_path[("full-fp8", 4096, 3)] / by_path[("pruned-argmax", 1000, 3)]
    assert entry["ratios"]["full fp8 (eager quant) / pruned bf16"] == pytest.approx(expected)
    assert entry["ratios"]["full fp8 (fused quant) / pruned bf16"] is None  # fused variants skipped


def test_a_wrong_post_processing_fails_the_check_before_timing(bench, monkeypatch):
    """The pre-timing check catches a pruned path whose ids are not the target ids."""
    real = bench.make_step

    def off_by_one(path, *args, **kwargs):
        step = real(path, *args, **kwargs)
        return (lambda: step() + 1) if path == "pruned-fp8-argmax" else step

    monkeypatch.setattr(bench, "make_step", off_by_one)
    args = bench.build_parser().parse_args(
        ["--vocab-size", "1024", "--hidden-size", "32", "--keep", "50", "--no-fused"]
    )
    with pytest.raises(bench.BenchCheckFailed, match="pruned-fp8-argmax ids"):
        bench.measure(args, torch.device("cpu"), cpu_timer)


def test_a_gpu_that_refuses_fp8_still_gets_the_bf16_paths_timed(bench, monkeypatch):
    """An fp8 GEMM the machine refuses (old GPU, torch without it) skips the fp8 paths, says why, and times the rest."""

    def refuse(*args, **kwargs):
        raise RuntimeError("_scaled_mm is not supported on this device")

    monkeypatch.setattr(bench, "fp8_matmul", refuse)
    args = bench.build_parser().parse_args(
        [
            "--vocab-size",
            "1024",
            "--hidden-size",
            "32",
            "--keep",
            "50",
            "--batch",
            "2",
            "--replays",
            "4",
            "--trials",
            "1",
        ]
        + ["--no-fused"]
    )
    result = bench.measure(args, torch.device("cpu"), cpu_timer)
    assert "_scaled_mm is not supported on this device" in result["fp8_error"]
    assert result["fp8_batch_rows"] == 16  # the padded batch was tried too
    paths = {r["path"] for r in result["records"]}
    assert paths == {"full", "full-gemv", "pruned-argmax", "pruned-full-vocab", "pruned-gemv"}
    assert set(result["summary"][0]["ms"]) == {"full bf16", "pruned bf16"}
