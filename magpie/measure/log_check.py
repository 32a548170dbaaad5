#!/usr/bin/env python3
"""Read a vLLM server log and state which optimizations are really active.

A benchmark of "the optimized server" is worthless if the server in fact ran the baseline: a
patch not applied, an override ignored, a draft head silently replaced by the target's. This
reads what the server itself printed and reports, with the line that proves it:

- MTP speculative decoding: on (k tokens) or off;
- the MTP draft head: pruned to a keep-set (both lines the mtp_pruning patch prints: the head
  built with K rows, then still in place after vLLM decided lm_head sharing), or the full
  vocabulary shared with the target;
- ple_mmap (n-gram table on disk): asked for (--hf-overrides on 0.29, --engram-config on 0.33),
  and whether the ple_ssd patch acknowledged it;
- the CUDA-graph mode vLLM settled on (FULL_AND_PIECEWISE, PIECEWISE, NONE, ...), and eager mode;
- prefix caching; the memory guard and the watchdog; the patch states of serve.sh's run manifest
  (LOG.launch.json, beside the log);
- the memory figures vLLM logged (weights, KV cache) and whether start-up completed.

    python3 magpie log-check server.log
    python3 magpie log-check server.log --expect mtp=3 --expect draft_head=pruned --json

`--expect FEATURE=STATE` makes the exit status 1 unless the log shows that state (features:
mtp, draft_head, ple_mmap, cudagraph_mode, prefix_caching, memguard, watchdog, startup). The
patterns of vLLM's own lines and of serve.sh's are the table PATTERNS below; the lines that prove
a patch active are the `Proof-Log:` fields of the patch headers (patches/README.md), read with
the patch tool's parser from the series of the vLLM release the log names (every series when
the log names none, or one without a series).
"""

from __future__ import annotations

import json
import os
import re
import sys

from magpie import cli, files, patches
from magpie.serving import manifest

SCHEMA = files.schema("log-check", 1)

PATTERNS = {
    # vLLM 0.29.0, vllm/v1/engine/core.py: "Initializing a V1 LLM engine (v0.29.0) with config: ..."
    "engine_config": re.compile(r"Initializing a V1 LLM engine \((?P<version>[^)]*)\) with config: (?P<config>.*)"),
    "spec_config": re.compile(r"speculative_config=(?:SpeculativeConfig\((?P<spec>[^)]*)\)|None)"),
    "spec_method": re.compile(r"method='(?P<method>[^']+)'"),
    "spec_tokens": re.compile(r"num_spec_tokens=(?P<k>\d+)"),
    "cudagraph_mode": re.compile(r"'cudagraph_mode': <CUDAGraphMode\.(?P<mode>\w+): \d+>"),
    "enforce_eager": re.compile(r"enforce_eager=(?P<eager>True|False)"),
    "prefix_caching": re.compile(r"enable_prefix_caching=(?P<on>True|False)"),
    # vllm/entrypoints/... "non-default args: {...}" (the arguments the user gave)
    "non_default_args": re.compile(r"non-default args: (?P<args>\{.*\})"),
    "hf_overrides_ple": re.compile(r"'hf_overrides': \{[^}]*'ple_mmap': (?P<on>True|False)"),
    # Draft head: vLLM shares the target's lm_head with an MTP draft that has none of its own.
    "head_shared": re.compile(r"Detected MTP model\. Sharing target model lm_head weights with the draft model"),
    # Memory and start-up.
    "weights": re.compile(r"Model loading took (?P<gib>[\d.]+) GiB memory and (?P<s>[\d.]+) seconds"),
    "kv_memory": re.compile(r"Available KV cache memory: (?P<gib>[\d.]+) GiB"),
    "cpu_kv_memory": re.compile(r"Explicitly set \((?P<gib>[\d.]+)/[\d.]+\) GiB for KV cache"),
    "kv_tokens": re.compile(
        r"KV cache size: (?P<tokens>[\d,]+) tokens, Maximum concurrency for (?P<len>[\d,]+) tokens per request: "
        r"(?P<x>[\d.]+)x"
    ),
    "init_engine": re.compile(r"init engine \(profile, create kv cache, warmup model\) took (?P<s>[\d.]+) s"),
    "startup_complete": re.compile(r"Application startup complete"),
    # The memory guard and the watchdog (magpie/serving/); the launch itself is in LOG.launch.json.
    "memguard_on": re.compile(r"\[memguard [^\]]*\] guarding server PID (?P<pid>\d+)"),
    "memguard_stopped": re.compile(r"\[memguard [^\]]*\] (?P<line>.*: stopping .*)"),
    "watchdog_on": re.compile(r"\[watchdog [^\]]*\] "),
    "watchdog_stalled": re.compile(r"\[watchdog [^\]]*\] (?P<line>stalled engine: .*)"),
    # memguard run's line (serve.sh's supervisor); serve.sh wrote "# serve.sh: restart" before.
    "serve_restart": re.compile(r"^(?:\[memguard [^\]]*\] |# serve\.sh: )restart (?P<n>\d+) of (?P<of>\d+)"),
}


