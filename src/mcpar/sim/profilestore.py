"""Where this machine's local profile is kept, what machine it is valid for, and the one rule its
consumers follow: the saved profile when it was measured on this machine and not edited since,
else none, and why (``lookup_profile``).

The file (``profile_path()``) holds the measured fields (``hardware.LocalProfile``) and:
- ``machine``: the key it was measured under (``machine_key``): the CPU model (/proc/cpuinfo's
  "model name"), the cores this process may run on, the torch version, and the device type and
  collective backend measured (the CPU and gloo: ``localprofile.measure``; a CUDA device and
  NCCL: ``deviceprofile.measure_device``, whose key adds the accelerator's name and count);
- ``measured``: when, in UTC;
- ``notes.foreign_cpu_share``: the share of the cores other processes used meanwhile
  (``cpu_load``; a measurement past ``MAX_FOREIGN_SHARE`` is warned about);
- ``sha256``: of the canonical JSON (sorted keys, no spaces) of every other field of the file.

A profile whose key differs from this machine's, whose checksum does not match its content (a
number edited by hand), or which has no key (saved before profiles were keyed) is stale. Every
consumer ignores a stale profile; ``localprofile.load_local_cluster`` (``mcpar simulate`` and
``mcpar plan`` on ``--cluster local``) then measures this machine again and says why. The
checksum tells an edit, not a forgery: whoever edits the numbers can recompute it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Literal

from mcpar.errors import problem
from mcpar.sim.cpu_load import MAX_FOREIGN_SHARE
from mcpar.sim.hardware import CROWDED_EXCHANGE_NOTE, TIME_SLICING_NOTE, LocalProfile
from mcpar.sim.microbench import RING_NOTE

PROFILE_ENV = "MCPAR_LOCAL_PROFILE"
DEVICE_PROFILE_ENV = "MCPAR_DEVICE_PROFILE"  # the CUDA device's profile (``deviceprofile``)
# The profile's note of the share of the cores other processes used while it was measured.
FOREIGN_NOTE = "foreign_cpu_share"
# What ``localprofile.measure`` measures: CPU workers talking over gloo.
MEASURED_DEVICE, MEASURED_BACKEND = "cpu", "gloo"
# The collective backend a device type's profile measures.
BACKENDS = {"cpu": "gloo", "cuda": "nccl"}
STAMP_FIELDS = ("machine", "measured", "sha256")
# What ``localprofile.measure`` writes: a profile without one of them predates its measurement.
MEASURED_FIELDS = tuple(f.name for f in fields(LocalProfile))

Status = Literal["valid", "missing", "stale", "broken"]


def profile_path(device_type: str = MEASURED_DEVICE) -> Path:
    """Where the profile of this machine's ``device_type`` (cpu or cuda) is kept."""
    env = os.environ.get(PROFILE_ENV if device_type == MEASURED_DEVICE else DEVICE_PROFILE_ENV)
    name = "local_profile.json" if device_type == MEASURED_DEVICE else f"{device_type}_profile.json"
    return Path(env) if env else Path.home() / ".cache" / "mcpar" / name


def cores() -> int:
    """The cores this process may run on (its affinity, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def cpu_model() -> str:
    """/proc/cpuinfo's first "model name", else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def torch_version() -> str:
    """The installed torch's version, read from its package metadata: a lookup need not import
    torch (seconds) to tell whether a profile is this machine's."""
    from importlib import metadata

    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:  # a source build without metadata
        import torch

        return str(torch.__version__)


def accelerators() -> tuple[str, int]:
    """The first CUDA device's name and how many this process sees."""
    import torch

    return torch.cuda.get_device_name(0), torch.cuda.device_count()


def machine_key(device: str = MEASURED_DEVICE, backend: str = MEASURED_BACKEND
                ) -> dict[str, str | int]:
    """What a profile measured here now would be keyed to: on a CUDA device also its name and
    how many there are (the collectives were measured between two of them, when there were)."""
    key: dict[str, str | int] = {"cpu_model": cpu_model(), "cores": cores(),
                                 "torch": torch_version(), "device": device, "backend": backend}
    if device != MEASURED_DEVICE:
        key["accelerator"], key["accelerators"] = accelerators()
    return key


