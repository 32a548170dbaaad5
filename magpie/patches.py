#!/usr/bin/env python3
"""Apply, check, revert and report magpie-vllm-plugins' patches on a vLLM installation.

The target is either a vLLM source tree (a checkout or an unpacked sdist) or an installed
package (the site-packages folder of a venv, found from its Python interpreter). Patches are
listed in apply order in one series per vLLM release (`patches/vllm-<version>/series`); the
tool picks the series that matches the target's vLLM version (`--series` picks another). Each
patch states what it requires in its header.

    magpie/patches.py status --python ~/venvs/vllm/bin/python
    magpie/patches.py apply ple_ssd --python ~/venvs/vllm/bin/python
    magpie/patches.py revert --target ~/src/vllm
    magpie/patches.py rebase --base ~/sdist/vllm-0.29.0 --target ~/src/vllm   # onto another release
    magpie/patches.py check-sources      # the modules the patches create match magpie/vllm_modules/

The series: installed (`pip install .`), the copy the package carries (magpie/patch_series/); in
a checkout, ../patches. Copied on its own beside a patches/ folder (or given --patches-dir), the
file does status, check, apply, revert and list; `rebase` (magpie/patch_rebase.py), `diff`
(magpie/patch_diff.py) and `refresh`, `check-sources` and `extract` (magpie/vllm_modules/
sources.py, beside the module sources they read) need the checkout or the installed package.

Everything is checked before anything changes: an apply or revert that cannot go through
completely changes no file. Hunks must match exactly (an offset is allowed, fuzz is not). The
files are written as one set through a journal (.magpie-patches.journal beside vllm/): SIGINT,
SIGTERM and SIGHUP wait until the set is written, and a run killed outright is rolled back by
the next run on the tree. One run at a time per tree: a second waits (--wait SECONDS, default
60), then is refused naming the first.
Standard library only, and no `git apply`: git run inside another repository's work tree (a
venv inside a project) silently skips paths outside it.

Exit codes: 0 success; 1 the request cannot be carried out (conflict, missing prerequisite,
the target locked by another run, with `status --require-applied`: a selected patch is not
applied); 2 usage or target error; 3 (`status`) a patch is conflicting; 130/143 interrupted by
SIGINT/SIGTERM; 141 the reader of stdout stopped early (`| head`), as for a process killed by
SIGPIPE. A `revert` of every applied patch is refused (1) while a patch is
conflicting: the tree would be neither stock nor patched.
"""

# Why this file is ~1,500 lines: it is the patch tool a user copies on its own (patches/README.md),
# so everything `status`, `check`, `apply`, `revert` and `list` need must sit in this one file,
# standard library only: the header parser, the series lookup, the exact-match hunk applier, the
# target discovery (a tree, a site-packages folder, an interpreter), the journal that writes a
# change set whole through signals and crashes, the per-tree lock, and the command line. What a
# copied tool does not need lives elsewhere: the three-way merge and `rebase` in
# magpie/patch_rebase.py, `diff` in magpie/patch_diff.py, the module sources' `refresh`,
# `check-sources` and `extract` in magpie/vllm_modules/sources.py, the tools' run_piped in
# magpie/cli.py. The release lookup (release_of, release_key, the series folders) is defined here
# once and magpie/releases.py imports it, because this file cannot import anything of the package.

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import difflib
import fcntl
import glob
import hashlib
import importlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
# The series an installed package carries (setup.py copies the checkout's patches/ there).
SHIPPED_SERIES = os.path.join(_HERE, "patch_series")
# Where the series are: installed, the shipped copy; in a checkout (or this file copied on its
# own beside a patches/ folder), ../patches (`patches/vllm-<release>/series`).
PATCHES_DIR = SHIPPED_SERIES if os.path.isdir(SHIPPED_SERIES) else os.path.join(_HERE, os.pardir, "patches")

APPLIED = "applied"
NOT_APPLIED = "not applied"
CONFLICTING = "conflicting"


class ToolError(Exception):
    """A problem with the request, the target or the patch files (exit 2)."""


class Refusal(Exception):
    """The request is well-formed but cannot be carried out as asked (exit 1)."""


# --------------------------------------------------------------------------------------------
# Patch files


@dataclasses.dataclass
class Hunk:
    header: str
    old_start: int
    old_lines: list[str]  # each line with its terminator ("\n", or none at end of file)
    new_lines: list[str]


@dataclasses.dataclass
class FilePatch:
    path: str  # relative to the target root, e.g. "vllm/config/speculative.py"
    old_exists: bool
    new_exists: bool
    hunks: list[Hunk]


@dataclasses.dataclass
class Patch:
    name: str  # as listed in the series, e.g. "ple_ssd/0001-mmap-ngram-table.patch"
    fields: dict[str, str]
    requires: list[str]
    files: list[FilePatch]

    @property
    def proof_logs(self) -> list[ProofLog]:
        return proof_logs(self.fields, self.name)

    @property
    def description(self) -> str:
        return self.fields.get("description", "").splitlines()[0] if self.fields else ""


_HUNK_RE = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def _strip_prefix(path: str) -> str:
    path = path.split("\t")[0]
    if path.startswith(("a/", "b/")):
        return path[2:]
    return path


# Header fields a field may repeat (one line each); their values are joined with "\n".
REPEATED_FIELDS = ("proof-log",)
REQUIRED_FIELDS = ("description", "target", "requires", "activation", "last-update", "proof-log")
_PROOF_LOG_RE = re.compile(r"^(?P<name>[a-z][a-z0-9_]*): (?P<regex>.+)$")


def parse_header(text: str) -> dict[str, str]:
    """DEP-3 style `Field: value` lines (continuation lines start with a space). Field names are
    lower-cased; a field of REPEATED_FIELDS may be given once per line (values joined by "\n")."""
    fields: dict[str, str] = {}
    key = None
    for line in text.splitlines():
        if line.startswith((" ", "\t")) and key:
            fields[key] += "\n" + line.strip()
        elif re.match(r"^[A-Za-z][A-Za-z0-9-]*:", line):
            key, _, value = line.partition(":")
            key = key.lower()
            if key in REPEATED_FIELDS and key in fields:
                fields[key] += "\n" + value.strip()
            else:
                fields[key] = value.strip()
        elif line.strip() in ("", "---"):
            key = None if line.strip() == "---" else key
    return fields


@dataclasses.dataclass(frozen=True)
class ProofLog:
    """A line the patched vLLM logs when the patch is active (`Proof-Log: NAME: REGEX`)."""

    name: str  # what log_check calls the line, e.g. "pruned_built"
    regex: re.Pattern


def proof_logs(fields: dict[str, str], source: str = "patch") -> list[ProofLog]:
    """The `Proof-Log:` lines of a header, each `NAME: REGEX` (a Python regular expression that
    log_check searches each log line with; its named groups are the figures it reads), or one
    `Proof-Log: none`."""
    values = [v for v in fields.get("proof-log", "").splitlines() if v]
    if values == ["none"]:
        return []  # a patch that prints nothing of its own (the tool's test fixtures)
    found = []
    for value in values:
        m = _PROOF_LOG_RE.match(value)
        if not m:
            raise ToolError(
                f"{source}: `Proof-Log: {value}`: expected `Proof-Log: NAME: REGEX` "
                "(NAME lower-case letters, digits and _, e.g. `Proof-Log: ple_staging: ple_mmap: .* stages`)"
            )
        try:
            regex = re.compile(m.group("regex"))
        except re.error as e:
            raise ToolError(
                f"{source}: `Proof-Log: {m.group('name')}`: the regular expression does not compile: {e}"
            ) from None
        found.append(ProofLog(m.group("name"), regex))
    return found