# The patches' lines this check reads (each declared by a `Proof-Log: NAME: REGEX` header line):
# mtp_pruning's head built with K rows and still in place after lm_head sharing; ple_ssd's config
# hook, its line per table served from the mappings (group `how`: gathered in the forward by 0001,
# staged before it by 0002) and 0002's staging line.
PROOF_LOGS = ("pruned_built", "pruned_in_use", "ple_hook", "ple_active", "ple_staging")

_VERSION = re.compile(r"Initializing a V1 LLM engine \(v?(?P<version>[^)]*)\)")


def proof_patterns(lines, patches_dir: str | None = None) -> dict[str, list[re.Pattern]]:
    """{name: [regex, ...]} from the `Proof-Log:` header lines of the series for the vLLM release
    the log names (all series when it names none, or one with no series). A name several patches
    declare (ple_active: 0001's and 0002's line) has one regex per distinct pattern."""
    root = os.path.normpath(patches_dir or patches.PATCHES_DIR)
    found = patches.available_series(root)
    if not found:
        raise patches.ToolError(
            f"no patch series under {root}: the lines that prove a patch active are the `Proof-Log:` "
            "lines of the patch headers; run log-check from a checkout (`python3 magpie log-check LOG`)"
        )
    version = next((m.group("version") for m in map(_VERSION.search, lines) if m), None)
    release = patches.release_of(version) if version else None
    folders = [found[release]] if release in found else list(found.values())
    patterns: dict[str, list[re.Pattern]] = {}
    for folder in folders:
        for patch in patches.load_series(folder):
            for proof in patch.proof_logs:
                if proof.name in PATTERNS:
                    raise patches.ToolError(
                        f"{os.path.join(folder, patch.name)}: `Proof-Log: {proof.name}` is the name of one of "
                        "vLLM's own lines in log_check's PATTERNS; name the patch's line otherwise"
                    )
                known = patterns.setdefault(proof.name, [])
                if proof.regex.pattern not in (r.pattern for r in known):
                    known.append(proof.regex)
    missing = [name for name in PROOF_LOGS if name not in patterns and release not in found]
    if missing:
        raise patches.ToolError(
            f"log_check reads the patch line(s) {', '.join(missing)}, which no `Proof-Log:` header line "
            f"under {root} declares"
        )
    return patterns


# vLLM's logger: "INFO 12-01 10:00:00 [core.py:12] ...", under a process prefix "(EngineCore_DP0 pid=7) "
VLLM_LOG_LINE = re.compile(r"^(?:\([\w.-]+ pid=\d+\) )?(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d \d\d:\d\d:\d\d")
NO_EVIDENCE = "no evidence: not one line of a vLLM server or of serve.sh in the log"


def _num(text: str) -> float:
    return float(text.replace(",", ""))


# A line longer than this is read in pieces (a log of one endless line is still read in bounded
# memory); each pattern keeps at most MAX_KEPT matches (their lines), and counts the rest.
MAX_LINE_CHARS = 1 << 20
MAX_KEPT = 64


def read_lines(path: str):
    """The lines of the log at PATH, streamed (no line longer than MAX_LINE_CHARS), as text
    with undecodable bytes replaced."""
    with open(path, encoding="utf-8", errors="replace") as f:
        while line := f.readline(MAX_LINE_CHARS):
            yield line.rstrip("\n")


