"""The modules the patch series ship, generated from their one source in this folder.

Every Python file a patch creates (a new-file hunk) has one source here, under the same file
name. What differs between vLLM releases sits in one `# [release X.Y.Z]` ... `# [release end]`
section of the source; the file a series ships keeps the lines of its own release (the patch's
`Target:`) and drops the other blocks and the markers. A release without a block of its own
takes the nearest older release's, so a new release needs no edit here unless what it needs
differs.

The patch tool's subcommands that work on these sources live here, beside them:

- `magpie patches refresh` rewrites each patch's new-file hunk from its source;
- `magpie patches check-sources` exits 1 when a hunk is not what its source generates;
- `magpie patches extract --output DIR` writes every file a series creates, as each patch that
  touches it leaves it (no vLLM tree needed), so that `tests/lint.sh patches` can lint them.

magpie/patches.py declares the subcommands (so `--help` lists them wherever it runs) and loads
this module when one of them is run; a copy of patches.py on its own refuses them, naming the
checkout or the installed package they need. This file is the project's code, not vLLM's: it is
not a shipped module and the project's ruff lints it (pyproject.toml excludes the sources by name).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys

from magpie.patches import (
    Conflict,
    Patch,
    ToolError,
    _listed_folders,
    _sections,
    apply_file,
    file_diff,
    load_series,
    release_key,
    release_of,
)

MODULES_DIR = os.path.dirname(os.path.abspath(__file__))


def created_files(patches: list[Patch]) -> dict[tuple[str, str], str]:
    """{(patch name, path): text} of every file the series creates, as each patch that touches it
    leaves it (a file 0001 creates and 0002 edits appears twice), in series order. The patches'
    own hunks build the text: no vLLM tree is needed. A file a later patch deletes is not listed
    for that patch."""
    current: dict[str, str | None] = {}
    found: dict[tuple[str, str], str] = {}
    for patch in patches:
        for fp in patch.files:
            if fp.path not in current and fp.old_exists:
                continue  # a vLLM file the patch edits, not one the series ships
            try:
                text = apply_file(fp, current.get(fp.path), reverse=False)
            except Conflict as e:
                raise ToolError(f"{patch.name}: {e}") from None
            current[fp.path] = text
            if text is not None:
                found[(patch.name, fp.path)] = text
    return found


def extract_created(folders: list[str], output: str) -> list[str]:
    """Write created_files() of each series folder to OUTPUT/<series folder>/<patch>/<path>;
    return the paths written. OUTPUT must not exist or be empty."""
    if os.path.exists(output) and os.listdir(output):
        raise ToolError(f"--output {output} exists and is not empty")
    written = []
    for folder in folders:
        for (name, path), text in created_files(load_series(folder)).items():
            dest = os.path.join(output, os.path.basename(os.path.normpath(folder)), name.removesuffix(".patch"), path)
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            with open(dest, "w", encoding="utf-8") as f:
                f.write(text)
            written.append(dest)
    return written


_RELEASE_MARK = re.compile(r"^# \[release (?P<what>\d+(?:\.\d+)*|end)\]$")


def render_module(text: str, release: str, source: str = "module") -> str:
    """`text` (a module source) as the series of vLLM `release` ships it: the lines of that
    release's `# [release ...]` block kept (no block of its own: the nearest older release's),
    every other release's block and the markers dropped."""
    out, block, seen = [], None, []
    for lineno, line in enumerate(text.splitlines(keepends=True), 1):
        mark = _RELEASE_MARK.match(line.rstrip("\n"))
        if not mark:
            if block is None or block == release:
                out.append(line)
            continue
        what = mark.group("what")
        if what == "end":
            if block is None:
                raise ToolError(f"{source}:{lineno}: `# [release end]` without a `# [release X.Y.Z]` above it")
            block = None
            continue
        if what in seen:
            raise ToolError(f"{source}:{lineno}: a second `# [release {what}]` block; keep one per release")
        block = what
        seen.append(what)
    if block is not None:
        raise ToolError(f"{source}: the `# [release {block}]` block has no `# [release end]`")
    if seen and release not in seen:
        older = [what for what in seen if release_key(what) < release_key(release)]
        if not older:
            raise ToolError(
                f"{source}: no `# [release {release}]` block and none for an older release (it has "
                f"{', '.join(seen)}): add the lines vLLM {release} needs there"
            )
        # A release without a block of its own ships the nearest older release's lines.
        return render_module(text, max(older, key=release_key), source)
    return "".join(out)


@dataclasses.dataclass
class ShippedModule:
    patch: Patch
    patch_file: str  # the patch file holding the new-file hunk
    path: str  # where it lands in vLLM's tree
    source: str  # magpie/vllm_modules/<name>
    release: str
    shipped: str  # the text the hunk creates now
    generated: str  # the text the source generates for `release`


