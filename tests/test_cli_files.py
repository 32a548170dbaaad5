"""magpie.cli and magpie.files, the preamble and the output policy every tool shares: on real
files in a temporary folder, real signals to a real child process, and the tools' own main()."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from magpie import cli, files

REPO = Path(__file__).resolve().parent.parent


def leftovers(folder: Path) -> list[str]:
    """Temporary files of an atomic write still lying in `folder`."""
    return sorted(p.name for p in folder.iterdir() if ".tmp" in p.name)


# --------------------------------------------------------------------------- atomic writes
def test_atomic_write_replaces_the_file_and_leaves_no_temporary_file(tmp_path):
    path = tmp_path / "out" / "result.json"  # the folder is created
    files.atomic_write_json(path, {"a": 1})
    first_inode = path.stat().st_ino
    files.atomic_write_text(path, "second\n")
    assert path.read_text() == "second\n"
    assert path.stat().st_ino != first_inode  # a new file renamed over the old one, not rewritten in place
    files.atomic_write_bytes(path, b"\x00third")
    assert path.read_bytes() == b"\x00third"
    assert leftovers(path.parent) == []


def test_a_reader_of_the_old_file_keeps_reading_the_old_content(tmp_path):
    path = tmp_path / "keep.npy"
    files.atomic_write_bytes(path, b"old" * 1000)
    with open(path, "rb") as reader:
        files.atomic_write_bytes(path, b"new")
        assert reader.read() == b"old" * 1000
    assert path.read_bytes() == b"new"


def test_an_error_while_writing_keeps_the_old_file_and_removes_the_temporary_one(tmp_path):
    path = tmp_path / "report.html"
    path.write_text("the old report")
    with pytest.raises(RuntimeError, match="disk on fire"):
        with files.atomic_open(path) as f:
            f.write("half of the new rep")
            raise RuntimeError("disk on fire")
    assert path.read_text() == "the old report"
    assert leftovers(tmp_path) == []


def test_an_object_json_cannot_hold_writes_nothing(tmp_path):
    path = tmp_path / "summary.json"
    with pytest.raises(TypeError):
        files.atomic_write_json(path, {"bad": object()})
    assert list(tmp_path.iterdir()) == []


def test_a_ctrl_c_during_a_write_by_name_keeps_the_old_file(tmp_path):
    path = tmp_path / "counts.npy"
    path.write_bytes(b"earlier counts")
    with pytest.raises(KeyboardInterrupt):
        with files.atomic_path(path) as tmp:
            assert tmp.parent == tmp_path and tmp.suffix == ".npy"  # a writer that picks the format by suffix
            tmp.write_bytes(b"partial")
            raise KeyboardInterrupt
    assert path.read_bytes() == b"earlier counts"
    assert leftovers(tmp_path) == []


def test_a_new_file_gets_the_mode_a_plain_open_gives(tmp_path):
    plain = tmp_path / "plain"
    plain.write_text("x")
    atomic = tmp_path / "atomic"
    files.atomic_write_text(atomic, "x")  # mkstemp alone would leave it 0600
    assert (atomic.stat().st_mode & 0o777) == (plain.stat().st_mode & 0o777)


def test_atomic_open_takes_only_write_modes(tmp_path):
    with pytest.raises(ValueError, match="mode must be 'w' or 'wb', not 'a'"):
        with files.atomic_open(tmp_path / "log.txt", "a"):
            pass


# --------------------------------------------------------------------------- the overwrite rule
def test_check_output_refuses_an_existing_file_naming_it_and_the_flag(tmp_path):
    path = tmp_path / "bench-c1.json"
    path.write_text("{}")
    with pytest.raises(SystemExit) as refused:
        files.check_output(path, force=False)
    message = str(refused.value)
    assert message == f"error: {path} exists; pass --force to replace it, or choose another --output"
    assert isinstance(refused.value, files.OutputExists) and refused.value.path == str(path)
    with pytest.raises(SystemExit, match=r"pass --overwrite to replace it, or choose another --summary"):
        files.check_output(path, False, flag="--overwrite", what="--summary")


def test_check_output_lets_through_force_a_new_path_stdout_and_no_output(tmp_path):
    existing = tmp_path / "x.json"
    existing.write_text("{}")
    files.check_output(existing, force=True)
    files.check_output(tmp_path / "new.json", force=False)
    files.check_output("-", force=False)
    files.check_output(None, force=False)


def test_check_output_counts_a_dangling_link_as_existing(tmp_path):
    link = tmp_path / "keep.npy"
    link.symlink_to(tmp_path / "gone.npy")
    with pytest.raises(SystemExit, match="keep.npy exists"):
        files.check_output(link, force=False)


# --------------------------------------------------------------------------- a run folder's names
def test_run_suite_sh_writes_the_files_magpie_files_names():
    script = (REPO / "magpie" / "measure" / "run_suite.sh").read_text()
    written = set(re.findall(r'"\$out/([A-Za-z0-9_.-]+)"', script))
    assert written == set(files.RUN_FILES)


def test_run_suite_sh_defaults_to_the_url_of_the_client_tools_and_writes_the_one_schema_prefix():
    script = (REPO / "magpie" / "measure" / "run_suite.sh").read_text()
    assert re.findall(r"^URL=\$\{URL:-(\S+)\}$", script, re.M) == [cli.DEFAULT_URL]
    assert f"#   URL={cli.DEFAULT_URL} " in script  # the usage text says the same
    assert re.findall(r'"schema": "([^"]+)"', script) == [files.schema("suite", 1)]


@pytest.mark.parametrize(
    "name, module", [("bench-decode", "bench_decode"), ("gsm8k", "gsm8k"), ("trace-split", "trace_split")]
)
def test_each_json_schema_takes_its_tools_schema_string_and_the_legacy_one(name, module):
    import importlib

    import jsonschema

    written = importlib.import_module(f"magpie.measure.{module}").SCHEMA
    field = json.loads((REPO / "magpie" / "measure" / "schemas" / f"{name}.schema.json").read_text())["properties"]
    version = files.schema_of(written)[1]
    assert written == files.schema(name, version)
    assert files.schema_of(written) == (name, version)
    jsonschema.validate(written, field["schema"])
    # Committed measurements carry the old prefix, at the version current when it was replaced.
    legacy = []
    for old in range(1, version + 1):
        value = f"flash-next/{name}/{old}"
        try:
            jsonschema.validate(value, field["schema"])
        except jsonschema.ValidationError:
            continue
        assert files.schema_of(value) == (name, old)
        legacy.append(value)
    assert legacy, f"{name}: no flash-next/{name}/N is accepted"
    for value in (f"magpie/{name}/{version + 1}", f"magpie/other/{version}"):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(value, field["schema"])


def test_bench_file_names_the_suites_two_concurrencies():
    assert (files.bench_file(1), files.bench_file(4), files.bench_file(8)) == (
        files.BENCH_C1,
        files.BENCH_C4,
        "bench-c8.json",
    )


# --------------------------------------------------------------------------- the parser
DOC = """Do one thing well.

    magpie thing --count 3

