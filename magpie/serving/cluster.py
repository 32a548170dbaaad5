#!/usr/bin/env python3
"""Two DGX Sparks (or any two hosts), tensor parallel over Ray: the head and worker roles, the
network settings every process needs, the keep-set on every host, and the server.

    node2$ python3 magpie cluster worker --head 192.168.100.10 --ip 192.168.100.11 --iface enp1s0f1np1
    node1$ python3 magpie cluster head --ip 192.168.100.10 --iface enp1s0f1np1
    node1$ MODEL=/models/Qwen3.8-Flash-Next-NVFP4 DRAFT_VOCAB_PATH=/models/keep.npy \\
           python3 magpie cluster serve --head 192.168.100.10 --ip 192.168.100.10 --iface enp1s0f1np1 LOG

Roles:
- `head` / `worker` run `ray start --block` in the foreground with the settings below in its
  environment (Ray's worker processes, and so vLLM's TP workers, inherit the environment of the
  `ray start` that started their node), until Ctrl-C / SIGTERM, which stops that node.
- `serve` (on the head, once every node has joined) checks that the cluster has `--tp` nodes and
  that the vLLM being served can use Ray at all, copies the keep-set (DRAFT_VOCAB_PATH) to the
  same absolute path on every node, then runs serve.sh with `--tensor-parallel-size TP
  --distributed-executor-backend ray` and the same network settings.
- `push-keep-set PATH` does the copy alone; `env` prints the settings as `export` lines.
- `check` (on the head) compares the hosts before TP: vLLM, series and patch hashes, checkpoint
  (a cached hash manifest), keep-set, link MTU, clocks, and an all-reduce bandwidth/latency test;
  it refuses (exit 1, one line) when any differs. magpie/serving/cluster_check.py has the details.

The settings (as NVIDIA's DGX Spark playbook and the community's cluster scripts set them, for
the QSFP link between the Sparks, e.g. enp1s0f1np1): VLLM_HOST_IP=--ip; NCCL_SOCKET_IFNAME,
GLOO_SOCKET_IFNAME, TP_SOCKET_IFNAME, UCX_NET_DEVICES and OMPI_MCA_btl_tcp_if_include=--iface
(else NCCL and Gloo may pick the 10 GbE management port); MASTER_ADDR=the head's IP;
NCCL_IB_HCA=--ib-hca (`auto`: the RDMA devices of --iface, from /sys/class/net/IFACE/device/
infiniband; on a GB10 list both RoCE "twins" of the cabled port, e.g. rocep1s0f1,roceP2p1s0f1,
for the full 200 Gb/s); RAY_memory_monitor_refresh_ms=0 (Ray's monitor counts the GPU's
unified-memory allocations as host memory and kills workers; the memory guard watches instead).

The keep-set: the mtp_pruning patch puts `draft_vocab_path` into the speculative config, which
vLLM hands to every worker, but each worker opens that path on its own host. So the launcher
sends the file's bytes through Ray to every node and writes them at the same absolute path
there (atomically, checked by SHA-256; an existing different file is refused without --force):
a path that only the head has is never handed to a worker.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

from magpie import cli, tool_command, tool_env
from magpie.serving import cluster_check

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_PORT = 6379


# --------------------------------------------------------------------------------------------
# Settings


def rdma_devices(iface: str) -> list[str]:
    """RDMA (RoCE / InfiniBand) devices behind a network interface, from sysfs."""
    folder = f"/sys/class/net/{iface}/device/infiniband"
    try:
        return sorted(os.listdir(folder))
    except OSError:
        return []


def cluster_env(ip: str, iface: str, head_ip: str, ib_hca: str = "auto") -> dict[str, str]:
    env = {
        "VLLM_HOST_IP": ip,
        "NCCL_SOCKET_IFNAME": iface,
        "GLOO_SOCKET_IFNAME": iface,
        "TP_SOCKET_IFNAME": iface,
        "UCX_NET_DEVICES": iface,
        "OMPI_MCA_btl_tcp_if_include": iface,
        "MASTER_ADDR": head_ip,
        "RAY_memory_monitor_refresh_ms": "0",
        "RAY_USAGE_STATS_ENABLED": "0",
    }
    hca = ",".join(rdma_devices(iface)) if ib_hca == "auto" else ib_hca
    if hca:
        env["NCCL_IB_HCA"] = hca
    return env


def check_interface(iface: str, ip: str) -> None:
    """Refuse an interface that does not exist or does not hold --ip (the usual slip: the
    management port's address with the QSFP interface, or the other way round)."""
    if not os.path.exists(f"/sys/class/net/{iface}"):
        present = ", ".join(sorted(os.listdir("/sys/class/net")))
        raise SystemExit(f"error: --iface {iface}: no such network interface here (present: {present})")
    try:
        shown = subprocess.run(["ip", "-o", "addr", "show", "dev", iface], capture_output=True, text=True).stdout
    except OSError:
        return  # no iproute2: the interface exists, trust --ip
    addresses = re.findall(r"inet6? ([0-9a-fA-F.:]+)/", shown)
    if addresses and ip not in addresses:
        raise SystemExit(
            f"error: --ip {ip} is not an address of --iface {iface} (it has {', '.join(addresses)}); give the "
            "address of the link between the hosts"
        )


def split_address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":") if ":" in text else (text, "", str(DEFAULT_PORT))
    if not host or not port.isdigit():
        raise SystemExit(f"error: --head {text!r}: expected IP or IP:PORT")
    return host, int(port)


