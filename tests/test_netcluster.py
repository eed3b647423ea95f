"""The emulated cluster (src/netcluster) really shapes its links and always cleans up.

Why these tests: every slow-link benchmark figure rests on the link being what it claims. So
the rate and the delay are measured with real TCP traffic between two node namespaces, the
teardown is checked after a normal exit, an exception and SIGTERM, and a 2-node torchrun job
must all-reduce the right sum over the emulated link. Tests that need namespaces skip (with
the reason) where they cannot be made: not root, no iproute2, a kernel without veth or tbf.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import netcluster
from netcluster import NetCluster
from netcluster import torchrun as netcluster_torchrun
from netcluster.stats import link_health

OK, WHY = netcluster.available()
needs_netns = pytest.mark.skipif(not OK, reason=f"emulated cluster unavailable: {WHY}")

# The servers' prologue: listen on port argv[2], say so, take one connection without Nagle.
ACCEPT_ONE = textwrap.dedent("""
    import socket, sys, time
    port = int(sys.argv[2])
    lsock = socket.socket()
    lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    lsock.bind(("0.0.0.0", port))
    lsock.listen(1)
    print("listening", flush=True)
    conn, _ = lsock.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
""")

RECEIVER = ACCEPT_ONE + textwrap.dedent("""
    skip = int(sys.argv[1])
    while True:  # echo single bytes until the sender says "go"
        b = conn.recv(1)
        if b == b"g":
            break
        conn.sendall(b)
    got, t_skip, n_skip = 0, None, 0
    while True:
        chunk = conn.recv(1 << 20)
        if not chunk:
            break
        got += len(chunk)
        if t_skip is None and got >= skip:  # leave out TCP slow start and tbf's burst
            t_skip, n_skip = time.monotonic(), got
    end = time.monotonic()
    print(f"{got} {(got - n_skip) * 8 / (end - t_skip)}", flush=True)
""")

# The clients' prologue: connect to argv[1]:argv[2] without Nagle; argv[3] is a size.
CONNECT = textwrap.dedent("""
    import socket, sys, time
    addr, port, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    s = socket.create_connection((addr, port))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
""")

SENDER = CONNECT + textwrap.dedent("""
    rtts = []
    for _ in range(7):
        t = time.perf_counter()
        s.sendall(b"x")
        assert s.recv(1) == b"x"
        rtts.append(time.perf_counter() - t)
    s.sendall(b"g" + b"\\0" * size)
    s.close()
    print(min(rtts), flush=True)
""")


# Request-response after an idle spell: the client sends `size` bytes, the server answers one
# byte once it has them all. Prints the fastest of a few rounds, in seconds.
SMALL_SERVER = ACCEPT_ONE + textwrap.dedent("""
    size = int(sys.argv[1])
    while True:
        got = 0
        while got < size:
            chunk = conn.recv(size - got)
            if not chunk:
                sys.exit(0)
            got += len(chunk)
        conn.sendall(b"k")
""")

SMALL_CLIENT = CONNECT + textwrap.dedent("""
    times = []
    for _ in range(6):
        time.sleep(0.3)  # idle: a token bucket would be full again
        t = time.perf_counter()
        s.sendall(b"x" * size)
        assert s.recv(1) == b"k"
        times.append(time.perf_counter() - t)
    print(min(times[1:]), flush=True)  # the first round also grows TCP's window