Formats: kept as written,
  indented lines too.
"""


def test_parser_shows_the_docstring_defaults_that_say_something_and_the_force_flag():
    parser = cli.parser("magpie thing", DOC)
    parser.add_argument("--count", type=int, default=3, help="how many")
    parser.add_argument("--label", help="a name")
    parser.add_argument("--quiet", action="store_true", help="say less")
    parser.add_argument("--seed", default="s.json", help="seed file (default: %(default)s)")
    cli.add_force(parser, "the --output file")
    text = parser.format_help()
    assert text.startswith("usage: magpie thing [-h]")
    assert "\n\nDo one thing well.\n\n" in text
    assert text.rstrip().endswith("    magpie thing --count 3\n\nFormats: kept as written,\n  indented lines too.")
    assert "how many (default: 3)" in text and "seed file (default: s.json)\n" in text
    assert "(default: None)" not in text and "(default: False)" not in text
    assert "  --force " in text and "replace the --output file if it exists" in text
    assert parser.parse_args(["--force"]).force and not parser.parse_args([]).force


def test_subcommands_get_the_same_help_format():
    parser = cli.parser("magpie thing", DOC)
    sub = parser.add_subparsers(dest="command", required=True)
    warm = sub.add_parser("warm", help="warm it", description="Warm the cache.\n\n  exactly as written")
    warm.add_argument("--chunk", default="16MiB", help="bytes per read")
    text = warm.format_help()
    assert "bytes per read (default: 16MiB)" in text and "\n  exactly as written" in text


def test_split_doc_without_a_second_paragraph():
    assert cli.split_doc("One line.") == ("One line.", None)
    assert cli.split_doc(None) == ("", None)


# --------------------------------------------------------------------------- run until stopped
def test_run_until_stopped_ends_a_loop_on_sigterm_running_its_cleanup(tmp_path):
    marker = tmp_path / "cleaned-up"
    child = f"""
import sys, time
from magpie import cli
def loop():
    try:
        print("running", flush=True)
        while True:
            time.sleep(0.05)
    finally:
        open({str(marker)!r}, "w").write("done")
