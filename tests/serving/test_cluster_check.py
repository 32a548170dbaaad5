"""`cluster check`: two hosts compared before TP=2, made here as two network namespaces joined by a
veth pair (addresses 10.232.x.y/30 that exist only inside them), each running a real Ray node
started by `cluster head` / `cluster worker`.

The worker "host" also gets a mount namespace of its own in which its copy of the checkpoint, of
the keep-set folder and of the checkout's patches/ folder are bind-mounted over the head's paths:
so the same absolute path holds different bytes on the two hosts exactly when a test makes them
differ (the test edits the worker's copy from outside), and each host's answer comes from its own
files, read by a Ray task on that node. The all-reduce runs between a process on each node over
Gloo on the veth link.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy
import pytest
from safetensors.numpy import save_file

from magpie.serving import cluster_check
from tests.serving.helpers import PYTHON, REPO, tool, vllm_env
from tests.serving.test_cluster import TwoHosts, stop, wait_until_joined

CLUSTER = tool("cluster")[1:]
PORT = 6381


def write_checkpoint(folder: Path, seed: int = 0) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    rng = numpy.random.default_rng(seed)
    for index in (1, 2):
        tensors = {f"model.layers.{index}.mlp.down_proj.weight": rng.standard_normal((64, 32)).astype(numpy.float32)}
        save_file(tensors, str(folder / f"model-0000{index}-of-00002.safetensors"))
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3_5", "hidden_size": 32}))
    return folder


class CheckedHosts(TwoHosts):
    def __init__(self, binds: list[tuple[Path, Path]]):
        super().__init__()
        tag = (os.getpid() + 17) % 10000
        self.ns = {"head": f"fnc-h{tag}", "worker": f"fnc-w{tag}"}
        self.iface = {"head": f"fnc{tag}h", "worker": f"fnc{tag}w"}
        subnet = (os.getpid() + 17) % 250
        self.ip = {"head": f"10.232.{subnet}.1", "worker": f"10.232.{subnet}.2"}
        self.binds = binds  # (the worker's copy, the path it appears at on the worker)

    def worker_cmd(self, *argv: str) -> list[str]:
        mounts = " && ".join(f'mount --bind "{src}" "{dst}"' for src, dst in self.binds)
        inner = ["unshare", "--mount", "--propagation", "private", "sh", "-c", f'{mounts} && exec "$@"', "sh", *argv]
        return ["ip", "netns", "exec", self.ns["worker"], *inner]


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    pytest.importorskip("ray", reason="Ray is needed for the two-node tests (tests/env/requirements.txt)")
    if os.geteuid() != 0:
        pytest.skip("network and mount namespaces need root")
    root = tmp_path_factory.mktemp("cluster-check")
    model = write_checkpoint(root / "model")
    keep_dir = root / "keep"
    keep_dir.mkdir()
    numpy.save(keep_dir / "keep.npy", numpy.arange(0, 4096, 3, dtype=numpy.int64))
    worker = root / "worker-copies"
    worker.mkdir()
    shutil.copytree(model, worker / "model")  # copy2: the same bytes, sizes and mtimes
    shutil.copytree(keep_dir, worker / "keep")
    shutil.copytree(REPO / "patches", worker / "patches")
    binds = [(worker / "model", model), (worker / "keep", keep_dir), (worker / "patches", REPO / "patches")]
    hosts = CheckedHosts(binds)
    try:
        hosts.up()
    except (subprocess.CalledProcessError, OSError) as e:
        hosts.down()
        pytest.skip(f"cannot make network namespaces here: {getattr(e, 'stderr', e)}")
    logs = root / "logs"
    logs.mkdir()
    env = vllm_env(None, RAY_USAGE_STATS_ENABLED="0")
    small = ["--num-cpus", "1", "--ray-arg=--object-store-memory=100000000"]
    procs = []
    try:
        for role in ("head", "worker"):
            argv = [PYTHON, *CLUSTER, role, "--ip", hosts.ip[role], "--iface", hosts.iface[role], *small]
            argv += ["--port", str(PORT)] if role == "head" else ["--head", f"{hosts.ip['head']}:{PORT}"]
            cmd = hosts.worker_cmd(*argv) if role == "worker" else hosts.cmd("head", *argv)
            with open(logs / f"{role}.log", "w") as log:
                procs.append(
                    subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
                )
            wait_until_joined(hosts, env, procs, logs / f"{role}.log", role, PORT)
        hosts.env = env
        hosts.model, hosts.keep_set, hosts.worker = model, keep_dir / "keep.npy", worker
        hosts.cache = root / "manifest-cache"
        yield hosts
    finally:
        for proc in reversed(procs):
            stop(proc)
        hosts.down()


def check(hosts, tmp_path: Path, *extra: str) -> tuple[subprocess.CompletedProcess, dict]:
    report = tmp_path / "check.json"
    argv = [PYTHON, *CLUSTER, "check", "--head", f"{hosts.ip['head']}:{PORT}", "--model", str(hosts.model)]
    argv += ["--keep-set", str(hosts.keep_set), "--manifest-cache", str(hosts.cache), "--json", str(report), *extra]
    proc = subprocess.run(hosts.cmd("head", *argv), capture_output=True, text=True, env=hosts.env, timeout=600)
    return proc, json.loads(report.read_text()) if report.exists() else {}


def error_lines(proc) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("error:")]


@pytest.mark.slow
def test_matching_hosts_pass_and_the_all_reduce_runs_over_the_link(hosts, tmp_path):
    proc, record = check(hosts, tmp_path, "--bytes", "8MiB", "--iterations", "3")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert record["ok"] and record["problems"] == []
    reports = record["reports"]
    assert set(reports) == {hosts.ip["head"], hosts.ip["worker"]}
    for role in ("head", "worker"):
        seen = reports[hosts.ip[role]]
        assert seen["link"]["iface"] == hosts.iface[role] and seen["link"]["has_ip"] is True
        assert seen["patches"]["vllm"] == "0.29.0"
        assert sorted(seen["checkpoint"]["files"]) == [
            "config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
        ]  # fmt: skip
    assert reports[hosts.ip["head"]]["checkpoint"]["digest"] == reports[hosts.ip["worker"]]["checkpoint"]["digest"]
    bench = record["collective"]
    assert bench["correct"] and bench["world_size"] == 2 and bench["bytes"] == 8 << 20 and bench["gbps"] > 0
    speed = reports[hosts.ip["head"]]["link"]["speed_mbps"]
    assert bench["nominal_gbps"] == (speed / 1000 if speed else None)
    print(proc.stdout)  # the table, for -s
    assert "all-reduce (gloo, 2 ranks): 8 MiB" in proc.stdout
    assert "TP=2 may start" in proc.stderr
    # The second check reads no checkpoint bytes on either host: the manifests are cached.
    proc, record = check(hosts, tmp_path, "--bytes", "0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["checkpoint"]["read_bytes"] for r in record["reports"].values()] == [0, 0]


@pytest.mark.slow
def test_a_checkpoint_file_that_differs_on_the_worker_refuses_tp2(hosts, tmp_path):
    shard = hosts.worker / "model" / "model-00002-of-00002.safetensors"
    original = shard.read_bytes()
    try:
        write_checkpoint(tmp_path / "other", seed=1)
        shard.write_bytes((tmp_path / "other" / shard.name).read_bytes())  # same size, other weights
        proc, record = check(hosts, tmp_path, "--bytes", "0")
    finally:
        shard.write_bytes(original)
    assert proc.returncode == 1, proc.stderr
    [line] = error_lines(proc)
    assert line.startswith("error: cluster check: refusing TP=2: checkpoint ")
    assert f"{hosts.model} differs: model-00002-of-00002.safetensors (sha256 " in line
    assert "model-00001" not in line and "config.json" not in line
    assert record["problems"] == [line.split("refusing TP=2: ", 1)[1]]


@pytest.mark.slow
def test_a_series_that_differs_on_the_worker_refuses_tp2(hosts, tmp_path):
    series = hosts.worker / "patches" / "vllm-0.29.0" / "series"
    original = series.read_text()
    try:
        series.write_text(original.replace("mtp_pruning/0001-draft-vocab-pruning.patch\n", ""))
        proc, _ = check(hosts, tmp_path, "--bytes", "0")
    finally:
        series.write_text(original)
    assert proc.returncode == 1, proc.stderr
    [line] = error_lines(proc)
    assert (
        "patch series vllm-0.29.0 differs: mtp_pruning/0001-draft-vocab-pruning.patch only on "
        f"{hosts.ip['head']}" in line
    )


@pytest.mark.slow
def test_an_edited_patch_a_missing_keep_set_and_another_mtu_are_each_named(hosts, tmp_path):
    patch = hosts.worker / "patches" / "vllm-0.29.0" / "ple_ssd" / "0001-ple-mmap-table.patch"
    keep = hosts.worker / "keep" / "keep.npy"
    original, kept = patch.read_bytes(), keep.read_bytes()
    ip_link = ["ip", "-n", hosts.ns["worker"], "link", "set", "dev", hosts.iface["worker"], "mtu"]
    try:
        patch.write_bytes(original + b"\n")
        keep.unlink()
        subprocess.run([*ip_link, "9000"], check=True)
        proc, record = check(hosts, tmp_path, "--bytes", "0")
    finally:
        patch.write_bytes(original)
        keep.write_bytes(kept)
        subprocess.run([*ip_link, "1500"], check=True)
    assert proc.returncode == 1, proc.stderr
    [line] = error_lines(proc)
    worker = hosts.ip["worker"]
    assert f"{worker}: no keep-set at {hosts.keep_set}" in line
    assert "patch ple_ssd/0001-ple-mmap-table.patch differs: sha256 " in line
    assert f"MTU 1500 on {hosts.ip['head']} ({hosts.iface['head']}), 9000 on {worker}" in line
    assert len(record["problems"]) == 3


def test_manifest_cache_rehashes_only_files_whose_size_or_mtime_changed(tmp_path):
    model = write_checkpoint(tmp_path / "model")
    cache = tmp_path / "cache"
    first = cluster_check.checkpoint_manifest(str(model), str(cache))
    total = sum(p.stat().st_size for p in model.iterdir())
    assert first["read_bytes"] == total and Path(first["cache"]).is_file()
    again = cluster_check.checkpoint_manifest(str(model), str(cache))
    assert again["read_bytes"] == 0 and again["digest"] == first["digest"]
    shard = model / "model-00001-of-00002.safetensors"
    stat = shard.stat()
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # other bytes, same size; the mtime put back: the cache is trusted (not read)
    shard.write_bytes(bytes(data))
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert cluster_check.checkpoint_manifest(str(model), str(cache))["digest"] == first["digest"]
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))  # a copy or an edit moves the mtime
    changed = cluster_check.checkpoint_manifest(str(model), str(cache))
    assert changed["read_bytes"] == stat.st_size and changed["digest"] != first["digest"]
    assert changed["files"][shard.name]["sha256"] == cluster_check.sha256_file(str(shard))