def validate_header(fields: dict[str, str], source: str) -> None:
    """Refuse a header that lacks a field of the convention (patches/README.md) or has one malformed."""
    for field in REQUIRED_FIELDS:
        if not fields.get(field, "").strip():
            spelled = "-".join(part.capitalize() for part in field.split("-"))
            raise ToolError(
                f"{source}: the header has no `{spelled}:` field (see patches/README.md, Header convention)"
                + (
                    ": add `Last-Update: YYYY-MM-DD`, the date of the patch's last change"
                    if field == "last-update"
                    else ""
                )
            )
    date = fields["last-update"].strip()
    if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", date):
        raise ToolError(f"{source}: `Last-Update: {date}` is not a date; write it as YYYY-MM-DD")
    try:
        datetime.date.fromisoformat(date)
    except ValueError as e:
        raise ToolError(f"{source}: `Last-Update: {date}`: {e}") from None
    proof_logs(fields, source)


def parse_patch(name: str, text: str) -> Patch:
    """Parse a git-style unified diff with a DEP-3 style header above the first `diff --git`."""
    first = text.find("diff --git ")
    if first < 0:
        raise ToolError(f"{name}: no `diff --git` section found")
    fields = parse_header(text[:first])
    requires = [r.strip() for r in fields.get("requires", "").split(",") if r.strip()]
    requires = [r for r in requires if r.lower() != "none"]
    lines = text[first:].split("\n")
    files: list[FilePatch] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if not line.startswith("diff --git "):
            i += 1
            continue
        old_path = new_path = None
        i += 1
        while i < len(lines) and not lines[i].startswith(("@@", "diff --git ")):
            meta = lines[i]
            if meta.startswith("--- "):
                old_path = meta[4:]
            elif meta.startswith("+++ "):
                new_path = meta[4:]
            elif meta.startswith(("rename ", "copy ", "Binary files", "GIT binary patch")):
                raise ToolError(f"{name}: unsupported diff feature: {meta!r}")
            i += 1
        if old_path is None or new_path is None:
            raise ToolError(f"{name}: a file section has no ---/+++ lines (mode-only change?)")
        old_exists = old_path != "/dev/null"
        new_exists = new_path != "/dev/null"
        path = _strip_prefix(new_path if new_exists else old_path)
        hunks: list[Hunk] = []
        while i < len(lines) and lines[i].startswith("@@"):
            m = _HUNK_RE.match(lines[i])
            if not m:
                raise ToolError(f"{name}: malformed hunk header {lines[i]!r} in {path}")
            header = lines[i]
            old_count = int(m.group(2)) if m.group(2) is not None else 1
            new_count = int(m.group(4)) if m.group(4) is not None else 1
            old: list[str] = []
            new: list[str] = []
            i += 1
            while len(old) < old_count or len(new) < new_count:
                if i >= len(lines):
                    raise ToolError(f"{name}: hunk {header!r} in {path} is truncated")
                body = lines[i]
                tag, content = (body[:1], body[1:]) if body else (" ", "")
                if tag == " ":
                    old.append(content + "\n")
                    new.append(content + "\n")
                elif tag == "-":
                    old.append(content + "\n")
                elif tag == "+":
                    new.append(content + "\n")
                else:
                    raise ToolError(f"{name}: unexpected line {body!r} in hunk {header!r} of {path}")
                i += 1
                # "\ No newline at end of file" applies to the line just read.
                if i < len(lines) and lines[i].startswith("\\"):
                    if tag in (" ", "-"):
                        old[-1] = old[-1][:-1]
                    if tag in (" ", "+"):
                        new[-1] = new[-1][:-1]
                    i += 1
            if i < len(lines) and lines[i].startswith("\\"):
                i += 1
            hunks.append(Hunk(header, int(m.group(1)), old, new))
        if not hunks and old_exists and new_exists:
            raise ToolError(
                f"{name}: the section for {path} changes nothing (a `diff --git` section without hunks, which "
                "`git apply` rejects as garbage): delete that section from the patch"
            )
        files.append(FilePatch(path, old_exists, new_exists, hunks))
    return Patch(name, fields, requires, files)


def load_file(path: str | os.PathLike, name: str, register: bool = True):
    """Import the Python file at `path` as module `name` (in sys.modules when `register`), without
    importing the package around it: the one loader of a single file (a patch's new module, a
    patched tree's module, torch's version.py)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, os.fspath(path))
    if spec is None or spec.loader is None:
        raise ToolError(f"{path}: not a Python file that can be imported")
    module = importlib.util.module_from_spec(spec)
    if register:
        sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        if register:
            sys.modules.pop(name, None)
        raise
    return module


def load_new_module(patch_file: str | os.PathLike, path: str, name: str):
    """Import the file that a patch creates (its new-file diff) as module `name`, without any
    vLLM tree: the benchmarks time the very code a patch ships this way."""
    with open(patch_file, encoding="utf-8") as f:
        patch = parse_patch(os.fspath(patch_file), f.read())
    created = [fp for fp in patch.files if fp.path == path and not fp.old_exists]
    if not created:
        raise ToolError(f"{patch_file} does not create {path}")
    # The file stays while this process runs (tracebacks and inspect read it); removed at exit.
    import atexit

    folder = tempfile.mkdtemp(prefix=f"{name}-")
    atexit.register(shutil.rmtree, folder, True)
    source = os.path.join(folder, os.path.basename(path))
    with open(source, "w", encoding="utf-8") as f:
        f.write("".join(line for hunk in created[0].hunks for line in hunk.new_lines))
    return load_file(source, name)


SERIES_PREFIX = "vllm-"


def release_of(version: str | None) -> str | None:
    """The release a version string belongs to: "0.29.0+cpu" -> "0.29.0", "0.33.0rc1" -> "0.33.0",
    "0.33.1.dev3" -> "0.33.1", "v0.34.0" -> "0.34.0"; None when it is not MAJOR.MINOR.PATCH at all
    ("0.33", "unknown"). The one definition: magpie/releases.py imports it."""
    m = re.match(r"^v?(\d+)\.(\d+)\.(\d+)", (version or "").strip())
    return ".".join(m.groups()) if m else None


def release_key(release: str) -> tuple[int, ...]:
    """A release as a tuple that sorts as the releases do ("0.9.0" before "0.10.0"); a part that is
    not a number sorts first (-1). The one definition: magpie/releases.py imports it."""
    return tuple(int(part) if part.isdigit() else -1 for part in release.split("."))


def available_series(root: str) -> dict[str, str]:
    """{release: folder} of the series folders (`vllm-<release>/series`) under `root`."""
    found = {}
    for series_file in glob.glob(os.path.join(root, SERIES_PREFIX + "*", "series")):
        folder = os.path.dirname(series_file)
        found[os.path.basename(folder).removeprefix(SERIES_PREFIX)] = folder

    return {release: found[release] for release in sorted(found, key=release_key)}


class NoSeries(ToolError):
    """No series matches the target's release; says which exist and how to try or carry one."""

    def __init__(self, version: str, found: dict[str, str]):
        self.version, self.found = version, found
        self.release = release_of(version) or version  # "unknown", "0.1.dev1": said as it is
        self.nearest = nearest_series(self.release, list(found))
        super().__init__(self.advice("--target DIR"))

    def advice(self, where: str) -> str:
        listing = ", ".join(self.found)
        release = self.release
        return (
            f"no series for vLLM {self.version}; series exist for vLLM {listing}.\n"
            f"  try the nearest one as it is:\n"
            f"    magpie/patches.py check --series {self.nearest} {where}\n"
            f"  or carry it onto {release} (three-way merge, writes patches/{SERIES_PREFIX}{release}/):\n"
            f"    magpie/patches.py rebase --series {self.nearest} --base PRISTINE-{self.nearest}-TREE {where}\n"
            f"  (a pristine {self.nearest} tree: `python3 tests/env/fetch_sdist.py {self.nearest} DIR` or a vLLM "
            f"checkout at v{self.nearest}; see patches/README.md)"
        )


