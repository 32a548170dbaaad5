"""The run manifest of a server serve.sh starts: `LOG.launch.json`, beside the log.

`launch plan` writes it (atomically) before vLLM starts, and `launch exec` runs what it says, so
the command it records is the command that ran. It holds, as data, everything the text header
at the top of LOG says, and more:

    schema        "magpie/launch/1"
    argv env cwd  what `launch exec` runs: the argv (the vLLM command, behind `memguard exec` under
                  MEM_HARD_LIMIT), the variables it sets, the server's working directory
    command       the `vllm serve` argv; command_text: the same, quoted for bash
    model, server {host, port, url}, log, started, user, node, caller_cwd, pythonpath
    profile       {name, path, values}: the `vllm serve --config` file and what it holds
    overrides     {VARIABLE: value} of serve.sh's variables applied over the profile; extra_args;
                  mem_hard_limit; config: the resolved profile (what `command` was expanded from)
    gb10          {applied, environment, notes}: the GB10 settings and why
    checks        {keep_set: {path, bytes, sha256, ids, vocab_size, first_id, last_id, rules} or
                  null, jit_tools}
    versions      {python, host, vllm, torch, gpu, flashinfer, transformers, driver, magpie}
                  (magpie: {commit, ref, root} of the git checkout, null outside one)
    patches       the patch tool's status of the served vLLM, as `patches.py status --json` has it
                  ({target, series, patches: [{name, state, detail, requires}]}), plus `table` (its
                  text); {error, table} when the tool could not tell

Readers (log_check, report) call `load(LOG)` and never parse the log's header:

    from magpie.serving import manifest
    record = manifest.load("server.log")   # None: no manifest beside this log
    manifest.patch_states(record)          # {"mtp_pruning/0001-...patch": "applied", ...}
    manifest.header(record)                # {"command": ..., "vllm": ..., ...}: the header's key: value lines

Standard library only.
"""

from __future__ import annotations

import json
import os
from typing import Any

from magpie import files

__all__ = [
    "SCHEMA",
    "SUFFIX",
    "ManifestError",
    "header",
    "header_lines",
    "header_text",
    "load",
    "patch_states",
    "path_for",
    "write",
]

SCHEMA = files.schema("launch", 1)
SUFFIX = ".launch.json"
OUTPUT_MARK = "# ---- vLLM output follows"


class ManifestError(ValueError):
    """A manifest that exists but cannot be used; the message names the file and the problem."""


def path_for(log: str | os.PathLike) -> str:
    """The manifest of the server log LOG (LOG.launch.json); a manifest's own path is kept."""
    log = os.fspath(log)
    return log if log.endswith(SUFFIX) else log + SUFFIX


def write(log: str | os.PathLike, record: dict[str, Any]) -> str:
    """Write RECORD as LOG's manifest, then LOG itself holding only the header (header_text),
    each atomically (a reader sees the old file or the new one, never half of one); return the
    manifest's path. vLLM's output is appended to LOG after that."""
    if record.get("schema") != SCHEMA:
        raise ValueError(f"a manifest record has schema {SCHEMA!r}, not {record.get('schema')!r}")
    path = path_for(log)
    text = header_text(record)  # rendered first: a record that cannot be rendered writes nothing
    files.atomic_write_text(path, json.dumps(record, indent=1) + "\n")
    files.atomic_write_text(os.fspath(log), text)
    return path


def load(log: str | os.PathLike) -> dict[str, Any] | None:
    """The manifest of the server log LOG (or a manifest's own path): None when there is none
    (a log serve.sh did not write); ManifestError when it cannot be read or is of another schema."""
    path = path_for(log)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise ManifestError(f"{path}: cannot be read ({e.strerror})") from None
    try:
        record = json.loads(text)
    except ValueError as e:
        raise ManifestError(f"{path}: not JSON ({e})") from None
    if not isinstance(record, dict) or files.schema_of(record.get("schema")) != files.schema_of(SCHEMA):
        schema = record.get("schema") if isinstance(record, dict) else None
        raise ManifestError(
            f"{path}: schema {schema!r}, expected {SCHEMA!r} (a plan of an older serve.sh has no schema: "
            "start the server again to get a manifest)"
        )
    return record


def patch_states(record: dict[str, Any]) -> dict[str, str]:
    """{patch name: "applied" | "not applied" | "conflicting"}; empty when the patch tool could not tell."""
    return {p["name"]: p["state"] for p in (record.get("patches") or {}).get("patches", [])}


def header_lines(record: dict[str, Any]) -> list[str]:
    """The log header serve.sh writes above vLLM's output, line by line, without the "# ":
    a rendering of the manifest, so the two cannot disagree."""
    from magpie.serving import preflight

    server = record["server"]
    lines = [
        f"serve.sh: started {record['started']} by {record['user']}@{record['node']}",
        f"command: {record['command_text']}",
        f"profile: {record['profile']['name']} ({record['profile']['path']})",
        f"settings: {' '.join(f'{k}={v}' for k, v in record['overrides'].items()) or 'none'} (over the profile); "
        f"HOST={server['host']} PORT={server['port']} MEM_HARD_LIMIT={record['mem_hard_limit'] or 'none'}",
        f"working directory: {record['cwd']} (caller's: {record['caller_cwd']})",
        f"PYTHONPATH: {record['pythonpath']}",
        *record["gb10"]["notes"],
        f"resolved config: {json.dumps(record['config'], sort_keys=True)}",
        *preflight.check_lines(record["checks"]),
        *preflight.version_lines(record["versions"]),
    ]
    lines += [f"patches: {line}" for line in record["patches"]["table"]]
    return lines


def header_text(record: dict[str, Any]) -> str:
    """The top of the log: header_lines as `# ` comments, then the line vLLM's output follows."""
    return "".join(f"# {line}\n" for line in header_lines(record)) + OUTPUT_MARK + "\n"


def header(record: dict[str, Any]) -> dict[str, str]:
    """{key: value} of the header's `# key: value` lines whose key is lower-case words (command,
    profile, settings, working directory, resolved config, keep-set, jit tools, python, host,
    vllm, torch, gpu, flashinfer, transformers, driver, magpie), the first of each key: what
    log_check read from the log's text before there was a manifest. The patch rows are in
    patch_states()."""
    found: dict[str, str] = {}
    for line in header_lines(record):
        key, sep, value = line.partition(": ")
        if sep and key != "patches" and key[:1].islower() and all(c.islower() or c in " -" for c in key):
            found.setdefault(key, value)
    return found
