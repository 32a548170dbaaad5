"""CPU tests of magpie/gpu/release_probe.py's step runner: real child Pythons importing the
installed vLLM (the 0.29.0 CPU build); a failing step is recorded with its exception and the
steps after it still run, a child that dies is restarted at the next step, and a hung child is
stopped at the deadline."""

from __future__ import annotations

import sys

from magpie.gpu import release_probe


def test_a_failing_step_is_recorded_and_later_steps_still_run():
    steps = [
        ("import vllm", "import vllm\nresult = vllm.__version__"),
        ("missing module", "import vllm.no_such_module_for_the_probe"),
        ("raises", "raise ValueError('boom from the step')"),
        ("vllm.envs after the failures", "import vllm.envs\nresult = vllm.envs.__name__"),
    ]
    got = release_probe.run_steps(steps, None, deadline_s=120, python=sys.executable)
    assert [s["name"] for s in got] == [name for name, _ in steps]
    first, missing, raises, last = got
    assert first["ok"] and first["result"].startswith("0.29.0")
    assert not missing["ok"]
    assert missing["error"]["type"] == "builtins.ModuleNotFoundError"
    assert missing["error"]["missing_module"] == "vllm.no_such_module_for_the_probe"
    assert not raises["ok"] and raises["error"]["type"] == "builtins.ValueError"
    assert raises["error"]["message"] == "boom from the step"
    assert raises["error"]["frames"] and "<step raises>" in raises["error"]["frames"][-1]
    assert last["ok"] and last["result"] == "vllm.envs"
    text = release_probe.table(got)
    assert "FAIL" in text.splitlines()[1] and "ModuleNotFoundError" in text.splitlines()[1]


def test_a_child_that_dies_is_recorded_and_a_fresh_one_runs_the_next_step():
    steps = [
        ("before", "result = 1"),
        ("dies", "import os\nprint('last words', flush=True)\nos._exit(3)"),
        ("after", "import json\nresult = json.__name__"),
    ]
    got = release_probe.run_steps(steps, None, deadline_s=60)
    assert [s["ok"] for s in got] == [True, False, True]
    err = got[1]["error"]
    assert err["type"] == "ChildDied" and "status 3" in err["message"] and "last words" in err["output_tail"]
    assert got[2]["result"] == "json"


def test_a_hung_step_is_stopped_at_the_deadline_and_the_rest_marked_not_run():
    steps = [("hangs", "import time\ntime.sleep(60)"), ("never", "result = 2")]
    got = release_probe.run_steps(steps, None, deadline_s=3)
    assert got[0]["error"]["type"] == "ChildDied" and "deadline" in got[0]["error"]["message"]
    assert got[1]["error"]["type"] == "NotRun"
