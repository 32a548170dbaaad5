"""cluster.py: two hosts over Ray, made here as two network namespaces joined by a veth pair.

Each "host" has its own network stack (its own loopback, one veth interface with a 10.231.x.y/30
address that exists only inside these namespaces), so the Ray head and the Ray worker really talk
over that link, and the interface settings (NCCL/Gloo/...) name a real, distinct interface per
host. The worker "host" also gets a private, empty tmpfs at the keep-set's folder (a mount
namespace of its own), so a keep-set reaches it only if the launcher delivers it.

What runs: the head and worker roles (real `ray start` processes of Ray 2.56.1 in the test venv),
the settings reaching Ray's worker processes on both hosts, the keep-set delivered to the worker
host at the same absolute path. What cannot: TP=2 over Ray on vLLM's CPU build. vLLM 0.29.0's
CPU platform has no Ray device key, and vllm/v1/executor/ray_utils.py refuses Ray for such a
platform ("current platform cpu does not support ray"); the launcher says so before starting,
and the last test shows the real server fails exactly there when the check is skipped (with the
pruned MTP head configured).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import numpy
import pytest

from tests.serving.helpers import PYTHON, tool, vllm_env

CLUSTER = tool("cluster")[1:]  # [package, "cluster"]

RAY = str(Path(PYTHON).parent / "ray")
PORT = 6379


class TwoHosts:
    """Two network namespaces ("head" and "worker") joined by a veth pair."""

    def __init__(self):
        tag = os.getpid() % 10000
        subnet = os.getpid() % 250
        self.ns = {"head": f"fnx-h{tag}", "worker": f"fnx-w{tag}"}
        self.iface = {"head": f"fnx{tag}h", "worker": f"fnx{tag}w"}
        self.ip = {"head": f"10.231.{subnet}.1", "worker": f"10.231.{subnet}.2"}

    def up(self) -> None:
        run = lambda *cmd: subprocess.run(cmd, check=True, capture_output=True, text=True)  # noqa: E731
        for role in ("head", "worker"):
            run("ip", "netns", "add", self.ns[role])
        run("ip", "link", "add", self.iface["head"], "type", "veth", "peer", "name", self.iface["worker"])
        for role in ("head", "worker"):
            run("ip", "link", "set", self.iface[role], "netns", self.ns[role])
            run("ip", "-n", self.ns[role], "addr", "add", f"{self.ip[role]}/30", "dev", self.iface[role])
            run("ip", "-n", self.ns[role], "link", "set", self.iface[role], "up")
            run("ip", "-n", self.ns[role], "link", "set", "lo", "up")

    def down(self) -> None:
        for role in ("head", "worker"):
            subprocess.run(["ip", "netns", "del", self.ns[role]], capture_output=True)

    def cmd(self, role: str, *argv: str, private_dir: Path | None = None) -> list[str]:
        inner = list(argv)
        if private_dir is not None:  # a mount namespace with an empty tmpfs at private_dir
            script = f'mount -t tmpfs fnx-private "{private_dir}" && exec "$@"'
            inner = ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", *inner]
        return ["ip", "netns", "exec", self.ns[role], *inner]


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)  # cluster.py forwards it to `ray start --block`, which stops its node
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def driver(hosts: TwoHosts, code: str, env=None, timeout: float = 180) -> dict:
    """Run a Ray driver in the head's namespace; it prints one JSON line."""
    prelude = (
        "import json, os, ray\n"
        f"ray.init(address='{hosts.ip['head']}:{PORT}', logging_level='ERROR', log_to_driver=False)\n"
        "from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy as Pin\n"
        "nodes = [n for n in ray.nodes() if n['Alive']]\n"
    )
    proc = subprocess.run(
        hosts.cmd("head", PYTHON, "-c", prelude + code), capture_output=True, text=True, timeout=timeout, env=env
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def wait_until_joined(hosts, env: dict, procs: list, log: Path, role: str, port: int) -> None:
    """Until `ray status` on the head counts the head (role "head") or both nodes; fails the test
    with the node's log when one of `procs` died or 240 s passed."""
    deadline = time.monotonic() + 240
    want = 1 if role == "head" else 2
    while time.monotonic() < deadline:
        status = subprocess.run(
            hosts.cmd("head", RAY, "status", "--address", f"{hosts.ip['head']}:{port}"),
            capture_output=True, text=True, env=env,
        )  # fmt: skip
        if status.returncode == 0 and status.stdout.split("Pending:")[0].count(" node_") >= want:
            return
        assert all(p.poll() is None for p in procs), log.read_text()[-3000:]
        time.sleep(2)
    pytest.fail(f"the Ray {role} did not join in time:\n{log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def keep_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("keep-sets")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, keep_dir, patched_vllm):
    pytest.importorskip("ray", reason="Ray is needed for the two-node tests (tests/env/requirements.txt)")
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    hosts = TwoHosts()
    try:
        hosts.up()
    except (subprocess.CalledProcessError, OSError) as e:
        hosts.down()
        pytest.skip(f"cannot make network namespaces here: {getattr(e, 'stderr', e)}")
    logs = tmp_path_factory.mktemp("ray-logs")
    env = vllm_env(patched_vllm, RAY_USAGE_STATS_ENABLED="0")
    small = ["--num-cpus", "1", "--ray-arg=--object-store-memory=100000000"]
    procs = []
    try:
        for role in ("head", "worker"):
            argv = [PYTHON, *CLUSTER, role, "--ip", hosts.ip[role], "--iface", hosts.iface[role], *small]
            argv += ["--port", str(PORT)] if role == "head" else ["--head", f"{hosts.ip['head']}:{PORT}"]
            with open(logs / f"{role}.log", "w") as log:
                procs.append(
                    subprocess.Popen(
                        hosts.cmd(role, *argv, private_dir=keep_dir if role == "worker" else None),
                        env=env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
            wait_until_joined(hosts, env, procs, logs / f"{role}.log", role, PORT)
        hosts.env = env
        hosts.logs = logs
        yield hosts
    finally:
        for proc in reversed(procs):
            stop(proc)
        hosts.down()


def test_env_prints_the_link_settings_and_help_needs_no_ray():
    proc = subprocess.run([PYTHON, *CLUSTER, "env", "--ip", "127.0.0.1", "--iface", "lo", "--head", "127.0.0.2"],
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    exports = dict(line.removeprefix("export ").split("=", 1) for line in proc.stdout.splitlines())
    assert exports["VLLM_HOST_IP"] == "127.0.0.1" and exports["MASTER_ADDR"] == "127.0.0.2"
    for key in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME", "UCX_NET_DEVICES"):
        assert exports[key] == "lo"
    assert exports["RAY_memory_monitor_refresh_ms"] == "0" and "NCCL_IB_HCA" not in exports  # lo has no RDMA device
    for role in ("head", "worker", "serve", "push-keep-set", "env"):
        help_text = subprocess.run([PYTHON, *CLUSTER, role, "--help"], capture_output=True, text=True)
        assert help_text.returncode == 0 and "usage:" in help_text.stdout, role


def test_head_refuses_an_interface_that_does_not_exist_or_lacks_the_address():
    proc = subprocess.run([PYTHON, *CLUSTER, "head", "--ip", "127.0.0.1", "--iface", "fnx-none0"],
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 1 and "--iface fnx-none0: no such network interface here (present:" in proc.stderr
    proc = subprocess.run([PYTHON, *CLUSTER, "head", "--ip", "10.231.255.9", "--iface", "lo"],
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 1 and "--ip 10.231.255.9 is not an address of --iface lo" in proc.stderr


@pytest.mark.slow
def test_ray_nodes_on_both_hosts_carry_the_link_settings(cluster):
    result = driver(
        cluster,
        "@ray.remote(num_cpus=0)\n"
        "def probe():\n"
        "    keys = ['VLLM_HOST_IP', 'NCCL_SOCKET_IFNAME', 'GLOO_SOCKET_IFNAME', 'TP_SOCKET_IFNAME',\n"
        "            'UCX_NET_DEVICES', 'MASTER_ADDR', 'RAY_memory_monitor_refresh_ms']\n"
        "    return {k: os.environ.get(k) for k in keys} | {'ifaces': sorted(os.listdir('/sys/class/net'))}\n"
        "out = {n['NodeManagerAddress']: ray.get(probe.options(scheduling_strategy=Pin(n['NodeID'], soft=False))"
        ".remote()) for n in nodes}\n"
        "print(json.dumps(out))\n",
        env=cluster.env,
    )
    assert set(result) == {cluster.ip["head"], cluster.ip["worker"]}  # two nodes, one per host
    for role in ("head", "worker"):
        seen = result[cluster.ip[role]]
        assert seen["VLLM_HOST_IP"] == cluster.ip[role] and seen["MASTER_ADDR"] == cluster.ip["head"]
        for key in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME", "UCX_NET_DEVICES"):
            assert seen[key] == cluster.iface[role], key
        assert seen["RAY_memory_monitor_refresh_ms"] == "0"
        assert cluster.iface[role] in seen["ifaces"]  # the worker process really is on that host


def keep_set_file(folder: Path) -> Path:
    path = folder / "keep.npy"
    numpy.save(path, numpy.arange(0, 4096, 3, dtype=numpy.int64))
    return path


def read_on_worker(cluster, path: Path) -> dict:
    return driver(
        cluster,
        "import hashlib\n"
        "@ray.remote(num_cpus=0)\n"
        "def look(p):\n"
        "    return {'files': sorted(os.listdir(os.path.dirname(p))),\n"
        "            'sha256': hashlib.sha256(open(p, 'rb').read()).hexdigest() if os.path.exists(p) else None}\n"
        f"worker = next(n for n in nodes if n['NodeManagerAddress'] == '{cluster.ip['worker']}')\n"
        "pinned = look.options(scheduling_strategy=Pin(worker['NodeID'], soft=False))\n"
        f"print(json.dumps(ray.get(pinned.remote('{path}'))))\n",
        env=cluster.env,
    )


@pytest.mark.slow
def test_keep_set_reaches_the_worker_host_at_the_same_absolute_path(cluster, keep_dir):
    import hashlib

    path = keep_set_file(keep_dir)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    before = read_on_worker(cluster, path)
    assert before == {"files": [], "sha256": None}  # the worker host has its own, empty folder there
    push = [PYTHON, *CLUSTER, "push-keep-set", "--head", f"{cluster.ip['head']}:{PORT}", str(path)]
    proc = subprocess.run(cluster.cmd("head", *push), capture_output=True, text=True, env=cluster.env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reports = {r["node_ip"]: r for r in json.loads(proc.stdout)}
    assert reports[cluster.ip["head"]]["status"] == "present"  # the head has the file already
    assert reports[cluster.ip["worker"]]["status"] == "written"
    assert all(r["sha256"] == digest and r["path"] == str(path) for r in reports.values())
    assert read_on_worker(cluster, path) == {"files": ["keep.npy"], "sha256": digest}
    # A different file at that path on a host is not replaced silently.
    numpy.save(path, numpy.arange(0, 4096, 5, dtype=numpy.int64))
    proc = subprocess.run(cluster.cmd("head", *push), capture_output=True, text=True, env=cluster.env, timeout=300)
    assert proc.returncode == 1 and "already has a different" in proc.stderr
    assert read_on_worker(cluster, path)["sha256"] == digest
    proc = subprocess.run(cluster.cmd("head", *push, "--force"), capture_output=True, text=True, env=cluster.env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert read_on_worker(cluster, path)["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()


def serve_cmd(cluster, log: Path, *extra: str) -> list[str]:
    return cluster.cmd(
        "head", PYTHON, *CLUSTER, "serve", "--head", f"{cluster.ip['head']}:{PORT}", "--ip", cluster.ip["head"],
        "--iface", cluster.iface["head"], *extra, str(log), "--served-model-name", "tiny", "--no-enable-prefix-caching",
    )  # fmt: skip


@pytest.mark.slow
def test_serve_refuses_tp_over_ray_on_the_cpu_build_and_says_why(cluster, tiny_mtp_model, tmp_path):
    env = dict(cluster.env, MODEL=str(tiny_mtp_model), VLLM_PYTHON=PYTHON)
    proc = subprocess.run(serve_cmd(cluster, tmp_path / "serve.log"), capture_output=True, text=True, env=env)
    assert proc.returncode == 1
    assert "'cpu' platform, which has no Ray device key" in proc.stderr
    assert "current platform cpu does not support ray" in proc.stderr
    assert not (tmp_path / "serve.log").exists()  # refused before serve.sh and the weight load


@pytest.mark.slow
def test_tp2_over_ray_with_the_pruned_head_fails_in_vllm_there(cluster, tiny_mtp_model, keep_dir, tmp_path):
    path = keep_set_file(keep_dir)
    log = tmp_path / "serve.log"
    env = dict(
        cluster.env,
        MODEL=str(tiny_mtp_model),
        VLLM_PYTHON=PYTHON,
        MTP="3",
        DRAFT_VOCAB_PATH=str(path),
        PLE="0",
        MAX_MODEL_LEN="2048",
        MEMGUARD="0",
    )
    proc = subprocess.run(
        serve_cmd(cluster, log, "--skip-platform-check", "--force"), capture_output=True, text=True, env=env,
        timeout=900,
    )  # fmt: skip
    text = log.read_text()
    assert proc.returncode != 0, text[-3000:]
    assert "on node " + cluster.ip["worker"] in proc.stderr  # the keep-set went to the worker host first
    command = next(line for line in text.splitlines() if line.startswith("# command:"))
    assert "--tensor-parallel-size 2 --distributed-executor-backend ray" in command
    assert "draft_vocab_path" in command and str(path) in command
    assert "ValueError: current platform cpu does not support ray." in text, text[-3000:]