def nearest_series(release: str, releases: list[str]) -> str:
    """The series closest to `release` by minor version (the older one on a tie)."""

    def distance(other: str) -> tuple:
        a, b = (release_key(release) + (0, 0, 0))[:3], (release_key(other) + (0, 0, 0))[:3]
        return (abs(a[0] - b[0]), abs(a[1] - b[1]), abs(a[2] - b[2]), b > a)

    return min(releases, key=distance)


def series_dir(patches_dir: str, version: str | None, wanted: str | None = None) -> str:
    """The folder holding the series to use.

    `patches_dir` is either one series folder (it holds a `series` file) or the root that holds
    one `vllm-<release>/` folder per supported release. From the root, `wanted` (a release such as
    "0.33.0") picks a series; otherwise the target's `version` does (NoSeries if none matches).
    """
    if os.path.isfile(os.path.join(patches_dir, "series")):
        if wanted:
            raise ToolError(f"--series {wanted}: {patches_dir} is a single series folder; give the root instead")
        return patches_dir
    found = available_series(patches_dir)
    if not found:
        raise ToolError(f"no series under {patches_dir} (expected {SERIES_PREFIX}<release>/series folders)")
    listing = ", ".join(found)
    if wanted:
        release = release_of(wanted.removeprefix(SERIES_PREFIX))
        if release is None or release not in found:
            raise ToolError(f"--series {wanted}: no such series; series exist for vLLM {listing}")
        return found[release]
    release = release_of(version)
    if release is not None and release in found:
        return found[release]
    raise NoSeries(version or "unknown", found)


def parse_series(text: str) -> list[tuple[int, str]]:
    """(line number, entry) of a series file's patches, in apply order: `#` starts a comment
    anywhere on a line, surrounding white space is dropped, blank lines are skipped."""
    entries = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        entry = raw.split("#", 1)[0].strip()
        if entry:
            entries.append((lineno, entry))
    return entries


def load_series(patches_dir: str) -> list[Patch]:
    series_file = os.path.join(patches_dir, "series")
    if not os.path.exists(series_file):
        raise ToolError(f"no series file at {series_file}")
    patches = []
    with open(series_file) as f:
        text = f.read()
    for lineno, entry in parse_series(text):
        path = os.path.join(patches_dir, entry)
        if not os.path.isfile(path):
            raise ToolError(f"{series_file}:{lineno}: {entry} does not exist")
        with open(path, encoding="utf-8") as pf:
            patch = parse_patch(entry, pf.read())
        validate_header(patch.fields, path)
        patches.append(patch)
    names = [p.name for p in patches]
    for index, patch in enumerate(patches):
        resolved = []
        for req in patch.requires:
            matches = [n for n in names if _matches(n, req)]
            if len(matches) != 1:
                raise ToolError(f"{patch.name}: `Requires: {req}` matches {matches or 'no patch'} in the series")
            if names.index(matches[0]) >= index:
                raise ToolError(f"{patch.name} requires {matches[0]}, which the series lists after it")
            resolved.append(matches[0])
        patch.requires = resolved
    return patches


def _matches(name: str, selector: str) -> bool:
    """`ple_ssd` selects a whole optimization, `ple_ssd/0001` one patch, or the full name."""
    selector = selector.strip().removesuffix(".patch")
    stem = name.removesuffix(".patch")
    return stem == selector or stem.startswith(selector + "/") or stem.startswith(selector + "-")


def select(patches: list[Patch], selectors: list[str]) -> list[Patch]:
    if not selectors:
        return list(patches)
    chosen = set()
    for selector in selectors:
        hits = [p.name for p in patches if _matches(p.name, selector)]
        if not hits:
            known = ", ".join(p.name for p in patches) or "(the series is empty)"
            raise ToolError(f"no patch matches {selector!r}; the series has: {known}")
        chosen.update(hits)
    return [p for p in patches if p.name in chosen]


# --------------------------------------------------------------------------------------------
# Applying hunks in memory


class Conflict(Refusal):
    def __init__(self, path: str, hunk_index: int | None, header: str, reason: str):
        where = f"{path}" if hunk_index is None else f"{path} hunk {hunk_index} ({header})"
        super().__init__(f"{where}: {reason}")
        self.path, self.hunk_index, self.header, self.reason = path, hunk_index, header, reason


def split_lines(content: str) -> list[str]:
    pieces = content.split("\n")
    lines = [p + "\n" for p in pieces[:-1]]
    if pieces[-1]:
        lines.append(pieces[-1])
    return lines


def _find(lines: list[str], needle: list[str], guess: int, start: int) -> int:
    """Position of `needle` in `lines` at or after `start`, nearest to `guess`; -1 if absent."""
    if not needle:
        return min(max(guess, start), len(lines))
    last = len(lines) - len(needle)
    for distance in range(0, max(last + 1, 1)):
        for pos in (guess - distance, guess + distance) if distance else (guess,):
            if start <= pos <= last and lines[pos : pos + len(needle)] == needle:
                return pos
        if guess - distance < start and guess + distance > last:
            break
    return -1


def apply_file(fp: FilePatch, content: str | None, reverse: bool) -> str | None:
    """Return the file's content after applying (or reversing) `fp`; None means deleted."""
    exists_before = fp.new_exists if reverse else fp.old_exists
    exists_after = fp.old_exists if reverse else fp.new_exists
    if exists_before and content is None:
        raise Conflict(fp.path, None, "", "file does not exist")
    if not exists_before and content is not None:
        raise Conflict(fp.path, None, "", "file already exists")
    lines = split_lines(content or "")
    offset = 0
    floor = 0
    for index, hunk in enumerate(fp.hunks, 1):
        old, new = (hunk.new_lines, hunk.old_lines) if reverse else (hunk.old_lines, hunk.new_lines)
        guess = max(hunk.old_start - 1, 0) + offset
        pos = _find(lines, old, guess, floor)
        if pos < 0:
            raise Conflict(fp.path, index, hunk.header, "context does not match")
        lines[pos : pos + len(old)] = new
        offset = pos - max(hunk.old_start - 1, 0) + len(new) - len(old)
        floor = pos + len(new)
    result = "".join(lines)
    if not exists_after:
        if result:
            raise Conflict(fp.path, None, "", "file to delete has content the patch does not remove")
        return None
    return result