def ray_executable() -> str:
    """`ray` of this Python's environment (the one that has vLLM and Ray), else the one on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "ray")
    found = beside if os.access(beside, os.X_OK) else shutil.which("ray")
    if not found:
        raise SystemExit(
            f"error: no `ray` next to {sys.executable} or on PATH: install Ray into the vLLM environment "
            "(vLLM 0.29's tests pin ray==2.56.1)"
        )
    return found


# --------------------------------------------------------------------------------------------
# Running a command in the foreground, stopped with its process group


def run_foreground(cmd: list[str], env: dict[str, str]) -> int:
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)

    def forward(signum, _frame):
        try:
            os.killpg(proc.pid, signum)
        except ProcessLookupError:
            pass

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    code = proc.wait()
    return code if code >= 0 else 128 - code


def node_command(args, head: bool) -> list[str]:
    cmd = [ray_executable(), "start", "--block", "--node-ip-address", args.ip, "--disable-usage-stats"]
    if head:
        cmd += ["--head", "--port", str(args.port), "--include-dashboard", "false"]
    else:
        host, port = split_address(args.head)
        cmd += ["--address", f"{host}:{port}"]
    if args.num_gpus is not None:
        cmd += ["--num-gpus", str(args.num_gpus)]
    if args.num_cpus is not None:
        cmd += ["--num-cpus", str(args.num_cpus)]
    return cmd + list(args.ray_arg)


def start_node(args, head: bool) -> int:
    check_interface(args.iface, args.ip)
    head_ip = args.ip if head else split_address(args.head)[0]
    settings = cluster_env(args.ip, args.iface, head_ip, args.ib_hca)
    cmd = node_command(args, head)
    if args.memguard:
        cmd = tool_command(
            sys.executable, "magpie.serving.memguard", "run", "--min-available", args.memguard, "--", *cmd
        )
    role = "head" if head else "worker"
    print(f"cluster.py {role}: {' '.join(f'{k}={v}' for k, v in settings.items())}", file=sys.stderr, flush=True)
    print(f"cluster.py {role}: {' '.join(cmd)}", file=sys.stderr, flush=True)
    # This checkout first on PYTHONPATH: the node's Ray workers import magpie for `cluster check`.
    return run_foreground(cmd, tool_env(dict(os.environ, **settings)))


# --------------------------------------------------------------------------------------------
# The cluster, seen from the head


def connect(address: str):
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    return ray


def alive_nodes(ray) -> list[dict]:
    return [n for n in ray.nodes() if n.get("Alive")]


def push_keep_set(ray, path: str, force: bool = False) -> list[dict]:
    """Write `path`'s bytes at the same absolute path on every alive node; one report per node."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if not os.path.isabs(path):
        raise SystemExit(f"error: keep-set {path!r}: give an absolute path (each node opens the same path)")
    with open(path, "rb") as f:
        data = f.read()
    digest = hashlib.sha256(data).hexdigest()

    # Defined here so that Ray ships the function by value: the nodes need no copy of this file.
    def store(target: str, payload: bytes, sha256: str, overwrite: bool) -> dict:
        import hashlib as _hashlib
        import os as _os
        import socket as _socket

        report = {"host": _socket.gethostname(), "pid": _os.getpid(), "path": target}
        if _os.path.exists(target):
            with open(target, "rb") as existing:
                present = _hashlib.sha256(existing.read()).hexdigest()
            if present == sha256:
                return dict(report, status="present", sha256=present)
            if not overwrite:
                return dict(report, status="refused", sha256=present)
        _os.makedirs(_os.path.dirname(target), exist_ok=True)
        tmp = f"{target}.tmp-{_os.getpid()}"
        # magpie.files.atomic_write_bytes, inlined: the nodes may have no magpie package.
        try:
            with open(tmp, "wb") as out:
                out.write(payload)
                out.flush()
                _os.fsync(out.fileno())
            _os.replace(tmp, target)
        except BaseException:
            if _os.path.exists(tmp):
                _os.unlink(tmp)
            raise
        with open(target, "rb") as written:
            check = _hashlib.sha256(written.read()).hexdigest()
        return dict(report, status="written" if check == sha256 else "corrupt", sha256=check)

    remote = ray.remote(num_cpus=0)(store)
    payload = ray.put(data)
    nodes = alive_nodes(ray)
    refs = [
        remote.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=n["NodeID"], soft=False)).remote(
            path, payload, digest, force
        )
        for n in nodes
    ]
    reports = []
    for node, report in zip(nodes, ray.get(refs, timeout=300), strict=True):
        reports.append(dict(report, node_id=node["NodeID"], node_ip=node["NodeManagerAddress"], expected=digest))
    return reports


