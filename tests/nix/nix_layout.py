"""Layout rules of nixfmt (RFC 166 style, nixfmt 1.x) that can be checked without nixfmt.

No package registry reachable here ships nixfmt (docs/nix.md says what was tried), so CI checks
the rules below, which are the ones hand-written Nix breaks most often, and the flake's
`checks.formatting` runs the real nixfmt on a machine with nixpkgs:

- a list with two or more items, or an attribute set (or `let`) with two or more bindings, is
  never written on one line (nixfmt always breaks them, one item or binding per line);
- no code line is longer than 100 columns unless what makes it long is one string;
- indentation is spaces in steps of two, no tabs, no trailing white space, one final newline.

Strings and comments are masked first (their content never counts), so a shell `[ -f x ]`
inside '' ... '' is not a list.
"""

from __future__ import annotations

import re
import sys

WIDTH = 100


def mask(text: str) -> str:
    """The text with string contents and comments replaced by `x` (same length, same newlines);
    interpolations `${...}` inside strings stay code."""
    return _scan(text)[0]


def in_string_lines(text: str) -> list[bool]:
    """For each line, whether it starts inside a string (nixfmt never reflows those lines)."""
    return _scan(text)[1]


def _scan(text: str) -> tuple[str, list[bool]]:
    out: list[str] = []
    line_starts = [False]
    i, n = 0, len(text)
    # stack of contexts: "code" (with its brace depth), '"' or "''"
    stack: list[list] = [["code", 0]]
    while i < n:
        kind = stack[-1][0]
        c = text[i]
        if c == "\n":
            line_starts.append(any(context[0] != "code" for context in stack))
            out.append(c)
            i += 1
            continue
        if kind == "code":
            if c == "#":
                j = text.find("\n", i)
                j = n if j == -1 else j
                out.append("x" * (j - i))
                i = j
                continue
            if text.startswith("/*", i):
                j = text.find("*/", i + 2)
                j = n if j == -1 else j + 2
                out.append(re.sub(r"[^\n]", "x", text[i:j]))
                line_starts += [True] * text.count("\n", i, j)
                i = j
                continue
            if c == '"':
                stack.append(['"', 0])
                out.append(c)
                i += 1
                continue
            if text.startswith("''", i):
                stack.append(["''", 0])
                out.append("''")
                i += 2
                continue
            if c == "{":
                stack[-1][1] += 1
            elif c == "}":
                if stack[-1][1] == 0 and len(stack) > 1:  # end of an interpolation
                    stack.pop()
                    out.append(c)
                    i += 1
                    continue
                stack[-1][1] -= 1
            out.append(c)
            i += 1
            continue
        # inside a string
        if text.startswith("${", i):
            stack.append(["code", 0])
            out.append("${")
            i += 2
            continue
        if kind == '"':
            if c == "\\" and i + 1 < n and text[i + 1] != "\n":
                out.append("xx")
                i += 2
                continue
            if c == '"':
                stack.pop()
                out.append(c)
                i += 1
                continue
        else:  # ''
            if text.startswith("'''", i) or text.startswith("''$", i) or text.startswith("''\\", i):
                out.append("xxx")
                i += 3
                continue
            if text.startswith("''", i):
                stack.pop()
                out.append("''")
                i += 2
                continue
        out.append("x")
        i += 1
    return "".join(out), line_starts


OPEN, CLOSE = "([{", ")]}"


def _groups_on_one_line(line: str):
    """(opening char, inner text) for each bracket pair that opens and closes on this line."""
    stack = []
    for pos, c in enumerate(line):
        if c in OPEN:
            stack.append((c, pos))
        elif c in CLOSE and stack:
            opening, start = stack.pop()
            yield opening, line[start + 1 : pos], line[:start]


def _top_level_items(inner: str) -> list[str]:
    """Whitespace-separated items of a list body, brackets and strings kept whole."""
    items, depth, current, quote = [], 0, "", None
    k = 0
    while k < len(inner):
        c = inner[k]
        if quote:
            current += c
            if inner.startswith(quote, k):
                current += inner[k + 1 : k + len(quote)]
                k += len(quote)
                quote = None
                continue
        elif c == '"' or inner.startswith("''", k):
            quote = '"' if c == '"' else "''"
            current += inner[k : k + len(quote)]
            k += len(quote)
            continue
        elif c in OPEN:
            depth += 1
            current += c
        elif c in CLOSE:
            depth -= 1
            current += c
        elif c.isspace() and depth == 0:
            if current:
                items.append(current)
            current = ""
        else:
            current += c
        k += 1
    if current:
        items.append(current)
    return items


def _top_level_count(inner: str, separator: str) -> int:
    depth, count = 0, 0
    for c in inner:
        if c in OPEN:
            depth += 1
        elif c in CLOSE:
            depth -= 1
        elif c == separator and depth == 0:
            count += 1
    return count


def violations(text: str) -> list[str]:
    """Each rule broken, as 'line N: what'."""
    found = []
    if not text.endswith("\n") or text.endswith("\n\n"):
        found.append("the file must end with exactly one newline")
    masked, in_string = _scan(text)
    original_lines = text.split("\n")
    rows = zip(masked.split("\n"), original_lines, in_string, strict=True)
    for number, (line, original, string_line) in enumerate(rows, 1):
        if "\t" in original:
            found.append(f"line {number}: a tab")
        if original != original.rstrip():
            found.append(f"line {number}: trailing white space")
        code = line.strip()
        if string_line or not code or set(code) <= {"x", "'", '"'}:
            continue  # inside a string or a comment: nixfmt leaves it as written
        indent = len(line) - len(line.lstrip(" "))
        if indent % 2:
            found.append(f"line {number}: indented by {indent} spaces (nixfmt indents in steps of 2)")
        if len(original) > WIDTH:
            strings = re.findall(r'"x*"', line) + re.findall(r"''x*''", line)
            if len(strings) != 1 or any(c in line.replace("${", "") for c in "[{("):
                found.append(f"line {number}: {len(original)} columns (nixfmt breaks it at {WIDTH})")
        for opening, inner, before in _groups_on_one_line(line):
            if opening == "[" and len(_top_level_items(inner)) >= 2:
                found.append(f"line {number}: a list of {len(_top_level_items(inner))} items on one line")
            elif opening == "{" and not before.endswith("$") and _top_level_count(inner, ";") >= 2:
                found.append(f"line {number}: an attribute set of several bindings on one line")
        if re.match(r"\s*let\b", line) and re.search(r"\bin\b", line) and line.count(";") >= 2:
            found.append(f"line {number}: a let with several bindings on one line")
    return found


def main(argv: list[str]) -> int:
    """usage: nix_layout.py FILE.nix...   (tests/run.sh runs it on every tracked .nix file)"""
    broken = 0
    for name in argv:
        with open(name) as f:
            for found in violations(f.read()):
                print(f"{name}: {found}", file=sys.stderr)
                broken += 1
    if broken:
        print(f"{broken} nixfmt layout problems; nixfmt (RFC style) fixes them: nix fmt", file=sys.stderr)
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
