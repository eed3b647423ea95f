"""The local profile is keyed to the machine and checksummed: a profile of another CPU model,
core count, torch version or backend, or one edited by hand, is stale; both consumers (the MFU's
CPU peak, the memory placement's machine) ignore it and say why, and ``--cluster local``
measures this machine again."""

from __future__ import annotations

import calendar
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, run_cli_in_process

from mcpar.errors import UserError
from mcpar.sim import localprofile
from mcpar.sim.cpu_load import foreign_share
from mcpar.sim.hardware import LocalProfile
from mcpar.sim.profilestore import (
    FOREIGN_NOTE,
    PROFILE_ENV,
    cores,
    lookup_profile,
    machine_key,
    profile_document,
    save_profile,
)

PROFILE = LocalProfile(
    cores=2, flops_per_thread=5e10, attention_flops_per_thread=2e10, mem_bw_per_thread=1e10,
    mem_bw_total=2e10, op_overhead_s=1e-5, layer_overhead_s=1e-4,
    collectives={"ar": [1e-4, 1e-9], "p2p": [5e-5, 5e-10]}, notes={"flops_all_cores": 1.2e11})
REMEASURED = LocalProfile(
    cores=2, flops_per_thread=6e10, attention_flops_per_thread=2e10, mem_bw_per_thread=1e10,
    mem_bw_total=2e10, op_overhead_s=1e-5, layer_overhead_s=1e-4,
    collectives={"ar": [2e-4, 1e-9]}, notes={})


def _edit(path: Path, **fields: object) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))


