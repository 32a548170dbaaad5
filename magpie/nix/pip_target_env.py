"""Run pip's resolver for another platform, with that platform's environment markers.

`pip install --platform/--python-version` picks wheels by the target's tags, but it still
evaluates environment markers (`platform_machine == "x86_64"`, `python_version < "3.13"`) with
the values of the interpreter that runs pip. Resolving an aarch64 closure on an x86_64 machine
then silently follows the wrong branch of every such marker. This runner replaces pip's marker
environment before pip starts, so every marker is evaluated for the target, and afterwards
computes which resolved distribution requires which (the dependency edges a Nix package set
needs), with the same marker environment.

It is started by `pin_wheels.py` with the interpreter whose pip does the resolving; it imports
pip's internals, so it is not meant to be run by hand:

    python pip_target_env.py ENVIRONMENT.json EDGES.json -- install --dry-run --report R.json ...

ENVIRONMENT.json holds the marker environment (PEP 508 names). EDGES.json receives
{"requires": {name: [names]}, "extras": {name: [extras]}, "environment": {...}} where the
names are canonical distribution names.
"""

from __future__ import annotations

import json
import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["-h"], ["--help"]):
        print("usage: pip_target_env.py ENVIRONMENT.json EDGES.json -- PIP_ARGS...\n\n" + (__doc__ or "").strip())
        return 0
    if len(argv) < 3 or argv[2] != "--":
        print("usage: pip_target_env.py ENVIRONMENT.json EDGES.json -- PIP_ARGS...", file=sys.stderr)
        return 2
    environment_path, edges_path, pip_args = argv[0], argv[1], argv[3:]
    with open(environment_path) as f:
        environment = json.load(f)

    import pip._vendor.packaging.markers as markers

    # Marker.evaluate() looks this function up at call time; pip's report also records it.
    markers.default_environment = lambda: dict(environment)

    from pip._internal.cli.main import main as pip_main

    status = pip_main(pip_args)
    if status != 0:
        return status

    report_path = pip_args[pip_args.index("--report") + 1]
    with open(report_path) as f:
        report = json.load(f)
    if report.get("environment") != environment:
        print(
            "error: pip's report does not show the requested marker environment; this pip's internals "
            f"differ from what {__file__} expects (pip {report.get('pip_version')})",
            file=sys.stderr,
        )
        return 1
    requires, extras = dependency_edges(report)
    with open(edges_path, "w") as f:
        json.dump({"environment": environment, "requires": requires, "extras": extras}, f, indent=1, sort_keys=True)
    return 0


def dependency_edges(report: dict) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """Which resolved distribution requires which, following requested extras transitively."""
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name

    items = {canonicalize_name(item["metadata"]["name"]): item for item in report["install"]}
    extras: dict[str, set[str]] = {name: set() for name in items}
    requires: dict[str, set[str]] = {name: set() for name in items}
    queue = []
    for name, item in items.items():
        if item.get("requested"):
            extras[name].update(canonicalize_name(e) for e in item.get("requested_extras") or [])
            queue.append(name)
    done_with: dict[str, frozenset[str]] = {}
    while queue:
        name = queue.pop()
        active = frozenset(extras[name])
        if done_with.get(name) == active:
            continue
        done_with[name] = active
        for text in items[name]["metadata"].get("requires_dist") or []:
            req = Requirement(text)
            if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in active | {""}):
                continue
            dep = canonicalize_name(req.name)
            if dep not in items:
                raise SystemExit(f"error: {name} requires {text!r}, but the resolver's result has no {dep}")
            requires[name].add(dep)
            new_extras = {canonicalize_name(e) for e in req.extras} - extras[dep]
            extras[dep].update(new_extras)
            if new_extras or dep not in done_with:
                queue.append(dep)
    unreached = sorted(set(items) - set(done_with))
    if unreached:
        raise SystemExit(f"error: resolved but required by nothing: {', '.join(unreached)}")
    return {n: sorted(r) for n, r in requires.items()}, {n: sorted(e) for n, e in extras.items()}


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