class Tree:
    """A target's files, read lazily, changed in memory, written out only by commit()."""

    def __init__(self, root: str):
        self.root = root
        self.original: dict[str, str | None] = {}
        self.current: dict[str, str | None] = {}

    def read(self, rel: str) -> str | None:
        if rel not in self.current:
            path = os.path.join(self.root, rel)
            try:
                with open(path, encoding="utf-8", newline="") as f:
                    text: str | None = f.read()
            except FileNotFoundError:
                text = None
            except IsADirectoryError:
                raise ToolError(f"{path} is a directory; a patch of this series edits it as a file") from None
            except UnicodeDecodeError as e:
                raise ToolError(
                    f"{path} is not UTF-8 text (byte {e.start}: {e.reason}); a patch edits it as "
                    "vLLM ships it: restore the file (reinstall vLLM or check out the release)"
                ) from None
            except OSError as e:
                raise ToolError(f"cannot read {path}: {e.strerror}") from None
            self.original[rel] = text
            self.current[rel] = text
        return self.current[rel]

    def try_patch(self, patch: Patch, reverse: bool, base: dict[str, str | None] | None = None):
        """The files `patch` would produce (on top of `base`), or raise Conflict. Changes nothing."""
        staged: dict[str, str | None] = {}
        for fp in patch.files:
            if fp.path in staged:
                before = staged[fp.path]
            elif base is not None and fp.path in base:
                before = base[fp.path]
            else:
                before = self.read(fp.path)
            staged[fp.path] = apply_file(fp, before, reverse)
        return staged

    def state(self, patch: Patch, base: dict[str, str | None] | None = None) -> tuple[str, str]:
        """applied / not applied / conflicting, judged on the files as `base` would leave them."""
        try:
            self.try_patch(patch, reverse=False, base=base)
            forward_ok, forward_error = True, ""
        except Conflict as e:
            forward_ok, forward_error = False, str(e)
        try:
            self.try_patch(patch, reverse=True, base=base)
            reverse_ok = True
        except Conflict:
            reverse_ok = False
        if reverse_ok and not forward_ok:
            return APPLIED, ""
        if forward_ok:
            return NOT_APPLIED, ""
        return CONFLICTING, self._culprit(patch, base) or forward_error

    def _culprit(self, patch: Patch, base: dict[str, str | None] | None) -> str:
        """Which file makes `patch` conflicting: the first file that neither applies nor reverses
        on its own (a hand edit, another release), judged in the direction most of the patch's
        files take; else, files split between the two (a half-applied patch), the first file on
        the smaller side. "" when no single file can be named."""
        applied, stock, neither = [], [], []
        staged: dict[str, str | None] = dict(base or {})
        for fp in patch.files:
            before = staged[fp.path] if fp.path in staged else self.read(fp.path)
            try:
                staged[fp.path] = apply_file(fp, before, reverse=False)
                stock.append(fp.path)
                continue
            except Conflict as e:
                forward = e
            try:
                apply_file(fp, before, reverse=True)
                applied.append(fp.path)
            except Conflict as e:
                neither.append((forward, e))
        if neither:
            forward, backward = neither[0]
            if len(applied) > len(stock):
                return f"{backward} (the patch's changes do not reverse there: edited since it was applied?)"
            return str(forward)
        if applied and stock:
            few, many = (applied, "applied") if len(applied) <= len(stock) else (stock, "not applied")
            return f"{few[0]} is {many} while the patch's other files are not (half applied)"
        return ""

    def stage(self, patch: Patch, reverse: bool) -> None:
        self.current.update(self.try_patch(patch, reverse))

    def changed(self) -> list[str]:
        return sorted(rel for rel, text in self.current.items() if text != self.original.get(rel))

    def commit(self) -> list[str]:
        """Write every changed file as one change set (see write_set): all of it or none of it,
        a signal or a failure part-way included."""
        changed = self.changed()
        for rel in changed:
            target_dir = os.path.dirname(os.path.join(self.root, rel))
            probe = target_dir
            while not os.path.isdir(probe):
                probe = os.path.dirname(probe)
            if not os.access(probe, os.W_OK):
                raise ToolError(f"cannot write {os.path.join(self.root, rel)}: permission denied")
        if changed:
            write_set(self.root, {rel: self.current[rel] for rel in changed})
        return changed


# --------------------------------------------------------------------------------------------
# Writing a change set: a journal, then the renames, all or nothing
#
# write_set() first writes JOURNAL in the target's root (the files it will change, phase
# "staging"), then beside each file its new text (.magpie-patches-new.NAME) and a hard link to
# (or copy of) the file as it is (.magpie-patches-old.NAME); then the journal's phase becomes
# "committing" and each new file is renamed over its file; then "done", the side files are
# removed, and the journal last. SIGINT, SIGTERM and SIGHUP arriving meanwhile are held until
# the set is written. Killed outright (SIGKILL, a power cut), the journal stays: the next run on
# the tree (any command with a target) rolls a "staging" or "committing" set back and finishes a
# "done" one before doing anything else (recover()).

JOURNAL = ".magpie-patches.journal"
LOCK_INFO = ".magpie-patches.lock"
_NEW, _OLD = ".magpie-patches-new.", ".magpie-patches-old."
# Test hook (tests/test_patch_tool_safety.py): "N:SIGNAL" sends SIGNAL to this process after step
# N of a change set (write_set and recover count their steps from 1).
TEST_SIGNAL_ENV = "MAGPIE_PATCHES_TEST_SIGNAL_AFTER"
_steps = [0]


def _step(what: str) -> None:
    _steps[0] += 1
    hook = os.environ.get(TEST_SIGNAL_ENV, "")
    if hook:
        number, _, name = hook.partition(":")
        if number.strip() == str(_steps[0]):
            print(f"test hook: {name} after step {_steps[0]} ({what})", file=sys.stderr, flush=True)
            os.kill(os.getpid(), getattr(signal, name))


def _side(root: str, rel: str, prefix: str) -> str:
    path = os.path.join(root, rel)
    return os.path.join(os.path.dirname(path), prefix + os.path.basename(path))


def _write_journal(root: str, record: dict) -> None:
    path = os.path.join(root, JOURNAL)
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)
    _fsync_dir(root)


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        os.unlink(path)


def _drop_pyc(path: str) -> None:
    # A stale bytecode file could outlive a same-size, same-second edit: drop it.
    stem = os.path.splitext(os.path.basename(path))[0]
    for pyc in glob.glob(os.path.join(os.path.dirname(path), "__pycache__", f"{glob.escape(stem)}.*.pyc")):
        _unlink(pyc)


class _HeldSignals:
    """Hold SIGINT, SIGTERM and SIGHUP while a change set is written; `received` lists them."""

    SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP")

    def __enter__(self):
        self.received: list[int] = []
        self.previous = {}
        for name in self.SIGNALS:
            number = getattr(signal, name)
            with contextlib.suppress(ValueError, OSError):  # not the main thread: nothing to hold
                self.previous[number] = signal.signal(number, lambda signum, frame: self.received.append(signum))
        return self

    def __exit__(self, *exc) -> None:
        for number, handler in self.previous.items():
            signal.signal(number, handler)
        HELD_SIGNALS.extend(self.received)


# Signals held during a change set, for main() to report once the set is written.
HELD_SIGNALS: list[int] = []


