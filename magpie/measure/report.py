#!/usr/bin/env python3
"""Render the Flash-Next report (one self-contained HTML page) from result folders.

(Over 800 lines, one file: the page's sections share one reading of the result folders and the
inline-SVG chart helpers; those helpers are the part to move out if it grows.)

A result folder is what run_suite.sh writes (suite.json, bench-c1.json, bench-c4.json,
gsm8k.json, log_check.json; optionally profile/<window>/split.json from profile_capture.py).
The page shows the seed GB10 figures (docs/data/flash-next-seed-gb10.json, attributed there)
beside our own runs: headline tiles, decode tok/s by configuration, a memory ledger, the
step-time breakdown and the table of runs; with `--sweep RUN_DIR` (sweep.py's run folders) also
TPOT and TTFT by input length per configuration and concurrency. Charts are inline SVG; the page loads no font,
script or image from anywhere.

    python3 magpie report results/cpu-mtp results/cpu-pruned --output docs/flash-next-report.html

Two text modes for scripts:
    python3 magpie report --summary results/cpu-mtp          # one screen about one folder
    python3 magpie report --compare results/a results/b      # side by side; outputs vs the first
"""

from __future__ import annotations

import datetime
import glob
import html
import json
import os
import sys

from magpie import cli, files
from magpie.measure import common

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_SEED = os.path.normpath(os.path.join(HERE, "..", "..", "docs", "data", "flash-next-seed-gb10.json"))
COLORS = ["#3b6ea8", "#e08a2e", "#4f9d69", "#b0485b", "#7c5ea8", "#8a8a8a"]


# --------------------------------------------------------------------------------------------
# Reading result folders


# The result formats this report reads: name -> the newest version it knows (older ones are read).
KNOWN_SCHEMAS = {"bench-decode": 4, "gsm8k": 1, "log-check": 1}


def _load(path: str, kind: str | None = None):
    """A result file's JSON object (None when absent); one line and exit 1 when it cannot be read,
    is not a JSON object, or is of another tool or a newer version of its schema than this report
    knows (its fields could mean something else)."""
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        return None
    except IsADirectoryError:
        raise SystemExit(f"error: {path} is a folder, not a result file") from None
    except OSError as e:
        raise SystemExit(f"error: {path} cannot be read ({e.strerror}); check its permissions") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise SystemExit(f"error: {path} is not JSON ({e}); rerun the tool that wrote it") from None
    if not isinstance(data, dict):
        raise SystemExit(f"error: {path} holds a JSON {type(data).__name__}, not a result object")
    if kind is not None:
        found = files.schema_of(data.get("schema"))
        newest = KNOWN_SCHEMAS[kind]
        if found is None or found[0] != kind or found[1] > newest:
            raise SystemExit(
                f"error: {path}: schema {data.get('schema')!r} is not one this report reads "
                f"({files.schema(kind, newest)} or older); use a magpie that knows it, or rerun the tool"
            )
    return data


def partial_benches(benches: dict[str, dict | None]) -> list[str]:
    """ "c=1 server-died", ...: the benches that did not run to the end."""
    return [f"{name} {b.get('status')}" for name, b in benches.items() if b and b.get("status") != "complete"]


def load_run(folder: str) -> dict:
    if not os.path.isdir(folder):
        raise SystemExit(f"error: {folder} is not a folder; give a result folder (what run_suite.sh writes)")
    suite = _load(os.path.join(folder, files.SUITE)) or {}
    bench1 = _load(os.path.join(folder, files.BENCH_C1), "bench-decode")
    bench4 = _load(os.path.join(folder, files.BENCH_C4), "bench-decode")
    gsm8k = _load(os.path.join(folder, files.GSM8K), "gsm8k")
    log_check = _load(os.path.join(folder, files.LOG_CHECK), "log-check")
    if not any((bench1, bench4, gsm8k, log_check)):
        names = ", ".join((files.BENCH_C1, files.BENCH_C4, files.GSM8K, files.LOG_CHECK))
        raise SystemExit(f"error: {folder} holds no result file ({names})")
    splits = {}
    for path in sorted(glob.glob(os.path.join(folder, files.PROFILE_DIR, "*", files.PROFILE_SPLIT))):
        traces = [t for t in (_load(path) or {}).get("traces", []) if t.get("summary")]
        if traces:
            splits[os.path.basename(os.path.dirname(path))] = traces[0]
    label = suite.get("label") or (bench1 or bench4 or gsm8k or {}).get("label") or os.path.basename(folder.rstrip("/"))
    spec = (bench1 or {}).get("summary", {}).get("spec_decode") if bench1 else None
    partial = partial_benches({"c=1": bench1, "c=4": bench4})
    if partial:  # a run cut short is never drawn as a complete one
        label = f"{label} [partial: {', '.join(partial)}]"
    return {
        "folder": folder,
        "label": label,
        "partial": partial,
        "suite": suite,
        "bench_c1": bench1,
        "bench_c4": bench4,
        "gsm8k": gsm8k,
        "log_check": log_check,
        "splits": splits,
        # The engine's timestamps only: a starved front-end delivers chunks in bursts, and a rate over
        # the client's arrival times then reads tens of thousands of tok/s (bench_decode.py).
        "c1_decode_tok_s": _get(bench1, "summary", "engine_decode_tok_per_s"),
        "c1_aggregate_tok_s": _get(bench1, "summary", "aggregate_output_tok_per_s"),
        "c4_aggregate_tok_s": _get(bench4, "summary", "aggregate_output_tok_per_s"),
        "acceptance_length": spec.get("acceptance_length") if spec else None,
        "acceptance_rate": spec.get("acceptance_rate") if spec else None,
        "per_position": spec.get("per_position_acceptance") if spec else None,
        "gsm8k_accuracy": _get(gsm8k, "summary", "accuracy"),
        "gsm8k_n": _get(gsm8k, "summary", "problems"),
        "counting_model": counting_model(bench1, bench4),
        "configuration": _get(log_check, "summary"),
        "host": suite.get("host") or {},
    }


