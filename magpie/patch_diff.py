"""Write a patch of the series again from an edited vLLM tree (`magpie patches diff`).

To change a patch (a hook in vLLM's code, say): copy the pristine tree, apply the series up to
the patch before it, copy that tree, apply the patch to the copy, edit the copy, then

    magpie/patches.py diff ple_ssd/0001 --base BEFORE --target EDITED

rewrites patches/vllm-<release>/ple_ssd/0001-....patch with every file under vllm/ that differs
between the two trees, in git's format with `a/` and `b/` prefixes, under the patch's own header
(its fields kept as they are, `Last-Update:` set to today). Before anything is written, the new
patch is applied in memory to BEFORE and must give EDITED's files. --output FILE writes it
elsewhere. Files the tool itself leaves beside vllm/ (journal, lock) and bytecode are not
compared; a file that is not UTF-8 text is refused, naming it.
"""

from __future__ import annotations

import argparse
import datetime
import os

from magpie.patches import (
    ToolError,
    Tree,
    file_diff,
    find_target,
    load_series,
    parse_patch,
    select,
    series_dir,
)

_SKIPPED = ("__pycache__",)
_SKIPPED_SUFFIXES = (".pyc", ".pyo", ".so")


def _files(root: str) -> set[str]:
    """The paths of the files under root/vllm, relative to root (bytecode and caches left out)."""
    found = set()
    for dirpath, dirnames, filenames in os.walk(os.path.join(root, "vllm")):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIPPED)
        for name in filenames:
            if not name.endswith(_SKIPPED_SUFFIXES):
                found.add(os.path.relpath(os.path.join(dirpath, name), root))
    return found


def tree_diff(before: str, after: str) -> str:
    """Every file that differs between the two trees' vllm/ folders, as git diff sections."""
    old, new = Tree(before), Tree(after)
    sections = []
    for path in sorted(_files(before) | _files(after)):
        if _bytes(before, path) != _bytes(after, path):  # only files that differ are read as text
            sections.append(file_diff(path, old.read(path), new.read(path)))
    return "".join(sections)


def _bytes(root: str, path: str) -> bytes | None:
    try:
        with open(os.path.join(root, path), "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None


def _with_today(header: str, today: str | None = None) -> str:
    """The header with `Last-Update:` set to today (UTC)."""
    day = today or datetime.datetime.now(datetime.UTC).date().isoformat()
    lines = [f"Last-Update: {day}" if line.startswith("Last-Update:") else line for line in header.split("\n")]
    return "\n".join(lines)


def command_diff(args) -> int:
    if not args.base:
        raise ToolError("diff needs --base DIR: the tree before the patch (the series' earlier patches applied)")
    before = find_target(args.base, None)
    after = find_target(args.target, args.python)
    folder = series_dir(args.patches_dir, after.version, args.series)
    chosen = select(load_series(folder), [args.name])
    if len(chosen) != 1:
        raise ToolError(f"{args.name} names {len(chosen)} patches of {folder}; name one (e.g. ple_ssd/0001)")
    patch_file = os.path.join(folder, chosen[0].name)
    with open(patch_file, encoding="utf-8") as f:
        old_text = f.read()
    body = tree_diff(before.root, after.root)
    if not body:
        raise ToolError(f"{before.root} and {after.root} have the same vllm/ files: nothing to write")
    text = _with_today(old_text[: old_text.index("diff --git ")]) + body
    patch = parse_patch(patch_file, text)  # the header is checked as every command checks it
    staged = Tree(before.root).try_patch(patch, reverse=False)
    edited = Tree(after.root)
    wrong = [path for path, content in staged.items() if content != edited.read(path)]
    if wrong:
        raise ToolError(f"internal error: the new patch does not give {after.root}'s {wrong[0]}")
    output = args.output or patch_file
    with open(output + ".tmp", "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(output + ".tmp", output)
    print(f"wrote {output}: {len(patch.files)} file(s) from {after.root} against {before.root}")
    return 0


def add_parsers(sub, common: argparse.ArgumentParser) -> None:
    """The patch tool's `diff` subcommand, with its options."""
    first, rest = __doc__.split("\n\n", 1)
    p_diff = sub.add_parser(
        "diff",
        parents=[common],
        help="write a patch of the series again from an edited tree (--target) against the tree before it (--base)",
        description=first,
        epilog=rest,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p_diff.add_argument("name", metavar="NAME", help="the patch to write again, e.g. ple_ssd/0001")
    p_diff.add_argument("--base", metavar="DIR", help="the tree before the patch (required)")
    p_diff.add_argument("--output", metavar="FILE", help="write the patch here (default: the patch file in the series)")
