"""The user-space switch of an emulated cluster whose kernel lacks ``netem``: a delay line.

Started by ``netcluster.NetCluster`` inside the switch namespace as
``python netcluster_forwarder.py --delay-s D --ifaces nc-s0,nc-s1``; it prints "ready" once
every socket is bound and runs until SIGTERM. Rate limiting stays the kernel's (tbf); this
process only holds each frame for the one-way delay and switches it to the right port.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import select
import signal
import socket
import sys
import time
from collections.abc import Callable, Sequence

_ETH_P_ALL = 0x0003
_SOL_PACKET = 263
_PACKET_VNET_HDR = 15
_PACKET_IGNORE_OUTGOING = 23
_PACKET_OUTGOING = 4
_SO_RCVBUFFORCE = 33
_VNET_HDR_LEN = 10
_MAX_FRAME = 10 + 14 + 65536 + 64  # vnet header + Ethernet + the largest GSO frame


def forward(ifaces: Sequence[str], delay_s: float, stop: Callable[[], bool] = lambda: False,
            ready: Callable[[], None] = lambda: None) -> None:
    """A learning Ethernet switch between ``ifaces`` that holds every frame ``delay_s``.

    Runs in the switch namespace. Frames are read and written with their virtio-net header, so
    GSO super-frames and checksum offload state pass through untouched. Rate limiting is the
    kernel's (tbf on each interface's egress), since AF_PACKET sends go through the qdisc.
    The loop is kept lean (one clock read per wake-up, our own sends filtered by the kernel):
    it costs about a tenth of a core per 100 Mbit/s forwarded.
    """
    socks = []
    for name in ifaces:
        s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(_ETH_P_ALL))
        s.setsockopt(_SOL_PACKET, _PACKET_VNET_HDR, 1)
        with contextlib.suppress(OSError):  # Linux >= 4.20; else filtered below
            s.setsockopt(_SOL_PACKET, _PACKET_IGNORE_OUTGOING, 1)
        with contextlib.suppress(OSError):
            s.setsockopt(socket.SOL_SOCKET, _SO_RCVBUFFORCE, 8 << 20)
        s.bind((name, _ETH_P_ALL))
        s.setblocking(False)
        socks.append(s)
    by_fd = {s.fileno(): i for i, s in enumerate(socks)}
    ep = select.epoll()
    for s in socks:
        ep.register(s.fileno(), select.EPOLLIN)
    macs: dict[bytes, int] = {}
    queue: collections.deque[tuple[float, int, bytes]] = collections.deque()
    src_at, dst_at = slice(_VNET_HDR_LEN + 6, _VNET_HDR_LEN + 12), slice(_VNET_HDR_LEN,
                                                                          _VNET_HDR_LEN + 6)
    monotonic = time.monotonic
    ready()
    while not stop():
        timeout = 0.5 if not queue else max(0.0, queue[0][0] - monotonic())
        events = ep.poll(timeout)
        now = monotonic()
        for fd, _ in events:
            port = by_fd[fd]
            recvfrom = socks[port].recvfrom
            while True:
                try:
                    data, addr = recvfrom(_MAX_FRAME)
                except BlockingIOError:
                    break
                except OSError:
                    break  # e.g. the interface went down at teardown
                if addr[2] == _PACKET_OUTGOING:
                    continue
                macs[data[src_at]] = port
                queue.append((now + delay_s, port, data))
        if not queue or queue[0][0] > now:
            continue
        while queue and queue[0][0] <= now:
            _, port, data = queue.popleft()
            dst = data[dst_at]
            out = None if dst[0] & 1 else macs.get(dst)
            for t in ([out] if out is not None else range(len(socks))):
                if t == port:
                    continue
                # A full egress queue drops the frame (ENOBUFS), as a switch would; TCP
                # recovers. Any other error (interface gone at teardown) also just drops it.
                with contextlib.suppress(OSError):
                    socks[t].send(data)


def _run_as_the_wire() -> str:
    """Give this process real-time priority where allowed, and say which it got.

    The forwarder plays the cable and the switch, which on a real cluster use none of the
    nodes' CPUs. Here it shares the cores with the training ranks; at normal priority a frame
    whose hold time is over waits until the scheduler gets round to this process, adding
    milliseconds of random delay to every exchange. SCHED_FIFO lets it run as soon as a frame
    is due; it uses about a tenth of a core per 100 Mbit/s, so it takes little from the ranks.
    """
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(10))
        return "SCHED_FIFO"
    except (AttributeError, OSError):
        pass
    with contextlib.suppress(OSError):
        os.nice(-10)
        return "nice -10"
    return "normal"


def _forward_main(args: argparse.Namespace) -> int:
    stopping: list[int] = []
    signal.signal(signal.SIGTERM, lambda s, _f: stopping.append(s))

    priority = _run_as_the_wire()

    def ready() -> None:
        print(f"ready {priority}", flush=True)

    forward(args.ifaces.split(","), args.delay_s, stop=lambda: bool(stopping), ready=ready)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ifaces", required=True, help="comma-separated switch-side interfaces")
    p.add_argument("--delay-s", type=float, required=True, help="one-way delay in seconds")
    return _forward_main(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