def _digest(fields: dict[str, object]) -> str:
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def profile_document(profile: LocalProfile, machine: dict[str, str | int] | None = None,
                     measured: str | None = None) -> dict[str, object]:
    """The file's content: the measured fields stamped with the machine key (this machine's
    unless given), the date, and the checksum over both."""
    doc: dict[str, object] = {
        **asdict(profile), "machine": machine if machine is not None else machine_key(),
        "measured": measured or time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    doc["sha256"] = _digest(doc)
    return doc


def save_profile(profile: LocalProfile, path: Path,
                 machine: dict[str, str | int] | None = None) -> dict[str, object]:
    """Writes the stamped profile to ``path`` (a reader never sees half a file); the document."""
    doc = profile_document(profile, machine)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(doc, indent=2))
    os.replace(tmp, path)
    return doc


@dataclass(frozen=True)
class ProfileLookup:
    """The saved profile, when it is this machine's, or what is wrong with the file."""

    path: Path
    status: Status
    profile: LocalProfile | None = None  # set when, and only when, valid
    why: str = ""  # one clause: why it is not used (empty when valid)
    problems: tuple[str, ...] = ()  # broken: one line per fault, as a UserError lists them
    measured: str = ""  # when the valid profile was measured


def _fix(path: Path, device_type: str = MEASURED_DEVICE) -> str:
    module, env = (("localprofile", PROFILE_ENV) if device_type == MEASURED_DEVICE
                   else ("deviceprofile", DEVICE_PROFILE_ENV))
    return (f"measure this machine again (python -m mcpar.sim.{module} --out {path}) or "
            f"delete the file (set by {env} or the default path)")


def _differences(saved: object, here: dict[str, str | int]) -> list[str]:
    saved = saved if isinstance(saved, dict) else {}
    return [f"{key} {saved.get(key)!r} there, {value!r} here"
            for key, value in here.items() if saved.get(key) != value]


def lookup_profile(path: Path | None = None, device_type: str = MEASURED_DEVICE
                   ) -> ProfileLookup:
    """The one rule: the profile of ``device_type`` at ``path`` (default
    ``profile_path(device_type)``) when it was measured on this machine (its key is
    ``machine_key``'s for that device and its backend) and its checksum matches, its fields
    sound; else why not: missing, stale (no key, edited, another machine) or broken (not a
    profile, or a measured field that is not a finite rate)."""
    path = path or profile_path(device_type)
    if not path.is_file():
        return ProfileLookup(path, "missing", why=f"no local profile at {path}")
    try:
        doc = json.loads(path.read_text())
        if not isinstance(doc, dict):
            raise ValueError(f"a JSON {type(doc).__name__}, not an object")
        stamp = {k: doc.pop(k) for k in STAMP_FIELDS if k in doc}
        profile = LocalProfile(**doc)
    except (OSError, UnicodeDecodeError, ValueError, TypeError) as err:
        line = problem(str(path), f"not a local profile ({err}); {_fix(path, device_type)}")
        return ProfileLookup(path, "broken", why=f"the local profile {path} is unreadable ({err})",
                             problems=(line,))
    if "sha256" not in stamp or "machine" not in stamp:
        return ProfileLookup(path, "stale", why=(
            f"the local profile {path} carries no machine key and checksum (saved before "
            "profiles were keyed to the machine)"))
    if stamp["sha256"] != _digest({**doc, **{k: v for k, v in stamp.items() if k != "sha256"}}):
        return ProfileLookup(path, "stale", why=(
            f"the local profile {path} was edited after it was measured (its sha256 does not "
            "match its content)"))
    unmeasured = sorted(set(MEASURED_FIELDS) - set(doc))
    if unmeasured:
        return ProfileLookup(path, "stale", why=(
            f"the local profile {path} was measured by an earlier version (it lacks "
            f"{', '.join(unmeasured)})"))
    differs = _differences(stamp["machine"], machine_key(device_type, BACKENDS[device_type]))
    if differs:
        return ProfileLookup(path, "stale", why=(
            f"the local profile {path} is of another machine ({'; '.join(differs)})"))
    # One CUDA device has no peer to time collectives with: the hardware table's links stand.
    problems = field_problems(profile, path, _fix(path, device_type),
                              needs_collectives=device_type == MEASURED_DEVICE)
    if problems:
        return ProfileLookup(path, "broken", why=f"the local profile {path} is unsound "
                             f"({'; '.join(problems)})", problems=tuple(problems))
    return ProfileLookup(path, "valid", profile, measured=str(stamp.get("measured", "")))


