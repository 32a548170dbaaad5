"""Reading a configuration's log and results: the lines that prove which path ran, the failure
excerpt, and the comparisons between configurations (greedy ids, acceptance, speed, sampling
statistics). Standard library only, so it runs anywhere (tests/gpu runs it on the CPU).
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import subprocess

# label -> regex over the log; each label keeps its first MAX_LINES matching lines.
PROOF_PATTERNS = {
    "runner": r"Using V2 Model Runner|V2 model runner|use_v2_model_runner",
    "cudagraph": r"cudagraph_mode|CUDAGraphMode|Capturing CUDA graphs|Graph capturing finished|cudagraph",
    "compile": r"torch\.compile|Compiling a graph|compile range|Dynamo bytecode transform",
    "backend": r"Using .*[Bb]ackend|[Bb]ackend (selected|chosen)|gdn_prefill_backend|TRITON_ATTN|MoE backend",
    "mtp_pruning": r"MTP draft vocab pruned|draft_vocab_path",
    "ple_ssd": r"ple_mmap",
    "spec_decode": r"SpecDecoding metrics|speculative",
    "model": r"Resolved architecture|Loading weights took|Model loading took",
}
MAX_LINES = 8
FAILURE = re.compile(r"Traceback|Error|error:|Exception|RuntimeError|AssertionError|CUDA error|Killed")


def parse_result(text: str) -> dict | None:
    """The worker's last `RESULT {json}` line, or None."""
    for line in reversed(text.splitlines()):
        if line.startswith("RESULT "):
            try:
                return json.loads(line[len("RESULT ") :])
            except json.JSONDecodeError:
                return None
    return None


