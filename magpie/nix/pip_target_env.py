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

    python pip_target_env.py ENVIRONMENT.json EDGES.json [OVERRIDES.json] -- install --dry-run ...

ENVIRONMENT.json holds the marker environment (PEP 508 names). OVERRIDES.json, when given, maps
a distribution name to the one version every requirement on it is resolved to instead of what the
requirer's metadata says (a release table row's `pins.overrides`: a dependency a release pins to a
version the registry does not have; the report keeps the metadata as published). EDGES.json receives
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
    if "--" not in argv or argv.index("--") not in (2, 3):
        print("usage: pip_target_env.py ENVIRONMENT.json EDGES.json [OVERRIDES.json] -- PIP_ARGS...", file=sys.stderr)
        return 2
    split = argv.index("--")
    environment_path, edges_path, pip_args = argv[0], argv[1], argv[split + 1 :]
    with open(environment_path) as f:
        environment = json.load(f)
    overrides = {}
    if split == 3:
        with open(argv[2]) as f:
            overrides = json.load(f)
        override_requirements(overrides)

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


def override_requirements(overrides: dict[str, str]) -> None:
    """Resolve every requirement on a name in OVERRIDES to that version (its marker and extras
    kept), whatever the requirer's metadata pins: pip reads dependencies from this method."""
    from pip._internal.metadata.importlib._dists import Distribution
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name

    wanted = {canonicalize_name(name): version for name, version in overrides.items()}
    published = Distribution.iter_dependencies

    def iter_dependencies(self, extras=()):
        for req in published(self, extras):
            version = wanted.get(canonicalize_name(req.name))
            if version is not None:
                extra = f"[{','.join(sorted(req.extras))}]" if req.extras else ""
                marker = f"; {req.marker}" if req.marker else ""
                req = Requirement(f"{req.name}{extra}=={version}{marker}")
            yield req

    Distribution.iter_dependencies = iter_dependencies


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