def vllm_ray_support(python: str) -> tuple[str, str]:
    """(platform device name, Ray device key) of the vLLM that `python` imports."""
    code = (
        "import json; from vllm.platforms import current_platform as p; "
        "print(json.dumps([p.device_name, p.ray_device_key]))"
    )
    proc = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"error: {python} cannot import vLLM's platform: {proc.stderr.strip()[-500:]}")
    device, key = json.loads(proc.stdout.strip().splitlines()[-1])
    return device, key


def serve(args, vllm_args: list[str]) -> int:
    check_interface(args.iface, args.ip)
    host, port = split_address(args.head)
    python = os.environ.get("VLLM_PYTHON") or sys.executable
    if not args.skip_platform_check:
        device, key = vllm_ray_support(python)
        if not key:
            raise SystemExit(
                f"error: the vLLM of {python} runs on its {device!r} platform, which has no Ray device key "
                "(Platform.ray_device_key is empty): vllm/v1/executor/ray_utils.py refuses Ray there "
                f"('current platform {device} does not support ray'), so tensor parallel over Ray cannot start. "
                "Serve with a CUDA build (ray_device_key 'GPU'); --skip-platform-check tries anyway"
            )
    ray = connect(f"{host}:{port}")
    nodes = alive_nodes(ray)
    if len(nodes) < args.tp:
        raise SystemExit(
            f"error: the Ray cluster at {host}:{port} has {len(nodes)} node(s), --tp {args.tp} needs {args.tp}: "
            "start `cluster.py worker` on the other host(s) first"
        )
    keep_set = os.environ.get("DRAFT_VOCAB_PATH")
    if keep_set:
        reports = push_keep_set(ray, keep_set, args.force)
        print_reports(reports)
        if any(r["status"] not in ("written", "present") for r in reports):
            ray.shutdown()
            return 1
    ray.shutdown()
    settings = cluster_env(args.ip, args.iface, host, args.ib_hca)
    env = dict(os.environ, **settings, RAY_ADDRESS=f"{host}:{port}")
    cmd = ["bash", os.path.join(HERE, "serve.sh"), args.log]
    cmd += ["--tensor-parallel-size", str(args.tp), "--distributed-executor-backend", "ray", *vllm_args]
    print(f"cluster.py serve: {' '.join(cmd)}", file=sys.stderr, flush=True)
    return run_foreground(cmd, env)


