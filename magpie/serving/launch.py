#!/usr/bin/env python3
"""serve.sh's logic: a profile plus your overrides -> one checked `vllm serve` launch.

A profile is a `vllm serve --config` YAML file (keys are `vllm serve` options without the dashes;
`profiles/*.yaml` ship: seed-gb10, gb10-community, hopper). `plan` loads it, applies serve.sh's
variables (GPU_MEM, MAX_NUM_SEQS, MTP, PLE, TOOL_CALL_PARSER, ...), expands it into command-line
options exactly as vLLM 0.29.0's own `--config` loader does, and puts your extra arguments last, so
the command line wins over the file as in vLLM. It then checks everything that would otherwise
fail only after the ~10-minute weight load (config.json, patches, keep-set, JIT tools), and parses
the command with vLLM's own `vllm serve` parser whenever there are extra arguments (or a profile
`false`): vLLM reads it last-wins, so extra arguments that would change a checked option (MODEL,
HOST, PORT, --hf-overrides, --engram-config, --speculative-config, in any of vLLM's spellings) are
refused, as is a command vLLM would not parse. It chooses the environment (the GB10's allocator
and JIT-job settings), names a neutral working directory (a `vllm/` folder where you stand must
not shadow the installed vLLM; `exec` creates it, so a plan never run leaves no folder), writes
the launch plan and run manifest `LOG.launch.json` (magpie/serving/manifest.py) and the top of the
log (a rendering of the manifest), and prints the working directory. `exec PLAN` then becomes the
server: same PID, the plan's environment, its working directory.

The profile file and serve.sh's variables on it are magpie/serving/profile.py's (re-exported
here); PLE=1's spelling per vLLM release is magpie/release_ple.py's.

Every check runs in this process (the patch tool's status, computed once, and preflight's
checks are function calls): between serve.sh and vLLM there is this one Python process and
`exec`'s. So they describe the vLLM that this interpreter imports: run `plan` under the vLLM
environment's Python (`--python` names the interpreter of the server's command, e.g. a wrapper
script of that environment).

    MODEL=/models/Flash-Next PROFILE=gb10-community launch.py plan --log server.log --host 127.0.0.1 --port 8100
    launch.py exec server.log.launch.json

Run it with the vLLM environment's Python (serve.sh does): it needs PyYAML, which vLLM requires.
Exit status of `plan`: 0 planned; 1 refused (the message says what, why and what to do).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import getpass
import io
import json
import os
import platform
import secrets
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Mapping

from magpie import cli, patches, release_ple, releases, tool_command
from magpie.serving import manifest, preflight
from magpie.serving.profile import (  # noqa: F401 - re-exported: launch.py is where serve.sh's logic is looked up
    DEFAULT_PROFILE,
    PLE_HELD_AS,
    PROFILE_DIR,
    PROFILE_SETTINGS,
    SETTING_LINE,
    Refused,
    _env,
    apply_overrides,
    available_profiles,
    expand,
    load_profile,
    profile_path,
    profile_settings,
)

# Applied to the server's environment on a GB10 (GB10_ENV=auto finds one, 1 forces), each only
# when you have not set it yourself. The reason is written into the log next to each value.
GB10_ENVIRONMENT = {
    "PYTORCH_CUDA_ALLOC_CONF": (
        "expandable_segments:False",
        "GB10 owners traced NV_ERR_NO_MEMORY failures and host wedges to the CUDA caching allocator's "
        "expandable segments (growing mappings of unified memory); plain segments are the fix they used",
    ),
    "MAX_JOBS": (
        "{jit_jobs}",
        "FlashInfer's JIT passes MAX_JOBS to `ninja -j` (flashinfer/jit/cpp_ext.py); unset, ninja runs "
        "nproc+2 nvcc processes at once, and the sm_120 fused-MoE build then runs out of the memory the "
        "loaded weights left",
    ),
    "FLASHINFER_NVCC_THREADS": (
        "1",
        "FlashInfer passes it to `nvcc --threads`: threads per compile job multiply MAX_JOBS; 1 keeps the "
        "JIT's peak memory at MAX_JOBS compilers",
    ),
}


# --------------------------------------------------------------------------------------------
# Checks before the launch


# PLE=1: the n-gram table on disk. It is serve.sh's one name for it (a profile's `#: ple: true`, the
# PLE variable); vLLM has a spelling per release (magpie/release_ple.py holds them, keyed like
# releases.PLE_SWITCHES; releases.ple_switch(version) says which one a release reads).
PLE_SPELLINGS = release_ple.SPELLINGS  # the name magpie.measure.machine reads them by
ple_switch_of = release_ple.switch_of
set_ple = release_ple.set_ple
ple_argument = release_ple.argument


def ple_for_release(config: dict, vllm_version: str | None) -> dict:
    """CONFIG with PLE=1 (in any release's spelling) spelled as the target vLLM reads it."""
    if not vllm_version:
        return config
    return release_ple.respell(config, releases.ple_switch(vllm_version))


def ple_runner_environment(config: dict, env: dict[str, str], environ: Mapping[str, str] | None = None) -> list[str]:
    """PLE=1 through `engram-config` (0.30-0.33) is staged by the V2 model runner only (the patch
    refuses the V1 runner when vLLM builds its config): ask for V2 unless the user chose a runner,
    and refuse V1 here, before vLLM starts. Returns the explanation line (none without it). From
    0.34 the V2 runner is the only one (runner_environment)."""
    if ple_switch_of(config) != "engram-config":
        return []
    chosen = (os.environ if environ is None else environ).get("VLLM_USE_V2_MODEL_RUNNER")
    if chosen is None or chosen == "":
        env["VLLM_USE_V2_MODEL_RUNNER"] = "1"
        return ["VLLM_USE_V2_MODEL_RUNNER=1 (PLE=1 on vLLM 0.30+: the table is staged by the V2 model runner)"]
    if chosen.strip().lower() in ("0", "false"):
        raise Refused(
            f"VLLM_USE_V2_MODEL_RUNNER={chosen} with PLE=1: vLLM 0.30+ stages the table on the V2 model runner "
            "only; unset it or set VLLM_USE_V2_MODEL_RUNNER=1"
        )
    return [f"VLLM_USE_V2_MODEL_RUNNER={chosen} (yours, kept)"]


def runner_environment(
    vllm_version: str | None, env: dict[str, str], environ: Mapping[str, str] | None = None
) -> list[str]:
    """vLLM 0.34+ has no VLLM_USE_V2_MODEL_RUNNER (the V2 runner is the only one; =1 only warns,
    any other value makes vLLM raise): the plan never sets it there, drops a user's =1 with a
    line saying so, and refuses any other value before vLLM starts."""
    if releases.has_runner_switch(vllm_version):
        return []
    chosen = (os.environ if environ is None else environ).get("VLLM_USE_V2_MODEL_RUNNER")
    env.pop("VLLM_USE_V2_MODEL_RUNNER", None)
    if chosen is None:
        return []
    if chosen.strip() in ("", "1"):
        return [f"VLLM_USE_V2_MODEL_RUNNER={chosen} dropped (vLLM {vllm_version} has only the V2 model runner)"]
    raise Refused(
        f"VLLM_USE_V2_MODEL_RUNNER={chosen}: vLLM {vllm_version} removed the V1 model runner and this variable "
        "(any value but 1 makes it raise); unset VLLM_USE_V2_MODEL_RUNNER"
    )


def required_patches(config: dict) -> list[tuple[str, str]]:
    needed = []
    if (switch := ple_switch_of(config)) is not None and PLE_SPELLINGS[switch][2]:
        needed.append(("ple_ssd", f"PLE=1 ({ple_argument(switch)})"))
    if (config.get("speculative-config") or {}).get("draft_vocab_path"):
        needed.append(("mtp_pruning", "DRAFT_VOCAB_PATH (the pruned MTP draft head)"))
    return needed


PATCH_TOOL = os.path.abspath(patches.__file__)


@dataclasses.dataclass
class PatchStatus:
    """The patch tool's status of the vLLM this interpreter imports, computed in this process,
    once: what `patches.py status --python PYTHON` reports, PYTHON being this interpreter (or a
    wrapper of it: it only spells the advice). `error` is set where the tool would have refused."""

    python: str
    target: patches.Target | None = None
    folder: str = ""
    series: list[patches.Patch] = dataclasses.field(default_factory=list)
    states: dict[str, tuple[str, str]] = dataclasses.field(default_factory=dict)
    error: str | None = None

    @classmethod
    def of_this_interpreter(cls, python: str) -> PatchStatus:
        try:
            root = os.path.dirname(preflight.vllm_package_dir())
        except preflight.Refused:
            return cls(python, error=f"--python {python}: vllm is not installed for this interpreter")
        try:
            # As `status --python` finds it: the folder that holds the imported vllm package.
            target = dataclasses.replace(patches.find_target(root, None), kind="installed package")
            folder = patches.series_dir(os.path.normpath(patches.PATCHES_DIR), target.version)
            series = patches.load_series(folder)
            states = patches.compute_states(patches.Tree(target.root), series)
        except patches.NoSeries as e:
            return cls(python, error=e.advice(f"--python {shlex.quote(python)}"))
        except patches.ToolError as e:
            return cls(python, error=str(e))
        return cls(python, target, folder, series, states)

    @property
    def version(self) -> str | None:
        """The version of the vLLM this interpreter imports (None when the tool found none)."""
        return self.target.version if self.target is not None else None

    def table(self, chosen: list[patches.Patch] | None = None) -> list[str]:
        """The tool's text: its table of CHOSEN (default: every patch), or its error."""
        if self.error is not None:
            return [f"error: {self.error}"]
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            patches.print_table(self.target, self.folder, self.series if chosen is None else chosen, self.states)
        return out.getvalue().splitlines()

    def record(self) -> dict:
        """The manifest's `patches`: `status --json`'s record and the table, or the error."""
        if self.error is not None:
            return {"error": self.error, "table": self.table()}
        return {
            "target": dataclasses.asdict(self.target),
            "series": os.path.abspath(self.folder),
            "patches": [
                {"name": p.name, "state": state, "detail": detail, "requires": p.requires}
                for p in self.series
                for state, detail in [self.states[p.name]]
            ],
            "table": self.table(),
        }

    def require(self, selector: str, why: str) -> None:
        """Refuse unless every patch SELECTOR names is applied (`status --require-applied SELECTOR`)."""
        try:
            if self.error is not None:
                raise patches.ToolError(self.error)
            chosen = patches.select(self.series, [selector])
        except patches.ToolError as e:
            raise Refused(f"{why} needs the {selector} patches; the patch tool says:\nerror: {e}") from None
        table = "\n".join(self.table(chosen))
        if any(self.states[p.name][0] == patches.CONFLICTING for p in chosen):
            raise Refused(
                f"{why} needs the {selector} patches, and they conflict with this vLLM (another version?):\n{table}"
            )
        if any(self.states[p.name][0] != patches.APPLIED for p in chosen):
            raise Refused(
                f"{why} needs the {selector} patches applied to this vLLM, and they are not:\n{table}\n"
                f"apply them: {PATCH_TOOL} apply {selector} --python {self.python}"
            )


def check_patches(status: PatchStatus, config: dict) -> None:
    for selector, why in required_patches(config):
        status.require(selector, why)


def relative_paths_in(args: list[str], cwd: str) -> list[str]:
    """Extra arguments that name an existing file or folder by a relative path: vLLM runs in another
    working directory, so they would name nothing there."""
    found = []
    for arg in args:
        value = arg.split("=", 1)[1] if arg.startswith("--") and "=" in arg else arg
        if value.startswith("-") or os.path.isabs(value) or not value:
            continue
        if os.sep not in value and "." not in value:  # a bare word (a served name, a parser) is no path
            continue
        if os.path.exists(os.path.join(cwd, value)):
            found.append(value)
    return found


# `vllm serve` destinations that serve.sh sets and checks (patches, keep-set) and that the manifest,
# the watchdog and log_check rely on; extra arguments must not change them. Each with what to use.
CHECKED_OPTIONS = {
    "model_tag": "MODEL",
    "model": "MODEL",
    "host": "HOST",
    "port": "PORT",
    "uds": "HOST and PORT (the watchdog and the tools reach the server over TCP)",
    "hf_overrides": "PLE, or a profile (PROFILE=/path/to/profile.yaml)",
    "engram_config": "PLE, or a profile (PROFILE=/path/to/profile.yaml)",
    "speculative_config": "MTP and DRAFT_VOCAB_PATH, or a profile (PROFILE=/path/to/profile.yaml)",
}


def _quiet(call, *args):
    """CALL(*ARGS) with its stdout and stderr captured: vLLM logs to stdout on import, and serve.sh
    reads `plan`'s stdout. Returns (result, captured text); SystemExit is returned, not raised."""
    captured = io.StringIO()
    with contextlib.redirect_stdout(captured), contextlib.redirect_stderr(captured):
        try:
            return call(*args), captured.getvalue()
        except SystemExit as e:
            return e, captured.getvalue()


def vllm_serve_parser():
    """`vllm serve`'s own argument parser, from the vLLM this interpreter imports (the function
    vllm/entrypoints/cli/serve.py builds it with, whichever module holds it in that release)."""

    def build():
        from vllm.entrypoints.cli import serve
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        return serve.make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))

    try:
        parser, captured = _quiet(build)
    except Exception as e:  # noqa: BLE001 - any import failure: the check cannot run, and says so
        raise Refused(
            f"cannot check the `vllm serve` arguments: vLLM's argument parser does not load here ({type(e).__name__}: "
            f"{e}); run serve.sh with the vLLM environment's Python (VLLM_PYTHON)"
        ) from None
    if isinstance(parser, SystemExit):
        raise Refused(f"cannot check the `vllm serve` arguments: loading vLLM's parser exited: {captured[-500:]}")
    return parser


