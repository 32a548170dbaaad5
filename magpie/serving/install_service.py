"""Write a systemd unit that keeps the supervised server up: serve.sh (and so `memguard run`) with
a profile, restarted on failure, stopped with the grace the server needs, logging to the journal.

    magpie install-service --model /models/Qwen3.8-Flash-Next-NVFP4 --profile seed-gb10 --print
    sudo magpie install-service --model /models/Qwen3.8-Flash-Next-NVFP4 --run-as spark
    magpie install-service --user --model ~/models/Flash-Next --env MTP=3 -- --max-num-seqs 2

The unit runs `bash magpie/serving/serve.sh LOG [vLLM args]` of this checkout with MODEL, PROFILE,
VLLM_PYTHON, HOST, PORT, STOP_GRACE and every --env in its environment. The policy:
- Restart=on-failure: any non-zero exit restarts the server after --restart-sec, an engine that
  died included (serve.sh returns the server's status, 128+N after signal N). Except, as
  `memguard run` itself decides: 3 (the memory guard stopped it; it would run short again) and 4
  (the watchdog stopped a stalled server and no restart was left) are final
  (RestartPreventExitStatus). Under the unit, WATCHDOG=restart: a stall is restarted by memguard
  run itself, at most WATCHDOG_RESTARTS times. At most --burst starts in --burst-interval s.
- A stop: SIGTERM to serve.sh alone (KillMode=mixed), which stops the server's process group and
  SIGKILLs it after STOP_GRACE s; systemd SIGKILLs whatever is left in the unit's cgroup after
  TimeoutStopSec = STOP_GRACE + 15 s. The stop's own status (143) counts as success.
- The journal gets serve.sh's and the supervisor's lines (PID, the exit reason, the last lines of
  the server log on a failure); the server's full output goes to LOG (serve.sh's log with its
  header and LOG.launch.json beside it), the previous run's log kept as LOG.1.

The unit goes to /etc/systemd/system/NAME.service (or ~/.config/systemd/user/ with --user, or
--unit-dir); an existing unit is refused without --force. `--print` writes it to stdout and
installs nothing. This tool does not call systemctl: it prints the commands to run next.
"""

from __future__ import annotations

import getpass
import os
import re
import shutil
import sys

from magpie import ROOT, cli, files
from magpie.serving import bounds, launch

SERVE_SH = ROOT / "magpie" / "serving" / "serve.sh"
STOP_MARGIN = 15  # s systemd waits beyond serve.sh's own SIGKILL (memguard run's --grace)
FINAL_STATUSES = (3, 4)  # memguard run: the memory guard stopped it; stall restarts used up


def quote(word: str, *, exec_line: bool = True) -> str:
    """One word of an ExecStart= line (EXEC_LINE) or an Environment= assignment: specifiers (%) and,
    on an Exec line, variables ($) escaped, quoted when it holds anything systemd would split or
    interpret (Environment= expands no variables: `$` is left as it is there). Words are checked
    for control characters first (check_text): a newline would end the line and start a directive."""
    escaped = word.replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%")
    if exec_line:
        escaped = escaped.replace("$", "$$")
    plain = escaped == word and word and not any(c.isspace() or c in "'\";" for c in word)
    return word if plain else f'"{escaped}"'


def check_text(what: str, value: str) -> str:
    """VALUE unless it holds a control character (a newline, a tab, NUL, DEL...), which no unit line
    can carry safely; SystemExit with one line naming WHAT."""
    bad = next((c for c in value if ord(c) < 0x20 or ord(c) == 0x7F), None)
    if bad is not None:
        raise SystemExit(
            f"error: {what}: holds the control character {bad!r}: a unit file line cannot carry it (a newline "
            "would start a directive of its own)"
        )
    return value


# A unit's name: systemd's unit-name characters, no path (`../x` would write outside the unit folder).
UNIT_NAME = re.compile(r"[A-Za-z0-9_:@-][A-Za-z0-9_.:@-]{0,199}")
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
USER_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,31}\$?")
# serve.sh's variables with a fixed set of values, checked as serve.sh checks them.
CHOICES = {"MEMGUARD": ("0", "1"), "WATCHDOG": ("stop", "restart", "report", "0")}


