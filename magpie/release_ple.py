"""PLE=1 (the n-gram table on disk) as each vLLM release spells it. Standard library only, and it
imports nothing of this project: magpie.releases (whose table names each release's switch, one
of PLE_SWITCHES) and magpie.serving.launch (which spells it on a command line) can both import it.

A switch is a key of `SPELLINGS`, keyed like `releases.PLE_SWITCHES`: the `vllm serve` option it
lives in, the values PLE=1 sets there, and whether the ple_ssd patch must be applied for it.

- 0.29 reads the ple_ssd patch's `ple_mmap` hf-override;
- 0.30-0.33 keep the table in vLLM's Engram code and PLE=1 is the patch's Engram storage mode
  (0.30+ ignores the hf-override, and then pins the whole table in host memory: 102 GB,
  impossible on a GB10);
- 0.34 ships the same design as upstream's Engram `disk_offload` mode.

A profile says `#: ple: true` (release-neutral); a profile may also carry one release's spelling
(the shipped profiles did, in 0.29's): `switch_of` finds any of them and `respell` moves it to the
target release's.
"""

from __future__ import annotations

import json

__all__ = ["SPELLINGS", "argument", "respell", "set_ple", "switch_of"]

SPELLINGS: dict[str, tuple[str, dict, bool]] = {
    "hf-overrides": ("hf-overrides", {"ple_mmap": True}, True),
    "engram-config": ("engram-config", {"offload_storage": "mmap"}, True),
    "engram-disk-offload": ("engram-config", {"disk_offload": True}, False),
}


def switch_of(config: dict) -> str | None:
    """The switch CONFIG (`vllm serve` options, as a profile holds them) turns PLE=1 on with, or
    None when it is off."""
    for switch, (option, spelling, _) in SPELLINGS.items():
        value = config.get(option) or {}
        if isinstance(value, dict) and all(value.get(key) == want for key, want in spelling.items()):
            return switch
    return None


def set_ple(config: dict, switch: str, on: bool) -> dict:
    """A copy of CONFIG with PLE=1 on (through SWITCH) or off (every release's spelling removed);
    an option left empty is dropped."""
    config = dict(config)
    for option, spelling, _ in SPELLINGS.values():
        value = {k: v for k, v in (config.get(option) or {}).items() if k not in spelling}
        if value:
            config[option] = value
        else:
            config.pop(option, None)
    if on:
        option, spelling, _ = SPELLINGS[switch]
        config[option] = {**(config.get(option) or {}), **spelling}
    return config


def respell(config: dict, wanted: str) -> dict:
    """CONFIG with PLE=1, where it is on in any spelling, spelled through the WANTED switch."""
    switch = switch_of(config)
    return config if switch is None or switch == wanted else set_ple(config, wanted, True)


def argument(switch: str) -> str:
    """PLE=1 as it appears on the command line of SWITCH: --engram-config '{"disk_offload": true}'."""
    option, spelling, _ = SPELLINGS[switch]
    return f"--{option} '{json.dumps(spelling)}'"