def _get(obj, *keys):
    for key in keys:
        if not isinstance(obj, dict):
            return None
        obj = obj.get(key)
    return obj


def identical_outputs(base: dict, other: dict, bench: str = "bench_c1") -> tuple[int, int]:
    """(prompts compared, prompts whose output token ids are identical) between two runs' benches."""
    a, b = base.get(bench), other.get(bench)
    if not a or not b:
        return 0, 0
    first = {r["index"]: r for r in a["records"] if r["ok"]}
    compared = same = 0
    for record in b["records"]:
        match = first.get(record["index"])
        if record["ok"] and match and match["prompt_id"] == record["prompt_id"]:
            compared += 1
            same += match["token_ids"] == record["token_ids"]
    return compared, same


def identical_text(base: dict, other: dict) -> str:
    compared, same = identical_outputs(base, other)
    if compared == 0:
        return "n/a"
    return "yes" if same == compared else f"no ({compared - same} of {compared} differ)"


COUNTING_MODEL_NOTE = (
    "GSM8K at 0 % is expected here: every reply of this model counts upwards (each output token id is the "
    "previous one + 1, the rule of the tiny test model the demo and the tests build), so it computes no answer; "
    "the run shows that the evaluation works (answers extracted, truncations counted), not accuracy."
)


def counting_model(*benches: dict | None) -> bool:
    """Whether the served model is the tiny "increment" test model, judged from what it did: every
    completed bench reply of at least 8 tokens is a run of consecutive token ids (next id =
    previous id + 1), and there is at least one such reply. A real model never answers so."""
    replies = [
        r["token_ids"]
        for bench in benches
        if bench
        for r in bench.get("records", [])
        if r.get("ok") and len(r.get("token_ids") or []) >= 8
    ]
    return bool(replies) and all(ids == list(range(ids[0], ids[0] + len(ids))) for ids in replies)


# --------------------------------------------------------------------------------------------
# Text modes


def _fmt(value, spec=".1f", suffix=""):
    return "-" if value is None else f"{format(value, spec)}{suffix}"


def summary_text(run: dict) -> str:
    lines = [f"{run['label']}  ({run['folder']})"]
    if run["configuration"]:
        lines.append(f"  server: {run['configuration']}")
    failed = (run["log_check"] or {}).get("expectations_failed") or []
    for failure in failed:
        lines.append(f"  WARNING: the log does not show the expected configuration: {failure}")
    for name, bench in (("c=1", run["bench_c1"]), ("c=4", run["bench_c4"])):
        if not bench:
            lines.append(f"  bench {name}: missing")
            continue
        s = bench["summary"]
        lines.append(
            f"  bench {name}: {s['completed']}/{s['requests']} ok ({bench['status']}), "
            f"decode {_fmt(s.get('engine_decode_tok_per_s'))} tok/s per request (engine times), "
            f"aggregate {_fmt(s['aggregate_output_tok_per_s'])} tok/s (all requests), "
            f"TTFT {_fmt((s['ttft_s'] or {}).get('median'), '.3f')} s, "
            f"TPOT p50 {_fmt((s.get('tpot_ms') or {}).get('p50'), '.2f')} ms, "
            f"ITL p50 {_fmt((s.get('itl_ms') or {}).get('p50'), '.2f')} ms"
        )
        for metric, figures in (s.get("percentiles_ms") or {}).items():
            if figures:
                chosen = "  ".join(f"{k} {v:.2f}" for k, v in figures.items())
                lines.append(f"           {metric.upper()} ms: {chosen}")
        good = s.get("goodput")
        if good:
            slos = ", ".join(f"{k} <= {v:g} ms" for k, v in good["slo_ms"].items())
            lines.append(
                f"           goodput {_fmt(good['request_per_s'], '.3f')} req/s "
                f"({good['good_requests']}/{good['requests']} met {slos})"
            )
        spec = s["spec_decode"]
        if spec:
            positions = " ".join(f"{x:.2f}" for x in spec["per_position_acceptance"] or [])
            lines.append(
                f"           MTP acceptance length {_fmt(spec['acceptance_length'], '.3f')}, "
                f"rate {_fmt(spec['acceptance_rate'], '.3f')}, per position [{positions}]"
            )
    gsm8k = run["gsm8k"]
    if gsm8k:
        s = gsm8k["summary"]
        lines.append(
            f"  GSM8K: {s['accuracy'] * 100:.1f} % of {s['problems']} ({gsm8k['status']}), {s['truncated']} truncated, "
            f"{_fmt(s['output_tok_per_s'])} tok/s; data set sha256 {gsm8k['dataset']['sha256'][:12]}"
        )
        if run["counting_model"]:
            lines.append(f"         {COUNTING_MODEL_NOTE}")
    else:
        lines.append("  GSM8K: not run")
    memory = (run["log_check"] or {}).get("memory") or {}
    if memory:
        lines.append("  memory: " + ", ".join(f"{k} {v:g}" for k, v in memory.items()))
    for window, trace in run["splits"].items():
        s = trace["summary"]
        lines.append(
            f"  profile {window}: {s['step_ms_median']:.2f} ms/step, "
            + ", ".join(f"{k} {v * 100:.0f} %" for k, v in s["share"].items())
        )
    return "\n".join(lines)


