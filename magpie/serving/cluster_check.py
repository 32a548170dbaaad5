"""`cluster check`: are the hosts of a Ray cluster the same where TP=2 needs them to be?

Run on the head once every node has joined (`cluster head` / `cluster worker`, which put this
checkout on PYTHONPATH of each node's Ray workers, so each node answers with its own copy):

    node1$ python3 magpie cluster check --head 192.168.100.10 \\
           --model /models/Qwen3.8-Flash-Next-NVFP4 --keep-set /models/keep.npy

Each node reports, from a Ray task pinned to it:
- vLLM: the version its Python imports, and the patch tool's status of that vLLM (the series
  folder's file list, each patch's state and the SHA-256 of each patch file and of `series`);
- the checkpoint: a hash manifest of every file under --model (size and SHA-256; a file whose
  size and mtime match the cached entry is not read again: the cache lives in --manifest-cache,
  one JSON file per checkpoint folder, keyed by its path, device and inode);
- the keep-set: SHA-256 of the file at the same absolute path (absent is a mismatch:
  `cluster push-keep-set` copies it);
- the link: the interface in NCCL_SOCKET_IFNAME, whether it holds VLLM_HOST_IP, its MTU and its
  nominal speed (/sys/class/net/IFACE/speed, Mb/s), and the settings `cluster_env` gives a node;
- its clock, compared with the head's over the Ray call (offset = remote time minus the middle of
  the call; the error bound is half the call's round trip).

Then one process per node (two for --tp 2) runs torch.distributed all-reduce over Gloo between
the hosts, on the link interface: the latency of an 8-byte all-reduce (median) and the bandwidth
of a --bytes all-reduce (algorithm bandwidth = bus bandwidth for two ranks), in Gb/s, against the
link's nominal rate when sysfs knows it. Gloo runs on the CPU and TCP: it measures the link and
the hosts' network stacks, not NCCL over RoCE (the GPU path the served model takes).

Exit status 0 when everything compares equal, 1 with one line `error: cluster check: refusing
TP=N: ...` naming each mismatch; the table goes to stdout, the whole report to --json.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from magpie import ROOT, files

SCHEMA = files.schema("cluster-check", 1)
DEFAULT_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "magpie", "checkpoint-manifests")
CHUNK = 1 << 20


# --------------------------------------------------------------------------------------------
# One host's side (runs in a Ray task on each node)


def sha256_file(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


def manifest_cache_path(folder: str, cache_dir: str) -> str:
    """The cache file of a checkpoint folder: its path, device and inode make the key, so two
    copies at one path (another disk, another mount) never share entries."""
    st = os.stat(folder)
    key = hashlib.sha256(f"{os.path.abspath(folder)}\0{st.st_dev}\0{st.st_ino}".encode()).hexdigest()[:32]
    return os.path.join(cache_dir, f"{key}.json")


def checkpoint_manifest(folder: str, cache_dir: str = DEFAULT_CACHE) -> dict:
    """{path, files: {relative path: {size, mtime_ns, sha256}}, digest, read_bytes, cache}: every
    regular file under `folder` (symbolic links followed, as vLLM's loader does). A file whose
    size and mtime match its cached entry keeps the cached SHA-256 and is not read."""
    folder = os.path.abspath(folder)
    if not os.path.isdir(folder):
        return {"path": folder, "error": "no such folder"}
    cache_file = manifest_cache_path(folder, cache_dir)
    try:
        with open(cache_file) as f:
            cached = json.load(f).get("files", {})
    except (OSError, ValueError):
        cached = {}
    entries: dict[str, dict] = {}
    read_bytes = 0
    for top, dirs, names in os.walk(folder, followlinks=True):
        dirs.sort()
        for name in sorted(names):
            path = os.path.join(top, name)
            rel = os.path.relpath(path, folder)
            st = os.stat(path)
            old = cached.get(rel)
            if old and old.get("size") == st.st_size and old.get("mtime_ns") == st.st_mtime_ns:
                entries[rel] = old
                continue
            entries[rel] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha256_file(path)}
            read_bytes += st.st_size
    if entries != cached:
        try:
            os.makedirs(cache_dir, exist_ok=True)
            files.atomic_write_text(cache_file, json.dumps({"folder": folder, "files": entries}, indent=1) + "\n")
        except OSError as e:
            cache_file = f"(not written: {e.strerror})"
    digest = hashlib.sha256(
        "".join(f"{rel}\0{e['size']}\0{e['sha256']}\n" for rel, e in sorted(entries.items())).encode()
    ).hexdigest()
    return {"path": folder, "files": entries, "digest": digest, "read_bytes": read_bytes, "cache": cache_file}


def patch_report(python: str) -> dict:
    """The patch tool's status of the vLLM `python` imports, with each patch file's SHA-256."""
    proc = subprocess.run(
        [python, str(ROOT / "magpie"), "patches", "status", "--json", "--python", python],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines() or ["(no output)"]
        return {"error": lines[-1]}
    status = json.loads(proc.stdout)
    series = status["series"]
    hashes = {p["name"]: sha256_file(os.path.join(series, p["name"])) for p in status["patches"]}
    return {
        "vllm": status["target"]["version"],
        "series_folder": os.path.basename(series),
        "series_sha256": sha256_file(os.path.join(series, "series")),
        "states": {p["name"]: p["state"] for p in status["patches"]},
        "hashes": hashes,
    }


def link_report() -> dict:
    iface = os.environ.get("NCCL_SOCKET_IFNAME", "")
    ip = os.environ.get("VLLM_HOST_IP", "")
    report: dict = {"iface": iface, "ip": ip, "mtu": None, "speed_mbps": None, "has_ip": None}
    folder = f"/sys/class/net/{iface}"
    if not iface or not os.path.isdir(folder):
        report["error"] = f"NCCL_SOCKET_IFNAME={iface!r} is not an interface of this host"
        return report
    for key, name in (("mtu", "mtu"), ("speed_mbps", "speed")):
        try:
            with open(os.path.join(folder, name)) as f:
                value = int(f.read().strip())
            report[key] = value if value > 0 else None  # -1: the driver does not know (veth down, ...)
        except (OSError, ValueError):
            pass
    shown = subprocess.run(["ip", "-o", "addr", "show", "dev", iface], capture_output=True, text=True).stdout
    report["has_ip"] = f"inet {ip}/" in shown or f"inet6 {ip}/" in shown
    return report


SETTINGS = (
    "NCCL_SOCKET_IFNAME",
    "GLOO_SOCKET_IFNAME",
    "TP_SOCKET_IFNAME",
    "UCX_NET_DEVICES",
    "OMPI_MCA_btl_tcp_if_include",
    "VLLM_HOST_IP",
    "MASTER_ADDR",
    "RAY_memory_monitor_refresh_ms",
)


def host_report(model: str | None, keep_set: str | None, cache_dir: str) -> dict:
    """Everything one node says about itself (the Ray task's body)."""
    started = time.time()
    report = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "python": sys.executable,
        "magpie_root": str(ROOT),
        "settings": {key: os.environ.get(key) for key in SETTINGS},
        "link": link_report(),
        "patches": patch_report(sys.executable),
        "checkpoint": checkpoint_manifest(model, cache_dir) if model else None,
        "keep_set": None,
    }
    if keep_set:
        exists = os.path.isfile(keep_set)
        report["keep_set"] = {"path": keep_set, "sha256": sha256_file(keep_set) if exists else None}
    report["seconds"] = round(time.time() - started, 3)
    return report


def clock_now() -> float:
    return time.time()


def free_port(ip: str) -> int:
    with socket.socket() as s:
        s.bind((ip, 0))
        return s.getsockname()[1]


def allreduce_rank(rank: int, world: int, master: str, port: int, size_bytes: int, iterations: int) -> dict:
    """One rank of the all-reduce test, over Gloo (its interface: GLOO_SOCKET_IFNAME)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://{master}:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )
    try:
        small = torch.ones(2, dtype=torch.float32)  # 8 bytes
        for _ in range(3):
            dist.all_reduce(small)
        latencies = []
        for _ in range(20):
            t0 = time.perf_counter()
            dist.all_reduce(small)
            latencies.append(time.perf_counter() - t0)
        big = torch.ones(max(1, size_bytes // 4), dtype=torch.float32)
        dist.all_reduce(big)  # warm-up: connections, buffers
        dist.barrier()
        times = []
        for _ in range(iterations):
            t0 = time.perf_counter()
            dist.all_reduce(big)
            times.append(time.perf_counter() - t0)
        expected = float(world ** (iterations + 1))  # ones, summed over `world` ranks at every call
        correct = bool(torch.all(big == expected).item())
    finally:
        dist.destroy_process_group()
    return {
        "rank": rank,
        "latency_us": statistics.median(latencies) * 1e6,
        "seconds": times,
        "bytes": big.numel() * 4,
        "correct": correct,
    }


# --------------------------------------------------------------------------------------------
# The head's side


def pinned(ray, function, node_id: str):
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    remote = ray.remote(num_cpus=0)(function)
    return remote.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False))


def measure_clock(ray, node_id: str, samples: int = 5) -> dict:
    task = pinned(ray, clock_now, node_id)
    best = None
    for _ in range(samples):
        t0 = time.time()
        remote = ray.get(task.remote(), timeout=60)
        t1 = time.time()
        sample = {"offset_s": remote - (t0 + t1) / 2, "error_s": (t1 - t0) / 2}
        if best is None or sample["error_s"] < best["error_s"]:
            best = sample
    return best


def collective(ray, nodes: list[dict], master_ip: str, size_bytes: int, iterations: int) -> dict:
    port = ray.get(pinned(ray, free_port, nodes[0]["NodeID"]).remote(master_ip), timeout=60)
    refs = [
        pinned(ray, allreduce_rank, n["NodeID"]).remote(rank, len(nodes), master_ip, port, size_bytes, iterations)
        for rank, n in enumerate(nodes)
    ]
    try:
        ranks = ray.get(refs, timeout=600)
    except Exception as e:  # a rank that could not connect: the reason is the finding
        text = str(e).strip().splitlines()
        return {"error": next((line for line in reversed(text) if line.strip()), type(e).__name__)}
    # A collective ends for every rank at once; the slowest rank's time is the operation's.
    per_call = [max(r["seconds"][i] for r in ranks) for i in range(iterations)]
    seconds = statistics.median(per_call)
    nbytes = ranks[0]["bytes"]
    return {
        "backend": "gloo",
        "world_size": len(nodes),
        "bytes": nbytes,
        "iterations": iterations,
        "median_s": seconds,
        "gbps": nbytes * 8 / seconds / 1e9,
        "latency_us": max(r["latency_us"] for r in ranks),
        "correct": all(r["correct"] for r in ranks),
    }


def node_label(node: dict) -> str:
    return node["NodeManagerAddress"]


def compare(reports: dict[str, dict], head_ip: str, clocks: dict[str, dict], max_offset: float) -> list[str]:
    """The mismatches, each a short phrase naming what differs where."""
    problems: list[str] = []
    head = reports[head_ip]
    for ip, r in reports.items():
        if r["patches"].get("error"):
            problems.append(f"{ip}: the patch tool could not tell its vLLM's state ({r['patches']['error']})")
        link = r["link"]
        if link.get("error"):
            problems.append(f"{ip}: {link['error']}")
        elif link["has_ip"] is False:
            problems.append(f"{ip}: interface {link['iface']} does not hold VLLM_HOST_IP={link['ip']}")
        settings = r["settings"]
        iface = settings.get("NCCL_SOCKET_IFNAME")
        for key in ("GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME"):
            if settings.get(key) != iface:
                problems.append(f"{ip}: {key}={settings.get(key)} but NCCL_SOCKET_IFNAME={iface}")
        if settings.get("MASTER_ADDR") != head_ip:
            problems.append(f"{ip}: MASTER_ADDR={settings.get('MASTER_ADDR')}, not the head {head_ip}")
        if r["checkpoint"] and r["checkpoint"].get("error"):
            problems.append(f"{ip}: checkpoint {r['checkpoint']['path']}: {r['checkpoint']['error']}")
        if r["keep_set"] and r["keep_set"]["sha256"] is None:
            problems.append(f"{ip}: no keep-set at {r['keep_set']['path']} (cluster push-keep-set copies it)")
    for ip, r in reports.items():
        if ip == head_ip:
            continue
        a, b = head["patches"], r["patches"]
        if not a.get("error") and not b.get("error"):
            if a["vllm"] != b["vllm"]:
                problems.append(f"vLLM {a['vllm']} on {head_ip}, {b['vllm']} on {ip}")
            if list(a["hashes"]) != list(b["hashes"]) or a["series_sha256"] != b["series_sha256"]:
                only_a = [n for n in a["hashes"] if n not in b["hashes"]]
                only_b = [n for n in b["hashes"] if n not in a["hashes"]]
                detail = (
                    ", ".join([f"{n} only on {head_ip}" for n in only_a] + [f"{n} only on {ip}" for n in only_b])
                    or "the series file differs"
                )
                problems.append(f"patch series {a['series_folder']} differs: {detail}")
            for name in a["hashes"]:
                if name in b["hashes"] and a["hashes"][name] != b["hashes"][name]:
                    problems.append(
                        f"patch {name} differs: sha256 {a['hashes'][name][:12]} on {head_ip}, "
                        f"{b['hashes'][name][:12]} on {ip}"
                    )
                if name in b["states"] and a["states"][name] != b["states"][name]:
                    problems.append(f"patch {name} is {a['states'][name]} on {head_ip}, {b['states'][name]} on {ip}")
        ca, cb = head["checkpoint"], r["checkpoint"]
        if ca and cb and not ca.get("error") and not cb.get("error") and ca["digest"] != cb["digest"]:
            names = sorted(set(ca["files"]) | set(cb["files"]))
            differ = []
            for name in names:
                fa, fb = ca["files"].get(name), cb["files"].get(name)
                if fa is None or fb is None:
                    differ.append(f"{name} only on {head_ip if fb is None else ip}")
                elif (fa["size"], fa["sha256"]) != (fb["size"], fb["sha256"]):
                    differ.append(f"{name} (sha256 {fa['sha256'][:12]} on {head_ip}, {fb['sha256'][:12]} on {ip})")
            shown = ", ".join(differ[:3]) + (f" and {len(differ) - 3} more" if len(differ) > 3 else "")
            problems.append(f"checkpoint {ca['path']} differs: {shown}")
        ka, kb = head["keep_set"], r["keep_set"]
        if ka and kb and ka["sha256"] and kb["sha256"] and ka["sha256"] != kb["sha256"]:
            problems.append(
                f"keep-set {ka['path']} differs: sha256 {ka['sha256'][:12]} on {head_ip}, {kb['sha256'][:12]} on {ip}"
            )
        la, lb = head["link"], r["link"]
        if la.get("mtu") != lb.get("mtu"):
            problems.append(
                f"MTU {la.get('mtu')} on {head_ip} ({la['iface']}), {lb.get('mtu')} on {ip} ({lb['iface']})"
            )
        clock = clocks.get(ip)
        if clock and abs(clock["offset_s"]) - clock["error_s"] > max_offset:
            problems.append(
                f"clock of {ip} is {clock['offset_s']:+.3f} s off the head's (limit {max_offset:g} s; "
                "sync both with chrony/NTP)"
            )
    return problems


def short(value, width: int = 16) -> str:
    text = "-" if value is None else str(value)
    return text if len(text) <= width else text[: width - 1] + "~"


def table(reports: dict[str, dict], clocks: dict[str, dict], bench: dict | None) -> str:
    ips = list(reports)
    rows = [("", *ips)]

    def row(label, getter):
        rows.append((label, *(short(getter(reports[ip], ip)) for ip in ips)))

    row("host", lambda r, _: r["host"])
    row("vLLM", lambda r, _: r["patches"].get("vllm", r["patches"].get("error")))
    row("series", lambda r, _: r["patches"].get("series_sha256", "")[:12])
    for name in reports[ips[0]]["patches"].get("hashes", {}):
        row(
            name.split("/")[0] + "/" + name.split("/")[-1][:4],
            lambda r, _, n=name: " ".join(
                (r["patches"].get("states", {}).get(n, "-"), r["patches"].get("hashes", {}).get(n, "")[:6])
            ),
        )
    row("checkpoint", lambda r, _: r["checkpoint"] and r["checkpoint"].get("digest", "")[:12])
    row("  files", lambda r, _: r["checkpoint"] and len(r["checkpoint"].get("files", {})))
    row("  read now (B)", lambda r, _: r["checkpoint"] and r["checkpoint"].get("read_bytes"))
    row("keep-set", lambda r, _: r["keep_set"] and (r["keep_set"]["sha256"] or "absent")[:12])
    row("interface", lambda r, _: r["link"]["iface"])
    row("  MTU", lambda r, _: r["link"]["mtu"])
    row("  speed (Mb/s)", lambda r, _: r["link"]["speed_mbps"])
    row("clock offset (s)", lambda _, ip: f"{clocks[ip]['offset_s']:+.4f}" if ip in clocks else "0 (head)")
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    if bench is not None:
        if bench.get("error"):
            lines.append(f"all-reduce: failed: {bench['error']}")
        else:
            nominal = bench.get("nominal_gbps")
            against = ""
            if nominal:
                against = f", {100 * bench['gbps'] / nominal:.1f} % of the link's nominal {nominal:g} Gb/s"
            lines.append(
                f"all-reduce ({bench['backend']}, {bench['world_size']} ranks): {bench['bytes'] / 2**20:.0f} MiB in "
                f"{bench['median_s'] * 1e3:.1f} ms = {bench['gbps']:.2f} Gb/s{against}; 8-byte latency "
                f"{bench['latency_us']:.0f} us"
            )
    return "\n".join(lines)


def check(ray, args) -> tuple[dict, list[str]]:
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    head_ip = args.head_ip
    if len(nodes) < args.tp:
        return {"nodes": [node_label(n) for n in nodes]}, [
            f"the Ray cluster has {len(nodes)} node(s), TP={args.tp} needs {args.tp}: start `cluster worker` "
            "on the other host(s)"
        ]
    nodes.sort(key=lambda n: (node_label(n) != head_ip, node_label(n)))
    if node_label(nodes[0]) != head_ip:
        return {"nodes": [node_label(n) for n in nodes]}, [f"no Ray node at the head's address {head_ip}"]
    nodes = nodes[: args.tp]
    model = os.path.abspath(args.model) if args.model else None
    keep_set = os.path.abspath(args.keep_set) if args.keep_set else None
    refs = [pinned(ray, host_report, n["NodeID"]).remote(model, keep_set, args.manifest_cache) for n in nodes]
    try:
        found = ray.get(refs, timeout=3600)
    except Exception as e:
        lines = [line for line in str(e).splitlines() if line.strip()]
        reason = lines[-1] if lines else type(e).__name__
        if "No module named 'magpie'" in str(e):
            reason = (
                "a node's Ray workers cannot import magpie: restart its `cluster head` / `cluster worker` "
                "from a checkout of this version"
            )
        return {"nodes": [node_label(n) for n in nodes]}, [f"a node could not report: {reason}"]
    reports = {node_label(n): r for n, r in zip(nodes, found, strict=True)}
    clocks = {node_label(n): measure_clock(ray, n["NodeID"]) for n in nodes[1:]}
    problems = compare(reports, head_ip, clocks, args.max_clock_offset)
    bench = None
    if args.bytes > 0:
        bench = collective(ray, nodes, head_ip, args.bytes, args.iterations)
        speeds = [r["link"]["speed_mbps"] for r in reports.values()]
        if not bench.get("error"):
            bench["nominal_gbps"] = min(speeds) / 1000 if all(speeds) else None
            if not bench["correct"]:
                problems.append("the all-reduce returned wrong sums")
            if bench["gbps"] < args.min_gbps:
                problems.append(f"all-reduce bandwidth {bench['gbps']:.2f} Gb/s is under --min-gbps {args.min_gbps:g}")
        else:
            problems.append(f"the all-reduce between the hosts failed: {bench['error']}")
    return {"reports": reports, "clocks": clocks, "collective": bench}, problems


def connect_bounded(connect, host: str, port: int, timeout: float):
    """CONNECT(host:port) within TIMEOUT seconds, to that address only: a TCP connection to it is
    tried first (nothing listening: refused at once), then Ray's own connect runs in a thread while
    Ray's retry lines (its C++ core writes them to the standard error) go to a scratch file. Raises
    ConnectionError with one line when either fails or the time runs out."""
    address = f"{host}:{port}"
    try:
        with socket.create_connection((host, port), timeout=timeout):
            pass
    except OSError as e:
        why = "timed out" if isinstance(e, TimeoutError) else (e.strerror or str(e))
        raise ConnectionError(f"cannot reach {address} ({why} within {timeout:g} s)") from None
    os.environ["RAY_ADDRESS"] = address  # no other cluster (`auto`, an earlier session's) is tried
    with contextlib.suppress(ImportError):
        import ray  # noqa: F401 - imported outside the timed part: its import alone takes seconds
    outcome: list = []

    def attempt() -> None:
        try:
            outcome.append(connect(address))
        except BaseException as e:  # noqa: BLE001 - handed to the caller below
            outcome.append(e)

    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as scratch:
        os.dup2(scratch.fileno(), 2)
        try:
            thread = threading.Thread(target=attempt, daemon=True)
            thread.start()
            thread.join(timeout)
        finally:
            os.dup2(saved, 2)
            os.close(saved)
    if not outcome:
        raise TimeoutError(f"Ray at {address} did not accept the connection within {timeout:g} s (--connect-timeout)")
    if isinstance(outcome[0], BaseException):
        raise ConnectionError(f"{address}: {outcome[0]}".splitlines()[0])
    return outcome[0]


def run(args, connect) -> int:
    timeout = getattr(args, "connect_timeout", 30.0)
    try:
        ray = connect_bounded(connect, args.head_ip, args.port, timeout)
    except (ConnectionError, TimeoutError) as e:  # the address is the finding
        print(f"error: cluster check: no Ray cluster at {args.head_ip}:{args.port}: {e}", file=sys.stderr, flush=True)
        # Ray's connect may still retry in its own threads: end here, not when they give up.
        os._exit(1)
    try:
        data, problems = check(ray, args)
    finally:
        ray.shutdown()
    record = {"schema": SCHEMA, "ok": not problems, "problems": problems, "tp": args.tp, "head": args.head_ip, **data}
    if args.json:
        files.atomic_write_text(args.json, json.dumps(record, indent=1) + "\n")
    if "reports" in data:
        print(table(data["reports"], data["clocks"], data["collective"]))
    if problems:
        print(f"error: cluster check: refusing TP={args.tp}: {'; '.join(problems)}", file=sys.stderr)
        return 1
    print(f"cluster check: the {args.tp} hosts match; TP={args.tp} may start", file=sys.stderr)
    return 0


def add_arguments(p, default_port: int) -> None:
    from magpie import cli
    from magpie.serving import bounds

    p.add_argument("--head", required=True, metavar="IP[:PORT]", help=f"the head node (port {default_port})")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size = hosts to compare (default: %(default)s)")
    p.add_argument("--model", default=os.environ.get("MODEL"), help="checkpoint folder, the same path on each host "
                   "(default: $MODEL)")  # fmt: skip
    p.add_argument("--keep-set", default=os.environ.get("DRAFT_VOCAB_PATH"),
                   help="keep-set file, the same path on each host (default: $DRAFT_VOCAB_PATH)")  # fmt: skip
    p.add_argument("--manifest-cache", default=DEFAULT_CACHE, help="each host's cache of checkpoint hashes "
                   "(default: %(default)s)")  # fmt: skip
    p.add_argument("--max-clock-offset", type=float, default=0.5, help="seconds (default: %(default)s)")
    p.add_argument("--bytes", type=cli.parse_size, default="64MiB",
                   help="all-reduce size for the bandwidth test; 0 = no test (default: %(default)s)")  # fmt: skip
    p.add_argument("--iterations", type=int, default=5, help="timed all-reduces (default: %(default)s)")
    p.add_argument("--min-gbps", type=float, default=0.0, help="refuse under this bandwidth; 0 = report only "
                   "(default: %(default)s)")  # fmt: skip
    p.add_argument("--json", metavar="FILE", help="write the whole report here")
    p.add_argument("--connect-timeout", type=bounds.seconds(1, 600), default=30.0,
                   help="seconds to reach the head's Ray before giving up (default: %(default)s)")  # fmt: skip
