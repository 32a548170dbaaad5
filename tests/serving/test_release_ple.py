"""PLE=1 said once, spelled per release: the shipped profiles say `#: ple: true` and carry no release's
spelling; `launch` spells it from magpie/release_ple.py for the release's switch (releases.json),
and a profile written in one release's spelling (as the shipped ones were, in 0.29's) still turns
it on. Also: a launch reads its environment from the mapping it is given, and whether the GB10
settings apply is data, not a message. In-process, on real profile files, in about a second."""

from __future__ import annotations

from pathlib import Path

import pytest

from magpie import release_ple, releases
from magpie.serving import launch

SHIPPED = sorted(Path(launch.PROFILE_DIR).glob("*.yaml"))
SWITCH_RELEASES = sorted({row["ple_switch"]: name for name, row in releases.load()["releases"].items()}.items())


def test_the_spellings_are_keyed_like_the_release_tables_switches():
    assert set(release_ple.SPELLINGS) == set(releases.PLE_SWITCHES)
    assert launch.PLE_SPELLINGS is release_ple.SPELLINGS


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_shipped_profiles_say_ple_true_in_no_releases_spelling(path):
    assert release_ple.switch_of(launch.load_profile(str(path))) is None
    assert launch.profile_settings(str(path))["ple"] is True


@pytest.mark.parametrize(("switch", "release"), SWITCH_RELEASES)
def test_ple_true_is_spelled_for_each_switchs_release(tmp_path, switch, release):
    neutral = tmp_path / "neutral.yaml"
    neutral.write_text("#: ple: true\nmax-num-seqs: 2\nhf-overrides:\n  other: 1\n")
    old = tmp_path / "old.yaml"  # a profile in 0.29's spelling, as the shipped ones were written
    old.write_text("max-num-seqs: 2\nhf-overrides:\n  other: 1\n  ple_mmap: true\n")
    option, values, _ = release_ple.SPELLINGS[switch]
    for path in (neutral, old):
        config = launch.Profile.resolve(release, {"PROFILE": str(path)}).config
        assert release_ple.switch_of(config) == switch, (path.name, config)
        assert {k: v for k, v in config[option].items() if k in values} == values
        assert config["hf-overrides"]["other"] == 1 and config["max-num-seqs"] == 2
    off = launch.Profile.resolve(release, {"PROFILE": str(neutral), "PLE": "0"}).config
    assert release_ple.switch_of(off) is None and off["hf-overrides"] == {"other": 1}


def test_ple_setting_of_the_wrong_type_is_refused_naming_it(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("#: ple: yes please\nmax-num-seqs: 2\n")
    with pytest.raises(launch.Refused, match=r"`#: ple: yes please`: expected a bool"):
        launch.Profile.resolve("0.29.0", {"PROFILE": str(bad)})


def test_resolve_reads_the_environment_it_is_given_not_the_process(monkeypatch, tmp_path):
    monkeypatch.setenv("PROFILE", "hopper")
    monkeypatch.setenv("MAX_NUM_SEQS", "9")
    profile = launch.Profile.resolve("0.29.0", {"PROFILE": "seed-gb10", "MAX_NUM_SEQS": "3"})
    assert profile.name == "seed-gb10" and profile.config["max-num-seqs"] == 3
    assert profile.used == ["MAX_NUM_SEQS=3"]


def test_gb10_settings_say_whether_they_apply_as_data():
    hopper = launch.Profile.resolve("0.29.0", {"PROFILE": "hopper"})
    forced = launch.server_environment(hopper, {"GB10_ENV": "1", "JIT_JOBS": "2", "MAX_JOBS": "8"})
    assert forced.applied is True and forced.env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:False"
    assert "MAX_JOBS" not in forced.env and any("MAX_JOBS=8 (yours, kept" in line for line in forced.lines)
    off = launch.server_environment(hopper, {"GB10_ENV": "0"})
    assert off.applied is False and off.env == {}
    seed = launch.Profile.resolve("0.29.0", {"PROFILE": "seed-gb10"})
    declared = launch.server_environment(seed, {})
    assert declared.applied is True and declared.env["MAX_JOBS"] == "4"
