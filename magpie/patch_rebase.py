"""`magpie patches rebase`: carry a patch series from the vLLM release it was written for onto
another release's source, by a three-way merge of every file a patch touches (standard library
only: difflib, no git). patches/README.md ("Carrying a series onto another release") is the guide.

magpie/patches.py declares the subcommand with add_parser() below and runs command_rebase(); it
holds everything else this module uses (the header parser, the hunk applier, trees, targets,
the writer of a patch's file sections). A copy of patches.py on its own has no rebase: it says
so, naming the checkout or installed package that has this file.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import difflib
import hashlib
import os
import shutil
import sys
import tempfile

from magpie.patches import (
    APPLIED,
    NOT_APPLIED,
    SERIES_PREFIX,
    FilePatch,
    NoSeries,
    Patch,
    Refusal,
    Target,
    ToolError,
    Tree,
    _sections,
    compute_states,
    file_diff,
    find_target,
    load_series,
    parse_patch,
    release_of,
    run_plan,
    select,
    series_dir,
    split_lines,
)

REBASE_HELP = """\
Carry a series from the vLLM release it was written for onto another release's source.

For each patch, in series order, and each file it touches, three versions are merged: the file
in the pristine base release (--base, with the series' earlier patches applied), the same file
with the patch applied, and the file in the new release (--target or --python, with the earlier
rebased patches applied). Where upstream left a file as it was, the patch's section is kept
verbatim; where it changed, the patch's change is merged in (a diff3-style merge done with the
standard library's difflib: git is not needed). Files a patch creates are carried as they are.

The rebased patches keep their headers (`Target:` names the new release, `Rebased-From:` the old
one) and go, with a series file, into PATCHES_DIR/vllm-<new release>/ (or --output DIR); an
existing folder is replaced only with --force. Before writing, every rebased patch is applied in
memory to the new tree to check that it reproduces the merge.

If any hunk needs a hand (upstream changed the lines a hunk changes, moved or removed a file the
patch edits, or already has a file the patch creates) each one is reported: the patch, the file,
the patch's hunk, and the region as the old release had it, as the new release has it, and as
the patch makes it. Then no series is written (exit 1). To finish by hand, add --work DIR: each
such file is written to DIR/<patch>/<path>, merged, with diff3-style markers around each conflict
(<<<<<<< the new release, ||||||| the old one, ======= the patch's side, >>>>>>>). Edit them
(every marker removed) and run the same command again: a file there without markers is taken as
that patch's version of the file, and the patches after it are carried on top of it. Without
--work nothing at all is written. A file the new release no longer has: --drop-removed drops the
patch's hunks of it (each file named) instead. No file section of the output is ever empty: a
file whose merge (or hand resolution) equals the new release's file gets none, and a patch left
with no section is left out of the series, said so.

    python3 tests/env/fetch_sdist.py 0.29.0 ~/sdist        # a pristine base tree (or a checkout)
    magpie/patches.py rebase --base ~/sdist/vllm-0.29.0 --python ~/venvs/vllm-0.31/bin/python
    magpie/patches.py rebase mtp_pruning --series 0.29.0 --base ~/sdist/vllm-0.29.0 \\
        --target ~/src/vllm --output /tmp/vllm-0.31.0-series --work /tmp/rebase-work

--series picks the series to carry (default: the one for --base's release). Neither tree is
changed. Exit codes: 0 written; 1 conflicts or the output exists (nothing written); 2 usage or
target error.
"""


# --------------------------------------------------------------------------------------------
# Rebasing a series onto another release: a three-way merge per file, stdlib only (difflib)


@dataclasses.dataclass
class MergeConflict:
    patch: str
    path: str
    hunks: list[str]  # the patch's hunks that touch the region, e.g. "hunk 3 (@@ -1507,8 +1519,57 @@ ...)"
    base: tuple[int, list[str]] | None  # (first line, lines) in the release the series was written for
    ours: tuple[int, list[str]] | None  # the same region in the new release (None: file absent)
    theirs: tuple[int, list[str]] | None  # what the patch makes of it (None: the patch deletes the file)
    reason: str


def _matches_of(a: list[str], b: list[str]) -> dict[int, int]:
    """Line i of `a` -> line j of `b` for the lines difflib pairs up (monotonic)."""
    pairs: dict[int, int] = {}
    for i, j, n in difflib.SequenceMatcher(None, a, b, autojunk=False).get_matching_blocks():
        for k in range(n):
            pairs[i + k] = j + k
    return pairs


def merge3(base: list[str], ours: list[str], theirs: list[str], labels: tuple[str, str, str] | None = None):
    """diff3-style merge of the change base -> theirs into ours.

    Returns (lines, conflicts); each conflict is (base_start, base_chunk, ours_start, ours_chunk,
    theirs_start, theirs_chunk), and `lines` keeps ours' side where a conflict is, or, given
    `labels` (ours, base, theirs), all three sides between diff3-style conflict markers.
    """
    to_ours, to_theirs = _matches_of(base, ours), _matches_of(base, theirs)
    merged: list[str] = []
    conflicts = []
    o = a = b = 0  # positions in base, theirs, ours
    while o < len(base) or a < len(theirs) or b < len(ours):
        if o < len(base) and to_ours.get(o) == b and to_theirs.get(o) == a:
            merged.append(base[o])
            o, a, b = o + 1, a + 1, b + 1
            continue
        nxt = o
        while nxt < len(base) and not (nxt in to_ours and nxt in to_theirs):
            nxt += 1
        b2 = to_ours[nxt] if nxt < len(base) else len(ours)
        a2 = to_theirs[nxt] if nxt < len(base) else len(theirs)
        chunk_o, chunk_b, chunk_a = base[o:nxt], ours[b:b2], theirs[a:a2]
        if chunk_b == chunk_o or chunk_b == chunk_a:
            merged.extend(chunk_a)
        elif chunk_a == chunk_o:
            merged.extend(chunk_b)
        else:
            both = _merge_disjoint(chunk_o, chunk_b, chunk_a)
            if both is None:
                conflicts.append((o, chunk_o, b, chunk_b, a, chunk_a))
                if labels:
                    merged.append(f"{MARKERS[0]} {labels[0]}\n")
                    merged.extend(_terminated(chunk_b))
                    merged.append(f"{MARKERS[1]} {labels[1]}\n")
                    merged.extend(_terminated(chunk_o))
                    merged.append(f"{MARKERS[2]}\n")
                    merged.extend(_terminated(chunk_a))
                    merged.append(f"{MARKERS[3]} {labels[2]}\n")
                else:
                    merged.extend(chunk_b)
            else:
                merged.extend(both)
        o, a, b = nxt, a2, b2
    return merged, conflicts


MARKERS = ("<<<<<<<", "|||||||", "=======", ">>>>>>>")


def _terminated(lines: list[str]) -> list[str]:
    return [line if line.endswith("\n") else line + "\n" for line in lines]


def has_markers(text: str) -> bool:
    return any(line.startswith(MARKERS) for line in text.splitlines())


def _edits(base: list[str], other: list[str]) -> list[tuple[int, int, list[str]]]:
    ops = difflib.SequenceMatcher(None, base, other, autojunk=False).get_opcodes()
    return [(i1, i2, other[j1:j2]) for tag, i1, i2, j1, j2 in ops if tag != "equal"]


def _merge_disjoint(base: list[str], ours: list[str], theirs: list[str]) -> list[str] | None:
    """Both sides' edits of one region when they touch different lines of it, else None.

    Upstream and the patch changing neighbouring lines (a line the patch edits next to lines
    upstream inserted, or a decorator upstream removed above a line the patch edits) is common
    across releases; edits of the same line, or insertions at the same place, stay conflicts.
    """
    mine = _edits(base, ours)
    other = [edit for edit in _edits(base, theirs) if edit not in mine]  # the same edit on both sides
    for x1, x2, _ in mine:
        for y1, y2, _ in other:
            if max(x1, y1) < min(x2, y2):  # both change a line
                return None
            if (x1 == x2 and y1 < x1 < y2) or (y1 == y2 and x1 < y1 < x2):  # insertion inside a change
                return None
            if x1 == x2 == y1 == y2:  # insertions at the same place: the order is a question
                return None
    # Apply from the bottom up; at one position an insertion goes before a change that starts there.
    edits = sorted(mine + other, key=lambda e: (e[0], e[1] != e[0]), reverse=True)
    result = list(base)
    for i1, i2, lines in edits:
        result[i1:i2] = lines
    return result


def _hunks_over(fp: FilePatch, start: int, length: int) -> list[str]:
    """The patch's hunks (numbered from 1) whose old range meets base lines [start, start+length)."""
    names = []
    for index, hunk in enumerate(fp.hunks, 1):
        h_start = max(hunk.old_start - 1, 0)
        h_end = h_start + len(hunk.old_lines)
        if start < h_end and h_start < start + length or (length == 0 and h_start <= start <= h_end):
            names.append(f"hunk {index} ({hunk.header})")
    return names or ["(between hunks)"]


@dataclasses.dataclass
class Carried:
    patch: Patch
    text: str  # the rebased patch file
    files: dict[str, str | None]  # the new release's files after this patch
    how: dict[str, str]  # path -> "unchanged upstream" / "merged" / "new file"


def rebase_series(
    patches: list[Patch],
    texts: dict[str, str],
    base: Tree,
    new: Tree,
    old_release: str,
    new_release: str,
    log=print,
    work: str | None = None,
    drop_removed: bool = False,
) -> tuple[list[Carried], list[MergeConflict], list[str]]:
    """Carry `patches` (in series order, already checked to apply on `base`) onto `new`.

    Per patch and file: base-before-patch (pristine base with the earlier patches applied),
    base-after-patch, and the new release's file with the earlier rebased patches applied are
    merged three ways. Returns (carried, conflicts, skipped): a patch that requires a conflicting
    one, or edits a file an earlier patch left in conflict, is skipped (named in `skipped`).

    With `work`, a file that needs a hand is resolved by WORK/<patch>/<path> when that file
    exists without conflict markers; otherwise it is written there, merged, with diff3-style
    markers around each conflict, for the user to edit.

    With `drop_removed`, the sections of files the new release no longer has are dropped (each
    named in the log). A file whose merge equals the new release's file gets no section (an
    empty `diff --git` section is not a patch git accepts); a patch left with no section at all
    is left out of the series, named in the log.
    """
    run = _Rebase(base, new, old_release, new_release, log, work, drop_removed)
    carried: list[Carried] = []
    conflicts: list[MergeConflict] = []
    skipped: list[str] = []
    failed_patches: set[str] = set()
    failed_files: set[str] = set()
    emptied: set[str] = set()
    for patch in patches:
        blocked = [r for r in patch.requires if r in failed_patches]
        touched = {fp.path for fp in patch.files}
        if blocked or touched & failed_files:
            why = f"requires {blocked[0]}" if blocked else f"edits {sorted(touched & failed_files)[0]}"
            what = (
                "was left out (nothing of it is left to carry)"
                if blocked and blocked[0] in emptied
                else ("needs a hand first")
            )
            skipped.append(f"{patch.name}: not tried, it {why}, which {what}")
            failed_patches.add(patch.name)
            continue
        after = base.try_patch(patch, reverse=False, base=run.base_stage)
        out = _PatchOut()
        for fp, section in zip(patch.files, _sections(texts[patch.name]), strict=True):
            if fp.path in out.result:
                raise ToolError(f"{patch.name}: {fp.path} appears twice; rebase does not support that")
            run.carry_file(patch, fp, section, after[fp.path], out)
        if out.conflicts:
            conflicts.extend(out.conflicts)
            failed_patches.add(patch.name)
            failed_files.update(c.path for c in out.conflicts)
            log(f"  {patch.name}: {len(out.conflicts)} hunk(s) need a hand")
            continue
        run.base_stage.update(after)
        run.new_stage.update(out.result)
        if not out.sections:
            log(f"  {patch.name}: nothing left to carry (vLLM {new_release} has it all, or it was dropped); left out")
            emptied.add(patch.name)
            failed_patches.add(patch.name)
            continue
        header = texts[patch.name][: texts[patch.name].find("diff --git ")]
        header = _retarget_header(header, old_release, new_release)
        carried.append(Carried(patch, header + "".join(out.sections), out.result, out.how))
        counts = ", ".join(f"{sum(1 for v in out.how.values() if v == k)} {k}" for k in sorted(set(out.how.values())))
        log(f"  {patch.name}: carried ({counts})")
    return carried, conflicts, skipped


@dataclasses.dataclass
class _PatchOut:
    """What carrying one patch gives: its file sections, the new release's files after it, how
    each file was carried, and the hunks that need a hand."""

    sections: list[str] = dataclasses.field(default_factory=list)
    result: dict[str, str | None] = dataclasses.field(default_factory=dict)
    how: dict[str, str] = dataclasses.field(default_factory=dict)
    conflicts: list[MergeConflict] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _Rebase:
    """One rebase: the two trees, the releases, the options, and each tree's files as the patches
    carried so far leave them (the stages)."""

    base: Tree
    new: Tree
    old_release: str
    new_release: str
    log: object
    work: str | None
    drop_removed: bool
    base_stage: dict[str, str | None] = dataclasses.field(default_factory=dict)
    new_stage: dict[str, str | None] = dataclasses.field(default_factory=dict)

    def carry_file(self, patch: Patch, fp: FilePatch, section: str, t: str | None, out: _PatchOut) -> None:
        """Carry one file section of `patch`: o the base before the patch, t after it, b the new
        release's file (each with the earlier patches)."""
        o = self.base_stage[fp.path] if fp.path in self.base_stage else self.base.read(fp.path)
        b = self.new_stage[fp.path] if fp.path in self.new_stage else self.new.read(fp.path)
        if b == o:
            out.how[fp.path] = "new file" if o is None else "unchanged upstream"
            out.result[fp.path] = t
            out.sections.append(section)
            return
        inputs = _inputs_digest(o, b, t)
        resolved, stale = _resolution(self.work, patch.name, fp.path, inputs)
        if resolved is not None:
            out.how[fp.path] = "resolved by hand"
            out.result[fp.path] = resolved
            if resolved != b:
                out.sections.append(file_diff(fp.path, b, resolved))
            else:
                self.log(f"  {patch.name}: {fp.path} resolved to vLLM {self.new_release}'s file as it is: no section")
            return
        if b is None and o is not None and self.drop_removed:
            out.how[fp.path] = "dropped"
            self.log(
                f"  {patch.name}: dropped the {len(fp.hunks)} hunk(s) of {fp.path}, which vLLM {self.new_release} "
                "does not have (--drop-removed)"
            )
            return
        if o is None or b is None or t is None:
            out.conflicts.extend(_unmergeable(patch, fp, o, b, t, self.new_release))
            return
        self._merge_file(patch, fp, (o, b, t), inputs, stale, out)

    def _merge_file(self, patch: Patch, fp: FilePatch, texts: tuple, inputs: str, stale: bool, out: _PatchOut) -> None:
        """The three-way merge of a file both the patch and upstream changed."""
        o, b, t = texts
        before_conflicts = len(out.conflicts)
        merged, found = merge3(split_lines(o), split_lines(b), split_lines(t))
        for o_start, o_chunk, b_start, b_chunk, t_start, t_chunk in found:
            out.conflicts.append(
                MergeConflict(
                    patch.name,
                    fp.path,
                    _hunks_over(fp, o_start, len(o_chunk)),
                    (o_start + 1, o_chunk),
                    (b_start + 1, b_chunk),
                    (t_start + 1, t_chunk),
                    f"vLLM {self.new_release} changed the lines this hunk changes",
                )
            )
        if stale and not found:
            out.conflicts.append(
                MergeConflict(
                    patch.name,
                    fp.path,
                    ["(hand resolution)"],
                    None,
                    None,
                    None,
                    "the hand-resolved file was made for another version of the patch or of a release",
                )
            )
        if found or stale:
            if self.work:
                labels = (f"vLLM {self.new_release}", f"vLLM {self.old_release}", f"{patch.name} (the patch)")
                marked, _ = merge3(split_lines(o), split_lines(b), split_lines(t), labels)
                _write_work(self.work, patch.name, fp.path, "".join(marked), out.conflicts[before_conflicts:], inputs)
            return
        merged_text = "".join(merged)
        out.how[fp.path] = "merged"
        out.result[fp.path] = merged_text
        if merged_text != b:
            out.sections.append(file_diff(fp.path, b, merged_text))
        else:
            self.log(f"  {patch.name}: vLLM {self.new_release} already has this change to {fp.path}: no section")


def _unmergeable(
    patch: Patch, fp: FilePatch, o: str | None, b: str | None, t: str | None, new_release: str
) -> list[MergeConflict]:
    """The conflicts of a file that cannot be merged line by line: the patch creates a file the new
    release has (o None), upstream moved or removed it (b None), or the patch deletes it (t None)."""
    if o is None:
        return [
            MergeConflict(
                patch.name,
                fp.path,
                ["(the whole new file)"],
                None,
                (1, split_lines(b or "")),
                (1, split_lines(t or "")),
                f"the patch creates {fp.path}, but vLLM {new_release} has one",
            )
        ]
    if b is None:
        return [
            MergeConflict(
                patch.name,
                fp.path,
                [f"hunk {index} ({hunk.header})"],
                (hunk.old_start, hunk.old_lines),
                None,
                (hunk.old_start, hunk.new_lines),
                f"{fp.path} does not exist in vLLM {new_release} (moved or removed upstream); "
                "--drop-removed drops such a file's hunks",
            )
            for index, hunk in enumerate(fp.hunks, 1)
        ]
    return [
        MergeConflict(
            patch.name,
            fp.path,
            ["(file deletion)"],
            (1, split_lines(o)),
            (1, split_lines(b)),
            None,
            f"the patch deletes {fp.path}, which vLLM {new_release} changed",
        )
    ]


def _work_path(work: str, patch_name: str, path: str) -> str:
    return os.path.join(work, patch_name.removesuffix(".patch"), path)


def _inputs_digest(*texts: str | None) -> str:
    digest = hashlib.sha256()
    for text in texts:
        digest.update(b"-" if text is None else hashlib.sha256(text.encode("utf-8")).digest())
    return digest.hexdigest()


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", newline="") as f:
            return f.read()
    except FileNotFoundError:
        return None


def _resolution(work: str | None, patch_name: str, path: str, inputs: str) -> tuple[str | None, bool]:
    """(text, stale) of the hand-resolved file WORK/<patch>/<path>.

    text is None unless the file exists without conflict markers and was resolved for these
    very three inputs (its `.merge-inputs` stamp, written with the merge, matches); stale is
    True when it was resolved for other inputs (the patch or a release changed since).
    """
    if not work:
        return None, False
    target = _work_path(work, patch_name, path)
    text = _read(target)
    if text is None:
        return None, False
    stamp = _read(target + ".merge-inputs")
    if stamp is not None and stamp.strip() != inputs:
        return None, True
    return (None if has_markers(text) else text), False


def _write_work(work: str, patch_name: str, path: str, text: str, conflicts: list[MergeConflict], inputs: str) -> None:
    """Write the merge with markers for hand resolution, stamped with its inputs' digest. A file
    being edited for the same inputs is left alone; one made for other inputs is kept as .old."""
    target = _work_path(work, patch_name, path)
    stamp_file = target + ".merge-inputs"
    existing, stamp = _read(target), _read(stamp_file)
    note = f"; resolve it in {target}"
    if existing is not None and stamp is not None and stamp.strip() == inputs:
        pass
    else:
        if existing is not None:
            os.replace(target, target + ".old")
            note = f"; {target} was resolved for other inputs (kept as {target}.old): resolve the fresh merge there"
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(target, "w", encoding="utf-8", newline="") as f:
            f.write(text)
        with open(stamp_file, "w", encoding="utf-8") as f:
            f.write(inputs + "\n")
    for conflict in conflicts:
        conflict.reason += note


def _retarget_header(header: str, old_release: str, new_release: str, today: str | None = None) -> str:
    """`Target: vllm <new>`, a `Rebased-From:` line naming the release it was carried from, and
    `Last-Update:` set to today (UTC): the rebased patch is a new version of the patch."""
    utc = datetime.timezone.utc  # noqa: UP017 (datetime.UTC is Python 3.11; the tool runs on 3.10)
    today = today or datetime.datetime.now(utc).date().isoformat()
    lines = [line for line in header.splitlines(keepends=True) if not line.startswith("Rebased-From:")]
    out = []
    for line in lines:
        if line.startswith("Target:"):
            out.append(f"Target: vllm {new_release}\n")
            out.append(f"Rebased-From: vllm {old_release} (magpie/patches.py rebase)\n")
        elif line.startswith("Last-Update:"):
            out.append(f"Last-Update: {today}\n")
        else:
            out.append(line)
    if not any(line.startswith("Target:") for line in lines):
        raise ToolError("a patch header has no `Target:` line")
    return "".join(out)


def _show(side: tuple[int, list[str]] | None, label: str, max_lines: int) -> list[str]:
    if side is None:
        return [f"    {label}: (no such file)"]
    start, lines = side
    span = f"line {start}" if len(lines) <= 1 else f"lines {start}-{start + len(lines) - 1}"
    out = [f"    {label} ({span}{', empty' if not lines else ''}):"]
    shown = lines if max_lines <= 0 else lines[:max_lines]
    out += ["      | " + line.rstrip("\n") for line in shown]
    if len(shown) < len(lines):
        out.append(f"      | ... {len(lines) - len(shown)} more line(s) (--max-lines 0 shows all)")
    return out


def report_conflicts(conflicts: list[MergeConflict], old_release: str, new_release: str, max_lines: int) -> str:
    out = []
    for number, c in enumerate(conflicts, 1):
        out.append(f"conflict {number}: {c.patch}: {c.path} {', '.join(c.hunks)}")
        out.append(f"    {c.reason}")
        out += _show(c.base, f"vLLM {old_release} had", max_lines)
        out += _show(c.ours, f"vLLM {new_release} has", max_lines)
        out += _show(c.theirs, "the patch makes it", max_lines)
    return "\n".join(out)


def _series_text(folder: str, carried: list[str], old_release: str, new_release: str) -> str:
    """The old series file with only the carried entries, its comments naming the new release."""
    out = []
    with open(os.path.join(folder, "series"), encoding="utf-8") as f:
        for raw in f:
            entry = raw.split("#", 1)[0].strip()
            if entry and entry not in carried:
                continue
            out.append(raw.replace(f"vLLM {old_release}", f"vLLM {new_release}"))
    return "".join(out)


def write_series(output: str, files: dict[str, str], force: bool) -> None:
    """Write `files` (relative path -> text) as a fresh folder `output`, all at once."""
    if os.path.exists(output) and not force:
        raise Refusal(f"{output} exists; pass --force to replace it, or --output another folder")
    parent = os.path.dirname(os.path.abspath(output))
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(dir=parent, prefix=".rebase-")
    try:
        for rel, text in files.items():
            path = os.path.join(staging, rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w", encoding="utf-8", newline="") as f:
                f.write(text)
        os.chmod(staging, 0o755)
        old = None
        if os.path.exists(output):
            old = tempfile.mkdtemp(dir=parent, prefix=".rebase-old-")
            os.rmdir(old)
            os.rename(output, old)
        os.rename(staging, output)
        if old:
            shutil.rmtree(old)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


@dataclasses.dataclass
class RebasePlan:
    """What `rebase` carries where: the series folder, its release and the target's, the output."""

    folder: str
    old_release: str
    new_release: str
    output: str


def _rebase_plan(args, base_target: Target, new_target: Target) -> RebasePlan:
    """The series to carry (the base tree's, or --series'), checked against both trees."""
    new_release = release_of(new_target.version) or new_target.version
    try:
        folder = series_dir(args.patches_dir, base_target.version, args.series)
    except NoSeries as e:
        raise ToolError(
            f"--base {args.base} is vLLM {base_target.version}, which has no series; series exist for vLLM "
            f"{', '.join(e.found)}: give a pristine tree of one of those releases (--series picks which)"
        ) from e
    base_release = release_of(base_target.version) or base_target.version
    if os.path.isfile(os.path.join(args.patches_dir, "series")):
        old_release = base_release
        if not args.output:
            raise ToolError("--patches-dir is a single series folder: give --output DIR for the rebased series")
    else:
        old_release = os.path.basename(os.path.normpath(folder)).removeprefix(SERIES_PREFIX)
    if base_release != old_release:
        raise ToolError(
            f"--base {args.base} is vLLM {base_target.version}, but the series {folder} was written for "
            f"{old_release}: give a pristine {old_release} tree"
        )
    if new_release == old_release:
        raise ToolError(f"the target is vLLM {new_target.version}, the release the series was written for")
    output = args.output or os.path.join(args.patches_dir, SERIES_PREFIX + new_release)
    if os.path.exists(output) and not args.force:
        raise Refusal(f"{output} exists; pass --force to replace it, or --output another folder")
    return RebasePlan(folder, old_release, new_release, output)


def _with_requires(patches: list[Patch], names: list[str]) -> tuple[list[Patch], list[str]]:
    """The selected patches plus every patch they require (in series order), and the names added."""
    chosen = select(patches, names)
    wanted = {p.name for p in chosen}
    for patch in reversed(patches):
        if patch.name in wanted:
            wanted.update(patch.requires)
    extra = [n for n in wanted if n not in {p.name for p in chosen}]
    return [p for p in patches if p.name in wanted], extra


def _rebase_trees(chosen: list[Patch], base_target: Target, new_target: Target, old_release: str) -> tuple[Tree, Tree]:
    """The base and new trees, after checking that the base is pristine and takes every patch, and
    that the new tree has none of them applied."""
    base = Tree(base_target.root)
    states = compute_states(base, chosen)
    dirty = [f"{n} is {s}{': ' + d if d else ''}" for n, (s, d) in states.items() if s != NOT_APPLIED]
    if dirty:
        raise ToolError(f"--base {base_target.root} is not a pristine vLLM {old_release}: " + "; ".join(dirty))
    run_plan(base, chosen, reverse=False)  # every patch applies on the base, in order
    new = Tree(new_target.root)
    applied_there = [n for n, (s, _) in compute_states(new, chosen).items() if s == APPLIED]
    if applied_there:
        raise ToolError(
            f"{new_target.root} already has {', '.join(applied_there)} applied: rebase onto a pristine tree"
        )
    return Tree(base_target.root), new


def _report_rebase_failure(args, conflicts: list[MergeConflict], skipped: list[str], plan: RebasePlan) -> int:
    print(report_conflicts(conflicts, plan.old_release, plan.new_release, args.max_lines), file=sys.stderr)
    for line in skipped:
        print(f"  {line}", file=sys.stderr)
    if args.work:
        hint = (
            f"edit the files named above under {args.work} (remove every conflict marker), "
            "then run the same command again"
        )
    else:
        hint = (
            "carry the others alone (`rebase NAME ...`), or add --work DIR to get each file merged with "
            "conflict markers to resolve by hand, then run the same command again"
        )
    print(f"error: {len(conflicts)} hunk(s) need a hand; no series was written. Next: {hint}", file=sys.stderr)
    return 1


def _check_carried(root: str, carried: list[Carried]) -> None:
    """Self-check: the written patches must apply on the new tree, in order, to exactly the merge."""
    check = Tree(root)
    for item in carried:
        reparsed = parse_patch(item.patch.name, item.text)
        staged = check.try_patch(reparsed, reverse=False, base=check.current)
        # A file the patch has no section for (its merge is upstream's file) must be as it is.
        if any((staged[path] if path in staged else check.read(path)) != text for path, text in item.files.items()):
            raise ToolError(f"internal error: the rebased {item.patch.name} does not reproduce the merge")
        check.current.update(staged)


def command_rebase(args) -> int:
    if not args.base:
        raise ToolError("rebase needs --base DIR: a pristine tree of the release the series was written for")
    new_target = find_target(args.target, args.python)
    base_target = find_target(args.base, None)
    plan = _rebase_plan(args, base_target, new_target)
    patches = load_series(plan.folder)
    chosen, extra = _with_requires(patches, args.names)
    texts = {}
    for patch in chosen:
        with open(os.path.join(plan.folder, patch.name), encoding="utf-8") as f:
            texts[patch.name] = f.read()
    base, new = _rebase_trees(chosen, base_target, new_target, plan.old_release)

    print(
        f"rebasing series {os.path.join(plan.folder, 'series')} (vLLM {plan.old_release}) onto vLLM "
        f"{new_target.version} ({new_target.kind}) at {new_target.root}"
    )
    if extra:
        order = [p.name for p in patches]
        print(f"  also carrying {', '.join(sorted(extra, key=order.index))} (required by the patches asked for)")
    carried, conflicts, skipped = rebase_series(
        chosen, texts, base, new, plan.old_release, plan.new_release, work=args.work, drop_removed=args.drop_removed
    )
    if conflicts or skipped:
        return _report_rebase_failure(args, conflicts, skipped, plan)
    _check_carried(new_target.root, carried)
    files = {item.patch.name: item.text for item in carried}
    files["series"] = _series_text(plan.folder, list(files), plan.old_release, plan.new_release)
    write_series(plan.output, files, args.force)
    print(f"wrote {len(carried)} patch(es) and a series file to {plan.output}")
    print(f"next: magpie/patches.py status --patches-dir {plan.output} --target {new_target.root}")
    print("      then test it as patches/README.md says (apply, revert byte for byte, the suite)")
    return 0


def add_parsers(sub, common: argparse.ArgumentParser) -> None:
    """The `rebase` subcommand of the patch tool's parser (`sub`), with its options."""
    p_rebase = sub.add_parser(
        "rebase",
        parents=[common],
        help="carry a series onto another vLLM release by a three-way merge",
        description=REBASE_HELP.split("\n\n")[0],
        epilog=REBASE_HELP.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p_rebase.add_argument("names", nargs="*", metavar="NAME", help="patches to carry (default: the whole series)")
    p_rebase.add_argument(
        "--base", metavar="DIR", help="pristine vLLM tree of the release the series was written for (required)"
    )
    p_rebase.add_argument(
        "--output", metavar="DIR", help="folder for the rebased series (default: PATCHES_DIR/vllm-<target release>)"
    )
    p_rebase.add_argument("--force", action="store_true", help="replace the output folder if it exists")
    p_rebase.add_argument(
        "--drop-removed",
        action="store_true",
        help="drop the hunks of files the new release no longer has (each named), instead of reporting them "
        "as needing a hand",
    )
    p_rebase.add_argument(
        "--work",
        metavar="DIR",
        help="resolve conflicts by hand: files that need a hand are written to DIR/<patch>/<path> with "
        "conflict markers; once edited (markers gone), the next run takes them as the merge",
    )
    p_rebase.add_argument(
        "--max-lines", type=int, default=40, metavar="N", help="lines shown per side of a conflict (0: all; default 40)"
    )