def parse_serve_args(parser, serve_args: list[str], what: str) -> argparse.Namespace:
    """SERVE_ARGS (after `serve`) as vLLM will read them; Refused with vLLM's own error."""
    namespace, captured = _quiet(parser.parse_args, serve_args)
    if isinstance(namespace, SystemExit):
        lines = [line for line in captured.splitlines() if line.strip()]
        raise Refused(f"{what}: vLLM would not start with them: {lines[-1] if lines else f'exit {namespace.code}'}")
    return namespace


def check_false_values(config: dict, profile: str, parser) -> None:
    """`key: false` becomes `--no-key`, which only options of vLLM's BooleanOptionalAction have."""
    for key, value in config.items():
        if value is False and f"--no-{key}" not in parser._option_string_actions:
            raise Refused(
                f"profile {profile}: `{key}: false`: `vllm serve` has no --no-{key} (--{key} is a switch that is "
                f"off unless given): remove the key"
            )


def check_extra_args(parser, base: list[str], extra: list[str]) -> None:
    """Refuse extra arguments that change an option serve.sh checked: vLLM parses the command line
    last-wins (a later `--speculative-config` replaces the checked one; `-sc.x`, `--hf_overrides.x`
    and `--config FILE` change them too), so the options are compared as vLLM parses them."""
    checked = parse_serve_args(parser, base, "the profile and serve.sh's variables")
    served = parse_serve_args(parser, base + extra, f"the extra arguments {shlex.join(extra)}")
    for dest, instead in CHECKED_OPTIONS.items():
        if not hasattr(checked, dest):
            continue
        before, after = getattr(checked, dest), getattr(served, dest)
        if before != after:
            raise Refused(
                f"the extra arguments {shlex.join(extra)} change --{dest.replace('_', '-')} "
                f"({json.dumps(before, default=str)} -> {json.dumps(after, default=str)}), which serve.sh sets and "
                f"checks (patches, keep-set) and records in LOG.launch.json: set it through {instead} instead"
            )