class Matches:
    """Where each pattern (PATTERNS and the patches' Proof-Log lines) matched in a log's lines:
    `lines` is a list, or a callable giving a fresh iterator of them (read twice, streaming:
    once for the release the log names, once for the patterns). Only matched lines are kept."""

    def __init__(self, lines, patches_dir: str | None = None) -> None:
        def fresh():
            return lines() if callable(lines) else iter(lines)

        matchers = {name: [regex] for name, regex in PATTERNS.items()}
        matchers.update(proof_patterns(fresh(), patches_dir))
        self.kept: dict[int, str] = {}
        self.found: dict[str, list[tuple[int, re.Match]]] = {name: [] for name in (*matchers, *PROOF_LOGS)}
        self.count: dict[str, int] = dict.fromkeys(self.found, 0)
        self.lines_read = 0
        self.vllm_format_lines = 0
        for number, line in enumerate(fresh(), 1):
            self.lines_read = number
            if not self.vllm_format_lines and VLLM_LOG_LINE.match(line):
                self.vllm_format_lines = 1
            for name, regexes in matchers.items():
                match = next(filter(None, (regex.search(line) for regex in regexes)), None)
                if match:
                    self.count[name] += 1
                    if len(self.found[name]) < MAX_KEPT:
                        self.found[name].append((number, match))
                        self.kept[number] = line

    def first(self, name: str) -> tuple[int | None, re.Match | None]:
        """(line number, match) of the pattern's first line; (None, None) when no line matched."""
        return self.found[name][0] if self.found[name] else (None, None)

    def evidence(self, number: int | None) -> str | None:
        """The line that proves a state, as the output quotes it."""
        return f"line {number}: {self.kept[number].strip()[:200]}" if number else None

    def any_vllm_line(self) -> bool:
        """Whether any line of vLLM's or serve.sh's was found (a known one, or any line in vLLM's
        logger format): without one, "off" is no evidence."""
        return self.vllm_format_lines > 0 or any(self.found[name] for name in self.found)


def check(lines, patches_dir: str | None = None) -> dict:
    """The features a log shows; `lines`: a list, or a callable giving a fresh iterator of them."""
    log = Matches(lines, patches_dir)
    _, engine = log.first("engine_config")
    features = {"mtp": mtp_feature(log)}
    features["draft_head"] = draft_head_feature(log, features["mtp"]["state"])
    features["ple_mmap"] = ple_mmap_feature(log)
    features.update(engine_config_features(log))
    features.update(supervision_features(log))
    if not log.any_vllm_line():
        # Not a vLLM server's log (or an empty one): no line says anything is off.
        for info in features.values():
            if info["state"] in ("off", "not complete"):
                info["state"] = "unknown"
                info["evidence"] = NO_EVIDENCE
    return {
        "schema": SCHEMA,
        "vllm_version": engine.group("version") if engine else None,
        "features": features,
        "serve_sh": None,  # main() fills it from the run manifest (LOG.launch.json) serve.sh wrote
        "memory": memory_figures(log),
        "summary": describe(features),
    }


def mtp_feature(log: Matches) -> dict:
    """MTP on (k tokens, or another speculative method), off, or unknown, from the engine's configuration."""
    spec_number, spec = log.first("spec_config")
    if spec is None:
        return {"state": "unknown", "evidence": "no engine configuration line (did the server start?)"}
    if spec.group("spec") is None:
        return {"state": "off", "num_speculative_tokens": 0, "evidence": log.evidence(spec_number)}
    method = PATTERNS["spec_method"].search(spec.group("spec"))
    tokens = PATTERNS["spec_tokens"].search(spec.group("spec"))
    return {
        "state": "on" if method and method.group("method") == "mtp" else (method.group("method") if method else "on"),
        "num_speculative_tokens": int(tokens.group("k")) if tokens else None,
        "evidence": log.evidence(spec_number),
    }