def decode_spread(run: dict) -> dict | None:
    """The c=1 bench's engine decode tok/s over its repeats (bench-decode/4 with --repeats)."""
    return ((_get(run["bench_c1"], "summary", "spread") or {}).get("engine_decode_tok_per_s")) or None


def versus_first(first: dict, run: dict) -> str:
    """ "within noise" when the two runs' repeat ranges overlap, else the change of the medians."""
    return common.compare(decode_spread(first), decode_spread(run))


def spread_text(figures: dict | None) -> str:
    """ "median [min - max] (n)" of a figure over repeats; "-" without repeats' figures."""
    if not figures:
        return "-"
    return f"{figures['median']:.1f} [{figures['min']:.1f} - {figures['max']:.1f}] ({figures['n']})"


def compare_text(runs: list[dict]) -> str:
    header = [
        "configuration",
        "c=1 decode tok/s per request",
        "c=1 median [min - max] (repeats)",
        "c=1 decode vs first (repeats)",
        "c=4 aggregate tok/s, all requests",
        "accept. L",
        "accept. rate",
        "GSM8K",
        "identical outputs",
    ]
    rows = []
    for run in runs:
        rows.append(
            [
                run["label"],
                _fmt(run["c1_decode_tok_s"]),
                spread_text(decode_spread(run)),
                "(reference)" if run is runs[0] else versus_first(runs[0], run),
                _fmt(run["c4_aggregate_tok_s"]),
                _fmt(run["acceptance_length"], ".2f"),
                _fmt(run["acceptance_rate"], ".3f"),
                "-" if run["gsm8k_accuracy"] is None else f"{run['gsm8k_accuracy'] * 100:.1f} %",
                "(reference)" if run is runs[0] else identical_text(runs[0], run),
            ]
        )
    widths = [max(len(str(row[i])) for row in [header] + rows) for i in range(len(header))]
    out = ["  ".join(str(cell).ljust(width) for cell, width in zip(header, widths, strict=True))]
    out.append("  ".join("-" * width for width in widths))
    out += ["  ".join(str(cell).ljust(width) for cell, width in zip(row, widths, strict=True)) for row in rows]
    out.append(
        "c=1 decode: one request at a time, its tokens after the first over its decode time (the engine's "
        "timestamps, pooled over the repeats), then its median [min - max] over the repeats; c=4 aggregate: "
        "four requests in flight, all output tokens over the run's wall time; vs first: 'within noise' when the "
        "repeats' min..max ranges overlap (run_suite.sh and scripts/demo.sh run REPEATS=3 by default)."
    )
    if any(run["counting_model"] and run["gsm8k_accuracy"] is not None for run in runs):
        out.append(COUNTING_MODEL_NOTE)
    return "\n".join(out)


# --------------------------------------------------------------------------------------------
# SVG


def _e(text) -> str:
    return html.escape(str(text), quote=True)


def bar_chart(rows: list[tuple[str, dict[str, float | None]]], series: list[str], unit: str, width: int = 760) -> str:
    """Horizontal grouped bars: one group per row, one bar per series."""
    label_w, bar_h, gap, pad = 260, 16, 10, 70
    values = [v for _, vals in rows for v in vals.values() if v is not None]
    if not values:
        return "<p class=note>no figures</p>"
    top = max(values) * 1.05 or 1.0
    plot_w = width - label_w - pad
    group_h = bar_h * len(series) + gap
    height = group_h * len(rows) + 30
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img">']
    for i, (label, vals) in enumerate(rows):
        y0 = i * group_h + 4
        parts.append(
            f'<text x="{label_w - 8}" y="{y0 + group_h / 2}" text-anchor="end" dominant-baseline="middle" '
            f'class="lbl">{_e(label)}</text>'
        )
        for j, name in enumerate(series):
            value = vals.get(name)
            y = y0 + j * bar_h
            if value is None:
                parts.append(f'<text x="{label_w + 4}" y="{y + bar_h - 4}" class="val">{_e(name)}: -</text>')
                continue
            w = max(1.0, plot_w * value / top)
            parts.append(
                f'<rect x="{label_w}" y="{y}" width="{w:.1f}" height="{bar_h - 2}" fill="{COLORS[j % len(COLORS)]}">'
                f"<title>{_e(label)} {_e(name)}: {value:.1f} {_e(unit)}</title></rect>"
            )
            parts.append(f'<text x="{label_w + w + 4:.1f}" y="{y + bar_h - 4}" class="val">{value:.1f}</text>')
    legend_y = len(rows) * group_h + 20
    x = label_w
    for j, name in enumerate(series):
        parts.append(f'<rect x="{x}" y="{legend_y - 10}" width="12" height="12" fill="{COLORS[j % len(COLORS)]}"/>')
        parts.append(f'<text x="{x + 16}" y="{legend_y}" class="val">{_e(name)} ({_e(unit)})</text>')
        x += 30 + 8 * len(name) + 8 * len(unit)
    parts.append("</svg>")
    return "".join(parts)


