"""The Python modules the patch series add to vLLM, each kept once.

Each file here is the one source of a module that patches create (a new-file hunk with the
same file name: `ple_mmap.py` and `ple_hash.py` in ple_ssd 0001 of 0.29.0 and 0.33.0,
`ple_rows.py`, their row I/O, in ple_ssd 0001 of all three series, `draft_vocab.py` in mtp_pruning 0001 of each).
What differs between vLLM releases sits in the module's one
`# [release X.Y.Z]` ... `# [release end]` section; the file a series ships keeps the lines of
its own release, or, for a release with no block of its own, the nearest older release's (so a
new release whose modules need nothing new is added without an edit here: 0.34.0 takes 0.33.0's).
`magpie/patches.py refresh` rewrites the hunks from these files,
`magpie/patches.py check-sources` fails when a hunk and its source disagree (tests run it);
both, and `extract`, are in `sources.py` here, which is not a module source but the project's
code that renders them. The sources follow vLLM's style, not this project's: `tests/lint.sh
patches` lints them with each release's ruff settings (the project's ruff skips each source by
name in pyproject.toml; a new source is added there). Imported as they are,
each file is the newest release's module (its last `# [release ...]` block wins).
"""