def log_proof(text: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for label, pattern in PROOF_PATTERNS.items():
        regex = re.compile(pattern)
        lines = []
        for line in text.splitlines():
            if line.startswith("RESULT "):
                continue
            if regex.search(line):
                lines.append(line.strip()[:400])
                if len(lines) >= MAX_LINES:
                    break
        out[label] = lines
    return out


def failure_excerpt(text: str, lines: int = 30) -> list[str]:
    """The last traceback of the log, else its last error-looking lines, else its tail."""
    all_lines = [ln for ln in text.splitlines() if not ln.startswith("RESULT ")]
    for i in range(len(all_lines) - 1, -1, -1):
        if all_lines[i].startswith("Traceback"):
            return [ln[:400] for ln in all_lines[i : i + 60]][-lines:]
    hits = [ln[:400] for ln in all_lines if FAILURE.search(ln)]
    return hits[-lines:] if hits else [ln[:400] for ln in all_lines[-lines:]]


def one_line(result: dict) -> str:
    name = result.get("config", "?")
    if not result.get("ok"):
        why = result.get("error") or (result.get("failure_excerpt") or ["?"])[-1]
        return f"{name}: FAILED rc={result.get('rc')} {result.get('wall_s')} s: {str(why)[:300]}"
    parts = [f"{name}: ok {result.get('wall_s')} s (init {result.get('init_s')} s)"]
    eng = result.get("engine", {})
    parts.append(f"v2={eng.get('v2_model_runner')} {eng.get('cudagraph_mode')}")
    for check in ("greedy_increment", "sampling", "ple"):
        if check in result:
            spec = result[check].get("spec", {})
            extra = result[check].get("exact", "")
            parts.append(f"{check} {extra} L={spec.get('mean_acceptance_length')} pos={spec.get('acceptance_per_pos')}")
            parts.append(f"steps={result[check].get('counts', {}).get('steps')}")
    if "ple_scale" in result:
        runs = result["ple_scale"]["runs"]
        parts.append(
            " ".join(f"{k}={v['decode_tok_s']} tok/s stage p50 {v['stage'].get('us_p50')} us" for k, v in runs.items())
        )
    if "speed" in result:
        sp = result["speed"]
        parts.append(" ".join(f"{k}={sp[k]['decode_tok_s']} tok/s ({sp[k]['exact']})" for k in sp if _is_conc(k)))
    return " | ".join(parts)


def _is_conc(key: str) -> bool:
    """speed results: "c1", "c4", ... (not "check_s")."""
    return re.fullmatch(r"c\d+", key) is not None


def machine() -> dict:
    info = {"host": platform.node(), "python": platform.python_version(), "cpus": os.cpu_count()}
    try:
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        info["gpu"] = smi.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        info["gpu"] = None
    return info


# ------------------------------------------------------------------------ sampling statistics


def _gamma_q(a: float, x: float) -> float:
    """Regularized upper incomplete gamma Q(a, x) (series / continued fraction)."""
    if x <= 0:
        return 1.0
    gln = math.lgamma(a)
    if x < a + 1:
        term = total = 1.0 / a
        n = a
        for _ in range(1000):
            n += 1
            term *= x / n
            total += term
            if abs(term) < abs(total) * 1e-14:
                break
        return max(0.0, 1.0 - total * math.exp(-x + a * math.log(x) - gln))
    b, c, d = x + 1 - a, 1e300, 1.0 / (x + 1 - a)
    h = d
    for i in range(1, 1000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = 1e-300 if abs(d) < 1e-300 else d
        c = b + an / c
        c = 1e-300 if abs(c) < 1e-300 else c
        d = 1.0 / d
        h *= d * c
        if abs(d * c - 1) < 1e-14:
            break
    return math.exp(-x + a * math.log(x) - gln) * h


def token_stats(sequences: list[list[int]], last_prompt_ids: list[int], bins: int = 16, vocab: int = 4096) -> dict:
    """Per generated token: was it previous + 1; is it even; and a histogram with one bin for
    'previous + 1' and `bins` bins of token id for the rest."""
    plus1 = even = total = 0
    hist = [0] * (bins + 1)
    for seq, last in zip(sequences, last_prompt_ids, strict=False):
        prev = last
        for tok in seq:
            total += 1
            even += tok % 2 == 0
            if tok == prev + 1:
                plus1 += 1
                hist[0] += 1
            else:
                hist[1 + min(bins - 1, tok * bins // vocab)] += 1
            prev = tok
    return {"tokens": total, "plus1_rate": plus1 / max(total, 1), "even_rate": even / max(total, 1), "hist": hist}


def two_sample(a: dict, b: dict) -> dict:
    """z of the two proportions, and a chi-square homogeneity test of the two histograms."""
    out = {}
    for key in ("plus1_rate", "even_rate"):
        pa, pb, na, nb = a[key], b[key], a["tokens"], b["tokens"]
        pooled = (pa * na + pb * nb) / max(na + nb, 1)
        se = math.sqrt(max(pooled * (1 - pooled) * (1 / max(na, 1) + 1 / max(nb, 1)), 1e-300))
        out[key] = {"a": round(pa, 4), "b": round(pb, 4), "z": round((pa - pb) / se, 2)}
    ha, hb = a["hist"], b["hist"]
    na, nb = sum(ha), sum(hb)
    chi2, df = 0.0, -1
    for x, y in zip(ha, hb, strict=False):
        if x + y == 0:
            continue
        df += 1
        ea, eb = (x + y) * na / (na + nb), (x + y) * nb / (na + nb)
        chi2 += (x - ea) ** 2 / ea + (y - eb) ** 2 / eb
    out["chi2"] = round(chi2, 2)
    out["df"] = df
    out["p_value"] = round(_gamma_q(df / 2, chi2 / 2), 4) if df > 0 else None
    return out


# ------------------------------------------------------------------------------ comparisons


def first_differences(a: list[list[int]], b: list[list[int]], last_prompt_ids: list[int], limit: int = 8) -> list:
    """Where two same-seed runs part: prompt index, token position, the token before it (in
    both runs; -1 = the prompt's last id) and the two tokens."""
    out = []
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        for pos, (u, v) in enumerate(zip(x, y, strict=False)):
            if u != v:
                before = x[pos - 1] if pos else last_prompt_ids[i]
                out.append({"prompt": i, "pos": pos, "token_before": before, "this": u, "base": v})
                break
        if len(out) >= limit:
            break
    return out


def compare(results: dict) -> dict:
    out = {}
    for name, res in results.items():
        base_name = res.get("compare_to")
        if not res.get("ok"):
            continue
        base = results.get(base_name) if base_name else None
        entry: dict = {}
        if "greedy_increment" in res:
            g = res["greedy_increment"]
            entry["greedy_exact"] = g["exact"]
            entry["acceptance_per_pos"] = g["spec"].get("acceptance_per_pos")
            entry["mean_acceptance_length"] = g["spec"].get("mean_acceptance_length")
            if base and base.get("ok") and "greedy_increment" in base:
                entry["ids_equal_to_" + base_name] = g["ids"] == base["greedy_increment"]["ids"]
        if "speed" in res:
            entry["decode_tok_s"] = {k: v["decode_tok_s"] for k, v in res["speed"].items() if _is_conc(k)}
            if base and base.get("ok") and "speed" in base:
                entry["speedup_vs_" + base_name] = {
                    k: round(v["decode_tok_s"] / base["speed"][k]["decode_tok_s"], 3)
                    for k, v in res["speed"].items()
                    if _is_conc(k) and k in base["speed"]
                }
                prof, bprof = res["speed"].get("profile"), base["speed"].get("profile")
                if prof and bprof:
                    entry["gpu_us_per_step"] = {"this": prof["gpu_us_per_step"], base_name: bprof["gpu_us_per_step"]}
        if "sampling" in res:
            s = res["sampling"]
            last = s["prompts_last_ids"]
            entry["same_seed_same_text_in_process"] = s["same_seed_same_text_in_process"]
            entry["acceptance_per_pos"] = s["spec"].get("acceptance_per_pos")
            stats = token_stats(s["ids_seed0"], last)
            entry["stats_seed0"] = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in stats.items()}
            if s.get("ids_seed10000"):
                entry["noise_floor_seed0_vs_seed10000"] = two_sample(stats, token_stats(s["ids_seed10000"], last))
            if base and base.get("ok") and "sampling" in base:
                b = base["sampling"]
                same = sum(x == y for x, y in zip(s["ids_seed0"], b["ids_seed0"], strict=False))
                entry["same_seed_same_text_vs_" + base_name] = f"{same}/{len(b['ids_seed0'])}"
                entry["first_differences"] = first_differences(s["ids_seed0"], b["ids_seed0"], last)
                entry["vs_" + base_name] = two_sample(stats, token_stats(b["ids_seed0"], last))
        if "ple" in res:
            p = res["ple"]
            entry["stage"] = p["counts"].get("stage")
            entry["lookup"] = p["counts"].get("lookup")
            entry["steps"] = p["counts"].get("steps")
            entry["replays"] = p["counts"].get("replays")
            entry["memory"] = p.get("memory")
            if base and base.get("ok") and "ple" in base:
                entry["ids_equal_to_" + base_name] = p["ids"] == base["ple"]["ids"]
        if "ple_scale" in res:
            p = res["ple_scale"]
            entry["runs"] = {
                k: {"decode_tok_s": v["decode_tok_s"], "stage": v["stage"], "per_step": v["per_step"]}
                for k, v in p["runs"].items()
            }
            entry["table_residency_after"] = p["table_residency_after"]
            entry["cgroup"] = p.get("cgroup")
            if base and base.get("ok") and "ple_scale" in base:
                entry["ids_equal_to_" + base_name] = {
                    k: v == base["ple_scale"]["ids"].get(k) for k, v in p["ids"].items()
                }
                entry["tok_s_vs_" + base_name] = {
                    k: round(v["decode_tok_s"] / base["ple_scale"]["runs"][k]["decode_tok_s"], 3)
                    for k, v in p["runs"].items()
                    if k in base["ple_scale"]["runs"]
                    and v["decode_tok_s"]
                    and base["ple_scale"]["runs"][k]["decode_tok_s"]
                }
        out[name] = entry
    return out


def summary_text(doc: dict) -> str:
    lines = [f"gpu harness results, {doc.get('written_utc')}, machine {doc.get('machine')}"]
    for res in doc.get("results", {}).values():
        lines.append(one_line(res))
    lines.append("comparisons:")
    for name, entry in doc.get("comparisons", {}).items():
        lines.append(f"  {name}: {json.dumps(entry)}")
    return "\n".join(lines) + "\n"
