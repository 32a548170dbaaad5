"""A serving profile and serve.sh's variables on top of it: a `vllm serve --config` YAML file
(keys are `vllm serve` options without the dashes) in profiles/ or at a path, its `#:` settings
(serve.sh's own, comments to vLLM), its expansion into command-line options as vLLM 0.29.0's
`--config` loader does, and GPU_MEM, MAX_NUM_SEQS, MTP, PLE, ... applied to it. Standard library
and PyYAML (which vLLM requires). `launch.py` (serve.sh's logic) builds on it and re-exports it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

from magpie import release_ple

HERE = os.path.dirname(os.path.abspath(__file__))
PROFILE_DIR = os.path.join(HERE, "profiles")
DEFAULT_PROFILE = "seed-gb10"
PLE_HELD_AS = "hf-overrides"  # how a plan holds PLE=1 until launch.ple_for_release spells it for the target


class Refused(Exception):
    """A launch serve.sh refuses: one line naming the file, variable or option and the fix."""


# --------------------------------------------------------------------------------------------
# Profiles


def profile_path(name_or_path: str) -> str:
    """A profile name in profiles/ (without .yaml) or a path to a .yaml/.yml file."""
    if os.sep in name_or_path or name_or_path.endswith((".yaml", ".yml")):
        path = os.path.abspath(name_or_path)
    else:
        path = os.path.join(PROFILE_DIR, name_or_path + ".yaml")
    if not os.path.isfile(path):
        known = sorted(f[:-5] for f in os.listdir(PROFILE_DIR) if f.endswith(".yaml"))
        raise Refused(f"PROFILE={name_or_path}: no such profile ({path}); known: {', '.join(known)}, or a .yaml path")
    return path


def available_profiles() -> list[str]:
    return sorted(f[:-5] for f in os.listdir(PROFILE_DIR) if f.endswith(".yaml"))


# serve.sh's own settings of a profile, each with its default: `#:` lines of the file (a YAML
# mapping once the `#:` is cut), comments to vLLM, so the file stays a `vllm serve --config` file.
PROFILE_SETTINGS = {
    # the GB10 environment (GB10_ENVIRONMENT) under GB10_ENV=auto even where nvidia-smi finds no GB10
    "gb10-environment": False,
    # PLE=1, the n-gram table on disk, spelled for the target vLLM (magpie/release_ple.py); the PLE
    # variable overrides it
    "ple": False,
}
SETTING_LINE = "#:"


def profile_settings(path: str) -> dict:
    """The profile's `#: key: value` lines over PROFILE_SETTINGS' defaults; Refused naming the line's
    key and the known ones when a setting is unknown or not of its default's type."""
    import yaml

    with open(path) as f:
        text = "\n".join(line[len(SETTING_LINE) :] for line in f if line.startswith(SETTING_LINE + " "))
    try:
        given = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise Refused(f"profile {path}: its `{SETTING_LINE}` lines are not a YAML mapping: {e}") from None
    if not isinstance(given, dict):
        raise Refused(f"profile {path}: its `{SETTING_LINE}` lines must read `{SETTING_LINE} key: value`")
    settings = dict(PROFILE_SETTINGS)
    for key, value in given.items():
        if key not in PROFILE_SETTINGS:
            raise Refused(
                f"profile {path}: `{SETTING_LINE} {key}` is no serve.sh setting (known: {', '.join(PROFILE_SETTINGS)})"
            )
        if type(value) is not type(PROFILE_SETTINGS[key]):
            raise Refused(
                f"profile {path}: `{SETTING_LINE} {key}: {value}`: expected a {type(PROFILE_SETTINGS[key]).__name__}"
            )
        settings[key] = value
    return settings


def load_profile(path: str) -> dict:
    import yaml

    try:
        with open(path) as f:
            profile = yaml.safe_load(f)
    except yaml.YAMLError as e:
        raise Refused(f"profile {path}: not valid YAML: {e}") from None
    if profile is None:
        return {}
    if not isinstance(profile, dict) or not all(isinstance(k, str) for k in profile):
        raise Refused(f"profile {path}: expected a mapping of `vllm serve` option names to values")
    for key in profile:
        if key.startswith("-") or key in ("model", "model-tag", "host", "port", "config"):
            raise Refused(
                f"profile {path}: key {key!r} is not allowed here (write option names without dashes; "
                "MODEL, HOST and PORT are serve.sh's variables)"
            )
        if "_" in key or "." in key:
            # vLLM reads `speculative_config` and `speculative-config.x` as the same option; serve.sh's
            # variables and checks read the dashed key only, so another spelling would slip past them.
            raise Refused(
                f"profile {path}: key {key!r}: write `vllm serve` option names with dashes and nested values "
                f"as a mapping (e.g. {key.split('.')[0].replace('_', '-')!r}: {{...}})"
            )
    return profile


