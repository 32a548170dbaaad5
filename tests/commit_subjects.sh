#!/usr/bin/env bash
# Commit subjects are at most 72 characters: what changed; the figures and reasons go in the body.
#
# usage: tests/commit_subjects.sh                 every commit after the base (below) up to HEAD
#        tests/commit_subjects.sh --message FILE  one message about to be committed (the
#                                                 commit-msg hook, .githooks/commit-msg)
#
# The base is the last commit of the history written before the rule ($COMMIT_SUBJECTS_BASE
# overrides it): older subjects are left as they are. In a clone without the base (a shallow
# one), or where HEAD does not descend from it, only HEAD is checked, and the script says so.
# Outside a git checkout (a plain copy of the source) there are no commits: it says so, exit 0.
# A subject is the message's first paragraph, its lines joined by spaces (as `git log %s` shows
# it), counted in characters (UTF-8). Exit 1 names each commit over the limit and its length.
set -euo pipefail

MAX=72
BASE=${COMMIT_SUBJECTS_BASE:-d28b98954572645c9da46ce33fce41bae0fb5c3c}
# Characters, not bytes, for ${#subject}; C.UTF-8 is built into glibc 2.35+.
export LC_ALL=C.UTF-8

# subject_of_message FILE: the subject of a commit message as `git commit` will store it
# (comment lines dropped, leading blank lines skipped, the first paragraph joined).
subject_of_message() {
    local line subject=""
    while IFS= read -r line || [ -n "$line" ]; do
        case "$line" in
            '#'*) continue ;;
        esac
        line=${line%$'\r'}
        if [ -z "${line//[[:space:]]/}" ]; then
            if [ -n "$subject" ]; then break; fi
            continue
        fi
        subject=${subject:+$subject }$line
    done <"$1"
    printf '%s' "$subject"
}

if [ "${1:-}" = --message ]; then
    if [ $# -ne 2 ] || [ ! -f "$2" ]; then
        echo "commit_subjects.sh: --message needs the commit message file (got '${2:-}')" >&2
        exit 2
    fi
    subject=$(subject_of_message "$2")
    if [ ${#subject} -gt "$MAX" ]; then
        echo "commit-msg: the subject is ${#subject} characters, at most $MAX: \"$subject\"" >&2
        echo "commit-msg: say what changed in the first line; put the figures and reasons in the" \
            "body, after a blank line (your message is kept in .git/COMMIT_EDITMSG)" >&2
        exit 1
    fi
    exit 0
elif [ $# -ne 0 ]; then
    echo "commit_subjects.sh: no argument '$1' (none, or --message FILE)" >&2
    exit 2
fi

cd "$(dirname "${BASH_SOURCE[0]}")/.."
if ! git rev-parse --verify --quiet HEAD >/dev/null 2>&1; then
    echo "commit subjects: not a git checkout with commits; nothing to check"
    exit 0
fi

if git cat-file -e "$BASE^{commit}" 2>/dev/null && git merge-base --is-ancestor "$BASE" HEAD; then
    range=("$BASE..HEAD")
    what="the commits after ${BASE:0:12}"
else
    range=(-1 HEAD)
    what="HEAD only: the base ${BASE:0:12} is not in this clone's history of HEAD (a shallow clone?)"
fi

count=0
bad=0
while IFS= read -r -d '' record || [ -n "$record" ]; do
    count=$((count + 1))
    hash=${record%% *}
    subject=${record#* }
    if [ ${#subject} -gt "$MAX" ]; then
        echo "commit subjects: $hash's subject is ${#subject} characters, at most $MAX: \"$subject\"" >&2
        bad=$((bad + 1))
    fi
done < <(git log -z --format='%h %s' "${range[@]}")

if [ "$bad" -gt 0 ]; then
    echo "commit subjects: $bad of $count over $MAX characters; reword them (git rebase -i, 'reword')" \
        "with the what in the subject and the why in the body" >&2
    exit 1
fi
echo "commit subjects: $count checked ($what), all at most $MAX characters"