def check_env(env: dict[str, str]) -> None:
    """The unit's variables as serve.sh will check them at every start: refused here, once, instead
    of a unit that fails at each start (PORT=0, STOP_GRACE=-5)."""
    for key, value in env.items():
        check_text(f"{key} (--env, or the option that sets it)", value)
    problems = [bounds.check_port(env["PORT"]), bounds.check_seconds(env["STOP_GRACE"])]
    if "WATCHDOG_RESTARTS" in env:
        problems.append(bounds.check_seconds(env["WATCHDOG_RESTARTS"], "WATCHDOG_RESTARTS"))
    for key, allowed in CHOICES.items():
        if key in env and env[key] not in allowed:
            problems.append(f"{key}={env[key]}: expected {', '.join(allowed)}")
    for problem in problems:
        if problem:
            raise SystemExit(f"error: {problem} (serve.sh would refuse it at every start)")


def default_log(name: str, user: bool) -> str:
    if user:
        state = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
        return os.path.join(state, "magpie", f"{name}.log")
    return f"/var/log/magpie/{name}.log"


def default_unit_dir(user: bool) -> str:
    if user:
        config = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
        return os.path.join(config, "systemd", "user")
    return "/etc/systemd/system"


def parse_env(items: list[str]) -> dict[str, str]:
    env = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not ENV_NAME.fullmatch(key):
            raise SystemExit(f"error: --env {item!r}: expected NAME=VALUE (a serve.sh variable, e.g. MTP=3)")
        env[key] = value
    return env