def stacked_bar(segments: list[tuple[str, float]], total: float, unit: str, width: int = 760) -> str:
    """One horizontal bar of `total`, split into segments; a legend underneath."""
    bar_w, height = width - 20, 40 + 20 * len(segments)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img">']
    parts.append(f'<rect x="0" y="0" width="{bar_w}" height="24" fill="#eeeeee" stroke="#999"/>')
    x = 0.0
    for i, (label, value) in enumerate(segments):
        w = bar_w * max(value, 0) / total if total else 0
        parts.append(
            f'<rect x="{x:.1f}" y="0" width="{w:.1f}" height="24" fill="{COLORS[i % len(COLORS)]}">'
            f"<title>{_e(label)}: {value:.2f} {_e(unit)}</title></rect>"
        )
        x += w
    for i, (label, value) in enumerate(segments):
        y = 44 + 20 * i
        parts.append(f'<rect x="0" y="{y - 11}" width="12" height="12" fill="{COLORS[i % len(COLORS)]}"/>')
        parts.append(
            f'<text x="18" y="{y}" class="val">{_e(label)}: {value:.2f} {_e(unit)} ({value / total:.0%})</text>'
        )
    parts.append("</svg>")
    return "".join(parts)


def line_chart(lines: list[tuple[str, list[tuple[float, float]]]], x_label: str, y_label: str, width: int = 760) -> str:
    """Lines of (x, y) points; x on a log2 axis (input lengths double), y linear from 0."""
    import math

    points = [p for _, pts in lines for p in pts if p[1] is not None]
    if not points:
        return "<p class=note>no figures</p>"
    left, right, top, bottom, height = 70, 190, 14, 40, 300
    xs = sorted({p[0] for p in points})
    lo, hi = math.log2(xs[0]), math.log2(xs[-1])
    y_top = max(p[1] for p in points) * 1.1 or 1.0
    plot_w, plot_h = width - left - right, height - top - bottom

    def sx(x):
        return left + (plot_w * (math.log2(x) - lo) / (hi - lo) if hi > lo else plot_w / 2)

    def sy(y):
        return top + plot_h * (1 - y / y_top)

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img">']
    parts.append(f'<rect x="{left}" y="{top}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#999"/>')
    for x in xs:
        parts.append(f'<text x="{sx(x):.1f}" y="{top + plot_h + 16}" text-anchor="middle" class="val">{x:g}</text>')
    for i in range(5):
        y = y_top * i / 4
        parts.append(f'<text x="{left - 6}" y="{sy(y) + 4:.1f}" text-anchor="end" class="val">{y:.3g}</text>')
        parts.append(f'<line x1="{left}" x2="{left + plot_w}" y1="{sy(y):.1f}" y2="{sy(y):.1f}" stroke="#eee"/>')
    parts.append(
        f'<text x="{left + plot_w / 2}" y="{height - 6}" text-anchor="middle" class="lbl">{_e(x_label)}</text>'
    )
    parts.append(f'<text x="12" y="{top + plot_h / 2}" class="lbl" transform="rotate(-90 12 {top + plot_h / 2})" '
                 f'text-anchor="middle">{_e(y_label)}</text>')  # fmt: skip
    for j, (label, pts) in enumerate(lines):
        color = COLORS[j % len(COLORS)]
        coords = [(sx(x), sy(y)) for x, y in sorted(pts) if y is not None]
        if len(coords) > 1:
            path = " ".join(f"{x:.1f},{y:.1f}" for x, y in coords)
            parts.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="2"/>')
        for (x, y), (vx, vy) in zip(coords, sorted(p for p in pts if p[1] is not None), strict=True):
            parts.append(
                f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3.5" fill="{color}"><title>{_e(label)}: {vy:.3g} '
                f"{_e(y_label)} at {vx:g}</title></circle>"
            )
        ly = top + 12 + 18 * j
        parts.append(f'<rect x="{left + plot_w + 12}" y="{ly - 10}" width="12" height="12" fill="{color}"/>')
        parts.append(f'<text x="{left + plot_w + 28}" y="{ly}" class="val">{_e(label)}</text>')
    parts.append("</svg>")
    return "".join(parts)


SWEEP_VERSIONS = (4, 3, 2, 1)


def load_sweep(folder: str) -> dict:
    """A sweep.py results.json (under the schema prefix of today or a legacy one: files.schema_of).
    Version 1 is read too, without its decode tok/s column: that was a client-side rate, which a
    front-end delivering replies in bursts inflates (version 2 has the engine's figure instead)."""
    document = _load(os.path.join(folder, files.SWEEP_RESULTS))
    if not document or files.schema_of(document.get("schema")) not in [("sweep", v) for v in SWEEP_VERSIONS]:
        wanted = " or ".join(files.schema("sweep", v) for v in SWEEP_VERSIONS)
        raise SystemExit(f"error: {folder}/{files.SWEEP_RESULTS} is missing or not a sweep.py result ({wanted})")
    document["folder"] = folder
    return document