def print_reports(reports: list[dict]) -> None:
    for r in reports:
        print(
            f"keep-set {r['path']} on node {r['node_ip']} ({r['host']}, {r['node_id'][:12]}): {r['status']}, "
            f"sha256 {r['sha256'][:16]}",
            file=sys.stderr,
        )
        if r["status"] == "refused":
            print(
                f"error: node {r['node_ip']} already has a different {r['path']}; pass --force to replace it",
                file=sys.stderr,
            )


# --------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = cli.parser("magpie cluster", __doc__)
    roles = parser.add_subparsers(dest="role", required=True)

    def network(p, head_required: bool):
        p.add_argument("--ip", required=True, help="this host's address on the link between the hosts")
        p.add_argument("--iface", required=True, help="the network interface of that link (e.g. enp1s0f1np1)")
        p.add_argument(
            "--ib-hca", default="auto", help="NCCL_IB_HCA: RDMA devices, or auto / '' (default: %(default)s)"
        )
        if head_required:
            p.add_argument("--head", required=True, metavar="IP[:PORT]", help=f"the head node (port {DEFAULT_PORT})")

    def node(p):
        p.add_argument("--num-gpus", type=int, help="GPUs this node offers Ray (default: Ray detects them)")
        p.add_argument("--num-cpus", type=int, help="CPUs this node offers Ray (default: Ray detects them)")
        p.add_argument("--memguard", metavar="SIZE", default="",
                       help="run the node under memguard.py --min-available SIZE (default: off)")  # fmt: skip
        p.add_argument("--ray-arg", action="append", default=[], help="more `ray start` arguments (repeatable)")

    head = roles.add_parser("head", help="start the Ray head node in the foreground")
    network(head, False)
    head.add_argument("--port", type=int, default=DEFAULT_PORT, help="Ray's GCS port (default: %(default)s)")
    node(head)
    worker = roles.add_parser("worker", help="join the head as a Ray worker node, in the foreground")
    network(worker, True)
    node(worker)
    srv = roles.add_parser("serve", help="serve.sh over the Ray cluster, tensor parallel (on the head)")
    network(srv, True)
    srv.add_argument("--tp", type=int, default=2, help="tensor-parallel size = nodes needed (default: %(default)s)")
    srv.add_argument("--force", action="store_true", help="replace a different keep-set file on a node")
    srv.add_argument("--skip-platform-check", action="store_true", help="start even if vLLM's platform lacks Ray")
    srv.add_argument("log", metavar="LOG", help="serve.sh's log file")
    push = roles.add_parser("push-keep-set", help="copy a file to the same absolute path on every node")
    push.add_argument("--head", required=True, metavar="IP[:PORT]", help="the head node")
    push.add_argument("--force", action="store_true", help="replace a different file on a node")
    push.add_argument("path", help="absolute path of the keep-set (any file)")
    chk = roles.add_parser("check", help="compare the hosts and test the link before TP (on the head)")
    cluster_check.add_arguments(chk, DEFAULT_PORT)
    env = roles.add_parser("env", help="print the network settings as export lines")
    network(env, False)
    env.add_argument("--head", metavar="IP", help="the head's address (default: --ip)")

    args, rest = parser.parse_known_args(argv)
    if rest and args.role != "serve":
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.role == "env":
        for key, value in cluster_env(args.ip, args.iface, args.head or args.ip, args.ib_hca).items():
            print(f"export {key}={value}")
        return 0
    if args.role in ("head", "worker"):
        return start_node(args, args.role == "head")
    if args.role == "check":
        args.head_ip, args.port = split_address(args.head)
        return cluster_check.run(args, connect)
    if args.role == "push-keep-set":
        host, port = split_address(args.head)
        try:
            ray = cluster_check.connect_bounded(connect, host, port, 30.0)
        except (ConnectionError, TimeoutError) as e:
            print(f"error: cluster push-keep-set: no Ray cluster at {host}:{port}: {e}", file=sys.stderr, flush=True)
            os._exit(1)
        reports = push_keep_set(ray, os.path.abspath(args.path), args.force)
        ray.shutdown()
        print_reports(reports)
        print(json.dumps(reports, indent=1))
        return 0 if all(r["status"] in ("written", "present") for r in reports) else 1
    started = time.monotonic()
    code = serve(args, rest)
    print(f"cluster.py serve: serve.sh exited with {code} after {time.monotonic() - started:.0f} s", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
