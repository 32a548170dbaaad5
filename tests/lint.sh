#!/usr/bin/env bash
# The lint step, and the one place that says which files each linter sees: tests/run.sh runs
# it before the suite, the flake's checks (nix/checks.nix) run its parts.
#
# usage: tests/lint.sh [PART...]          PART: python, patches, shell, nix, commits (default: all)
#
#   python   ruff check and ruff format --check over every *.py file (pyproject.toml's settings)
#   patches  the one source of each module the patch series create (magpie/vllm_modules/), as
#            each release's series ships it (`patches.py refresh` into a scratch copy of the
#            series, then `extract`: each file as each patch leaves it), linted with the ruff
#            settings of that vLLM release: its own pyproject.toml, read from
#            $VLLM_SDISTS/vllm-<release>/ (default .cache/sdist, which tests/env/setup.sh fills);
#            the files go into vLLM's tree, so they follow vLLM's rules (line length 88, its rule
#            set), not the project's. Then `patches.py check-sources`: the committed hunks must
#            be what the sources generate
#   shell    ShellCheck over every *.sh file, .ci/run and .githooks/commit-msg
#   nix      nixfmt --check over every *.nix file: $NIXFMT, else the nixfmt 1.4.0 kept beside
#            the checkout (../shared/tools/nixfmt/nixfmt: nixfmt is on no registry reachable
#            here); without either the part says it was skipped (`nix flake check` runs nixpkgs'
#            nixfmt through this part too)
#   commits  every commit subject after the rule's base commit is at most 72 characters
#            (tests/commit_subjects.sh; in a shallow clone HEAD's only, and it says so)
#
# Files: git's tracked files in a checkout; in a plain copy of the source (the flake's build
# sandbox, which gets exactly the tracked files) every file outside .git, .venv and .cache.
# Tools: $RUFF, $SHELLCHECK, $PYTHON, $NIXFMT, else the test venv's (.venv/bin), else the ones on PATH.
# $LINT_PATCHES_DIR: the series root to lint (default: patches/); $LINT_MODULES_DIR: the module
# sources (default: magpie/vllm_modules/).
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

tool() {  # tool NAME: the venv's NAME if there is one, else NAME (found on PATH)
    if [ -x "$root/.venv/bin/$1" ]; then echo "$root/.venv/bin/$1"; else echo "$1"; fi
}
ruff=${RUFF:-$(tool ruff)}
shellcheck=${SHELLCHECK:-$(tool shellcheck)}
python=${PYTHON:-$(tool python3)}
sdists=${VLLM_SDISTS:-$root/.cache/sdist}
patches_dir=${LINT_PATCHES_DIR:-$root/patches}
modules_dir=${LINT_MODULES_DIR:-$root/magpie/vllm_modules}
scratch=()
cleanup() { if [ ${#scratch[@]} -gt 0 ]; then rm -rf "${scratch[@]}"; fi; }
trap cleanup EXIT

# files PATTERN...: the files each linter sees (glob patterns such as '*.sh', or plain paths),
# relative to the root, sorted.
files() {
    if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
        git ls-files -- "$@"
        return
    fi
    local pattern
    for pattern in "$@"; do
        case "$pattern" in
            *'*'*)
                find . \( -path ./.git -o -path ./.venv -o -path ./.cache \) -prune -o -type f \
                    -name "$pattern" -print | sed 's|^\./||'
                ;;
            *) if [ -f "$pattern" ]; then echo "$pattern"; fi ;;
        esac
    done | sort -u
}

lint_python() {
    local py
    mapfile -t py < <(files '*.py')
    echo "lint: ruff over ${#py[@]} Python files"
    "$ruff" check --no-cache --force-exclude "${py[@]}"
    "$ruff" format --no-cache --check --force-exclude "${py[@]}"
}

lint_patches() {
    local out series release config patch count
    out=$(mktemp -d)
    scratch+=("$out")
    # The series as the sources generate them, then every file they create.
    cp -r "$patches_dir" "$out/series"
    "$python" "$root/magpie/patches.py" refresh --patches-dir "$out/series" --modules-dir "$modules_dir" >/dev/null
    "$python" "$root/magpie/patches.py" extract --patches-dir "$out/series" --output "$out/files" >/dev/null
    for series in "$out"/files/*/; do
        release=$(basename "$series")
        config="$sdists/$release/pyproject.toml"
        if [ ! -f "$config" ]; then
            echo "lint: $config is missing: the ruff settings of $release's own tree" \
                "(tests/env/setup.sh unpacks the sdists to .cache/sdist; or set VLLM_SDISTS)" >&2
            return 2
        fi
        for patch in "$series"*/; do cp "$config" "$patch/pyproject.toml"; done
    done
    count=$(find "$out/files" -name '*.py' | wc -l)
    echo "lint: ruff over the $count Python files the patch series create, with each vLLM release's settings"
    echo "lint: (a finding in vllm-<release>/<patch>/<path> is in $modules_dir/<its file name>," \
        "as that release's series ships it)"
    local failed=0
    (cd "$out/files" && "$ruff" check --no-cache .) || failed=1
    (cd "$out/files" && "$ruff" format --no-cache --check .) || failed=1
    "$python" "$root/magpie/patches.py" check-sources --patches-dir "$patches_dir" --modules-dir "$modules_dir" ||
        failed=1
    return "$failed"
}

lint_shell() {
    local scripts
    mapfile -t scripts < <(files '*.sh' .ci/run .githooks/commit-msg)
    echo "lint: ShellCheck over ${#scripts[@]} shell scripts"
    "$shellcheck" "${scripts[@]}"
}

lint_nix() {
    local nix_files nixfmt=${NIXFMT:-}
    if [ -z "$nixfmt" ]; then
        nixfmt="$root/../shared/tools/nixfmt/nixfmt"
        if [ ! -x "$nixfmt" ]; then
            echo "lint: SKIPPED nixfmt: no $nixfmt (the nixfmt 1.4.0 kept beside the checkout)" \
                "and NIXFMT is unset; the .nix files were not format-checked" >&2
            return 0
        fi
    elif ! command -v "$nixfmt" >/dev/null; then
        echo "lint: NIXFMT=$nixfmt is not an executable nixfmt" >&2
        return 2
    fi
    mapfile -t nix_files < <(files '*.nix')
    echo "lint: $("$nixfmt" --version) --check over ${#nix_files[@]} Nix files"
    "$nixfmt" --check "${nix_files[@]}"
}

lint_commits() {
    "$root/tests/commit_subjects.sh"
}

parts=("$@")
if [ ${#parts[@]} -eq 0 ]; then parts=(python patches shell nix commits); fi
for part in "${parts[@]}"; do
    case "$part" in
        python | patches | shell | nix | commits) "lint_$part" ;;
        *)
            echo "tests/lint.sh: no part '$part' (python, patches, shell, nix, commits)" >&2
            exit 2
            ;;
    esac
done
