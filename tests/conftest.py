"""Shared fixtures: the pinned vLLM (pristine sdist, installed package, patched overlays), a tiny
Qwen3.5 + MTP model with a tokenizer trained here, and real vLLM servers on 127.0.0.1: the
session's pool (`vllm_servers`, one server per model, overlay and arguments, shared by the tests
that only send it requests) and `vllm_server_factory` (a test's own servers).

The suite runs under the test venv's interpreter (tests/env/setup.sh); tests/run.sh does both.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent

from magpie import releases  # noqa: E402
from magpie.demo.demo_model import build_tiny_qwen35, train_tokenizer  # noqa: E402
from magpie.demo.demo_overlay import installed_vllm_dir, make_overlay, vllm_env  # noqa: E402
from magpie.serving.process import VllmServer  # noqa: E402
from tests.releases import sdist_tree  # noqa: E402

# The release the test venv's vLLM is and the flake's default: the release table's default row.
VLLM_VERSION = releases.default()

# Under pytest-xdist (tests/run.sh runs two workers) two CPU servers may start at once. vLLM's CPU
# worker binds its OpenMP threads, its main thread among them, to the first core by default
# (VLLM_CPU_OMP_THREADS_BIND=auto with one core reserved: "core ids=[0]" on this 2-core VM), so both
# servers would share core 0; `nobind` leaves the placing to the kernel. A value set outside is kept.
#
# With two workers two processes compute at once, and each would run torch's OpenMP pool on both
# cores: a parallel region then waits at its barrier for a thread the other process holds off the
# core. Two tiny MTP servers decoding 4 x 200 tokens each at once took 26.2 s so (6.4 s one alone),
# 6.0 s with one OpenMP thread each (5.8 s alone). So every process of the suite gets one thread.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("OMP_NUM_THREADS", "1")

# A run started in the background of a non-interactive shell (`tests/run.sh &`, `nohup ... &`)
# inherits SIGINT and SIGQUIT ignored, and so would every process the suite starts: Python then
# installs no KeyboardInterrupt handler, and the tests of what a Ctrl-C does (to the patch tool
# waiting for its lock, to a sweep under `| tee`) saw it ignored: both failed in every such run on
# 2026-12-07 (/proc's SigIgn of the tool: 0x1001006, SIGINT and SIGQUIT among it) and passed run in
# the foreground. A terminal's foreground job has the defaults, which these tests stand for: set
# them back. SIGHUP is left as it is (nohup keeps a run going after a hang-up).
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
if signal.getsignal(signal.SIGQUIT) == signal.SIG_IGN:
    signal.signal(signal.SIGQUIT, signal.SIG_DFL)

# vLLM's CPU platform gives an engine's one worker a process of its own, spawned, so that it can
# bind its OpenMP threads: a third import of vLLM per server (API server, engine core, worker), ~12 s
# of CPU here (a tiny MTP server healthy after 32 s, 20 s without it, on this 2-core VM). With
# VLLM_ENABLE_V1_MULTIPROCESSING=0 the worker runs inside the engine-core process, as one rank does
# on a GPU (vLLM's uni executor); a server's engine core still runs in its own process (the API
# server always starts one), and `vllm.LLM` runs its engine in the caller's process. The plain
# server of tests/test_vllm_server.py keeps the CPU default (1). A value set outside is kept.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


@pytest.fixture(scope="session")
def gsm8k_fixture() -> Path:
    """Twelve GSM8K-format problems (tests/fixtures) for the gsm8k tool and the suites that run it."""
    return TESTS / "fixtures" / "gsm8k_fixture.jsonl"


@pytest.fixture(scope="session")
def sdist_root() -> Path:
    """The pristine source tree of the table's default release (read-only: copy it before
    changing anything)."""
    return sdist_tree(VLLM_VERSION)


@pytest.fixture(scope="session")
def sdist_028_root() -> Path:
    """The pristine vLLM 0.28.0 source tree: the "wrong version" for conflict tests."""
    return sdist_tree("0.28.0")


@pytest.fixture(scope="session")
def site_packages() -> Path:
    """The test venv's site-packages folder holding the installed (pristine) vllm package."""
    return installed_vllm_dir().parent


@pytest.fixture(scope="session")
def patched_vllm(tmp_path_factory) -> Path:
    """An overlay with the whole real patch series applied; put it first on PYTHONPATH."""
    return make_overlay(tmp_path_factory.mktemp("patched-vllm"))


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    return train_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="session")
def tiny_mtp_model(tmp_path_factory, tokenizer_dir) -> Path:
    """Tiny Qwen3.5 + MTP whose greedy continuation is next id = previous id + 1 (all drafts accepted)."""
    return build_tiny_qwen35(tmp_path_factory.mktemp("tiny-mtp") / "model", tokenizer_dir, variant="increment")


@pytest.fixture(scope="session")
def tiny_random_model(tmp_path_factory, tokenizer_dir) -> Path:
    """Tiny Qwen3.5 + MTP with random weights (never compare texts on it)."""
    return build_tiny_qwen35(tmp_path_factory.mktemp("tiny-random") / "model", tokenizer_dir, variant="random")


# A test server runs eagerly unless its test is about compiled behaviour: on the CPU build
# `--enforce-eager` skips the torch.compile warm-up, 25-60 s of a ~70-100 s start on two cores
# (init 12 s eager vs 36-73 s compiled, tiny models, vLLM 0.29.0). What the suite checks of a
# server (texts, ids, logs, HTTP, stops) does not depend on it; tests/test_vllm_server.py keeps a
# compiled server and the README's demo serves compiled. Tool runs that start their own servers
# (serve.sh, the sweep, bench-pruned) pass EAGER as their serve arguments.
EAGER = ("--enforce-eager",)


