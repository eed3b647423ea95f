"""Algorithm and bus bandwidth of a collective, with nccl-tests' definitions.

nccl-tests reports ``algbw = S / t`` (S: the collective's size, t: its time) and
``busbw = algbw x factor``, the factor chosen so that busbw reads as the speed of the bottleneck
link whatever the number of ranks n:

=================  =================================  ============
collective         S                                  factor
=================  =================================  ============
all_reduce         the buffer                         2(n-1)/n
all_gather         the whole output (n parts)         (n-1)/n
reduce_scatter     the whole input (n parts)          (n-1)/n
all_to_all         the whole input                    (n-1)/n
broadcast, p2p     the buffer                         1
=================  =================================  ============

The Communicator's books hold the bytes each rank *sent* under the ring algorithms
(``comm/communicator.py``), not S; :func:`from_sent` turns those back into S first. Units are
bytes per second; the report prints them in 1e3-based units (nccl-tests' GB/s is 1e9 B/s),
the unit chosen per figure (:func:`format_rate`), so that a small collective's bandwidth does
not read 0.0000 GB/s.
"""

from __future__ import annotations

from dataclasses import dataclass

_REDUCING = {"all_reduce"}
_PARTED = {"all_gather", "reduce_scatter", "all_to_all"}


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' busbw / algbw factor of ``op`` over ``n`` ranks."""
    if n <= 1:
        return 1.0
    if op in _REDUCING:
        return 2.0 * (n - 1) / n
    if op in _PARTED:
        return (n - 1) / n
    return 1.0  # broadcast, reduce, send/recv


def sent_fraction(op: str, n: int) -> float:
    """Bytes one rank sends per byte of S, as the Communicator counts them."""
    if n <= 1:
        return 0.0
    if op in _REDUCING:
        return 2.0 * (n - 1) / n
    if op in _PARTED or op == "broadcast":
        return (n - 1) / n
    return 1.0  # send: the whole tensor


@dataclass(frozen=True)
class Bandwidth:
    size_bytes: float  # S
    seconds: float
    algbw: float  # bytes/s
    busbw: float  # bytes/s


def bandwidth(op: str, size_bytes: float, seconds: float, n: int) -> Bandwidth:
    """Bandwidths of moving S = ``size_bytes`` in ``seconds`` over ``n`` ranks."""
    algbw = size_bytes / seconds if seconds > 0 else 0.0
    return Bandwidth(size_bytes, seconds, algbw, algbw * bus_factor(op, n))


def from_sent(op: str, sent_bytes: float, seconds: float, n: int) -> Bandwidth:
    """Bandwidths from the Communicator's count of bytes sent by one rank."""
    frac = sent_fraction(op, n)
    return bandwidth(op, sent_bytes / frac if frac else 0.0, seconds, n)


_UNITS = ("B", "KB", "MB", "GB", "TB")


def format_bytes(count: float, per: str = "") -> str:
    """``count`` bytes in the largest 1e3-based unit that keeps it at 1 or more, to three
    significant digits: 1234567 -> '1.23 MB'; ``per`` is appended to the unit ('/s')."""
    if count <= 0:
        return f"0 B{per}"
    value, unit = float(count), 0
    while value >= 999.5 and unit < len(_UNITS) - 1:
        value, unit = value / 1e3, unit + 1
    text = f"{value:.3g}" if value < 999.5 else f"{value:.0f}"
    return f"{text} {_UNITS[unit]}{per}"


def format_rate(bytes_per_s: float) -> str:
    """A bandwidth with a unit that suits it: 2.5e9 -> '2.5 GB/s', 4.2e4 -> '42 KB/s'."""
    return format_bytes(bytes_per_s, "/s")