def expand(config: dict) -> list[str]:
    """Config mapping -> command-line options, as vLLM 0.29.0's FlexibleArgumentParser.load_config_file
    does (a test compares the two): true -> --key, false -> --no-key, list -> --key a b, mapping ->
    --key JSON, other -> --key str(value)."""
    args: list[str] = []
    for key, value in config.items():
        if isinstance(value, bool):
            args.append(f"--{key}" if value else f"--no-{key}")
        elif isinstance(value, list):
            if value:
                args += [f"--{key}", *map(str, value)]
        elif isinstance(value, dict):
            args += [f"--{key}", json.dumps(value)]
        else:
            args += [f"--{key}", str(value)]
    return args


# --------------------------------------------------------------------------------------------
# serve.sh's variables on top of a profile


def _env(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """ENVIRON's NAME (default: this process's environment), None when unset or empty."""
    value = (os.environ if environ is None else environ).get(name, "")
    return value if value != "" else None


def _number(name: str, value: str, kind, low: float, high: float | None = None):
    try:
        number = kind(value)
    except ValueError:
        raise Refused(f"{name}={value}: expected {'an integer' if kind is int else 'a number'}") from None
    if number < low or (high is not None and number > high):
        bound = f"between {low} and {high}" if high is not None else f"at least {low}"
        raise Refused(f"{name}={value}: expected a value {bound}")
    return number


def apply_overrides(profile: dict, environ: Mapping[str, str] | None = None) -> tuple[dict, list[str]]:
    """Apply serve.sh's variables (of ENVIRON, default this process's environment) to a copy of the
    profile; return it and the variables used."""
    config = json.loads(json.dumps(profile))  # deep copy of plain data
    used: list[str] = []

    def take(name: str) -> str | None:
        value = _env(name, environ)
        if value is not None:
            used.append(f"{name}={value}")
        return value

    if (value := take("GPU_MEM")) is not None:
        config["gpu-memory-utilization"] = _number("GPU_MEM", value, float, 0.01, 1.0)
    if (value := take("MAX_NUM_SEQS")) is not None:
        config["max-num-seqs"] = _number("MAX_NUM_SEQS", value, int, 1)
    if (value := take("MAX_MODEL_LEN")) is not None:
        config["max-model-len"] = _number("MAX_MODEL_LEN", value, int, 16)
    if (value := take("KV_CACHE_DTYPE")) is not None:
        config["kv-cache-dtype"] = value

    spec = dict(config.get("speculative-config") or {})
    if (value := take("MTP")) is not None:
        tokens = _number("MTP", value, int, 0)
        if tokens == 0:
            spec = {}
        else:
            if spec.get("method", "mtp") != "mtp":
                spec = {}
            spec.update({"method": "mtp", "num_speculative_tokens": tokens})
    if (value := take("DRAFT_VOCAB_PATH")) is not None:
        if not spec:
            raise Refused(
                "DRAFT_VOCAB_PATH is set but MTP=0: the pruned draft head is part of MTP; set MTP>0 or unset "
                "DRAFT_VOCAB_PATH"
            )
        spec["draft_vocab_path"] = value
    if spec:
        config["speculative-config"] = spec
    else:
        config.pop("speculative-config", None)

    if (value := take("PLE")) is not None:
        if value not in ("0", "1"):
            raise Refused(f"PLE={value}: expected 1 (table on disk) or 0 (table resident)")
        config = release_ple.set_ple(config, PLE_HELD_AS, value == "1")

    if (value := take("LANGUAGE_MODEL_ONLY")) is not None:
        if value not in ("0", "1"):
            raise Refused(f"LANGUAGE_MODEL_ONLY={value}: expected 1 or 0")
        if value == "1":
            config["language-model-only"] = True
        else:
            config.pop("language-model-only", None)

    # Names: `none` removes the profile's setting.
    if (value := take("SERVED_MODEL_NAME")) is not None:
        if value == "none":
            config.pop("served-model-name", None)
        else:
            config["served-model-name"] = value
    if (value := take("TOOL_CALL_PARSER")) is not None:
        if value == "none":
            config.pop("tool-call-parser", None)
            config.pop("enable-auto-tool-choice", None)
        else:
            config["enable-auto-tool-choice"] = True
            config["tool-call-parser"] = value
    if (value := take("REASONING_PARSER")) is not None:
        if value == "none":
            config.pop("reasoning-parser", None)
        else:
            config["reasoning-parser"] = value
    return config, used