def write_set(root: str, texts: dict[str, str | None]) -> None:
    """Write `texts` (relative path -> new text, None: delete) under `root` all at once."""
    rels = sorted(texts)
    made_dirs: list[str] = []
    for rel in rels:
        if texts[rel] is None:
            continue
        missing, probe = [], os.path.dirname(os.path.join(root, rel))
        while not os.path.exists(probe):
            missing.append(probe)
            probe = os.path.dirname(probe)
        made_dirs += [os.path.relpath(d, root) for d in reversed(missing) if os.path.relpath(d, root) not in made_dirs]
    entries = [
        {"path": rel, "existed": os.path.lexists(os.path.join(root, rel)), "delete": texts[rel] is None} for rel in rels
    ]
    record = {"tool": "magpie/patches.py", "pid": os.getpid(), "phase": "staging", "entries": entries}
    record["made_dirs"] = made_dirs
    with _HeldSignals():
        try:
            _write_journal(root, record)
        except OSError as e:
            _unlink(os.path.join(root, JOURNAL + ".tmp"))
            raise ToolError(
                f"cannot write the journal {os.path.join(root, JOURNAL)} ({e.strerror}); nothing was changed"
            ) from None
        _step("journal written: staging")
        failed = None
        try:
            for rel in rels:
                failed = rel
                path = os.path.join(root, rel)
                if texts[rel] is not None:
                    os.makedirs(os.path.dirname(path), exist_ok=True)
                    new = _side(root, rel, _NEW)
                    mode = os.stat(path).st_mode & 0o7777 if os.path.exists(path) else 0o644
                    with open(new, "w", encoding="utf-8", newline="") as f:
                        f.write(texts[rel])
                        f.flush()
                        os.fsync(f.fileno())
                    os.chmod(new, mode)
                    _step(f"new text of {rel} staged")
                if os.path.lexists(path):
                    old = _side(root, rel, _OLD)
                    _unlink(old)
                    try:
                        os.link(path, old, follow_symlinks=False)
                    except OSError:
                        shutil.copy2(path, old)
                    _step(f"{rel} kept aside")
            failed = None
            record["phase"] = "committing"
            _write_journal(root, record)
            _step("journal: committing")
            for rel in rels:
                failed = rel
                path = os.path.join(root, rel)
                _drop_pyc(path)
                if texts[rel] is None:
                    _unlink(path)
                else:
                    os.replace(_side(root, rel, _NEW), path)
                _step(f"{rel} {'deleted' if texts[rel] is None else 'replaced'}")
            failed = None
            for directory in {os.path.dirname(os.path.join(root, rel)) for rel in rels}:
                _fsync_dir(directory)
            record["phase"] = "done"
            _write_journal(root, record)
            _step("journal: done")
        except OSError as e:
            where = os.path.join(root, failed) if failed else os.path.join(root, JOURNAL)
            try:
                _roll(root, record, quiet=True)
            except OSError as again:
                raise ToolError(
                    f"writing {where} failed ({e}), and so did undoing it ({again}); the journal "
                    f"{os.path.join(root, JOURNAL)} stays: run the same command again once the cause is fixed"
                ) from e
            raise ToolError(
                f"writing {where} failed ({e}); the files already written were restored, nothing was changed"
            ) from e
        _finish(root, record)


def _finish(root: str, record: dict) -> None:
    """The last steps of a written set: its side files removed, then the journal."""
    for entry in record["entries"]:
        _unlink(_side(root, entry["path"], _NEW))
        _unlink(_side(root, entry["path"], _OLD))
        _step(f"side files of {entry['path']} removed")
    _unlink(os.path.join(root, JOURNAL))
    _fsync_dir(root)
    _step("journal removed")


def _roll(root: str, record: dict, quiet: bool = False) -> str:
    """Undo a set that was not written to the end ("staging", "committing"), or finish one that
    was ("done"). Each step can be repeated: a recovery cut short is taken up again next time."""
    if record.get("phase") == "done":
        _finish(root, record)
        return "finished"
    for entry in record["entries"]:
        path = os.path.join(root, entry["path"])
        old, new = _side(root, entry["path"], _OLD), _side(root, entry["path"], _NEW)
        if record.get("phase") == "committing":
            if entry["existed"]:
                if os.path.lexists(old):
                    _drop_pyc(path)
                    os.replace(old, path)  # both links of one file: rename leaves `old`; removed below
            elif os.path.lexists(path):
                _drop_pyc(path)
                os.unlink(path)
        _unlink(new)
        _unlink(old)
        _step(f"{entry['path']} restored")
    for rel in reversed(record.get("made_dirs", [])):
        with contextlib.suppress(OSError):
            os.rmdir(os.path.join(root, rel))
    _unlink(os.path.join(root, JOURNAL))
    _unlink(os.path.join(root, JOURNAL + ".tmp"))
    _fsync_dir(root)
    _step("journal removed")
    return "rolled back"


