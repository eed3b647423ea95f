"""The user-space switch of an emulated cluster whose kernel lacks ``netem``: the wire's model.

Started by ``netcluster.NetCluster`` inside the switch namespace as
``python -m netcluster.forwarder --delay-s D --rate-bps R --ifaces nc-s0,nc-s1``; it prints
"ready" once every socket is bound and runs until SIGTERM. It switches each frame to the right
port and holds it as the wire would: serialized at the link rate on the sender's uplink and
the receiver's downlink, plus the one-way delay (``LinkModel``). The kernel's tbf on each
node's egress still paces what the node's TCP sends, with the back-pressure a NIC gives.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import heapq
import itertools
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


class LinkModel:
    """The wire's timing: every port is a full-duplex link of ``rate_bps`` to its node.

    A frame from port a to port b is serialized on a's uplink, then on b's downlink
    (cut-through: when b's downlink is idle it carries the frame as a's uplink does), and
    arrives ``delay_s`` after its last bit. This is what makes the link slow for SMALL
    messages too: the kernel's tbf, which gives the nodes' TCP its back-pressure, lets a burst
    of up to its bucket (64 KiB here, for GSO frames) leave at once, so a 55 KB message after
    an idle spell would cross in the delay alone, as no 100 Mbit/s NIC allows. A frame that
    would wait more than ``queue_s`` for its link is dropped, as a switch's full buffer drops.
    """

    # Preamble and start delimiter (8), frame check sequence (4), inter-frame gap (12): bytes
    # every Ethernet frame occupies on the wire besides its own.
    FRAMING_BYTES = 24

    def __init__(self, num_ports: int, rate_bps: float, delay_s: float, queue_s: float):
        self.rate_bps, self.delay_s, self.queue_s = rate_bps, delay_s, queue_s
        self.uplink_free = [0.0] * num_ports  # when each node's uplink finishes its queue
        self.downlink_free = [0.0] * num_ports

    @classmethod
    def wire_bytes(cls, frame: bytes) -> int:
        """Bytes ``frame`` (virtio-net header first) takes on the wire: a GSO super-frame
        crosses as gso_size segments, each with its own headers and framing."""
        length = len(frame) - _VNET_HDR_LEN
        gso_type, hdr_len, gso_size = frame[1], int.from_bytes(frame[2:4], "little"), \
            int.from_bytes(frame[4:6], "little")
        if gso_type == 0 or gso_size == 0:
            return max(length, 60) + cls.FRAMING_BYTES
        hdr_len = hdr_len or 66  # Ethernet + IPv4 + TCP with timestamps, if not given
        segments = max(1, -(-(length - hdr_len) // gso_size))
        return length + (segments - 1) * hdr_len + segments * cls.FRAMING_BYTES

    def uplink(self, port: int, nbytes: int, now: float) -> float | None:
        """When the frame's last bit leaves node ``port``'s uplink, or None (dropped)."""
        start = max(now, self.uplink_free[port])
        if start - now > self.queue_s:
            return None
        self.uplink_free[port] = start + nbytes * 8 / self.rate_bps
        return self.uplink_free[port]

    def downlink(self, port: int, nbytes: int, uplink_done: float) -> float | None:
        """When the frame reaches node ``port`` (its downlink done, plus the delay)."""
        done = max(uplink_done, self.downlink_free[port] + nbytes * 8 / self.rate_bps)
        if done - uplink_done > self.queue_s:
            return None
        self.downlink_free[port] = done
        return done + self.delay_s


class _TimespecPair(ctypes.Structure):
    """struct itimerspec: interval then value, each a struct timespec (seconds, nanoseconds)."""

    _fields_ = [("interval_s", ctypes.c_long), ("interval_ns", ctypes.c_long),
                ("value_s", ctypes.c_long), ("value_ns", ctypes.c_long)]


class WakeTimer:
    """A timerfd on CLOCK_MONOTONIC (``time.monotonic``'s clock) that epoll can wait on.

    Why: epoll's own timeout has millisecond resolution and Python rounds it UP, so frames
    due 0.12 ms apart (1500-byte frames at 100 Mbit/s) left in millisecond batches, later
    than the link model says. Measured (tests/test_netcluster.py): a wait of 0.3 ms ends
    0.80 ms late that way, 0.04 ms late with this timer (best of 20); a 12 KB round trip on a
    1 ms, 100 Mbit/s link, 2.96 ms in the model, took 3.79-3.94 ms that way and 3.50-3.53
    with this timer. A timerfd wakes the loop at the due time to the microsecond. Python 3.11
    has no ``os.timerfd_*``, hence libc through ctypes; where that fails, ``fd`` is None and
    the caller falls back to epoll's timeout.
    """

    _CLOCK_MONOTONIC, _TFD_NONBLOCK, _TFD_CLOEXEC, _TFD_TIMER_ABSTIME = 1, 0o4000, 0o2000000, 1

    def __init__(self) -> None:
        self.fd: int | None = None
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            self._settime = libc.timerfd_settime
            fd = libc.timerfd_create(self._CLOCK_MONOTONIC,
                                     self._TFD_NONBLOCK | self._TFD_CLOEXEC)
        except (OSError, AttributeError):
            return
        if fd >= 0:
            self.fd = fd
        self._spec = _TimespecPair()
        self._armed_for: float | None = None

    def arm(self, due: float) -> None:
        """Wake at monotonic time ``due`` (re-arming for the same time is free)."""
        if due == self._armed_for:
            return
        seconds = int(due)
        self._spec.value_s, self._spec.value_ns = seconds, max(1, int((due - seconds) * 1e9))
        self._settime(self.fd, self._TFD_TIMER_ABSTIME, ctypes.byref(self._spec), None)
        self._armed_for = due

    def clear(self) -> None:
        """Consume an expiry (after epoll reported the fd readable)."""
        self._armed_for = None
        with contextlib.suppress(BlockingIOError):
            os.read(self.fd, 8)  # type: ignore[arg-type]


def forward(ifaces: Sequence[str], delay_s: float, rate_bps: float | None = None,
            queue_s: float = 0.1, stop: Callable[[], bool] = lambda: False,
            ready: Callable[[], None] = lambda: None) -> None:
    """A learning Ethernet switch between ``ifaces`` that holds every frame as the wire would.

    Runs in the switch namespace. Frames are read and written with their virtio-net header, so
    GSO super-frames and checksum offload state pass through untouched. With ``rate_bps``,
    each frame is delivered when :class:`LinkModel` says; without, ``delay_s`` after it came
    (the rate is then left to the kernel's tbf alone). The loop is kept lean (one clock read
    per wake-up, our own sends filtered by the kernel): it costs about a tenth of a core per
    100 Mbit/s forwarded. It wakes when the next frame falls due (:class:`WakeTimer`).
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
    timer = WakeTimer()
    if timer.fd is not None:
        ep.register(timer.fd, select.EPOLLIN)
    link = None if rate_bps is None else LinkModel(len(socks), rate_bps, delay_s, queue_s)
    macs: dict[bytes, int] = {}
    # (due time, arrival order, output port, frame): a heap, since frames for different
    # ports may fall due out of arrival order once links queue.
    pending: list[tuple[float, int, int, bytes]] = []
    order = itertools.count()
    src_at, dst_at = slice(_VNET_HDR_LEN + 6, _VNET_HDR_LEN + 12), slice(_VNET_HDR_LEN,
                                                                          _VNET_HDR_LEN + 6)
    monotonic = time.monotonic
    ready()
    while not stop():
        if pending and timer.fd is not None:
            timer.arm(pending[0][0])
            timeout = 0.5
        else:
            timeout = 0.5 if not pending else max(0.0, pending[0][0] - monotonic())
        events = ep.poll(timeout)
        now = monotonic()
        for fd, _ in events:
            if fd == timer.fd:
                timer.clear()
                continue
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
                dst = data[dst_at]
                out = None if dst[0] & 1 else macs.get(dst)
                targets = [out] if out is not None else range(len(socks))
                if link is None:
                    for t in targets:
                        if t != port:
                            heapq.heappush(pending, (now + delay_s, next(order), t, data))
                    continue
                nbytes = link.wire_bytes(data)
                sent = link.uplink(port, nbytes, now)
                for t in targets:
                    due = None if sent is None or t == port else link.downlink(t, nbytes, sent)
                    if due is not None:
                        heapq.heappush(pending, (due, next(order), t, data))
        while pending and pending[0][0] <= now:
            _, _, port, data = heapq.heappop(pending)
            # A full egress queue drops the frame (ENOBUFS), as a switch would; TCP
            # recovers. Any other error (interface gone at teardown) also just drops it.
            with contextlib.suppress(OSError):
                socks[port].send(data)


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

    forward(args.ifaces.split(","), args.delay_s, rate_bps=args.rate_bps, queue_s=args.queue_s,
            stop=lambda: bool(stopping), ready=ready)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ifaces", required=True, help="comma-separated switch-side interfaces")
    p.add_argument("--delay-s", type=float, required=True, help="one-way delay in seconds")
    p.add_argument("--rate-bps", type=float, default=None,
                   help="each node's link rate in bit/s (default: leave the rate to tbf)")
    p.add_argument("--queue-s", type=float, default=0.1,
                   help="longest wait for a link before a frame is dropped")
    return _forward_main(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