def under_load(profile: LocalProfile) -> str:
    """'' when the profile was measured on a quiet machine (or its load is unknown), else one
    clause saying how loaded it was: other processes used more than ``MAX_FOREIGN_SHARE`` of
    the cores while it was measured. Said, not refused: on a machine always shared (a CI
    runner's parallel tests) every measurement would be, and a run whose step then misses its
    prediction measures again anyway (``profiler.predict``)."""
    notes = profile.notes if isinstance(profile.notes, dict) else {}
    share = notes.get(FOREIGN_NOTE)
    if not isinstance(share, int | float) or share <= MAX_FOREIGN_SHARE:
        return ""  # unknown (a field check names a value that is not a number)
    return (f"measured while other processes used {share:.0%} of the cores (more than "
            f"{MAX_FOREIGN_SHARE:.0%})")


def _finite(value: object, least: float, strict: bool) -> bool:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return math.isfinite(value) and (value > least if strict else value >= least)


def field_problems(profile: LocalProfile, path: Path, fix: str,
                   needs_collectives: bool = True) -> list[str]:
    """One line per field that is not what a measurement gives (a non-finite, zero or negative
    rate, a cost missing), naming ``path.field`` and ``fix``."""
    problems: list[str] = []

    def bad(key: str, expected: str, value: object) -> None:
        problems.append(problem(f"{path}.{key}", f"expected {expected}, got {value!r}; {fix}"))

    if not isinstance(profile.cores, int) or isinstance(profile.cores, bool) or profile.cores < 1:
        bad("cores", "an integer >= 1", profile.cores)
    for key in ("flops_per_thread", "attention_flops_per_thread", "mem_bw_per_thread",
                "mem_bw_total"):
        if not _finite(getattr(profile, key), 0.0, strict=True):
            bad(key, "a finite number > 0", getattr(profile, key))
    for key in ("op_overhead_s", "layer_overhead_s", "mask_rate_per_thread"):
        if not _finite(getattr(profile, key), 0.0, strict=False):
            bad(key, "a finite number >= 0", getattr(profile, key))
    ops = profile.collectives if isinstance(profile.collectives, dict) else {}
    if needs_collectives and "ar" not in ops:
        bad("collectives.ar", "[alpha, beta] of the all-reduce", None)
    for op, cost in ops.items():
        if not (isinstance(cost, list | tuple) and len(cost) == 2
                and _finite(cost[0], 0.0, strict=False) and _finite(cost[1], 0.0, strict=True)):
            bad(f"collectives.{op}", "[alpha >= 0, beta > 0]", cost)
    notes = profile.notes if isinstance(profile.notes, dict) else {}
    if "flops_all_cores" in notes and not _finite(notes["flops_all_cores"], 0.0, strict=True):
        bad("notes.flops_all_cores", "a finite number > 0", notes["flops_all_cores"])
    for key, value in notes.items():  # the ring blocks' times and what sharing cores costs
        if ((key.startswith(RING_NOTE) or key in (TIME_SLICING_NOTE, CROWDED_EXCHANGE_NOTE))
                and not _finite(value, 0.0, strict=False)):
            bad(f"notes.{key}", "a finite number >= 0", value)
    return problems