def shipped_modules(folder: str, modules_dir: str = MODULES_DIR) -> list[ShippedModule]:
    """Every Python file the series in `folder` creates, with its source and what the source
    generates. A created .py file without a source is an error naming the file to add."""
    found = []
    for patch in load_series(folder):
        release = release_of(patch.fields["target"].split()[-1])
        for fp in patch.files:
            if fp.old_exists or not fp.new_exists or not fp.path.endswith(".py"):
                continue
            source = os.path.join(modules_dir, os.path.basename(fp.path))
            if not os.path.isfile(source):
                raise ToolError(
                    f"{patch.name} creates {fp.path}, which has no source {source}: every module a patch "
                    "creates is kept there once (copy the file there, then run `refresh`)"
                )
            with open(source, encoding="utf-8") as f:
                generated = render_module(f.read(), release, os.path.relpath(source))
            shipped = "".join(line for hunk in fp.hunks for line in hunk.new_lines)
            patch_file = os.path.join(folder, patch.name)
            found.append(ShippedModule(patch, patch_file, fp.path, source, release, shipped, generated))
    return found


def refresh_patch_text(text: str, path: str, content: str) -> str:
    """The patch `text` with its new-file section for `path` rewritten to create `content`."""
    header, sections = text[: text.index("diff --git ")], _sections(text)
    first = f"diff --git a/{path} b/{path}\n"
    hits = [i for i, section in enumerate(sections) if section.startswith(first)]
    if len(hits) != 1:
        raise ToolError(f"{len(hits)} diff sections for {path} (expected one)")
    sections[hits[0]] = file_diff(path, None, content)
    return header + "".join(sections)


def refresh_series(folders: list[str], modules_dir: str = MODULES_DIR, write: bool = True) -> list[ShippedModule]:
    """The shipped modules whose hunk differs from their source's text; with `write`, each such
    patch file is rewritten from the source (nothing else in it changes)."""
    stale = [m for folder in folders for m in shipped_modules(folder, modules_dir) if m.shipped != m.generated]
    if write:
        for module in stale:
            with open(module.patch_file, encoding="utf-8") as f:
                text = f.read()
            _write_text(module.patch_file, refresh_patch_text(text, module.path, module.generated))
    return stale


def _write_text(path: str, text: str) -> None:
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def command_extract(args) -> int:
    for path in extract_created(_listed_folders(args), args.output):
        print(path)
    return 0


def _first_difference(a: str, b: str) -> str:
    for lineno, (x, y) in enumerate(zip(a.splitlines() + [""], b.splitlines() + [""], strict=False), 1):
        if x != y:
            return f"line {lineno}: the patch has {x!r}, the source gives {y!r}"
    return "the same lines, a different ending"


def command_check_sources(args) -> int:
    stale = refresh_series(_listed_folders(args), args.modules_dir, write=False)
    for m in stale:
        print(
            f"{os.path.relpath(m.patch_file)}: {m.path} is not what {os.path.relpath(m.source)} generates for "
            f"vLLM {m.release} ({_first_difference(m.shipped, m.generated)}); run `magpie/patches.py refresh`",
            file=sys.stderr,
        )
    if stale:
        return 1
    print("every module the series create is what its source generates")
    return 0


def command_refresh(args) -> int:
    for m in refresh_series(_listed_folders(args), args.modules_dir):
        print(f"refreshed {os.path.relpath(m.patch_file)}: {m.path} from {os.path.relpath(m.source)}")
    print("every module the series create is what its source generates")
    return 0


COMMANDS = {"extract": command_extract, "refresh": command_refresh, "check-sources": command_check_sources}


def add_parsers(sub, common: argparse.ArgumentParser) -> None:
    """The patch tool's `extract`, `refresh` and `check-sources` subcommands, with their options."""
    p_extract = sub.add_parser(
        "extract",
        parents=[common],
        help="write the files the series create, as each patch leaves them, to lint them as Python",
        description="Write every file the series create (default: every series under --patches-dir; "
        "--series or a target picks one) to OUTPUT/vllm-<release>/<patch>/<path>, as each patch that "
        "touches it leaves it. No vLLM tree is needed: the patches' hunks build the files.",
    )
    p_extract.add_argument("--output", metavar="DIR", required=True, help="folder to write (must be new or empty)")
    for name, help_text in (
        ("refresh", "rewrite the new-file hunks of the series from their sources (magpie/vllm_modules/)"),
        ("check-sources", "exit 1 when a new-file hunk differs from what its source generates"),
    ):
        p_sources = sub.add_parser(
            name,
            parents=[common],
            help=help_text,
            description=f"{help_text[0].upper()}{help_text[1:]}. Every Python file a patch creates is kept once, "
            "in --modules-dir (same file name); what differs between releases sits in its `# [release X.Y.Z]` "
            "... `# [release end]` section, and each series ships the lines of its own release. Default: every "
            "series under --patches-dir. Needs the checkout (the sources are not installed).",
        )
        p_sources.add_argument(
            "--modules-dir",
            default=MODULES_DIR,
            help="the folder holding one source per shipped module (default: %(default)s)",
        )