def with_eager(args: Sequence[str], eager: bool) -> list[str]:
    """`args`, with EAGER added when `eager` and `args` do not already say it."""
    args = list(args)
    return args + [a for a in EAGER if a not in args] if eager else args


@pytest.fixture
def vllm_server_factory(tmp_path):
    """Start real vLLM servers (eager unless eager=False); every server started is stopped at
    teardown."""
    started: list[VllmServer] = []

    def start(model, extra_args=(), env=None, timeout=600, eager=True, **kwargs) -> VllmServer:
        server = VllmServer(
            model,
            with_eager(extra_args, eager),
            env=env or vllm_env(),
            log_path=tmp_path / f"server{len(started)}.log",
            **kwargs,
        )
        started.append(server)
        return server.start(timeout=timeout)

    yield start
    for server in started:
        server.stop()


# The tiny increment model served with MTP k=3 and vLLM's dev endpoints (the sweep's prefix-cache
# reset): the arguments of the pool's server that tests/test_vllm_server.py and
# tests/measure/test_bench_and_sweep.py share. MTP on the CPU build needs prefix caching off.
MTP_TOKENS = 3
MTP3_ARGS = (
    "--no-enable-prefix-caching",
    "--speculative-config",
    json.dumps({"method": "mtp", "num_speculative_tokens": MTP_TOKENS}),
)
MTP3_ENV = {"VLLM_SERVER_DEV_MODE": "1"}


class ServerPool:
    """Real vLLM servers shared by the session (under pytest-xdist: by one worker's tests), one
    per (model, overlay, arguments, extra environment, max model length), eager unless
    eager=False: started when a test first asks for it, stopped at the session's end. A server
    start costs 40-100 s on two cores, so tests that differ only in what they send a server ask
    the pool for the same one; a test of a server's own start or stop behaviour starts its own
    (`vllm_server_factory`). A test may stop a pooled server (the next ask starts it again) but
    must not otherwise change it."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.servers: dict[tuple, VllmServer] = {}
        self.starts = 0

    def get(
        self,
        model: Path,
        args: Sequence[str] = (),
        overlay: Path | None = None,
        env: Mapping[str, str] | None = None,
        max_model_len: int | None = 2048,
        timeout: float = 600,
        eager: bool = True,
    ) -> VllmServer:
        args = with_eager(args, eager)
        extra = dict(env or {})
        key = (str(model), str(overlay) if overlay else None, tuple(args), tuple(sorted(extra.items())), max_model_len)
        server = self.servers.get(key)
        if server is not None and server.alive():
            return server
        if server is not None:
            server.stop()  # stopped by a test, or died: its group is emptied before a new start
        self.starts += 1
        server = VllmServer(
            model,
            list(args),
            env=vllm_env(overlay, **extra),
            log_path=self.folder / f"server{self.starts}.log",
            max_model_len=max_model_len,
        )
        self.servers[key] = server
        return server.start(timeout=timeout)

    def stop_all(self) -> None:
        for server in self.servers.values():
            server.stop()
        self.servers.clear()


@pytest.fixture(scope="session")
def vllm_servers(tmp_path_factory):
    """The session's pool of shared real vLLM servers (ServerPool)."""
    pool = ServerPool(tmp_path_factory.mktemp("server-pool"))
    yield pool
    pool.stop_all()


@pytest.fixture(scope="module")
def mtp3_server(vllm_servers, tiny_mtp_model) -> VllmServer:
    """The pool's tiny increment model with MTP k=3 (MTP3_ARGS), running when the module starts
    (a module that stops it leaves the next module a fresh one)."""
    return vllm_servers.get(tiny_mtp_model, MTP3_ARGS, env=MTP3_ENV)


# tests/run.sh runs two workers that take whole files (--dist loadfile), the next file in collection
# order whenever one is free (--no-loadscope-reorder: pytest-xdist would otherwise order the files by
# their number of tests). The files below took the longest on the 2-core VM (seconds per file summed
# from --durations, two runs on 2026-12-07: 190-290 s for the first three, 70-140 s for the rest),
# so they go first, the longest first: the run then ends on short files that fill both workers
# instead of one worker finishing a long file alone. The other files follow in collection order.
LONGEST_FIRST = (
    "tests/serving/test_profiles.py",
    "tests/release_python/test_mtp_pruning.py",
    "tests/serving/test_serving_tools.py",
    "tests/ple_ssd/test_ple_ssd.py",
    "tests/nix/test_flake_pins.py",
    "tests/nix/test_wheel_install.py",
    "tests/serving/test_serve_sh_liveness.py",
    "tests/v0_33/test_ple_ssd_033.py",
    "tests/serving/test_cluster.py",
    "tests/measure/test_sweep_signals.py",
    "tests/test_patch_tool_safety.py",
    "tests/measure/test_log_check_ple.py",
    "tests/measure/test_sweep_keepsets.py",
    "tests/measure/test_bench_and_sweep.py",
    "tests/mtp_pruning/test_mtp_pruning_startup.py",
    "tests/test_vllm_server.py",
    "tests/test_test_env.py",
    "tests/mtp_pruning/test_mtp_pruning_server.py",
    "tests/mtp_pruning/test_mtp_pruning_bench_pruned.py",
)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items):
    """LONGEST_FIRST's files first, in its order; a stable sort keeps each file's own order (and the
    fixture-scope grouping pytest made before this hook) and the rest's collection order."""
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))