def unit_text(args, vllm_args: list[str]) -> str:
    """The unit file, from parsed arguments; refuses what cannot serve."""
    model = os.path.abspath(os.path.expanduser(args.model))
    if not os.path.isdir(model):
        raise SystemExit(f"error: --model {args.model}: no such folder (the checkpoint the service serves)")
    try:
        profile = launch.profile_path(args.profile)
    except launch.Refused as e:
        raise SystemExit(f"error: --profile: {e}") from None
    python = os.path.abspath(args.python)
    if not os.access(python, os.X_OK):
        raise SystemExit(f"error: --python {args.python}: not an executable (the vLLM environment's Python)")
    bash = shutil.which("bash") or "/bin/bash"
    mv = shutil.which("mv") or "/bin/mv"
    log = os.path.abspath(os.path.expanduser(args.log or default_log(args.name, args.user)))
    env = {
        "MODEL": model,
        "PROFILE": profile if os.sep in args.profile or profile.endswith(".yml") else args.profile,
        "VLLM_PYTHON": python,
        "HOST": args.host,
        "PORT": str(args.port),
        "STOP_GRACE": str(args.stop_grace),
        "WATCHDOG": "restart",
        "OVERWRITE": "1",  # LOG.1 keeps the previous run's log (ExecStartPre)
        "PYTHONUNBUFFERED": "1",
    }
    env.update(parse_env(args.env))
    check_env(env)
    grace = int(env["STOP_GRACE"])
    check_text("--log", log)
    for word in vllm_args:
        check_text("a vLLM argument", word)
    if not args.user and not USER_NAME.fullmatch(args.run_as):
        raise SystemExit(f"error: --run-as {args.run_as!r}: expected a plain user name")
    lines = [
        "# Written by `magpie install-service` (magpie/serving/install_service.py); see docs/service.md.",
        "[Unit]",
        "Description="
        + f"vLLM server {os.path.basename(model)} ({env['PROFILE']}) under serve.sh and memguard run".replace(
            "%", "%%"
        ),
        f"Documentation=file://{ROOT / 'docs' / 'service.md'}",
        "After=network-online.target",
        "Wants=network-online.target",
        f"StartLimitIntervalSec={args.burst_interval}",
        f"StartLimitBurst={args.burst}",
        "",
        "[Service]",
        "Type=exec",
    ]
    if not args.user:
        lines.append(f"User={args.run_as}")
        if log.startswith("/var/log/magpie/"):
            lines.append("LogsDirectory=magpie")
    lines += [f"Environment={quote(f'{key}={value}', exec_line=False)}" for key, value in env.items()]
    lines += [
        f"ExecStartPre=-{mv} -f {quote(log)} {quote(log + '.1')}",
        "ExecStart=" + " ".join(quote(w) for w in [bash, str(SERVE_SH), log, *vllm_args]),
        "Restart=on-failure",
        f"RestartSec={args.restart_sec}",
        "RestartPreventExitStatus=" + " ".join(str(s) for s in FINAL_STATUSES),
        "SuccessExitStatus=143",
        "KillMode=mixed",
        "KillSignal=SIGTERM",
        f"TimeoutStopSec={grace + STOP_MARGIN}",
        "StandardOutput=journal",
        "StandardError=journal",
        f"SyslogIdentifier={args.name}",
        "",
        "[Install]",
        f"WantedBy={'default.target' if args.user else 'multi-user.target'}",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = cli.parser("magpie install-service", __doc__)
    parser.add_argument("--model", required=True, help="the checkpoint folder (MODEL)")
    parser.add_argument("--profile", default=launch.DEFAULT_PROFILE,
                        help=f"a profile ({', '.join(launch.available_profiles())}) or a .yaml path "
                        "(default: %(default)s)")  # fmt: skip
    parser.add_argument("--name", default="magpie-serve", help="the unit's name (default: %(default)s)")
    parser.add_argument("--user", action="store_true", help="a user unit (systemctl --user), not a system one")
    parser.add_argument("--run-as", default=os.environ.get("SUDO_USER") or getpass.getuser(),
                        help="User= of a system unit (default: %(default)s)")  # fmt: skip
    parser.add_argument("--python", default=os.environ.get("VLLM_PYTHON") or sys.executable,
                        help="the vLLM environment's Python (default: %(default)s)")  # fmt: skip
    parser.add_argument("--host", default=cli.DEFAULT_HOST, help="bind address (default: %(default)s)")
    parser.add_argument("--port", type=int, default=cli.DEFAULT_PORT, help="(default: %(default)s)")
    parser.add_argument("--stop-grace", type=int, default=30,
                        help="STOP_GRACE: seconds from SIGTERM to SIGKILL (default: %(default)s)")  # fmt: skip
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="another serve.sh variable (repeatable; docs/serving.md lists them)")  # fmt: skip
    parser.add_argument("--log", help="the server log (default: /var/log/magpie/NAME.log, "
                        "or $XDG_STATE_HOME/magpie/NAME.log with --user)")  # fmt: skip
    parser.add_argument("--restart-sec", type=int, default=10, help="RestartSec= (default: %(default)s)")
    parser.add_argument("--burst", type=int, default=3, help="StartLimitBurst= (default: %(default)s)")
    parser.add_argument("--burst-interval", type=int, default=1800,
                        help="StartLimitIntervalSec= (default: %(default)s)")  # fmt: skip
    parser.add_argument("--unit-dir", help="where the unit goes (default: /etc/systemd/system, "
                        "~/.config/systemd/user with --user)")  # fmt: skip
    parser.add_argument("--print", action="store_true", help="print the unit to stdout; install nothing")
    cli.add_force(parser, "an existing unit file")
    args, rest = parser.parse_known_args(argv)
    if not UNIT_NAME.fullmatch(args.name) or args.name.endswith(".service"):
        print(
            f"error: --name {args.name!r}: expected a plain unit name (letters, digits, _ . : @ -; no / and no "
            "leading dot), without .service",
            file=sys.stderr,
        )
        return 1
    for flag in ("burst", "burst_interval", "restart_sec"):
        if getattr(args, flag) < (1 if flag == "burst" else 0):
            print(f"error: --{flag.replace('_', '-')} {getattr(args, flag)}: out of range", file=sys.stderr)
            return 1
    if rest and rest[0] == "--":
        rest = rest[1:]
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)} (vLLM arguments go after --)")
    text = unit_text(args, rest)
    if args.print:
        sys.stdout.write(text)
        return 0
    unit_dir = args.unit_dir or default_unit_dir(args.user)
    path = os.path.join(unit_dir, f"{args.name}.service")
    if os.path.exists(path) and not args.force:
        print(f"error: {path} exists; pass --force to replace it (or --name for another unit)", file=sys.stderr)
        return 1
    try:
        os.makedirs(unit_dir, exist_ok=True)
        if args.user and not args.log:
            os.makedirs(os.path.dirname(default_log(args.name, True)), exist_ok=True)
        files.atomic_write_text(path, text)
    except OSError as e:
        print(f"error: cannot write {path}: {e.strerror} (a system unit needs root: sudo)", file=sys.stderr)
        return 1
    ctl = "systemctl --user" if args.user else "sudo systemctl"
    journal = f"journalctl {'--user ' if args.user else ''}-u {args.name} -f"
    print(f"wrote {path}; next: {ctl} daemon-reload && {ctl} enable --now {args.name}; logs: {journal}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