def recover(root: str) -> str | None:
    """Complete or roll back a change set an earlier run left (its journal); say which, or None."""
    path = os.path.join(root, JOURNAL)
    _unlink_quietly = os.path.lexists(path + ".tmp") and not os.path.lexists(path)
    if _unlink_quietly:  # killed while writing the first journal: nothing else was written
        with contextlib.suppress(OSError):
            os.unlink(path + ".tmp")
    if not os.path.lexists(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
        if not isinstance(record, dict) or not isinstance(record.get("entries"), list):
            raise ValueError("not a journal of this tool")
        for entry in record["entries"]:
            rel = entry["path"]
            if os.path.isabs(rel) or os.pardir in rel.split(os.sep):
                raise ValueError(f"path {rel!r} outside the tree")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ToolError(
            f"{path}: an interrupted change set's journal that cannot be read ({e}); reinstall vLLM (or check "
            "the release out again), then delete the journal"
        ) from None
    with _HeldSignals():
        try:
            how = _roll(root, record)
        except OSError as e:
            raise ToolError(
                f"{path}: an earlier run was interrupted mid-change and undoing it failed ({e}); fix the cause "
                "(permissions, space) and run again"
            ) from None
    print(
        f"note: an earlier run (pid {record.get('pid', '?')}) was interrupted while it changed {root}; "
        f"its change set was {how} ({len(record['entries'])} file(s))",
        file=sys.stderr,
    )
    return how


@contextlib.contextmanager
def locked(root: str, wait: float, command: str):
    """Hold the target's lock (flock on its root folder) for the whole command: two runs on one
    tree take turns. Waits up to `wait` seconds, then refuses naming the holder."""
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as e:
        raise ToolError(f"cannot open {root} to lock it: {e.strerror}") from None
    info = os.path.join(root, LOCK_INFO)
    try:
        deadline = time.monotonic() + wait
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    try:
                        with open(info, encoding="utf-8") as f:
                            holder = f.read().strip() or "a process that did not say who it is"
                    except OSError:
                        holder = "a process that did not say who it is"
                    raise Refusal(
                        f"{root} is locked by another magpie/patches.py run ({holder}); waited {wait:g} s: "
                        "run again when it ends, or give it longer with --wait SECONDS"
                    ) from None
                time.sleep(min(0.1, max(deadline - time.monotonic(), 0.01)))
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")  # noqa: UP017
        wrote_info = False
        try:
            with open(info + ".tmp", "w", encoding="utf-8") as f:
                f.write(f"pid {os.getpid()}, `{command}` since {stamp}\n")
            os.replace(info + ".tmp", info)
            wrote_info = True
        except OSError:
            pass  # a read-only tree: the lock holds all the same
        try:
            yield
        finally:
            if wrote_info:
                _unlink(info)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------------------------
# Targets


@dataclasses.dataclass
class Target:
    root: str  # the folder that holds vllm/
    kind: str  # "source tree" or "installed package"
    version: str


def _version_of(root: str) -> str:
    for rel in ("vllm/_version.py", "vllm/version.py"):
        path = os.path.join(root, rel)
        if os.path.exists(path):
            with open(path, encoding="utf-8", errors="replace") as f:
                m = re.search(r"""^__version__\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""", f.read(), re.M)
            if m:
                return m.group(1)
    for meta in sorted(glob.glob(os.path.join(root, "vllm*.dist-info", "METADATA"))) + [os.path.join(root, "PKG-INFO")]:
        if os.path.exists(meta):
            with open(meta, encoding="utf-8", errors="replace") as f:
                m = re.search(r"^Version:\s*(\S+)", f.read(), re.M)
            if m:
                return m.group(1)
    return "unknown"


def find_target(target: str | None, python: str | None) -> Target:
    if target and python:
        raise ToolError("give either --target or --python, not both")
    if python:
        code = (
            "import importlib.util, sys\n"
            "spec = importlib.util.find_spec('vllm')\n"
            "sys.exit('vllm is not installed for this interpreter') if spec is None else "
            "print(list(spec.submodule_search_locations)[0])"
        )
        try:
            proc = subprocess.run([python, "-c", code], capture_output=True, text=True, check=False)
        except OSError as e:
            raise ToolError(f"cannot run --python {python}: {e.strerror}") from e
        if proc.returncode != 0:
            raise ToolError(
                f"--python {python}: {proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else 'failed'}"
            )
        reported = proc.stdout.strip().splitlines()
        package_dir = reported[-1].strip() if reported else ""
        if (
            not package_dir
            or not os.path.isabs(package_dir)
            or not os.path.isfile(os.path.join(package_dir, "__init__.py"))
        ):
            said = f"printed {package_dir!r}" if package_dir else "printed nothing"
            raise ToolError(
                f"--python {python}: it did not report an installed vllm package ({said}); give the Python "
                "of the venv that has vLLM (VENV/bin/python, where `python -c 'import vllm'` works), or --target DIR"
            )
        root = os.path.dirname(package_dir)
        return Target(root, "installed package", _version_of(root))
    if not target:
        raise ToolError("no target: give --python /path/to/venv/bin/python or --target /path/to/vllm-tree")
    path = os.path.abspath(target)
    if os.path.basename(path) == "vllm" and os.path.isfile(os.path.join(path, "__init__.py")):
        path = os.path.dirname(path)
    if not os.path.isfile(os.path.join(path, "vllm", "__init__.py")):
        raise ToolError(f"--target {target}: no vllm/__init__.py there (expected a vLLM source tree or site-packages)")
    kind = (
        "source tree"
        if os.path.exists(os.path.join(path, "setup.py")) or os.path.exists(os.path.join(path, "pyproject.toml"))
        else "installed package"
    )
    return Target(path, kind, _version_of(path))


# --------------------------------------------------------------------------------------------
# Writing a file's section of a patch (git's format): refresh, rebase and diff write with it


def _git_blob(text: str | None) -> str:
    if text is None:
        return "0000000"
    data = text.encode("utf-8")
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()[:7]


def _unified_range(start: int, length: int) -> str:
    first = start + 1 if length else start
    return str(first) if length == 1 else f"{first},{length}"


def _funcname(lines: list[str], before: int) -> str:
    """git's default hunk-header context: the last line above the hunk that starts a definition."""
    for line in reversed(lines[:before]):
        if re.match(r"[A-Za-z_$]", line):
            return " " + line.rstrip("\n")[:80].rstrip()
    return ""


def file_diff(path: str, before: str | None, after: str | None, context: int = 3) -> str:
    """A git-style diff section (what `git diff` writes) turning `before` into `after`."""
    old, new = split_lines(before or ""), split_lines(after or "")
    out = [f"diff --git a/{path} b/{path}\n"]
    if before is None:
        out.append("new file mode 100644\n")
    elif after is None:
        out.append("deleted file mode 100644\n")
    mode = "" if before is None or after is None else " 100644"
    out.append(f"index {_git_blob(before)}..{_git_blob(after)}{mode}\n")
    out.append("--- /dev/null\n" if before is None else f"--- a/{path}\n")
    out.append("+++ /dev/null\n" if after is None else f"+++ b/{path}\n")

    def body(tag: str, line: str) -> None:
        out.append(tag + line if line.endswith("\n") else f"{tag}{line}\n\\ No newline at end of file\n")

    matcher = difflib.SequenceMatcher(None, old, new, autojunk=False)
    for group in matcher.get_grouped_opcodes(context):
        i1, i2, j1, j2 = group[0][1], group[-1][2], group[0][3], group[-1][4]
        out.append(f"@@ -{_unified_range(i1, i2 - i1)} +{_unified_range(j1, j2 - j1)} @@{_funcname(old, i1)}\n")
        for tag, x1, x2, y1, y2 in group:
            if tag == "equal":
                for line in old[x1:x2]:
                    body(" ", line)
                continue
            for line in old[x1:x2]:
                body("-", line)
            for line in new[y1:y2]:
                body("+", line)
    return "".join(out)


def _sections(text: str) -> list[str]:
    """The `diff --git` sections of a patch, verbatim, in order."""
    starts = [m.start() for m in re.finditer(r"^diff --git ", text, re.M)]
    return [text[s:e] for s, e in zip(starts, starts[1:] + [len(text)], strict=True)]


# --------------------------------------------------------------------------------------------
# Commands


def compute_states(tree: Tree, patches: list[Patch]) -> dict[str, tuple[str, str]]:
    """Each patch's state, treating the series as a stack.

    A patch is "applied" when it reverses cleanly once the applied patches after it are reversed
    (a later patch may edit lines an earlier one added). A patch whose prerequisites are not
    applied yet is judged on the files as those prerequisites would leave them, so it reads
    "not applied", not "conflicting".
    """
    by_name = {p.name: p for p in patches}
    states: dict[str, tuple[str, str]] = {}
    unwound: dict[str, str | None] = {}
    # The files as they were before the applied patches after each one: a patch is judged on
    # them (a later applied patch's edits in a file it shares are not its conflict).
    later: dict[str, dict[str, str | None]] = {}
    for patch in reversed(patches):
        later[patch.name] = dict(unwound)
        state, _ = tree.state(patch, unwound)
        if state == APPLIED:
            states[patch.name] = (APPLIED, "")
            unwound.update(tree.try_patch(patch, reverse=True, base=unwound))
    for patch in patches:
        if patch.name in states:
            continue
        pending = _pending_requires(patch, by_name, states)
        base: dict[str, str | None] = dict(later[patch.name])
        blocked = ""
        for req in pending:
            if states[req][0] != NOT_APPLIED:
                blocked = f"{req} is {states[req][0]}"
                break
            base.update(tree.try_patch(by_name[req], reverse=False, base=base))
        state, detail = tree.state(patch, base if not blocked else later[patch.name])
        if state == APPLIED:  # reverses on the current files but not in stack order
            state, detail = CONFLICTING, "its changes are present but a later patch no longer reverses"
        if state == CONFLICTING and blocked:
            detail = f"{detail} (prerequisite {blocked})"
        elif state == NOT_APPLIED and pending:
            detail = "needs " + ", ".join(pending) + " first"
        states[patch.name] = (state, detail)
    return {p.name: states[p.name] for p in patches}


def _pending_requires(patch: Patch, by_name: dict[str, Patch], states) -> list[str]:
    """Transitive prerequisites of `patch` that are not applied, in series order."""
    pending: list[str] = []

    def visit(p: Patch) -> None:
        for req in p.requires:
            visit(by_name[req])
            if states[req][0] != APPLIED and req not in pending:
                pending.append(req)

    visit(patch)
    order = list(by_name)
    return sorted(pending, key=order.index)


def plan_apply(
    patches: list[Patch], chosen: list[Patch], states: dict[str, tuple[str, str]], with_requires: bool
) -> list[Patch]:
    by_name = {p.name: p for p in patches}
    wanted: set[str] = set()

    def want(patch: Patch) -> None:
        for req in patch.requires:
            if states[req][0] != APPLIED and req not in wanted:
                if not with_requires and req not in {c.name for c in chosen}:
                    raise Refusal(
                        f"{patch.name} requires {req}, which is {states[req][0]}; "
                        f"apply it first or pass --with-requires"
                    )
                want(by_name[req])
        if states[patch.name][0] != APPLIED:
            wanted.add(patch.name)

    for patch in chosen:
        want(patch)
    return [p for p in patches if p.name in wanted]


def plan_revert(
    patches: list[Patch], chosen: list[Patch], states: dict[str, tuple[str, str]], with_dependents: bool
) -> list[Patch]:
    wanted = {p.name for p in chosen if states[p.name][0] == APPLIED}
    changed = True
    while changed:
        changed = False
        for patch in patches:
            if states[patch.name][0] != APPLIED or patch.name in wanted:
                continue
            needed = [r for r in patch.requires if r in wanted]
            if needed:
                if not with_dependents:
                    raise Refusal(
                        f"cannot revert {needed[0]}: {patch.name} is applied and requires it; "
                        f"revert {patch.name} first or pass --with-dependents"
                    )
                wanted.add(patch.name)
                changed = True
    return [p for p in reversed(patches) if p.name in wanted]


def run_plan(tree: Tree, plan: list[Patch], reverse: bool) -> None:
    """Stage every patch of the plan in memory, in order; raise on the first conflict."""
    for patch in plan:
        try:
            tree.stage(patch, reverse)
        except Conflict as e:
            raise Refusal(f"{patch.name} is {CONFLICTING}: {e}") from e


def print_table(target: Target, folder: str, patches: list[Patch], states) -> None:
    print(f"vLLM {target.version} ({target.kind}) at {target.root}")
    print(f"series {os.path.join(folder, 'series')}")
    width = max([len(p.name) for p in patches] + [5])
    print(f"  {'PATCH':<{width}}  {'STATE':<11}  DETAIL")
    for patch in patches:
        state, detail = states[patch.name]
        print(f"  {patch.name:<{width}}  {state:<11}  {detail}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        # argparse's own choice from sys.argv[0]: "patches.py" run by path, "magpie patches" from
        # the package's entry point, "magpie-patches" as a console script.
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    common = _common_options()
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_target_commands(sub, common)
    sub.add_parser("list", parents=[common], help="list the series with each patch's header fields")
    _add_part(sub, common, _sources, ("extract", "refresh", "check-sources"))
    _add_part(sub, common, _rebase, ("rebase",))
    _add_part(sub, common, _diff, ("diff",))
    return parser


def _common_options() -> argparse.ArgumentParser:
    """The options every subcommand takes: the target, the series, the lock's wait."""
    common = argparse.ArgumentParser(add_help=False)
    where = common.add_argument_group("target (one of)")
    where.add_argument("--python", metavar="PY", help="interpreter whose installed vllm package is the target")
    where.add_argument("--target", metavar="DIR", help="vLLM source tree, site-packages folder, or the vllm/ package")
    common.add_argument(
        "--patches-dir",
        default=os.path.normpath(PATCHES_DIR),
        help="the root with one vllm-<release>/ series folder per release, or one series folder (default: %(default)s)",
    )
    common.add_argument(
        "--wait",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="with a target: how long to wait for another run on the same tree to end (default: %(default)g)",
    )
    common.add_argument(
        "--series",
        metavar="RELEASE",
        help="use this release's series (e.g. 0.33.0) instead of the one matching the target's vLLM version",
    )
    return common


def _add_target_commands(sub, common: argparse.ArgumentParser) -> None:
    """status, check, apply and revert: the subcommands that work on a target tree."""
    p_status = sub.add_parser("status", parents=[common], help="report each patch: applied, not applied, conflicting")
    p_status.add_argument("names", nargs="*", metavar="NAME", help="patches to report (default: all)")
    p_status.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p_status.add_argument(
        "--require-applied", action="store_true", help="exit 1 unless every selected patch is applied"
    )
    p_check = sub.add_parser(
        "check", parents=[common], help="say whether `apply NAME...` would succeed; change nothing"
    )
    p_check.add_argument("names", nargs="*", metavar="NAME", help="patches to check (default: all)")
    p_check.add_argument("--with-requires", action="store_true", help="as for apply")
    p_apply = sub.add_parser("apply", parents=[common], help="apply patches (default: the whole series)")
    p_apply.add_argument("names", nargs="*", metavar="NAME", help="e.g. ple_ssd, ple_ssd/0002, mtp_pruning")
    p_apply.add_argument(
        "--with-requires", action="store_true", help="also apply the prerequisites a patch names (default: refuse)"
    )
    p_apply.add_argument("--dry-run", action="store_true", help="check and report, change nothing")
    p_revert = sub.add_parser("revert", parents=[common], help="revert applied patches, in reverse order")
    p_revert.add_argument("names", nargs="*", metavar="NAME", help="patches to revert (default: all applied)")
    p_revert.add_argument(
        "--with-dependents", action="store_true", help="also revert applied patches that require them (default: refuse)"
    )
    p_revert.add_argument("--dry-run", action="store_true", help="check and report, change nothing")


def _add_part(sub, common: argparse.ArgumentParser, part, names: tuple[str, ...]) -> None:
    """The subcommands `names` of a part kept in its own file (its add_parsers); a copy of this file
    on its own lists them, and running one says what it needs."""
    try:
        module = part()
    except ToolError:
        for name in names:
            # Every argument taken as it comes (no option parsed), so that running it gives the reason.
            stub = sub.add_parser(
                name, help="(not in a copy of patches.py on its own)", add_help=False, prefix_chars="\0"
            )
            stub.add_argument("rest", nargs="*")
        return
    module.add_parsers(sub, common)


def _listed_folders(args) -> list[str]:
    """The series folders `list`, `extract`, `refresh` and `check-sources` work on: the target's
    (or --series') one, else every series under --patches-dir."""
    if args.target or args.python:
        version = find_target(args.target, args.python).version
        return [series_dir(args.patches_dir, version, args.series)]
    if os.path.isfile(os.path.join(args.patches_dir, "series")) or args.series:
        return [series_dir(args.patches_dir, None, args.series)]
    folders = list(available_series(args.patches_dir).values())
    if not folders:
        series_dir(args.patches_dir, None)  # raises: no series at all
    return folders


def command_list(args) -> int:
    for folder in _listed_folders(args):
        print(f"series {os.path.relpath(os.path.join(folder, 'series'))}")
        for patch in load_series(folder):
            print(f"  {patch.name}")
            for key in ("description", "requires", "target", "last-update", "activation"):
                value = ", ".join(patch.requires) if key == "requires" else patch.fields.get(key, "")
                first = value.splitlines()[0] if value else "none"
                print(f"      {key}: {first}")
    return 0


def _part(module: str, commands: str):
    """magpie.<module>, a part of the patch tool kept in its own file (rebase, the module sources'
    commands), imported from the package this file belongs to (a checkout or the installed
    package); run as a script, this module stands for magpie.patches (so that the part's errors
    are the ones main() catches). A copy of this file on its own has no parts: ToolError."""
    path = os.path.join(_HERE, *module.split(".")) + ".py"
    if __name__ != "magpie.patches":
        if not os.path.isfile(path):
            raise ToolError(
                f"{path} not found: {commands} the magpie checkout or installed package this file "
                "came from (a copy of patches.py on its own has status, check, apply, revert and list)"
            )
        parent = os.path.dirname(_HERE)
        if parent not in sys.path:
            sys.path.insert(0, parent)
        sys.modules.setdefault("magpie.patches", sys.modules[__name__])
    return importlib.import_module(f"magpie.{module}")


def _sources():
    """magpie/vllm_modules/sources.py: extract, refresh and check-sources, beside the sources."""
    return _part("vllm_modules.sources", "extract, refresh and check-sources need")


def _rebase():
    """magpie/patch_rebase.py: rebase."""
    return _part("patch_rebase", "rebase needs")


def _diff():
    """magpie/patch_diff.py: diff (a patch written again from an edited tree)."""
    return _part("patch_diff", "diff needs")


def command_status(args, target: Target) -> int:
    folder = series_dir(args.patches_dir, target.version, args.series)
    patches = load_series(folder)
    chosen = select(patches, args.names)
    states = compute_states(Tree(target.root), patches)
    if args.json:
        record = {
            "target": dataclasses.asdict(target),
            "series": os.path.abspath(folder),
            "patches": [
                {"name": p.name, "state": states[p.name][0], "detail": states[p.name][1], "requires": p.requires}
                for p in chosen
            ],
        }
        print(json.dumps(record, indent=2))
    else:
        print_table(target, folder, chosen, states)
    if any(states[p.name][0] == CONFLICTING for p in chosen):
        return 3
    if args.require_applied and any(states[p.name][0] != APPLIED for p in chosen):
        return 1
    return 0


def command_apply(args, target: Target) -> int:
    """`apply`, and `check` (an apply that changes nothing)."""
    patches = load_series(series_dir(args.patches_dir, target.version, args.series))
    chosen = select(patches, args.names)
    tree = Tree(target.root)
    plan = plan_apply(patches, chosen, compute_states(tree, patches), args.with_requires)
    run_plan(tree, plan, reverse=False)
    if args.command == "check" or args.dry_run:
        print(f"vLLM {target.version} ({target.kind}) at {target.root}")
        for patch in plan:
            print(f"  would apply {patch.name}")
        if not plan:
            print("  nothing to apply: every selected patch is already applied")
        return 0
    return commit_plan(tree, plan, target, "applied", "nothing to apply: every selected patch is already applied")


def commit_plan(tree: Tree, plan: list, target: Target, done: str, nothing: str) -> int:
    """Write the planned tree and say what was done (`done` each patch, or `nothing`)."""
    written = tree.commit()
    for patch in plan:
        print(f"{done} {patch.name}")
    if not plan:
        print(nothing)
    print(f"{len(written)} file(s) changed under {target.root}")
    return 0


def command_revert(args, target: Target) -> int:
    patches = load_series(series_dir(args.patches_dir, target.version, args.series))
    chosen = select(patches, args.names)
    tree = Tree(target.root)
    states = compute_states(tree, patches)
    if not args.names:
        conflicting = [p for p in patches if states[p.name][0] == CONFLICTING]
        if conflicting:
            # Reverting the applied ones would leave the conflicting changes in place: a tree
            # that is neither stock nor patched, reported as a success.
            raise Refusal(
                f"the tree is neither stock nor patched: {conflicting[0].name} is {CONFLICTING} "
                f"({states[conflicting[0].name][1]}), so reverting every applied patch would not "
                "give stock vLLM back; restore the files it names (reinstall vLLM, or check the "
                "release out again), then run `status`"
            )
        chosen = [p for p in patches if states[p.name][0] == APPLIED]
    for patch in chosen:
        if states[patch.name][0] == CONFLICTING:
            raise Refusal(f"{patch.name} is {CONFLICTING}: {states[patch.name][1]}")
    plan = plan_revert(patches, chosen, states, args.with_dependents)
    run_plan(tree, plan, reverse=True)
    if args.dry_run:
        for patch in plan:
            print(f"would revert {patch.name}")
        return 0
    return commit_plan(tree, plan, target, "reverted", "nothing to revert: no selected patch is applied")


# The sub-commands: those of the first table work on series files alone, those of the second on
# a target (found before they run, so that a refusal can name it).
COMMANDS = {
    "list": command_list,
    "extract": lambda args: _sources().COMMANDS["extract"](args),
    "refresh": lambda args: _sources().COMMANDS["refresh"](args),
    "check-sources": lambda args: _sources().COMMANDS["check-sources"](args),
    "rebase": lambda args: _rebase().command_rebase(args),
    "diff": lambda args: _diff().command_diff(args),
}
TARGET_COMMANDS = {"status": command_status, "check": command_apply, "apply": command_apply, "revert": command_revert}


class Interrupted(BaseException):
    """SIGTERM or SIGHUP outside a change set (SIGINT raises KeyboardInterrupt)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _raise_interrupted(signum, frame):
    raise Interrupted(signum)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command in TARGET_COMMANDS and not 0 <= args.wait <= 86400:
        print(f"error: --wait {args.wait:g}: give seconds from 0 to 86400", file=sys.stderr)
        return 2
    previous = {}
    for name in ("SIGTERM", "SIGHUP"):
        with contextlib.suppress(ValueError, OSError):  # not the main thread
            previous[getattr(signal, name)] = signal.signal(getattr(signal, name), _raise_interrupted)
    try:
        status = _main(args)
        sys.stdout.flush()
        if HELD_SIGNALS:
            name = signal.Signals(HELD_SIGNALS[0]).name
            print(
                f"error: {name} arrived while the files were being written; the change set was finished "
                "first (above), then the run stopped",
                file=sys.stderr,
            )
            return 128 + HELD_SIGNALS[0]
        return status
    except (KeyboardInterrupt, Interrupted) as e:
        signum = e.signum if isinstance(e, Interrupted) else signal.SIGINT
        print(f"error: interrupted by {signal.Signals(signum).name}; nothing was changed", file=sys.stderr)
        return 128 + signum
    except BrokenPipeError:
        # The reader of stdout stopped early (`| head`): 141, as for a process killed by SIGPIPE.
        # Python flushes stdout again at exit: point it at /dev/null so that flush cannot fail.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def _main(args) -> int:
    target = None
    try:
        if args.command in COMMANDS:
            return COMMANDS[args.command](args)
        target = find_target(args.target, args.python)
        with locked(target.root, args.wait, args.command):
            recover(target.root)
            return TARGET_COMMANDS[args.command](args, target)
    except NoSeries as e:
        where = (
            f"--python {shlex.quote(args.python)}" if args.python else f"--target {shlex.quote(args.target or 'DIR')}"
        )
        print(f"error: {e.advice(where)}", file=sys.stderr)
        return 2
    except ToolError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Refusal as e:
        print(f"error: {e}", file=sys.stderr)
        if target is None:
            print("nothing was written", file=sys.stderr)
        else:
            print(f"vLLM {target.version} ({target.kind}) at {target.root}; nothing was changed", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