def check_model_config(model: str) -> None:
    """A local model folder's config.json must be a JSON object (preflight and vLLM read it)."""
    path = os.path.join(model, "config.json")
    if not os.path.isdir(model) or not os.path.exists(path):
        return
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise Refused(f"MODEL={model}: {path} cannot be read as JSON ({e}): fix or replace the file") from None
    if not isinstance(config, dict):
        raise Refused(f"MODEL={model}: {path} holds a JSON {type(config).__name__}, not an object of model settings")


def check_mem_hard_limit(value: str) -> None:
    """MEM_HARD_LIMIT: empty (no limit) or a size `memguard exec --max` accepts, above zero."""
    if not value:
        return
    try:
        size = cli.parse_size(value)
    except argparse.ArgumentTypeError:
        size = 0
    if size <= 0:
        raise Refused(f"MEM_HARD_LIMIT={value}: expected a memory size such as 110GiB (or empty for no limit)")


def check_log_writable(log: str) -> None:
    """LOG, LOG.launch.json and LOG.pid are written in LOG's folder: try it before any other work."""
    folder = os.path.dirname(log)
    if not os.path.isdir(folder):
        raise Refused(f"LOG={log}: the folder {folder} does not exist")
    try:
        fd, probe = tempfile.mkstemp(prefix=".serve-sh-write-test-", dir=folder)
    except OSError as e:
        raise Refused(f"LOG={log}: cannot write in {folder} ({e.strerror}); choose a LOG in a writable folder") from e
    os.close(fd)
    os.unlink(probe)