sys.exit(cli.run_until_stopped(loop))
"""
    proc = subprocess.Popen([sys.executable, "-c", child], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "running\n"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert marker.read_text() == "done"


def test_run_until_stopped_returns_the_loops_status_and_restores_the_handler():
    before = signal.getsignal(signal.SIGTERM)
    assert cli.run_until_stopped(lambda: 3) == 3
    assert signal.getsignal(signal.SIGTERM) is before


# --------------------------------------------------------------------------- the tools
def _tool_cases(tmp_path: Path) -> dict[str, tuple[str, list[str], Path]]:
    """tool -> (module, argv whose output exists, that output): each refusal comes before any work."""
    out = tmp_path / "exists.json"
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"results": {}, "written_utc": "now", "machine": "here"}))
    return {
        "report": ("magpie.measure.report", ["--output", str(out)], out),
        "trace-split": ("magpie.measure.trace_split", [str(tmp_path / "no-trace"), "--output", str(out)], out),
        "bench-staging": ("magpie.ple_ssd.bench_staging", ["--dir", str(tmp_path / "t"), "--out", str(out)], out),
        "bench-draft-head": ("magpie.mtp_pruning.bench_draft_head", ["--output", str(out)], out),
        "gpu-harness": ("magpie.gpu.gpu_harness", ["summary", str(results), "--write-to", str(out)], out),
        "log-check": ("magpie.measure.log_check", [str(tmp_path / "no-log"), "--output", str(out)], out),
    }


@pytest.mark.parametrize(
    "tool", ["report", "trace-split", "bench-staging", "bench-draft-head", "gpu-harness", "log-check"]
)
def test_each_tool_refuses_an_existing_output_before_any_work(tmp_path, capsys, tool):
    import importlib

    module, argv, out = _tool_cases(tmp_path)[tool]
    out.write_text("earlier result")
    with pytest.raises(SystemExit) as refused:
        importlib.import_module(module).main(argv)
    assert str(refused.value).startswith(f"error: {out} exists; pass --force to replace it")
    assert out.read_text() == "earlier result"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exists.json", "results.json"]  # nothing else began


def test_gpu_harness_summary_writes_with_force(tmp_path, capsys):
    from magpie.gpu import gpu_harness as harness

    _, argv, out = _tool_cases(tmp_path)["gpu-harness"]
    out.write_text("earlier result")
    assert harness.main([*argv, "--force"]) == 0
    assert json.loads(out.read_text())["comparisons"] == {}
    assert "gpu harness results, now, machine here" in capsys.readouterr().out


@pytest.mark.parametrize(
    "tool, usage, epilog_words",
    [
        ("report", "magpie report", "Two text modes for scripts:"),
        ("trace-split", "magpie trace-split", "python3 magpie trace-split"),
        ("profile-capture", "magpie profile-capture", "python3 magpie profile-capture"),
        ("cluster", "magpie cluster", "a path that only the head has is never handed to a worker."),
        ("ple-warmup", "magpie ple-warmup", "python3 magpie ple-warmup"),
        ("count-tokens", "magpie count-tokens", "Exit status 1 when no token was counted."),
        ("build-keepset", "magpie build-keepset", 'schema "magpie/build-keepset/1"'),
        ("fit-keepset", "magpie fit-keepset", "fitted on all texts."),
        ("bench-draft-head", "magpie bench-draft-head", "CutlassFP8ScaledMMLinearKernel"),
        ("bench-staging", "magpie bench-staging", "A CPU smoke run"),
        ("gpu-harness", "magpie gpu-harness", "summary --write-to"),
        ("log-check", "magpie log-check", "--expect FEATURE=STATE` makes the exit status 1"),
        ("demo-model", "magpie demo-model", "python3 magpie demo-model /tmp/tiny/tokenizer"),
    ],
)
def test_help_from_the_entry_point_is_complete(tmp_path, tool, usage, epilog_words):
    proc = subprocess.run(
        [sys.executable, str(REPO / "magpie"), tool, "--help"], cwd=tmp_path, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"usage: {usage} "), proc.stdout[:200]
    assert epilog_words in proc.stdout  # the docstring past its first paragraph is there
    assert "(default: None)" not in proc.stdout


@pytest.mark.parametrize(
    "text, size",
    [
        ("6GiB", 6 * 1024**3),
        ("512mib", 512 * 1024**2),
        ("110G", 110 * 10**9),
        ("2 GB", 2 * 10**9),
        ("1048576", 1 << 20),
    ],
)
def test_parse_size_reads_iec_and_si_units(text, size):
    assert cli.parse_size(text) == size


def test_a_size_option_refuses_a_non_size_naming_the_option(capsys):
    parser = cli.parser("magpie thing", DOC)
    parser.add_argument("--budget", type=cli.parse_size, default="16GiB", help="bytes")
    assert parser.parse_args([]).budget == 16 * 1024**3  # a string default goes through the type too
    with pytest.raises(SystemExit) as refused:
        parser.parse_args(["--budget", "16 gallons"])
    assert refused.value.code == 2
    assert "argument --budget: not a size: '16 gallons' (examples: 6GiB" in capsys.readouterr().err


def test_add_server_gives_the_client_options():
    parser = cli.parser("magpie thing", DOC)
    cli.add_server(parser)
    args = parser.parse_args([])
    assert (args.url, args.model) == (cli.DEFAULT_URL, None)
    assert f"server base URL (default: {cli.DEFAULT_URL})" in parser.format_help()
