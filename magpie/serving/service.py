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
import shutil
import sys

from magpie import ROOT, cli, files
from magpie.serving import launch

SERVE_SH = ROOT / "magpie" / "serving" / "serve.sh"
STOP_MARGIN = 15  # s systemd waits beyond serve.sh's own SIGKILL (memguard run's --grace)
FINAL_STATUSES = (3, 4)  # memguard run: the memory guard stopped it; stall restarts used up


def quote(word: str) -> str:
    """One word of an ExecStart= / Environment= line: specifiers and variables escaped, quoted
    when it holds anything systemd would split or interpret."""
    escaped = word.replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%").replace("$", "$$")
    plain = escaped == word and word and not any(c.isspace() or c in "'\";" for c in word)
    return word if plain else f'"{escaped}"'


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
        if not sep or not key.isidentifier():
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
    try:
        grace = int(env["STOP_GRACE"])
    except ValueError:
        raise SystemExit(f"error: STOP_GRACE={env['STOP_GRACE']}: expected a number of seconds") from None
    lines = [
        "# Written by `magpie install-service` (magpie/serving/service.py); see docs/service.md.",
        "[Unit]",
        f"Description=vLLM server {os.path.basename(model)} ({env['PROFILE']}) under serve.sh and memguard run",
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
    lines += [f"Environment={quote(f'{key}={value}')}" for key, value in env.items()]
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