def test_a_saved_profile_is_this_machines(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    doc = save_profile(PROFILE, path)
    assert doc["machine"] == machine_key()
    assert set(machine_key()) == {"cpu_model", "cores", "torch", "device", "backend"}
    assert machine_key()["cores"] == cores() and machine_key()["backend"] == "gloo"
    found = lookup_profile(path)
    assert found.status == "valid" and found.profile == PROFILE and found.why == ""
    # Laid out differently, the same content: the checksum is of the content, not the bytes.
    path.write_text(json.dumps(json.loads(path.read_text()), indent=7, sort_keys=True))
    assert lookup_profile(path).profile == PROFILE


@pytest.mark.parametrize("key", ["cpu_model", "cores", "torch", "backend", "device"])
def test_a_profile_of_another_machine_is_stale_naming_the_key(tmp_path: Path, key: str) -> None:
    here = machine_key()
    other = {**here, key: 64 if key == "cores" else "something else"}
    path = tmp_path / "p.json"
    save_profile(PROFILE, path, other)
    found = lookup_profile(path)
    assert found.status == "stale" and found.profile is None
    assert f"{key} {other[key]!r} there, {here[key]!r} here" in found.why
    assert str(path) in found.why and found.why.count(" there, ") == 1  # only the key that differs


def test_an_edited_or_unkeyed_profile_is_stale(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    save_profile(PROFILE, path)
    _edit(path, flops_per_thread=5.5e10)
    found = lookup_profile(path)
    assert found.status == "stale" and "edited after it was measured" in found.why
    # Editing the key to this machine's after measuring elsewhere is an edit too.
    save_profile(PROFILE, path, {**machine_key(), "torch": "1.0.0"})
    _edit(path, machine=machine_key())
    assert "edited after it was measured" in lookup_profile(path).why
    # A profile saved before profiles were keyed (no machine key, no checksum).
    doc = json.loads(path.read_text())
    path.write_text(json.dumps({k: v for k, v in doc.items()
                                if k not in ("machine", "measured", "sha256")}))
    found = lookup_profile(path)
    assert found.status == "stale" and "no machine key" in found.why


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", '{"cores": 2}'])
def test_a_file_that_is_no_profile_is_broken_not_overwritten(tmp_path: Path, text: str) -> None:
    path = tmp_path / "p.json"
    path.write_text(text)
    found = lookup_profile(path)
    assert found.status == "broken" and found.profile is None
    assert found.problems and f"{path}: not a local profile" in found.problems[0]
    with pytest.raises(UserError, match="not a local profile"):
        localprofile.load_local_cluster(path)
    assert path.read_text() == text


def test_both_consumers_follow_the_one_rule(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The MFU's peak and the placement's machine use a valid profile, and both pass over the
    same file once it is edited."""
    from mcpar.controllers.memory.placement import ranking_cluster
    from mcpar.profiler.mfu import calibrated_cpu_peak

    path = tmp_path / "p.json"
    monkeypatch.setenv(PROFILE_ENV, str(path))
    save_profile(PROFILE, path)
    peak = calibrated_cpu_peak(1)
    assert peak is not None and peak[0] == 1.2e11 / 2 and str(path) in peak[1]
    cluster, what = ranking_cluster("cpu", 2)
    assert what.startswith(f"this machine's calibrated local profile ({path})")
    assert cluster.accel.peak_flops["fp32"] == 1.2e11 / 2
    _edit(path, notes={"flops_all_cores": 9e12})
    assert calibrated_cpu_peak(1) is None
    cluster, what = ranking_cluster("cpu", 2)
    assert "declared figures" in what and "edited after it was measured" in what
    assert cluster.accel.peak_flops["fp32"] != 9e12 / 2


def _fake_measure(calls: list[int]):
    def measure() -> LocalProfile:
        calls.append(1)
        return REMEASURED
    return measure


@pytest.mark.parametrize("state", ["missing", "edited", "other torch"])
def test_local_cluster_measures_again_when_missing_or_stale(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        state: str) -> None:
    path = tmp_path / "sub" / "p.json"
    if state == "edited":
        save_profile(PROFILE, path)
        _edit(path, mem_bw_total=4e10)
    elif state == "other torch":
        save_profile(PROFILE, path, {**machine_key(), "torch": "1.0.0"})
    calls: list[int] = []
    monkeypatch.setattr(localprofile, "measure", _fake_measure(calls))
    cluster = localprofile.load_local_cluster(path)
    err = capsys.readouterr().err.strip().splitlines()
    assert calls == [1] and len(err) == 1
    why = {"missing": "no local profile at", "edited": "edited after it was measured",
           "other torch": "torch '1.0.0' there"}[state]
    assert why in err[0] and "measuring this machine" in err[0] and str(path) in err[0]
    assert cluster.op_costs["ar"] == (2e-4, 1e-9)
    assert lookup_profile(path).profile == REMEASURED  # saved, stamped, valid
    localprofile.load_local_cluster(path)  # and reused, not measured again
    assert calls == [1] and capsys.readouterr().err == ""


def test_a_measured_profile_that_is_no_rate_is_refused(tmp_path: Path) -> None:
    """Its checksum intact (measured so, not edited): a UserError naming the field, not a silent
    measurement over it."""
    path = tmp_path / "p.json"
    save_profile(LocalProfile(**{**PROFILE.__dict__, "mem_bw_total": 0.0}), path)
    assert lookup_profile(path).status == "broken"
    with pytest.raises(UserError, match=r"p\.json\.mem_bw_total: expected a finite number > 0"):
        localprofile.load_local_cluster(path)


def test_simulate_measures_an_edited_profile_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "p.json"
    monkeypatch.setenv(PROFILE_ENV, str(path))
    save_profile(PROFILE, path)
    _edit(path, flops_per_thread=5e12)  # a 'faster' machine, by hand
    calls: list[int] = []
    monkeypatch.setattr(localprofile, "measure", _fake_measure(calls))
    proc = run_cli_in_process(capsys, "simulate", str(REPO / "configs" / "moe.yaml"),
                              "--cluster", "local")
    assert proc.returncode == 0 and "local-cpu" in proc.stdout, proc.stderr
    assert calls == [1] and "edited after it was measured" in proc.stderr
    assert lookup_profile(path).profile == REMEASURED


@pytest.mark.slow
def test_measuring_again_writes_a_fresh_valid_profile(tmp_path: Path) -> None:
    """The real measurement (about 25 s on 2 cores) over a stale file."""
    path = tmp_path / "p.json"
    path.write_text(json.dumps(profile_document(
        PROFILE, {**machine_key(), "cpu_model": "Another CPU"}, "2020-01-01 00:00 UTC")))
    start = time.time()
    localprofile.load_local_cluster(path)
    found = lookup_profile(path)
    assert found.status == "valid" and found.profile is not None
    assert found.profile.cores == cores() and found.profile != PROFILE
    doc = json.loads(path.read_text())
    assert doc["machine"] == machine_key()
    measured = calendar.timegm(time.strptime(doc["measured"], "%Y-%m-%d %H:%M UTC"))
    assert measured >= start - 60  # now (to the minute), not the stale file's date


def test_the_runs_prediction_passes_over_a_stale_profile_without_measuring(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The profile report's plan-vs-measured row: a valid profile prices the run; a stale one
    is named as the reason there is no prediction, and the run is not held up to measure."""
    import torch

    from mcpar.config import load_config
    from mcpar.profiler.predict import predicted

    path = tmp_path / "p.json"
    monkeypatch.setenv(PROFILE_ENV, str(path))
    calls: list[int] = []
    monkeypatch.setattr(localprofile, "measure", _fake_measure(calls))
    cfg = load_config(None, [])
    save_profile(PROFILE, path)
    pred, source = predicted(cfg, 1, torch.device("cpu"))
    assert pred is not None and pred["step_s"] > 0 and str(path) in source
    save_profile(PROFILE, path, {**machine_key(), "cores": 999})
    pred, source = predicted(cfg, 1, torch.device("cpu"))
    assert pred is None and "cores 999 there" in source and "mcpar simulate --cluster local" \
        in source
    assert calls == []


def test_a_profile_measured_before_a_field_existed_is_stale_naming_it(tmp_path: Path) -> None:
    """A profile saved without the dropout-mask rate (an earlier version's, its checksum
    sound) is measured again, not read with the rate at 0, which prices dropout as free."""
    from mcpar.sim.profilestore import _digest

    path = tmp_path / "p.json"
    save_profile(PROFILE, path)
    doc = json.loads(path.read_text())
    del doc["mask_rate_per_thread"], doc["sha256"]
    path.write_text(json.dumps({**doc, "sha256": _digest(doc)}))
    found = lookup_profile(path)
    assert found.status == "stale" and "earlier version" in found.why
    assert "mask_rate_per_thread" in found.why


@pytest.mark.parametrize(("share", "warned"), [(0.5, True), (0.02, False), (None, False)])
def test_a_profile_measured_under_load_says_so(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        share: float | None, warned: bool) -> None:
    """The measurement records the share of the cores other processes used meanwhile; past
    ``MAX_FOREIGN_SHARE`` a warning names it and how to measure again (a profile measured
    beside a busy job prices the machine slow: a plan priced on one missed its step 6x)."""
    path = tmp_path / "p.json"
    monkeypatch.setattr(localprofile, "foreign_share", lambda fn: (REMEASURED, share))
    localprofile.load_local_cluster(path)
    err = capsys.readouterr().err
    assert ("50% of the cores" in err and "--out" in err) == warned, err
    saved = lookup_profile(path).profile
    assert saved is not None and saved.notes.get(FOREIGN_NOTE) == share


def test_the_share_of_the_cores_other_processes_use_is_measured() -> None:
    """A busy loop that is not this process's child (orphaned at once, so its CPU time is no
    child's of ours) takes a core: at least half a core of the machine's is foreign."""
    if not Path("/proc/stat").is_file():
        pytest.skip("the machine's CPU time is read from Linux's /proc/stat")
    spin = "import time\nend = time.time() + 2.5\nwhile time.time() < end: pass"
    subprocess.run(["sh", "-c", f"{shlex.quote(sys.executable)} -c {shlex.quote(spin)} &"],
                   check=True)
    result, share = foreign_share(lambda: time.sleep(1.5) or "done")
    assert result == "done" and share is not None
    assert share >= 0.5 / len(os.sched_getaffinity(0)), share