def draft_head_feature(log: Matches, mtp_state: str) -> dict:
    """The draft head: pruned to a keep-set (both of the patch's lines), built but not yet in use,
    the target's shared, or none when MTP is off."""
    built_number, built = log.first("pruned_built")
    use_number, in_use = log.first("pruned_in_use")
    shared_number, _ = log.first("head_shared")
    if built and in_use:
        return {
            "state": "pruned",
            "keep_ids": int(_num(built.group("keep"))),
            "vocab_size": int(_num(built.group("vocab"))),
            "keep_set": built.group("path").rstrip(",;"),
            "evidence": [log.evidence(built_number), log.evidence(use_number)],
        }
    if built:
        return {
            "state": "pruned head built, not yet confirmed in use",
            "keep_ids": int(_num(built.group("keep"))),
            "evidence": [log.evidence(built_number)],
            "note": "the second line appears at the first speculative step; send a request, then check again",
        }
    if mtp_state == "off":
        return {"state": "none (MTP off)", "evidence": None}
    if shared_number:
        return {"state": "full (shared with the target)", "evidence": log.evidence(shared_number)}
    return {"state": "unknown", "evidence": None}


def ple_mmap_feature(log: Matches) -> dict:
    """ple_mmap: on (a table line of the ple_ssd patch, and how its rows are read), asked for but
    not confirmed, or off."""
    asked_number, asked = log.first("hf_overrides_ple")
    active_number, active = log.first("ple_active")
    hook_number, _ = log.first("ple_hook")
    staging_number, _ = log.first("ple_staging")
    if active is not None:
        how = active.group("how")
        if how.startswith("rows read by the GPU"):  # vLLM 0.33's Engram storage mode where ATS is reported
            rows = "read by the GPU straight from the checkpoint's file mappings (ple_ssd on 0.33, ATS)"
        elif how.startswith("rows staged"):
            rows = "staged before the forward (ple_ssd 0002; on 0.33 the Engram storage mode)"
        else:
            rows = "gathered inside the forward by a custom op (ple_ssd 0001 only; PIECEWISE graphs)"
        return {
            "state": "on",
            "tables": log.count["ple_active"],
            "rows": rows,
            "evidence": [log.evidence(n) for n in (asked_number, hook_number, active_number, staging_number) if n],
        }
    if (asked is not None and asked.group("on") == "True") or hook_number:
        # Asked through 0.29's hf-override, or the patch's hook line: on 0.29 the patch's own, on
        # 0.33 the resolved Engram configuration with offload_storage='mmap' (--engram-config).
        return {
            "state": "requested, not confirmed",
            "evidence": [log.evidence(n) for n in (asked_number, hook_number) if n],
            "note": "ple_mmap was asked for, but no table line of the ple_ssd patch says the table is served "
            "from the checkpoint's mappings (not applied, or the server stopped before loading)",
        }
    return {"state": "off", "evidence": log.evidence(asked_number)}


def engine_config_features(log: Matches) -> dict[str, dict]:
    """CUDA graphs, eager mode and prefix caching, all read from the engine configuration line."""
    number, match = log.first("engine_config")
    config_text = match.group("config") if match else ""
    mode = PATTERNS["cudagraph_mode"].search(config_text)
    eager = PATTERNS["enforce_eager"].search(config_text)
    prefix = PATTERNS["prefix_caching"].search(config_text)
    return {
        "cudagraph_mode": {
            "state": mode.group("mode") if mode else "unknown",
            "enforce_eager": eager.group("eager") == "True" if eager else None,
            "evidence": log.evidence(number),
        },
        "prefix_caching": {
            "state": ("on" if prefix.group("on") == "True" else "off") if prefix else "unknown",
            "evidence": log.evidence(number),
        },
    }


def supervision_features(log: Matches) -> dict[str, dict]:
    """The memory guard, the watchdog (and serve.sh's restarts), and whether start-up completed."""
    guard_number, _ = log.first("memguard_on")
    stop_number, _ = log.first("memguard_stopped")
    watch_number, _ = log.first("watchdog_on")
    stall_number, _ = log.first("watchdog_stalled")
    complete_number, _ = log.first("startup_complete")
    return {
        "memguard": {
            "state": "stopped the server" if stop_number else ("on" if guard_number else "off"),
            "evidence": log.evidence(stop_number or guard_number),
        },
        "watchdog": {
            "state": "found a stalled engine" if stall_number else ("on" if watch_number else "off"),
            "restarts": log.count["serve_restart"],
            "evidence": log.evidence(stall_number or watch_number),
        },
        "startup": {
            "state": "complete" if complete_number else "not complete",
            "evidence": log.evidence(complete_number),
        },
    }