def keepset_section(section: dict | None) -> list[str]:
    """A keep-set sweep's table (sweep/4): per keep-set and point, the corpus coverage, acceptance
    and decode tok/s median [min - max]; then the best keep-set per point."""
    if not section:
        return []
    body = [
        "<h4>Keep-set sizes (one server start per keep-set)</h4>",
        "<table><tr><th>keep-set</th><th>ids</th><th>corpus coverage</th><th>input</th><th>c</th>"
        "<th>repeats</th><th>acceptance L</th><th>per position</th><th>decode tok/s median [min - max]</th></tr>",
    ]
    for row in section["rows"]:
        coverage = "-" if row.get("corpus_coverage") is None else f"{100 * row['corpus_coverage']:.2f} %"
        positions = " ".join(f"{x:.2f}" for x in row.get("per_position_acceptance") or []) or "-"
        depth = f" (depth {row['depth']})" if row.get("depth") else ""
        body.append(
            f"<tr><td>{_e(row['config'] + depth)}{' (best)' if row.get('best') else ''}</td>"
            f"<td class=n>{row['keep_ids']}</td><td class=n>{coverage}</td>"
            f"<td class=n>{row['input_len']}</td><td class=n>{row['concurrency']}</td>"
            f"<td class=n>{row['repeats']}</td><td class=n>{_fmt(row['acceptance_length'], '.2f')}</td>"
            f"<td>{positions}</td><td class=n>{_fmt(row['decode_tok_s_median'])} "
            f"[{_fmt(row['decode_tok_s_min'])} - {_fmt(row['decode_tok_s_max'])}]</td></tr>"
        )
    body.append("</table>")
    for best in section["best"]:
        versus = best["versus_runner_up"]
        if best.get("runner_up"):
            versus = f"against the runner-up {best['runner_up']}: {versus}"
        body.append(
            f'<p class="note">Best keep-set at input {best["input_len"]}, c={best["concurrency"]}: '
            f"{_e(best['config'])} ({best['keep_ids']} ids), {_fmt(best['decode_tok_s_median'])} tok/s median; "
            f"{_e(versus)}.</p>"
        )
    return body


def sweep_section(sweep: dict) -> list[str]:
    host = sweep.get("host") or {}
    settings = sweep["settings"]
    body = [
        f"<h3>Sweep {_e(os.path.relpath(sweep['folder']))}: {sweep['points_complete']} of "
        f"{sweep['points_expected']} runs ({_e(sweep['status'])}), {_e(host.get('name', '?'))} "
        f"({_e(host.get('machine', '?'))}, {_e(host.get('cpus', '?'))} CPUs)</h3>",
        f'<p class="note">{settings["output_len"]} output tokens per request, {_e(settings["prompt_style"])} '
        f"prompts, {settings['prompts_per_point']} requests per run; TTFT, TPOT and ITL as vllm bench serve "
        "defines them, pooled over repeats; prefix cache reset before every run.</p>",
    ]
    groups: dict[str, list[tuple[float, float]]] = {}
    ttft: dict[str, list[tuple[float, float]]] = {}
    for row in sweep["summary"]:
        key = f"{row['config']} c={row['concurrency']}" + (f" depth {row['depth']}" if row.get("depth") else "")
        groups.setdefault(key, []).append((row["input_len"], row["tpot_p50_ms"]))
        ttft.setdefault(key, []).append((row["input_len"], row["ttft_p50_ms"]))
    body.append(line_chart(list(groups.items()), "input length (tokens)", "TPOT p50 (ms)"))
    body.append(line_chart(list(ttft.items()), "input length (tokens)", "TTFT p50 (ms)"))
    body.append(
        "<table><tr><th>config</th><th>input</th><th>c</th><th>repeats</th><th>TTFT p50 / p99 ms</th>"
        "<th>TPOT p50 / p99 ms</th><th>ITL p50 / p99 ms</th><th>decode tok/s per request (engine)</th>"
        "<th>aggregate tok/s (all requests)</th><th>acceptance L</th></tr>"
    )
    for row in sweep["summary"]:
        depth = f" (depth {row['depth']})" if row.get("depth") else ""
        body.append(
            f"<tr><td>{_e(row['config'] + depth)}</td>"
            f"<td class=n>{row['input_len']}</td>"
            f"<td class=n>{row['concurrency']}</td>"
            f"<td class=n>{row['repeats']}</td>"
            f"<td class=n>{_fmt(row['ttft_p50_ms'])} / {_fmt(row['ttft_p99_ms'])}</td>"
            f"<td class=n>{_fmt(row['tpot_p50_ms'], '.2f')} / {_fmt(row['tpot_p99_ms'], '.2f')}</td>"
            f"<td class=n>{_fmt(row['itl_p50_ms'], '.2f')} / {_fmt(row['itl_p99_ms'], '.2f')}</td>"
            f"<td class=n>{_fmt(row.get('engine_decode_tok_s'))}</td>"
            f"<td class=n>{_fmt(row['aggregate_tok_s_median'])}</td>"
            f"<td class=n>{_fmt(row['acceptance_length'], '.2f')}</td></tr>"
        )
    body.append("</table>")
    body += keepset_section(sweep.get("keepset_sweep"))  # version 4 on
    if files.schema_of(sweep["schema"]) == ("sweep", 1):
        body.append(
            f'<p class="note">This sweep was written by an older sweep.py ({_e(sweep["schema"])}): it has no decode '
            "tok/s from the engine's timestamps, and its client-side decode rate is not shown (a front-end "
            "that delivers a reply in a burst inflates it). Rerun the sweep for the engine's figure.</p>"
        )
    return body


# --------------------------------------------------------------------------------------------
# HTML

CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", Roboto, "DejaVu Sans", sans-serif; margin: 24px auto;
       max-width: 1040px; color: #1d1d1f; padding: 0 16px; }