""")


def serve_and_run(cluster: NetCluster, server: str, client: str, server_arg: str,
                  client_arg: str, port: int = 5001) -> tuple[bytes, bytes]:
    """Run ``server`` on node 1 (argv: server_arg, port), then ``client`` on node 0 (argv:
    node 1's address, port, client_arg); both must exit 0. Returns their outputs."""
    srv = cluster.run_on_node(1, [sys.executable, "-c", server, server_arg, str(port)],
                              stdout=subprocess.PIPE)
    assert srv.stdout is not None
    assert srv.stdout.readline().strip() == b"listening"
    cli = cluster.run_on_node(
        0, [sys.executable, "-c", client, cluster.node_addr(1), str(port), client_arg],
        stdout=subprocess.PIPE)
    out_client, _ = cli.communicate(timeout=60)
    out_server, _ = srv.communicate(timeout=60)
    assert cli.returncode == 0 and srv.returncode == 0
    return out_server, out_client


def root_links() -> str:
    return subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout


def test_units() -> None:
    assert netcluster.parse_rate("100mbit") == 1e8
    assert netcluster.parse_rate("1gbit") == 1e9
    assert netcluster.parse_rate("2mbps") == 16e6
    assert netcluster.parse_delay("20ms") == pytest.approx(0.02)
    assert netcluster.parse_delay("0") == 0.0
    with pytest.raises(ValueError):
        netcluster.parse_rate("fast")
    assert netcluster_torchrun.threads_per_worker(4, cores=2) == 1
    assert netcluster_torchrun.threads_per_worker(1, cores=2) == 2


@needs_netns
def test_rate_and_delay_are_measured_on_the_link() -> None:
    rate_bps, delay_s, size, skip = 20e6, 0.020, 4_000_000, 1_000_000
    with NetCluster(2, rate="20mbit", delay="20ms") as cluster:
        names = list(cluster.namespaces)
        assert set(names) <= set(netcluster.list_namespaces())
        out_r, out_s = serve_and_run(cluster, RECEIVER, SENDER, str(skip), str(size))
        backend = cluster.backend
        health = link_health(cluster)
    rtt = float(out_s.split()[-1])
    got, measured_bps = (float(x) for x in out_r.split())
    assert got == size
    # One-way delay 20 ms each way: RTT >= 40 ms, plus little more (user-space switch, stack).
    assert 2 * delay_s * 0.97 <= rtt <= 2 * delay_s + 0.015, (rtt, backend)
    assert abs(measured_bps - rate_bps) <= 0.35 * rate_bps, (measured_bps, backend)
    # The kernel's counters are read in each node's namespace, the switch's CPU from /proc.
    for node in ("node0", "node1"):
        assert set(health[node]["tcp"]) >= {"RetransSegs", "TCPTimeouts"}, health
        assert health[node]["node_qdisc_drops"] is not None, health
    if backend == "forwarder":
        assert health["forwarder_cpu_s"] > 0, health  # it forwarded every frame
    left = set(netcluster.list_namespaces())
    assert not set(names) & left
    assert cluster.prefix not in root_links()


def idle_round_trip(rate: str, delay: str, size: int) -> float:
    """Seconds for ``size`` bytes from node 0 to node 1 and a 1-byte reply after an idle
    spell (SMALL_CLIENT's best round); skips unless the forwarder models the wire."""
    with NetCluster(2, rate=rate, delay=delay) as cluster:
        if cluster.backend != "forwarder":
            pytest.skip(f"the {cluster.backend} backend leaves the wire's timing to the kernel")
        _, out = serve_and_run(cluster, SMALL_SERVER, SMALL_CLIENT, str(size), str(size))
    return float(out.split()[-1])


@needs_netns
def test_a_small_message_pays_its_bytes_on_an_idle_link() -> None:
    """A 48 KB message fits in tbf's bucket, which would let it cross an idle link in the
    delay alone; on a real 20 Mbit/s link it takes 19 ms more. The forwarder serializes it."""
    rate_bps, delay_s, size = 20e6, 0.005, 48_000
    took = idle_round_trip("20mbit", "5ms", size)
    serialization = size * 8 / rate_bps  # 19.2 ms, framing not counted
    assert 2 * delay_s + 0.95 * serialization <= took <= 2 * delay_s + 1.5 * serialization + 0.01, \
        took


def test_the_forwarders_timer_wakes_it_when_a_frame_falls_due() -> None:
    """The forwarder sleeps in epoll until the next frame falls due. epoll's own timeout has
    millisecond resolution and Python rounds it up, so a frame due in 0.3 ms left 0.7 ms late
    and frames 0.12 ms apart (1500 bytes at 100 Mbit/s) in millisecond batches. Its timerfd
    wakes it at the due time. Best of 20 waits of 0.3 ms, measured: 0.04 ms late with the
    timer, 0.80 ms late with epoll's timeout."""
    import select
    import time

    from netcluster.forwarder import WakeTimer

    timer = WakeTimer()
    assert timer.fd is not None, "timerfd_create through libc failed"
    ep = select.epoll()
    ep.register(timer.fd, select.EPOLLIN)
    lateness = []
    for _ in range(20):
        due = time.monotonic() + 0.0003
        timer.arm(due)
        events = ep.poll(1.0)
        woke = time.monotonic()
        assert [fd for fd, _ in events] == [timer.fd]
        assert woke >= due
        lateness.append(woke - due)
        timer.clear()
    ep.close()
    assert min(lateness) < 0.0003, lateness


@needs_netns
def test_a_message_is_not_held_much_longer_than_the_link_model_says() -> None:
    """End to end, coarsely (a busy 2-core machine adds scheduling noise): a 12 KB round trip
    on 100 Mbit/s and 1 ms, 2.96 ms in the model, measured 3.50-3.53 ms with the forwarder's
    timer (3 runs; the rest is both nodes' network stacks and the Python processes at each
    end) and once 3.86 ms in a full test run. 12 KB: after an idle spell TCP restarts from its
    initial window, which a larger message overflows."""
    rate_bps, delay_s, size = 100e6, 0.001, 12_000
    model = 2 * delay_s + size * 8 / rate_bps
    took = idle_round_trip("100mbit", "1ms", size)
    for _ in range(2):
        if took > model + 0.002:
            # A scheduling hiccup of the shared machine (once 5.1 ms in a full run under load):
            # a forwarder that holds messages would be late every time; best of three.
            took = min(took, idle_round_trip("100mbit", "1ms", size))
    assert model <= took <= model + 0.002, took


@needs_netns
def test_teardown_when_the_body_raises() -> None:
    cluster = NetCluster(3, rate="50mbit", delay="2ms")
    with pytest.raises(RuntimeError, match="boom"), cluster:
        names = list(cluster.namespaces)
        assert len(names) == 4  # switch + 3 nodes
        sleeper = cluster.run_on_node(0, ["sleep", "60"])
        raise RuntimeError("boom")
    assert not set(names) & set(netcluster.list_namespaces())
    assert sleeper.poll() is not None  # processes on the nodes were stopped
    assert "nc-n" not in root_links() and "nc-s" not in root_links()


@needs_netns
def test_teardown_on_sigterm() -> None:
    code = textwrap.dedent("""
        import json, time
        from netcluster import NetCluster
        with NetCluster(2, rate="10mbit", delay="5ms") as c:
            sleeper = c.run_on_node(1, ["sleep", "60"])
            print(json.dumps({"ns": c.namespaces, "pid": sleeper.pid}), flush=True)
            time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    info = json.loads(proc.stdout.readline())
    assert set(info["ns"]) <= set(netcluster.list_namespaces())
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 128 + signal.SIGTERM
    assert not set(info["ns"]) & set(netcluster.list_namespaces())
    with pytest.raises(ProcessLookupError):
        os.kill(info["pid"], 0)


@needs_netns
def test_cleanup_removes_runs_whose_owner_is_dead() -> None:
    dead = 4_000_000 + os.getpid() % 100_000  # above pid_max's default: never a live pid
    if os.path.exists(f"/proc/{dead}"):
        pytest.skip("the made-up pid is alive")
    stale = f"{netcluster.ROOT_PREFIX}{dead}-abcdef-n0"
    live = f"{netcluster.ROOT_PREFIX}{os.getpid()}-abcdef-n0"
    for ns in (stale, live):
        subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        removed = netcluster.cleanup()
        names = netcluster.list_namespaces()
        assert stale in removed and stale not in names
        assert live in names  # the owner (this test) is alive: not touched
    finally:
        for ns in (stale, live):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


ALL_REDUCE = textwrap.dedent("""
    import json, os, sys
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, {k: os.environ.get(k) for k in (
        "RANK", "GROUP_RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GLOO_SOCKET_IFNAME",
        "OMP_NUM_THREADS")})
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump({"sum": t.item(), "workers": rows}, f)
    dist.barrier()
    dist.destroy_process_group()
""")


@pytest.mark.slow
@needs_netns
def test_torchrun_all_reduce_across_two_nodes(tmp_path: Path) -> None:
    script, out = tmp_path / "all_reduce.py", tmp_path / "out.json"
    script.write_text(ALL_REDUCE)
    with NetCluster(2, rate="100mbit", delay="1ms") as cluster:
        result = netcluster_torchrun.launch_torchrun(cluster, 1, [str(script), str(out)],
                                                     timeout_s=120)
        sent = int(subprocess.run(
            ["ip", "netns", "exec", cluster.node_ns(0), "cat",
             f"/sys/class/net/{cluster.node_ifname(0)}/statistics/tx_bytes"],
            capture_output=True, text=True, check=True).stdout)
    assert result.ok, "\n".join(o[-2000:] for o in result.output)
    data = json.loads(out.read_text())
    assert data["sum"] == 3.0  # ranks 0 and 1 contribute 1 + 2
    workers = sorted(data["workers"], key=lambda w: int(w["RANK"]))
    assert [w["GROUP_RANK"] for w in workers] == ["0", "1"]  # one rank per node
    assert [w["GLOO_SOCKET_IFNAME"] for w in workers] == ["nc-n0", "nc-n1"]
    assert all(w["LOCAL_WORLD_SIZE"] == "1" and w["OMP_NUM_THREADS"] for w in workers)
    assert sent > 0  # the job talked over node 0's shaped link