def memory_figures(log: Matches) -> dict[str, float]:
    """The memory and start-up figures vLLM logged, each from its first line."""
    memory = {}
    for name, key, group in (
        ("weights", "weights_gib", "gib"),
        ("weights", "load_s", "s"),
        ("kv_memory", "kv_cache_gib", "gib"),
        ("cpu_kv_memory", "kv_cache_gib", "gib"),
        ("kv_tokens", "kv_cache_tokens", "tokens"),
        ("kv_tokens", "max_concurrency", "x"),
        ("init_engine", "init_engine_s", "s"),
    ):
        if log.found[name] and key not in memory:
            memory[key] = _num(log.found[name][0][1].group(group))
    return memory


def describe(features: dict) -> str:
    mtp = features["mtp"]
    parts = [f"MTP k={mtp['num_speculative_tokens']}" if mtp["state"] == "on" else f"MTP {mtp['state']}"]
    if mtp["state"] == "on":
        head = features["draft_head"]
        parts.append(
            f"pruned draft head ({head['keep_ids']} ids)"
            if head["state"] == "pruned"
            else f"draft head {head['state']}"
        )
    parts.append(f"ple_mmap {features['ple_mmap']['state']}")
    parts.append(f"cudagraph {features['cudagraph_mode']['state']}")
    parts.append(f"prefix caching {features['prefix_caching']['state']}")
    return ", ".join(parts)


def matches_expectation(features: dict, feature: str, wanted: str) -> bool:
    info = features.get(feature)
    if info is None:
        return False
    if feature == "mtp" and wanted.isdigit():
        return info["state"] == "on" and info.get("num_speculative_tokens") == int(wanted)
    if feature == "draft_head" and wanted == "full":
        return info["state"].startswith("full")
    return info["state"].lower() == wanted.lower()


def main(argv: list[str] | None = None) -> int:
    parser = cli.parser("magpie log-check", __doc__)
    parser.add_argument("log", help="the server log (serve.sh's LOG, or any vLLM server output)")
    parser.add_argument("--expect", action="append", default=[], metavar="FEATURE=STATE", help="require a state")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    parser.add_argument("--output", metavar="JSON", help="also write the JSON here")
    cli.add_force(parser, "the --output file")
    args = parser.parse_args(argv)
    files.check_output(args.output, args.force)
    files.check_input(args.log, "the log")
    try:
        result = check(lambda: read_lines(args.log))
    except patches.ToolError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    result["log"] = args.log
    try:
        record = manifest.load(args.log)  # serve.sh's run manifest: the launch as data, not the header's text
    except manifest.ManifestError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if record is not None:
        result["serve_sh"] = {
            "header": manifest.header(record),
            "patches": manifest.patch_states(record),
            "manifest": manifest.path_for(args.log),
        }
    failures = []
    for item in args.expect:
        feature, _, wanted = item.partition("=")
        if not wanted:
            parser.error(f"--expect {item!r}: use FEATURE=STATE, e.g. mtp=3, draft_head=pruned, ple_mmap=on")
        if not matches_expectation(result["features"], feature, wanted):
            info = result["features"].get(feature, {})
            state = info.get("state", "no such feature")
            if info.get("evidence") == NO_EVIDENCE:
                state = f"{state} ({NO_EVIDENCE})"
            failures.append(f"{feature}: expected {wanted}, the log shows {state}")
    result["expectations_failed"] = failures
    if args.output:
        files.atomic_write_json(args.output, result)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print(f"{args.log}: {result['summary']}")
        for name, info in result["features"].items():
            detail = {k: v for k, v in info.items() if k not in ("state", "evidence")}
            extra = "  " + ", ".join(f"{k}={v}" for k, v in detail.items()) if detail else ""
            print(f"  {name:15s} {info['state']}{extra}")
            evidence = info.get("evidence")
            for line in evidence if isinstance(evidence, list) else [evidence] if evidence else []:
                print(f"  {'':15s}   {line[:150]}")
        if result["serve_sh"] and result["serve_sh"]["patches"]:
            print("  patches        " + ", ".join(f"{k}: {v}" for k, v in result["serve_sh"]["patches"].items()))
        if result["memory"]:
            print("  memory         " + ", ".join(f"{k}={v:g}" for k, v in result["memory"].items()))
    for failure in failures:
        print(f"error: {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(cli.run_tool("log-check", main, sys.argv[1:]))
