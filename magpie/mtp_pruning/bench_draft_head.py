#!/usr/bin/env python3
"""Time one MTP draft step's head on a GPU, under CUDA-graph replay: the four draft-head paths.

Per draft token, the full head is a 248,320 x 2560 GEMV (1.27 GB in bf16). Two ways to make it
cheaper: vLLM 0.33's `draft_lm_head_quantization: "fp8"` (the drafter's copy of the shared head
in fp8, half the bytes) and this project's draft-vocab pruning (K rows instead of V), and the
two composed (the pruned rows quantized). One run times the four side by side, at each batch
size, each with the post-processing it ships:

- `full` (stock, bf16): F.linear over all V rows, argmax over V;
- `full-fp8` (vLLM 0.33, fp8): per-token fp8 quantization of the hidden state, the fp8 GEMM with
  per-row weight scales, argmax over V;
- `pruned-argmax` (this patch, bf16; shipped for greedy drafting): F.linear over the K rows,
  padded to a multiple of 64 as ParallelLMHead pads them, -inf on the padding rows, max over K,
  then target id = row + d2t[row] (vLLM 0.29's LogitsProcessor.get_top_tokens +
  LocalArgmaxMixin at TP=1);
- `pruned-fp8-argmax` (composed): the K padded rows quantized per row exactly as the full fp8
  copy quantizes them (a per-row scale depends only on its row, so the pruned fp8 rows equal the
  kept rows of the full fp8 head: checked), the same activation quantization and fp8 GEMM, then
  the same local-argmax post-processing as `pruned-argmax`.

Beside them, the parts: `*-gemv` / `*-fp8-gemm` (the GEMM alone, the floor of each path),
`act-quant` (the activation quantization alone), `pruned-full-vocab` (the patch's path for
consumers of full-vocabulary logits: `DraftVocab.expand_logits`, then argmax), and `*-fused`
variants of the fp8 paths whose activation quantization is one torch.compile'd kernel.

What the fp8 paths model (read in the vLLM 0.33.0 sources:
`model_executor/layers/quantization/online/lm_head.py` -> `online/fp8.py`
`Fp8PtpcOnlineLinearMethod` -> `kernels/linear/scaled_mm/cutlass.py`
`CutlassFP8ScaledMMLinearKernel`, the kernel vLLM picks on an H100/H200):
  * weight: one fp32 scale per output row (per channel), scale = max(amax(|row|) / 448,
    1 / (448 * 512)), q = clamp(w / scale, -448, 448) in float8_e4m3fn (true division);
  * activation: dynamic, one fp32 scale per token, the same formula over the hidden state
    (vLLM's `QuantFP8`, see below);
  * GEMM: fp8 x fp8 with fp32 accumulation, the two scale vectors applied in the epilogue, bf16
    logits. vLLM calls its CUTLASS 3.x sm90 kernels (`cutlass_scaled_mm`, FP8 fast accumulation);
    here `torch._scaled_mm` with row-wise scales (scale_a [M, 1], scale_b [1, N],
    use_fast_accum=True), torch's own CUTLASS row-wise kernel on sm90: the same arithmetic and
    the same bytes read, not the same tile configuration.
The activation quantization is `QuantFP8`, a vLLM CustomOp: with custom ops on (`--enforce-eager`,
or checkpoints with block-quantized fp8 weights) its CUDA kernel, one launch, dividing by the
scale; with torch.compile and custom ops off (vLLM's default otherwise, Flash-Next NVFP4
included) its `forward_native`, compiled by inductor (`compile_native`), multiplying by the
scale's reciprocal. Either way about one fused kernel: the `*-fused` variants (this function
compiled by torch.compile, dividing like the CUDA kernel) are the model of vLLM; the plain
`full-fp8` / `pruned-fp8-argmax` run the quantization as several eager torch kernels, an upper
bound; `act-quant` and `act-quant-fused` time it alone so the difference can be read off.
Division and reciprocal multiplication can round the last bit of a value differently. If torch._scaled_mm refuses a
batch that is not a multiple of 16, the fp8 paths quantize into a zero-padded 16-row buffer
(recorded as `fp8_batch_rows`); vLLM's CUTLASS call takes any batch.

Each path is captured in CUDA graphs and replayed (as vLLM decodes). Between steps a real decode
runs the target and the MTP layer, so the head is not in L2: each replay reads its own copy of
the weights, rotated through enough copies to exceed `--cold-bytes` ("cold"). The patch's module
is loaded from the patch file itself (torch only), so the post-processing timed is the one
shipped. Needs only torch (2.11 tested) and a CUDA GPU with fp8 (sm_89+).

H200: python3 magpie bench-draft-head --output $OUT/draft-head-4paths-h200.json

Output: JSON (schema "magpie/bench-draft-head/2": device, settings, `summary` (the four
paths per keep-set size and batch: ms per step and the ratios between them), then one record
per path, rows and batch: median ms per step over trials, eager ms, GB read, fraction of the
bandwidth roofline, speed-up over the full bf16 head, the GB10 roofline projection), then two
tables on stdout.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from magpie import cli, files, patches

SCHEMA = files.schema("bench-draft-head", 2)
PATCH = Path(patches.PATCHES_DIR).resolve() / "vllm-0.29.0" / "mtp_pruning" / "0001-draft-vocab-pruning.patch"
MODULE_PATH = "vllm/v1/spec_decode/draft_vocab.py"
PAD = 64  # DEFAULT_VOCAB_PADDING_SIZE of vLLM's ParallelLMHead
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
FP8_MIN_SCALE = 1.0 / (FP8_MAX * 512.0)  # vLLM's min_scaling_factor for fp8
FULL_PATHS = ("full", "full-gemv", "full-fp8", "full-fp8-fused", "full-fp8-gemm")
PRUNED_PATHS = (
    "pruned-argmax",
    "pruned-full-vocab",
    "pruned-gemv",
    "pruned-fp8-argmax",
    "pruned-fp8-fused",
    "pruned-fp8-gemm",
)
QUANT_PATHS = ("act-quant", "act-quant-fused")
# The summary's paths: (label, path); "pruned" paths are taken at each K, the others at V rows.
FOUR_PATHS = (
    ("full bf16", "full"),
    ("full fp8 (eager quant)", "full-fp8"),
    ("full fp8 (fused quant)", "full-fp8-fused"),
    ("pruned bf16", "pruned-argmax"),
    ("pruned fp8 (eager quant)", "pruned-fp8-argmax"),
    ("pruned fp8 (fused quant)", "pruned-fp8-fused"),
)


def load_module_from_patch(patch: Path, path: str = MODULE_PATH):
    """The new file that a patch adds, imported as a module (the patch tool's own parser)."""
    return patches.load_new_module(patch, path, "draft_vocab")


def padded(rows: int) -> int:
    return (rows + PAD - 1) // PAD * PAD


# --------------------------------------------------------------------------------------------
# fp8 arithmetic of vLLM 0.33's fp8 lm_head copy (see the module docstring)


def quantize_rows(weight):
    """Per-row (per output channel) fp8 quantization of a [rows, hidden] head.

    Returns (q [rows, hidden] float8_e4m3fn, scale [rows, 1] float32): w ~ q * scale. Rows of
    zeros (the padding rows) get the minimum scale and quantize to zeros.
    """
    import torch

    fp8_max = torch.tensor(FP8_MAX, dtype=torch.float32, device=weight.device)
    low, high = weight.aminmax(dim=-1, keepdim=True)
    amax = torch.maximum(low.abs(), high.abs()).to(torch.float32)
    scale = (amax / fp8_max).clamp_min(FP8_MIN_SCALE)
    q = torch.empty_like(weight, dtype=torch.float8_e4m3fn)
    chunk = max(1, (16 << 20) // weight.shape[-1])  # bounds the fp32 intermediate, as vLLM does
    for start in range(0, weight.shape[0], chunk):
        rows = slice(start, start + chunk)
        q[rows] = (weight[rows] / scale[rows]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def quantize_tokens(hidden, fp8_max):
    """Dynamic per-token fp8 quantization of [tokens, hidden] (FP8_MAX as a 0-d fp32 tensor).

    Returns (q float8_e4m3fn, scale [tokens, 1] float32), the formula of vLLM's
    dynamic_per_token_scaled_fp8_quant kernel: scale = max(amax / 448, 1 / (448 * 512)),
    q = clamp(x / scale, -448, 448).
    """
    import torch

    amax = torch.linalg.vector_norm(hidden, ord=float("inf"), dim=-1, keepdim=True, dtype=torch.float32)
    scale = (amax / fp8_max).clamp_min(FP8_MIN_SCALE)
    q = (hidden / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def fp8_matmul(q_hidden, hidden_scale, q_weight, weight_scale_row):
    """bf16 logits of the fp8 GEMM: (q_hidden @ q_weight.T) * hidden_scale * weight_scale, fp32 accumulation."""
    import torch

    return torch._scaled_mm(
        q_hidden,
        q_weight.t(),
        scale_a=hidden_scale,
        scale_b=weight_scale_row,
        out_dtype=torch.bfloat16,
        use_fast_accum=True,
    )


def fp8_reference_logits(q_hidden, hidden_scale, q_weight, weight_scale):
    """The same product in float64 from the dequantized operands: what the fp8 GEMM approximates."""
    return (q_hidden.double() * hidden_scale.double()) @ (q_weight.double() * weight_scale.double()).T


class Fp8Head:
    """A head's rows quantized once, the way vLLM 0.33 builds its fp8 copy of a shared lm_head."""

    def __init__(self, weight):
        self.q, scale = quantize_rows(weight)
        self.scale = scale
        self.scale_row = scale.reshape(1, -1).contiguous()  # torch._scaled_mm's scale_b layout
        self.rows = weight.shape[0]


# --------------------------------------------------------------------------------------------
# One draft step per path


def make_step(
    path: str,
    weight,
    hidden,
    module,
    draft_vocab,
    num_rows: int,
    fp8_head: Fp8Head | None = None,
    quant=None,
    fp8_batch_rows: int | None = None,
):
    """A closure computing one draft step's head work for HIDDEN.

    WEIGHT is the bf16 head (padded rows; None for fp8-only paths), FP8_HEAD its fp8 copy,
    QUANT the activation quantizer (quantize_tokens or a compiled version of it),
    FP8_BATCH_ROWS the row count the fp8 GEMM is given (hidden zero-padded to it if larger).
    """
    import torch
    import torch.nn.functional as F

    batch = hidden.shape[0]
    device = hidden.device
    fp8_max = torch.tensor(FP8_MAX, dtype=torch.float32, device=device)
    quant = quant or quantize_tokens
    fp8_rows = fp8_batch_rows or batch
    if fp8_rows > batch:  # a static zero-padded input, as a captured graph would hold
        fp8_input = torch.zeros(fp8_rows, hidden.shape[1], dtype=hidden.dtype, device=device)
        fp8_input[:batch] = hidden
    else:
        fp8_input = hidden

    def rows_of_head() -> int:
        return fp8_head.rows if fp8_head is not None else weight.shape[0]

    def fp8_logits():
        q_hidden, hidden_scale = quant(fp8_input, fp8_max)
        return fp8_matmul(q_hidden, hidden_scale, fp8_head.q, fp8_head.scale_row)[:batch]

    if path in ("act-quant", "act-quant-fused"):
        return lambda: quant(fp8_input, fp8_max)
    if path == "full":
        return lambda: F.linear(hidden, weight).argmax(dim=-1)
    if path in ("full-fp8", "full-fp8-fused"):
        return lambda: fp8_logits().argmax(dim=-1)
    if path.endswith("-fp8-gemm"):
        q_hidden, hidden_scale = quantize_tokens(fp8_input, fp8_max)  # quantized once, outside the step
        return lambda: fp8_matmul(q_hidden, hidden_scale, fp8_head.q, fp8_head.scale_row)
    if path.endswith("-gemv"):
        return lambda: F.linear(hidden, weight)
    d2t = module.draft_to_target_offsets(draft_vocab.keep_ids.to(device))
    num_pad = rows_of_head() - num_rows

    def local_argmax(logits):
        # vLLM 0.29's LogitsProcessor.get_top_tokens + LocalArgmaxMixin at TP=1.
        if num_pad > 0:
            logits[..., -num_pad:] = -float("inf")
        _, index = logits.max(dim=-1)
        index = index + 0  # + org_vocab_start_index (0 at TP=1): a kernel in vLLM too
        return index + d2t[index]

    if path == "pruned-argmax":
        return lambda: local_argmax(F.linear(hidden, weight))
    if path in ("pruned-fp8-argmax", "pruned-fp8-fused"):
        return lambda: local_argmax(fp8_logits())
    if path == "pruned-full-vocab":

        def step():
            logits = F.linear(hidden, weight)[..., :num_rows]
            return draft_vocab.expand_logits(logits).argmax(dim=-1)

        return step
    raise ValueError(path)


def time_graphs(steps, replays: int, trials: int) -> tuple[float, float]:
    """Median ms per replay over TRIALS, replaying the captured graphs round-robin; and eager ms."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for step in steps:  # warm up outside capture (cuBLAS picks its kernels, torch.compile compiles)
            for _ in range(3):
                step()
    torch.cuda.current_stream().wait_stream(stream)
    graphs = []
    for step in steps:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        graphs.append(graph)
    for graph in graphs * 3:
        graph.replay()
    torch.cuda.synchronize()
    results = []
    for _ in range(trials):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(replays):
            graphs[i % len(graphs)].replay()
        end.record()
        end.synchronize()
        results.append(start.elapsed_time(end) / replays)
    eager = []
    for _ in range(trials):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(replays // 4):
            steps[i % len(steps)]()
        torch.cuda.synchronize()
        eager.append((time.perf_counter() - t0) * 1000 / (replays // 4))
    return statistics.median(results), statistics.median(eager)


# --------------------------------------------------------------------------------------------
# Arguments, checks, summary


def build_parser() -> argparse.ArgumentParser:
    parser = cli.parser("magpie bench-draft-head", __doc__)
    parser.add_argument("--vocab-size", type=int, default=248320, help="rows of the full head")
    parser.add_argument("--hidden-size", type=int, default=2560, help="hidden size (Flash-Next)")
    parser.add_argument("--keep", type=int, nargs="+", default=[7696, 10010], help="pruned head sizes K")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4], help="sequences per draft step")
    parser.add_argument("--bandwidth", type=float, default=4.8e12, help="roofline bytes/s of this GPU (H200)")
    parser.add_argument("--gb10-bandwidth", type=float, default=273e9, help="GB10 unified memory bytes/s")
    parser.add_argument("--cold-bytes", type=float, default=4e8, help="rotate weight copies until they exceed this")
    parser.add_argument("--replays", type=int, default=400, help="graph replays per trial")
    parser.add_argument("--trials", type=int, default=7, help="trials per measurement (median reported)")
    parser.add_argument(
        "--no-fused", action="store_true", help="skip the torch.compile'd activation-quantization variants"
    )
    parser.add_argument("--patch", default=str(PATCH), help="the mtp_pruning patch to load the shipped module from")
    parser.add_argument("--output", help="JSON results file (its folder must exist)")
    cli.add_force(parser, "the --output file")
    return parser


def check_args(args) -> str | None:
    """The first problem with ARGS, as an error message naming the option; None when usable."""
    if args.vocab_size < 2 or args.hidden_size < 16 or args.hidden_size % 16:
        return (
            f"--vocab-size {args.vocab_size} / --hidden-size {args.hidden_size}: need a vocabulary of at least "
            "2 ids and a hidden size that is a multiple of 16 (the fp8 GEMM's alignment)"
        )
    if args.vocab_size % 16:
        return f"--vocab-size {args.vocab_size}: the fp8 GEMM needs a multiple of 16 rows (248320 is)"
    for k in args.keep:
        if not 0 < k < args.vocab_size:
            return f"--keep {k}: a keep-set size must lie in [1, --vocab-size {args.vocab_size})"
    if any(b < 1 for b in args.batch):
        return f"--batch {args.batch}: batch sizes must be at least 1"
    if args.replays < 4 or args.trials < 1:
        return f"--replays {args.replays} / --trials {args.trials}: need at least 4 replays and 1 trial"
    if not Path(args.patch).is_file():
        return f"--patch {args.patch}: no such file"
    if args.output and not Path(args.output).resolve().parent.is_dir():
        return f"--output {args.output}: folder {Path(args.output).resolve().parent} does not exist"
    return None


def summarize(records: list[dict], vocab: int, keeps: list[int], batches: list[int]) -> list[dict]:
    """Per (K, batch): the four paths' ms and the ratios between them (>1: the second is faster)."""
    by_key = {(r["path"], r["rows"], r["batch"]): r["graph_ms"] for r in records}
    summary = []
    for batch in batches:
        for k in keeps:
            ms = {}
            for label, path in FOUR_PATHS:
                key = (path, k if path.startswith("pruned") else vocab, batch)
                if key in by_key:
                    ms[label] = by_key[key]
            entry = {"keep": k, "batch": batch, "ms": ms}

            def ratio(slow: str, fast: str, ms=ms) -> float | None:
                return ms[slow] / ms[fast] if slow in ms and fast in ms else None

            # The fused-quant fp8 paths model vLLM 0.33 (module docstring); eager quant bounds it.
            entry["ratios"] = {
                f"{slow} / {fast}": ratio(slow, fast)
                for slow, fast in (
                    ("full bf16", "full fp8 (fused quant)"),
                    ("full fp8 (fused quant)", "pruned bf16"),
                    ("full fp8 (fused quant)", "pruned fp8 (fused quant)"),
                    ("pruned bf16", "pruned fp8 (fused quant)"),
                    ("full bf16", "pruned bf16"),
                    ("full bf16", "full fp8 (eager quant)"),
                    ("full fp8 (eager quant)", "pruned bf16"),
                    ("full fp8 (eager quant)", "pruned fp8 (eager quant)"),
                    ("pruned bf16", "pruned fp8 (eager quant)"),
                )
            }
            summary.append(entry)
    return summary


def fp8_batch_rows_needed(device, hidden_size: int) -> tuple[int | None, str]:
    """None if torch._scaled_mm takes a 1-row batch here, else 16 (pad), with what was seen."""
    import torch

    head = Fp8Head(torch.randn(64, hidden_size, device=device, dtype=torch.bfloat16))
    fp8_max = torch.tensor(FP8_MAX, device=device)
    try:
        q, s = quantize_tokens(torch.randn(1, hidden_size, device=device, dtype=torch.bfloat16), fp8_max)
        fp8_matmul(q, s, head.q, head.scale_row)
        return None, "torch._scaled_mm takes any batch"
    except RuntimeError as e:
        return 16, f"torch._scaled_mm refused a 1-row batch ({str(e).splitlines()[0]}); fp8 batch padded to 16 rows"


def compiled_quant(device):
    """quantize_tokens compiled by torch.compile (one fused kernel), or (None, the reason)."""
    import torch

    try:
        fused = torch.compile(quantize_tokens, dynamic=False, fullgraph=True)
        x = torch.randn(3, 64, device=device, dtype=torch.bfloat16)
        fp8_max = torch.tensor(FP8_MAX, device=device)
        (got_q, got_scale), (want_q, want_scale) = fused(x, fp8_max), quantize_tokens(x, fp8_max)
        # Triton's fp32 division may differ from torch's in the last bit: allow one fp8 step.
        close = torch.allclose(got_scale, want_scale, rtol=1e-6, atol=0) and bool(
            ((got_q.float() - want_q.float()).abs() <= want_q.float().abs() * 0.125 + 2.0**-9).all()
        )
        if not close:
            return None, "torch.compile'd quantization differs from the eager one by more than one fp8 step"
        differ = int((got_q.float() != want_q.float()).sum())
        return fused, f"torch.compile (inductor); {differ} of {got_q.numel()} values differ by one fp8 step from eager"
    except Exception as e:  # no Triton, no C compiler for its launcher, ...
        return None, f"torch.compile unavailable: {e.__class__.__name__}: {str(e).splitlines()[0][:200]}"


def check_paths(module, full, keep_ids, device, fused, fp8_rows, fp8: bool = True) -> str | None:
    """Correctness before timing: each pruned path agrees with the full head over the keep-set."""
    import torch
    import torch.nn.functional as F

    vocab, hidden_size = full.shape
    k = keep_ids.numel()
    draft_vocab = module.DraftVocab("bench", keep_ids, vocab)
    draft_vocab.place(device)
    keep = keep_ids.to(device)
    sliced = torch.zeros(padded(k), hidden_size, dtype=torch.bfloat16, device=device)
    sliced[:k] = full[keep]
    h = torch.randn(4, hidden_size, device=device, dtype=torch.bfloat16)
    reference = keep[F.linear(h, full)[:, keep].argmax(-1)]
    for path in ("pruned-argmax", "pruned-full-vocab"):
        got = make_step(path, sliced, h, module, draft_vocab, k)()
        if not torch.equal(got, reference):
            return f"{path} ids {got.tolist()} != full head restricted to the keep-set {reference.tolist()}"
    return check_fp8_paths(module, full, sliced, keep, draft_vocab, h, fused, fp8_rows) if fp8 else None


def check_fp8_paths(module, full, sliced, keep, draft_vocab, h, fused, fp8_rows) -> str | None:
    import torch

    device, vocab, k = full.device, full.shape[0], keep.numel()
    full_fp8, pruned_fp8 = Fp8Head(full), Fp8Head(sliced)
    if not (
        torch.equal(pruned_fp8.scale[:k], full_fp8.scale[keep]) and torch.equal(pruned_fp8.q[:k], full_fp8.q[keep])
    ):
        return "the pruned rows quantized on their own differ from the full fp8 head's kept rows"
    fp8_max = torch.tensor(FP8_MAX, device=device)
    q_h, s_h = quantize_tokens(h, fp8_max)
    exact = fp8_reference_logits(q_h, s_h, full_fp8.q, full_fp8.scale)
    for path, head, quant in (("full-fp8", full_fp8, None), ("pruned-fp8-argmax", pruned_fp8, None)) + (
        (("pruned-fp8-fused", pruned_fp8, fused),) if fused else ()
    ):
        step = make_step(path, None, h, module, draft_vocab, k, fp8_head=head, quant=quant, fp8_batch_rows=fp8_rows)
        ids = step()
        allowed = exact if path.startswith("full") else exact[:, keep]
        allowed_ids = torch.arange(vocab, device=device) if path.startswith("full") else keep
        best = allowed.max(-1).values
        picked = exact.gather(1, ids.view(-1, 1)).squeeze(1)
        if not set(ids.tolist()) <= set(allowed_ids.tolist()) or bool(
            ((best - picked) > 2e-2 * best.abs() + 1e-3).any()
        ):
            return f"{path} ids {ids.tolist()} are not the best of the fp8 logits (exact products) over its rows"
    return None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cli.require_modules("bench-draft-head", "torch")
    problem = check_args(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    files.check_output(args.output, args.force)

    import torch

    if not torch.cuda.is_available():
        print("error: needs a CUDA GPU", file=sys.stderr)
        return 2
    if torch.cuda.get_device_capability() < (8, 9):
        print(f"error: fp8 GEMMs need sm_89 or newer, {torch.cuda.get_device_name()} is not", file=sys.stderr)
        return 2
    try:
        result = measure(args, torch.device("cuda"), time_graphs)
    except BenchCheckFailed as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.output:
        files.atomic_write_json(args.output, result, indent=2)
    print_tables(result)
    return 0


class BenchCheckFailed(RuntimeError):
    """A path computed the wrong ids: nothing is timed."""


def measure(args, device, timer) -> dict:
    """Check the paths, then time each with TIMER(steps, replays, trials) -> (graph ms, eager ms)."""
    import torch

    module = load_module_from_patch(Path(args.patch))
    vocab, hidden_size = args.vocab_size, args.hidden_size
    generator = torch.Generator(device="cpu").manual_seed(0)
    keep_sets = {k: torch.randperm(vocab, generator=generator)[:k].sort().values for k in args.keep}
    fp8_rows, fp8_note = fp8_batch_rows_needed(device, hidden_size)
    fused, fused_note = (None, "skipped (--no-fused)") if args.no_fused else compiled_quant(device)
    print(f"fp8 GEMM: {fp8_note}; fused activation quantization: {fused_note}", file=sys.stderr)

    torch.manual_seed(0)
    full = torch.randn(vocab, hidden_size, device=device, dtype=torch.bfloat16) * 0.02
    # An fp8 operation this torch/GPU refuses costs what it must and no more: first the fused
    # variants, then the unpadded batch, and only then the fp8 paths (the bf16 ones are timed anyway).
    attempts = [(fused, fp8_rows)] + ([(None, fp8_rows)] if fused else []) + ([(None, 16)] if not fp8_rows else [])
    errors = []
    for fused_try, rows_try in attempts:
        try:
            problem = check_paths(module, full, keep_sets[args.keep[0]], device, fused_try, rows_try)
        except Exception as e:  # a torch/GPU that refuses an fp8 or compiled op
            errors.append(f"fused={fused_try is not None}, fp8 batch rows={rows_try}: {str(e).splitlines()[0][:300]}")
            print(f"fp8 check failed ({errors[-1]})", file=sys.stderr)
            continue
        if fused is not None and fused_try is None:
            fused_note = f"dropped after a failed check ({errors[0]})"
        if rows_try != fp8_rows:
            fp8_note += f"; padded to {rows_try} rows after a failed check"
        fused, fp8_rows, fp8_error = fused_try, rows_try, None
        break
    else:
        fp8_error = "; ".join(errors)
        fused = None
        problem = check_paths(module, full, keep_sets[args.keep[0]], device, None, fp8_rows, fp8=False)
    if problem:
        raise BenchCheckFailed(problem)
    full_fp8 = Fp8Head(full) if not fp8_error else None

    records = []
    failures = []
    t_start = time.monotonic()
    hiddens = {batch: torch.randn(batch, hidden_size, device=device, dtype=torch.bfloat16) for batch in args.batch}
    configs = []
    # bf16 paths first, then fp8, then the torch.compile'd variants: a failure in a later phase
    # (even one that leaves the CUDA context unusable) cannot cost the earlier phases' figures.
    for phase in ("bf16", "fp8", "fused"):
        for batch in args.batch:
            for path, rows in (
                [(p, vocab) for p in FULL_PATHS]
                + [(p, k) for k in args.keep for p in PRUNED_PATHS]
                + [(p, 0) for p in QUANT_PATHS]
            ):
                kind = (
                    "fused" if "fused" in path else "fp8" if ("fp8" in path or path.startswith("act-quant")) else "bf16"
                )
                if kind == phase and not (kind == "fused" and fused is None) and not (kind != "bf16" and fp8_error):
                    configs.append((batch, path, rows))
    for batch, path, rows in configs:
        hidden = hiddens[batch]
        quant = fused if "fused" in path else None
        fp8 = "fp8" in path or path.startswith("act-quant")
        draft_vocab = None
        if 0 < rows < vocab:
            draft_vocab = module.DraftVocab("bench", keep_sets[rows], vocab)
            draft_vocab.place(device)
        row_count = vocab if rows in (0, vocab) else padded(rows)
        if rows == 0:  # activation quantization alone: reads the hidden state only
            weights, heads, weight_bytes = [None], [None], 0
        elif rows == vocab:  # 1.27 GB (bf16) / 0.64 GB (fp8): larger than L2 already
            weights, heads = [full], [full_fp8]
            weight_bytes = row_count * hidden_size * (1 if fp8 else 2) + (row_count * 4 if fp8 else 0)
        else:
            weight_bytes = row_count * hidden_size * (1 if fp8 else 2) + (row_count * 4 if fp8 else 0)
            copies = 1 if weight_bytes >= args.cold_bytes else int(args.cold_bytes // weight_bytes) + 1
            weights = [
                torch.randn(row_count, hidden_size, device=device, dtype=torch.bfloat16) * 0.02 for _ in range(copies)
            ]
            if fp8:
                heads = [Fp8Head(w) for w in weights]
                weights = [None] * copies
            else:
                heads = [None] * copies
        steps = [
            make_step(
                path,
                w,
                hidden,
                module,
                draft_vocab,
                rows if 0 < rows < vocab else row_count,
                fp8_head=head,
                quant=quant,
                fp8_batch_rows=fp8_rows,
            )
            for w, head in zip(weights, heads, strict=True)
        ]
        try:
            graph_ms, eager_ms = timer(steps, args.replays, args.trials)
        except Exception as e:  # recorded, and the other paths still run
            failures.append({"path": path, "rows": rows or None, "batch": batch, "error": str(e)[:500]})
            print(f"  {path:18} rows {rows:>7} batch {batch}: FAILED {str(e).splitlines()[0]}", file=sys.stderr)
            del weights, heads, steps
            torch.cuda.empty_cache()
            continue
        records.append(
            {
                "path": path,
                "rows": rows if rows else None,
                "padded_rows": row_count if rows else None,
                "batch": batch,
                "dtype": "fp8" if fp8 else "bf16",
                "weight_copies": len(steps),
                "graph_ms": graph_ms,
                "eager_ms": eager_ms,
                "weight_gb": weight_bytes / 1e9,
                "roofline_ms": weight_bytes / args.bandwidth * 1000,
                "roofline_fraction": weight_bytes / args.bandwidth * 1000 / graph_ms,
                "gb10_roofline_ms": weight_bytes / args.gb10_bandwidth * 1000,
            }
        )
        print(f"  {path:18} rows {rows:>7} batch {batch}: {graph_ms:.4f} ms", file=sys.stderr)
        del weights, heads, steps
        torch.cuda.empty_cache()
    for record in records:
        base = next((r for r in records if r["path"] == "full" and r["batch"] == record["batch"]), None)
        record["speedup_vs_full"] = base["graph_ms"] / record["graph_ms"] if base else None
        record["gb10_speedup_vs_full"] = (
            base["gb10_roofline_ms"] / record["gb10_roofline_ms"] if base and record["gb10_roofline_ms"] else None
        )

    summary = summarize(records, vocab, args.keep, args.batch)
    return {
        "schema": SCHEMA,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else str(device),
        "torch": torch.__version__,
        "settings": {k: v for k, v in vars(args).items() if k != "output"},
        "fp8_batch_rows": fp8_rows,
        "fp8_gemm": fp8_note,
        "fused_quant": fused_note,
        "fp8_error": fp8_error,
        "seconds": time.monotonic() - t_start,
        "check": (
            "pruned-argmax and pruned-full-vocab ids equal the full head's argmax over the keep-set; the pruned "
            "rows quantized alone equal the full fp8 head's kept rows; the fp8 paths' ids are the best of the "
            "exact fp8 products over their rows"
        ),
        "summary": summary,
        "failures": failures,
        "records": records,
    }


def print_tables(result: dict) -> None:
    records, summary = result["records"], result["summary"]
    print(f"{result['device']}, torch {result['torch']}; per draft step, CUDA-graph replay, cold weights")
    print(
        f"{'path':18} {'rows':>7} {'batch':>5} {'graph ms':>9} {'eager ms':>9} {'vs full':>8} {'roofline':>8} "
        f"{'GB10 ms':>8}"
    )
    for r in records:
        print(
            f"{r['path']:18} {r['rows'] or '-':>7} {r['batch']:>5} {r['graph_ms']:>9.4f} {r['eager_ms']:>9.4f} "
            f"{r['speedup_vs_full'] or 0:>7.1f}x {100 * r['roofline_fraction']:>7.0f}% {r['gb10_roofline_ms']:>8.3f}"
        )
    for failure in result["failures"]:
        print(f"FAILED {failure['path']} rows {failure['rows']} batch {failure['batch']}: {failure['error']}")
    if result["fp8_error"]:
        print(f"fp8 paths not timed: {result['fp8_error']}")
    print("\nThe four paths (ms per draft step; ratio > 1: the second is faster)")
    for entry in summary:
        cells = ", ".join(f"{label} {ms:.4f}" for label, ms in entry["ms"].items())
        print(f"K={entry['keep']} batch={entry['batch']}: {cells}")
        ratios = ", ".join(f"{name} {value:.2f}x" for name, value in entry["ratios"].items() if value is not None)
        print(f"    {ratios}")


if __name__ == "__main__":
    sys.exit(cli.run_tool("bench-draft-head", main, sys.argv[1:]))
