"""Every .nix file of the repository follows the nixfmt layout rules that can be checked without
nixfmt (nix_layout.py); the flake's checks.formatting runs nixfmt itself."""

from __future__ import annotations

import pytest

from tests.nix.nix_layout import mask, violations
from tests.nix.nixeval import REPO
from tests.nix.test_nix_lib import tracked

NIX_FILES = tracked("*.nix")


def test_the_flake_files_are_all_checked():
    assert {"flake.nix", "nix/lib.nix", "nix/checks.nix", "tests/nix/nixpkgs-stand-in/lib.nix"} <= set(NIX_FILES)


@pytest.mark.parametrize("name", NIX_FILES)
def test_nix_file_follows_nixfmt_layout(name):
    assert violations((REPO / name).read_text()) == [], name


# What the rules catch, each on the construct that once failed nixfmt 1.2 here.
BROKEN = {
    "two list items on one line": (
        'x = runCommand "n" { nativeBuildInputs = [ shellcheck findutils ]; } "";\n',
        "line 1: a list of 2 items on one line",
    ),
    "a line past 100 columns": (
        '{\n  patch-series = runCommand "magpie-patch-series-vllm-0.29.0" '
        "{ nativeBuildInputs = [ python312 ]; } ''\n  '';\n}\n",
        "line 2: 103 columns (nixfmt breaks it at 100)",
    ),
    "two bindings on one line": ("{ a = { b = 1; c = 2; }; }\n", "line 1: an attribute set of several bindings"),
    "odd indentation": ("{\n   a = 1;\n}\n", "line 2: indented by 3 spaces"),
    "trailing white space": ("{ }  \n", "line 1: trailing white space"),
    "no final newline": ("{ }", "the file must end with exactly one newline"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_layout_rule_catches(case):
    text, expected = BROKEN[case]
    assert any(found.startswith(expected) for found in violations(text)), violations(text)


def test_strings_and_comments_are_not_code():
    text = (
        "{\n  # [ a b ] { x = 1; y = 2; }\n"
        "  s = ''\n    if [ -f a ] && [ -f b ]; then x; fi ${toString [ 1 ]}\n  '';\n}\n"
    )
    assert violations(text) == []
    masked = mask(text)
    assert "[ -f a ]" not in masked and "${toString [ 1 ]}" in masked