h1 { font-size: 24px; margin-bottom: 4px; } h2 { font-size: 18px; margin-top: 32px; border-bottom: 1px solid #ddd; }
h3 { font-size: 15px; margin: 18px 0 6px; }
.sub { color: #555; font-size: 13px; }
.tiles { display: grid; grid-template-columns: repeat(auto-fill, minmax(180px, 1fr)); gap: 10px; margin: 10px 0; }
.tile { border: 1px solid #d9d9d9; border-radius: 8px; padding: 10px 12px; background: #fafafa; }
.tile .v { font-size: 22px; font-weight: 600; } .tile .k { font-size: 12px; color: #555; }
.tile .s { font-size: 11px; color: #777; margin-top: 2px; }
table { border-collapse: collapse; font-size: 13px; width: 100%; margin-top: 8px; }
th, td { border-bottom: 1px solid #e3e3e3; padding: 5px 8px; text-align: left; vertical-align: top; }
th { background: #f3f3f3; } td.n { text-align: right; font-variant-numeric: tabular-nums; }
.lbl { font-size: 12px; fill: #1d1d1f; } .val { font-size: 11px; fill: #333; }
.note { color: #666; font-size: 12px; } .warn { color: #a33; font-size: 12px; }
"""


STEP_SERIES = "share of step"
GPU_SERIES = "share of GPU time"


def step_charts(share: dict, gpu_busy_share: float | None, gpu_share_by_family: dict | None) -> list[str]:
    """The step's phases and GPU busy time as shares of the step; kernel families as shares of the
    GPU's busy time, in a second chart (their sum is 100 % of GPU time, not of the step)."""
    rows = [(k, {STEP_SERIES: v * 100}) for k, v in share.items()]
    if gpu_busy_share is not None:
        rows.append(("GPU busy", {STEP_SERIES: gpu_busy_share * 100}))
    parts = [bar_chart(rows, [STEP_SERIES], "%")]
    if gpu_share_by_family:
        families = [(k, {GPU_SERIES: v * 100}) for k, v in gpu_share_by_family.items()]
        busy = "" if gpu_busy_share is None else f" ({gpu_busy_share * 100:.1f} % of the step)"
        parts.append(f'<p class="note">The GPU\'s busy time{busy} by kernel family, as shares of GPU time:</p>')
        parts.append(bar_chart(families, [GPU_SERIES], "%"))
    return parts


def tile(value: str, key: str, sub: str = "") -> str:
    return (
        f'<div class="tile"><div class="v">{_e(value)}</div><div class="k">{_e(key)}</div>'
        f'<div class="s">{_e(sub)}</div></div>'
    )


def render(runs: list[dict], seed: dict | None, title: str, sweeps: list[dict] | None = None) -> str:
    """The whole page: a section per part, each from the seed figures (when given) and our runs."""
    body = [
        *page_header(runs, seed, title),
        *headline_section(runs, seed),
        *decode_section(runs, seed),
        *memory_section(runs, seed),
        *step_section(runs, seed),
        *runs_table(runs, seed),
    ]
    if sweeps:
        body.append("<h2>Sweep: latency by input length and concurrency</h2>")
        for sweep in sweeps:
            body += sweep_section(sweep)
    if seed:
        body.append(f'<h2>Attribution</h2><p class="note">{_e(seed["attribution"])}</p>')
    return (
        "<!DOCTYPE html>\n<html lang=en><head><meta charset=utf-8>"
        f"<meta name=viewport content='width=device-width, initial-scale=1'><title>{_e(title)}</title>"
        f"<style>{CSS}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n"
    )


def page_header(runs: list[dict], seed: dict | None, title: str) -> list[str]:
    """The title and where the figures came from."""
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    sources = ", ".join(os.path.relpath(r["folder"]) for r in runs) or "none"
    return [
        f"<h1>{_e(title)}</h1>",
        f'<p class="sub">Generated by magpie/measure/report.py on {now} from result folders: {_e(sources)}'
        + ("; seed figures: docs/data/flash-next-seed-gb10.json" if seed else "")
        + ".</p>",
    ]


def headline_section(runs: list[dict], seed: dict | None) -> list[str]:
    """Tiles: the seed's best configuration, then each run's decode speed and the best acceptance."""
    body = ["<h2>Headline numbers</h2>"]
    if seed:
        best = max(seed["configurations"], key=lambda c: c["c1_decode_tok_s"] or 0)
        ledger = seed["memory_ledger_gb"]
        body.append(f"<h3>Seed: {_e(seed['model']['name'])} on {_e(seed['platform']['name'])}</h3><div class=tiles>")
        body.append(tile(f"{best['c1_decode_tok_s']:.1f} tok/s", "decode at c=1", best["label"]))
        body.append(tile(f"{best['c4_aggregate_tok_s']:.1f} tok/s", "aggregate at c=4", best["label"]))
        body.append(tile(f"{best['acceptance_length']:.2f}", "MTP acceptance length (c=1)", best["label"]))
        body.append(tile(f"{best['gsm8k_accuracy'] * 100:.1f} %", "GSM8K", "zero-shot, greedy"))
        body.append(tile(f"{ledger['used_after_load']} / {ledger['total']} GB", "memory used after load", "unified"))
        body.append("</div>")
    if runs:
        body.append("<h3>Our runs</h3><div class=tiles>")
        for run in runs:
            host = run["host"]
            sub = f"{host.get('name', '?')} ({host.get('machine', '?')}, {host.get('cpus', '?')} CPUs)"
            body.append(tile(f"{_fmt(run['c1_decode_tok_s'])} tok/s", f"{run['label']}: decode at c=1", sub))
        best = max(runs, key=lambda r: r["acceptance_length"] or 0)
        if best["acceptance_length"]:
            body.append(tile(f"{best['acceptance_length']:.2f}", f"{best['label']}: MTP acceptance length", ""))
        body.append("</div>")
    return body


def decode_section(runs: list[dict], seed: dict | None) -> list[str]:
    """Decode tok/s by configuration: the seed's, then ours, one chart per host and model."""
    body = ["<h2>Decode speed by configuration</h2>"]
    if seed:
        rows = [
            (c["label"], {"c=1 decode": c["c1_decode_tok_s"], "c=4 aggregate": c["c4_aggregate_tok_s"]})
            for c in seed["configurations"]
        ]
        body.append(f"<h3>Seed, {_e(seed['platform']['name'])}, {_e(seed['model']['name'])}</h3>")
        body.append(bar_chart(rows, ["c=1 decode", "c=4 aggregate"], "tok/s"))
    groups: dict[str, list[dict]] = {}
    for run in runs:
        host = run["host"]
        model = _get(run["bench_c1"], "server", "model") or "?"
        key = f"{host.get('name', 'unknown host')} ({host.get('machine', '?')}), model {model}"
        groups.setdefault(key, []).append(run)
    for key, members in groups.items():
        rows = [
            (r["label"], {"c=1 decode": r["c1_decode_tok_s"], "c=4 aggregate": r["c4_aggregate_tok_s"]})
            for r in members
        ]
        body.append(f"<h3>Ours: {_e(key)}</h3>")
        body.append(bar_chart(rows, ["c=1 decode", "c=4 aggregate"], "tok/s"))
    body.append(
        '<p class="note">c=1 decode (ours): per request, the tokens after the first over the time from the first to '
        "the last token, from the engine's own timestamps (vllm:request_decode_time_seconds); client-side TPOT "
        "and ITL are in each bench file. c=4 aggregate: four requests in flight, all output tokens over the "
        "run's wall time.</p>"
    )
    return body


def memory_section(runs: list[dict], seed: dict | None) -> list[str]:
    """The memory ledger: the seed's unified memory, then each run's host memory at the suite's start."""
    body = ["<h2>Memory ledger</h2>"]
    if seed:
        ledger = seed["memory_ledger_gb"]
        segments = [(i["label"], i["gib"] * 1.073741824) for i in ledger["items"]]
        used = sum(v for _, v in segments)
        segments.append(("other use after load (runtime, CUDA context, OS)", max(ledger["used_after_load"] - used, 0)))
        segments.append(("left for the OS page cache serving the table", ledger["total"] - ledger["used_after_load"]))
        body.append(f"<h3>Seed, {_e(seed['platform']['name'])}: {ledger['total']} GB unified memory</h3>")
        body.append(stacked_bar(segments, ledger["total"], "GB"))
        for item in ledger.get("not_resident", []):
            body.append(
                f'<p class="note">Not resident: {_e(item["label"])}, {item["gb"]} GB. {_e(ledger.get("note", ""))}</p>'
            )
    for run in runs:
        memory = (run["log_check"] or {}).get("memory") or {}
        total = run["host"].get("mem_total_bytes")
        available = run["host"].get("mem_available_bytes_at_start")
        if not total:
            continue
        gib = 1024**3
        segments = []
        if memory.get("weights_gib"):
            segments.append(("weights", memory["weights_gib"]))
        if memory.get("kv_cache_gib"):
            segments.append(("KV cache", memory["kv_cache_gib"]))
        if available is not None:
            used_other = (total - available) / gib - sum(v for _, v in segments)
            segments.append(("everything else in use at the suite's start", max(used_other, 0)))
            segments.append(("available (MemAvailable)", available / gib))
        body.append(f"<h3>{_e(run['label'])}: {total / gib:.1f} GiB host memory</h3>")
        body.append(stacked_bar(segments, total / gib, "GiB"))
    return body


def step_section(runs: list[dict], seed: dict | None) -> list[str]:
    """Step-time breakdown: shares of the step (host phases, GPU busy) and, in a chart of its own,
    how the GPU's busy time divides between kernel families (shares of GPU time, not of the step)."""
    body = ["<h2>Step-time breakdown</h2>"]
    if seed:
        step = seed["step_breakdown"]
        body.append(f"<h3>Seed: {_e(step['configuration'])}, {step['step_ms']} ms/step</h3>")
        body += step_charts(step["share"], step["gpu_busy_share"], step["gpu_share_by_family"])
        body.append(
            f'<p class="note">{step["kernel_launches_per_step"]} kernel launches in ~{step["graph_launches_per_step"]} '
            f"graph replays per step. {_e(step.get('note', ''))}</p>"
        )
    for run in runs:
        for window, trace in run["splits"].items():
            body += trace_window(run["label"], window, trace)
    return body


def trace_window(label: str, window: str, trace: dict) -> list[str]:
    """One profiled window of a run (trace_split's summary): its charts, notes and top kernels."""
    s = trace["summary"]
    body = [f"<h3>{_e(label)}, {_e(window)}: {s['step_ms_median']:.2f} ms/step (median of {s['steps']})</h3>"]
    body += step_charts(s["share"], s.get("gpu_busy_share"), s.get("gpu_share_by_family"))
    extra = []
    if s.get("ple_staging_ms_mean"):
        extra.append(f"PLE staging on the host {s['ple_staging_ms_mean']:.3f} ms/step")
    if s.get("worker_cpu_not_covered_by_gpu_ms_mean") is not None:
        extra.append(
            f"worker CPU time with no kernel running {s['worker_cpu_not_covered_by_gpu_ms_mean']:.2f} ms/step "
            f"({s['worker_cpu_not_covered_by_gpu_share'] * 100:.1f} % of the step)"
        )
    if extra:
        body.append(f'<p class="note">{_e("; ".join(extra))}.</p>')
    if s.get("top_kernels"):
        body.append("<table><tr><th>kernel</th><th>family</th><th>ms / step</th><th>GPU time</th></tr>")
        for kernel in s["top_kernels"][:10]:
            body.append(
                f"<tr><td>{_e(kernel['name'][:100])}</td><td>{_e(kernel['family'])}</td>"
                f"<td class=n>{kernel['gpu_ms_per_step']:.3f}</td>"
                f"<td class=n>{_fmt((kernel['share_of_gpu_time'] or 0) * 100, '.1f', ' %')}</td></tr>"
            )
        body.append("</table>")
    for note in trace.get("notes", []):
        body.append(f'<p class="note">{_e(note)}</p>')
    return body


def runs_table(runs: list[dict], seed: dict | None) -> list[str]:
    """The table of runs: the seed's configurations, then ours with their outputs compared to the first."""
    body = [
        "<h2>Runs</h2><table><tr><th>source</th><th>configuration</th><th>c=1 decode tok/s</th>"
        "<th>c=4 aggregate tok/s</th><th>acceptance L</th><th>acceptance rate</th><th>GSM8K</th>"
        "<th>identical outputs</th></tr>"
    ]
    if seed:
        for c in seed["configurations"]:
            gsm = f"{c['gsm8k_accuracy'] * 100:.1f} %" + (f" (n={c['gsm8k_n']})" if c.get("gsm8k_n") else "")
            body.append(
                f"<tr><td>seed, {_e(seed['platform']['name'])}</td><td>{_e(c['label'])}</td>"
                f"<td class=n>{_fmt(c['c1_decode_tok_s'])}</td><td class=n>{_fmt(c['c4_aggregate_tok_s'])}</td>"
                f"<td class=n>{_fmt(c['acceptance_length'], '.2f')}</td><td class=n>-</td><td class=n>{gsm}</td>"
                "<td>-</td></tr>"
            )
    for run in runs:
        gsm = "-" if run["gsm8k_accuracy"] is None else f"{run['gsm8k_accuracy'] * 100:.1f} % (n={run['gsm8k_n']})"
        if run["counting_model"] and run["gsm8k_accuracy"] is not None:
            gsm += '<div class="note">the tiny counting model: see below</div>'
        same = "(reference)" if run is runs[0] else identical_text(runs[0], run)
        config = run["configuration"] or ""
        warn = "".join(
            f'<div class="warn">{_e(f)}</div>' for f in (run["log_check"] or {}).get("expectations_failed") or []
        )
        body.append(
            f"<tr><td>ours, {_e(run['host'].get('name', '?'))}</td>"
            f"<td>{_e(run['label'])}<div class=note>{_e(config)}</div>{warn}</td>"
            f"<td class=n>{_fmt(run['c1_decode_tok_s'])}</td><td class=n>{_fmt(run['c4_aggregate_tok_s'])}</td>"
            f"<td class=n>{_fmt(run['acceptance_length'], '.2f')}</td>"
            f"<td class=n>{_fmt(run['acceptance_rate'], '.3f')}</td>"
            f"<td class=n>{gsm}</td><td>{_e(same)}</td></tr>"
        )
    body.append("</table>")
    if runs:
        body.append(
            '<p class="note">Identical outputs: the c=1 bench\'s output token ids compared prompt by prompt with '
            f"the first of our runs ({_e(runs[0]['label'])}).</p>"
        )
        counting = [r["label"] for r in runs if r["counting_model"] and r["gsm8k_accuracy"] is not None]
        if counting:
            body.append(f'<p class="note">GSM8K of {_e(", ".join(counting))}: {_e(COUNTING_MODEL_NOTE)}</p>')
    return body


def main(argv: list[str] | None = None) -> int:
    parser = cli.parser("magpie report", __doc__)
    parser.add_argument("runs", nargs="*", metavar="RESULT_DIR", help="result folders (run_suite.sh OUTDIRs)")
    parser.add_argument("--output", metavar="HTML", help="write the report here")
    cli.add_force(parser, "the --output file")
    parser.add_argument(
        "--seed", default=DEFAULT_SEED, help="seed figures file (default: %(default)s); 'none' to leave out"
    )
    parser.add_argument(
        "--sweep", action="append", default=[], metavar="RUN_DIR", help="a sweep.py run folder to draw (repeatable)"
    )
    parser.add_argument("--title", default="Qwen3.8-Flash-Next on vLLM 0.29: measurements", help="page title")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--summary", metavar="RESULT_DIR", help="print one screen about one result folder")
    mode.add_argument("--compare", action="store_true", help="print the runs side by side (outputs vs the first)")
    args = parser.parse_args(argv)
    if args.summary:
        print(summary_text(load_run(args.summary)))
        return 0
    runs = [load_run(folder) for folder in args.runs]
    if args.compare:
        if not runs:
            parser.error("--compare needs result folders")
        print(compare_text(runs))
        return 0
    if not args.output:
        parser.error("give --output HTML (or --summary / --compare)")
    files.check_output(args.output, args.force)
    seed = None if args.seed == "none" else _load(args.seed)
    if args.seed != "none" and seed is None:
        raise SystemExit(f"error: seed figures file {args.seed} not found (or pass --seed none)")
    sweeps = [load_sweep(folder) for folder in args.sweep]
    page = render(runs, seed, args.title, sweeps)
    files.atomic_write_text(args.output, page)
    print(
        f"wrote {args.output} ({len(page) / 1024:.0f} KiB, {len(runs)} runs, {len(sweeps)} sweeps"
        f"{', seed figures' if seed else ''})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