def is_gb10() -> bool:
    smi = shutil.which("nvidia-smi")
    if not smi:
        return False
    try:
        proc = subprocess.run(
            [smi, "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return proc.returncode == 0 and "GB10" in proc.stdout


@dataclasses.dataclass
class Gb10Environment:
    """The GB10 settings of one launch: whether they apply, the variables set, one line per choice."""

    applied: bool
    env: dict[str, str]
    lines: list[str]


def server_environment(profile: Profile, environ: Mapping[str, str]) -> Gb10Environment:
    """The GB10 settings for the server under ENVIRON's GB10_ENV and JIT_JOBS (a variable of the
    GB10 environment that ENVIRON sets already is kept)."""
    mode, jit_jobs = environ.get("GB10_ENV", "auto"), environ.get("JIT_JOBS", "4")
    if mode not in ("auto", "0", "1"):
        raise Refused(f"GB10_ENV={mode}: expected auto, 1 or 0")
    if not jit_jobs.isdigit() or int(jit_jobs) < 1:
        raise Refused(f"JIT_JOBS={jit_jobs}: expected a positive number of parallel compile jobs")
    if mode == "0":
        return Gb10Environment(False, {}, ["GB10 settings: off (GB10_ENV=0)"])
    if mode == "auto":
        if is_gb10():
            why = "nvidia-smi reports a GB10"
        elif profile.settings["gb10-environment"]:
            why = f"profile {profile.name}"
        else:
            return Gb10Environment(
                False,
                {},
                [
                    "GB10 settings: not applied (no GB10 found by nvidia-smi, and the profile does not ask for "
                    f"them: `{SETTING_LINE} gb10-environment: true`)"
                ],
            )
    else:
        why = "GB10_ENV=1"
    env, lines = {}, [f"GB10 settings: applied ({why})"]
    for name, (value, reason) in GB10_ENVIRONMENT.items():
        value = value.format(jit_jobs=jit_jobs)
        if environ.get(name):
            lines.append(f"{name}={environ[name]} (yours, kept; the GB10 default is {value}: {reason})")
        else:
            env[name] = value
            lines.append(f"{name}={value} ({reason})")
    return Gb10Environment(True, env, lines)


# --------------------------------------------------------------------------------------------
# plan / exec


@dataclasses.dataclass
class Profile:
    """A profile resolved for one launch: the file, its values, serve.sh's settings of it, and the
    vLLM options that result (serve.sh's variables applied, PLE=1 spelled for the target vLLM)."""

    name: str
    path: str
    values: dict
    settings: dict
    config: dict
    used: list[str]

    @classmethod
    def resolve(cls, vllm_version: str | None, environ: Mapping[str, str]) -> Profile:
        """PROFILE (default DEFAULT_PROFILE) with serve.sh's variables, both of ENVIRON, for
        VLLM_VERSION: what `plan` launches and `show` prints. A profile's `#: ple: true` turns PLE=1
        on (then spelled for the release), as a release's own spelling in the file does."""
        path = profile_path(_env("PROFILE", environ) or DEFAULT_PROFILE)
        values = load_profile(path)
        settings = profile_settings(path)
        base = set_ple(values, ple_switch_of(values) or PLE_HELD_AS, True) if settings["ple"] else values
        config, used = apply_overrides(base, environ)
        name = os.path.basename(path).rsplit(".", 1)[0]
        return cls(name, path, values, settings, ple_for_release(config, vllm_version), used)


def bash_quote(argv: list[str]) -> str:
    """The command as bash's `printf '%q '` writes it (the log's `# command:` line)."""
    proc = subprocess.run(["bash", "-c", 'printf "%q " "$@"', "_", *argv], capture_output=True, text=True, check=True)
    return proc.stdout.rstrip()


def user_name() -> str:
    """getpass.getuser(), or `uid N` where neither LOGNAME/USER nor a passwd entry names the user
    (the flake's OCI image has no /etc/passwd; getuser raises KeyError or OSError there)."""
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return f"uid {os.getuid()}"


def plan(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    """Check, write LOG.launch.json and LOG's header, print the working directory. ENVIRON: serve.sh's
    variables and the environment the server inherits, read once by the caller."""
    python = args.python
    log = os.path.abspath(args.log)
    caller_cwd = os.getcwd()
    extra = args.extra[1:] if args.extra[:1] == ["--"] else args.extra
    if args.supervisor_option:  # serve.sh's `memguard run` options, checked before anything is written
        from magpie.serving import memguard, supervisor

        try:
            memguard.check_run_options(args.supervisor_option)
        except supervisor.RunRefused as e:
            raise Refused(
                f"the supervisor's options (MEMGUARD_ARGS, WATCHDOG_ARGS, PID_FILE, STOP_GRACE): {e}"
            ) from None
    check_mem_hard_limit(args.mem_hard_limit)  # `memguard exec --max` reads it only after LOG is written
    check_log_writable(log)

    model = _env("MODEL", environ)
    if model is None:
        raise Refused("MODEL is not set: MODEL=/path/to/checkpoint serve.sh LOG")
    if model.startswith(("/", "./", "../")) or os.path.exists(model):
        if not os.path.exists(model):
            raise Refused(f"MODEL={model} does not exist")
        model = os.path.abspath(model)  # vLLM runs in another working directory
        check_model_config(model)
    if os.path.exists(log) and os.path.getsize(log) > 0 and environ.get("OVERWRITE", "0") != "1":
        raise Refused(f"{log} exists; choose another LOG or set OVERWRITE=1")
    jit_check = environ.get("JIT_CHECK", "auto")
    if jit_check not in ("auto", "0", "1"):
        raise Refused(f"JIT_CHECK={jit_check}: expected auto, 1 or 0")
    relative = relative_paths_in(extra, caller_cwd)
    if relative:
        raise Refused(
            f"{', '.join(relative)}: relative path(s) among the vLLM arguments; vLLM runs in a working directory "
            "of its own (so that a vllm/ folder here cannot shadow the installed vLLM): give absolute paths"
        )

    status = PatchStatus.of_this_interpreter(python)
    profile = Profile.resolve(status.version, environ)
    config, path = profile.config, profile.path
    check_patches(status, config)

    spec = config.get("speculative-config") or {}
    try:
        checks = preflight.run_checks(model, spec.get("draft_vocab_path"), jit_check)
    except preflight.Refused as e:
        raise Refused(str(e)) from None
    versions = preflight.versions()

    gb10 = server_environment(profile, environ)
    env, env_lines = dict(gb10.env), list(gb10.lines)
    env_lines += ple_runner_environment(config, env, environ)
    env_lines += runner_environment(status.version, env, environ)
    pythonpath = environ.get("PYTHONPATH", "")
    if pythonpath:  # relative entries would point elsewhere from the server's working directory
        env["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p) if p else p for p in pythonpath.split(os.pathsep))

    serve_args = [model, "--host", args.host, "--port", str(args.port)]
    if extra or any(value is False for value in config.values()):
        parser = vllm_serve_parser()
        check_false_values(config, path, parser)
        if extra:
            check_extra_args(parser, serve_args + expand(config), extra)
    cmd = [python, "-m", "vllm.entrypoints.cli.main", "serve", *serve_args, *expand(config), *extra]
    launch = cmd
    if args.mem_hard_limit:
        launch = tool_command(python, "magpie.serving.memguard", "exec", "--max", args.mem_hard_limit, "--", *cmd)

    # Named here, created by `exec` (so a plan that is never run leaves no folder behind).
    if args.workdir:
        workdir = os.path.abspath(args.workdir)
        if os.path.exists(os.path.join(workdir, "vllm")):
            raise Refused(f"WORKDIR={workdir} has a vllm/ entry, which would shadow the installed vLLM")
    else:
        workdir = os.path.join(tempfile.gettempdir(), f"magpie-serve-{secrets.token_hex(6)}")

    record = {
        "schema": manifest.SCHEMA,
        "argv": launch,
        "env": env,
        # Removed from the server's environment by `exec` (a variable the release no longer reads).
        "unset": [] if releases.has_runner_switch(status.version) else ["VLLM_USE_V2_MODEL_RUNNER"],
        "cwd": workdir,
        "command": cmd,
        "command_text": bash_quote(cmd),
        "model": model,
        "server": {"host": args.host, "port": args.port, "url": f"http://{args.host}:{args.port}"},
        "log": log,
        "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "user": user_name(),
        "node": platform.node(),
        "caller_cwd": caller_cwd,
        "pythonpath": env.get("PYTHONPATH", ""),
        "profile": {"name": profile.name, "path": path, "values": profile.values},
        "overrides": dict(item.split("=", 1) for item in profile.used),
        "extra_args": extra,
        "mem_hard_limit": args.mem_hard_limit or None,
        "config": config,
        "gb10": {
            "applied": gb10.applied,
            "environment": gb10.env,
            "notes": env_lines,
        },
        "checks": checks,
        "versions": versions,
        "patches": status.record(),
    }
    try:
        manifest.write(log, record)
    except OSError as e:
        raise Refused(f"LOG={log}: cannot write the log or its manifest ({e.strerror}: {e.filename or log})") from None
    if sys.stdout.isatty():  # run by hand, not by serve.sh
        print(f"launch plan: planned {manifest.path_for(log)}; `launch exec` on it starts the server", file=sys.stderr)
    print(workdir)
    return 0


def enter_workdir(workdir: str) -> None:
    """Create the plan's working directory (or take the one a restart or WORKDIR left) and go there."""
    os.makedirs(workdir, mode=0o700, exist_ok=True)
    info = os.lstat(workdir)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise Refused(f"working directory {workdir}: not a folder of this user (uid {os.getuid()})")
    if os.path.exists(os.path.join(workdir, "vllm")):
        raise Refused(f"working directory {workdir} has a vllm/ entry, which would shadow the installed vLLM")
    os.chdir(workdir)


def exec_plan(plan_path: str) -> int:
    with open(plan_path) as f:
        launch = json.load(f)
    os.environ.update(launch["env"])
    for name in launch.get("unset", []):
        os.environ.pop(name, None)
    enter_workdir(launch["cwd"])
    try:
        os.execvp(launch["argv"][0], launch["argv"])
    except OSError as e:
        print(f"launch.py: cannot run {launch['argv'][0]}: {e.strerror}", file=sys.stderr)
        return 127


def main(argv: list[str] | None = None) -> int:
    parser = cli.parser("magpie launch", __doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p_plan = sub.add_parser(
        "plan", help="check everything, write LOG.launch.json (plan and run manifest) and LOG's header"
    )
    p_plan.add_argument("--log", required=True, help="the server log (serve.sh's LOG)")
    p_plan.add_argument("--host", default=cli.DEFAULT_HOST)
    p_plan.add_argument("--port", type=int, default=cli.DEFAULT_PORT)
    p_plan.add_argument(
        "--python",
        default=sys.executable,
        help="the vLLM environment's Python, as the server's command names it (the checks are of the vLLM "
        "that the Python running `plan` imports)",
    )
    p_plan.add_argument("--mem-hard-limit", default="", help="launch through `memguard.py exec --max` (e.g. 110GiB)")
    p_plan.add_argument("--workdir", default="", help="the server's working directory (default: a new empty one)")
    p_plan.add_argument(
        "--supervisor-option",
        action="append",
        default=[],
        metavar="OPTION",
        help="one option of the `memguard run` that will supervise the server, checked as `memguard run --check` "
        "does (give each as --supervisor-option=VALUE)",
    )
    p_plan.add_argument("extra", nargs=argparse.REMAINDER, help="-- more `vllm serve` arguments (they come last)")
    p_exec = sub.add_parser("exec", help="become the server a plan describes")
    p_exec.add_argument("plan", help="LOG.launch.json")
    sub.add_parser("profiles", help="list the profiles in profiles/")
    sub.add_parser(
        "show",
        help="print a profile (PROFILE) with serve.sh's variables applied, as vLLM options: those `plan` launches "
        "with the vLLM this Python imports",
    )
    args = parser.parse_args(argv)
    try:
        if args.command == "plan":
            return plan(args, dict(os.environ))
        if args.command == "exec":
            return exec_plan(args.plan)
        if args.command == "profiles":
            for name in available_profiles():
                print(f"{name:16s} {profile_path(name)}")
            return 0
        profile = Profile.resolve(PatchStatus.of_this_interpreter(sys.executable).version, dict(os.environ))
        print(shlex.join(expand(profile.config)))
        return 0
    except Refused as e:
        print(f"serve.sh: refusing to start: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
