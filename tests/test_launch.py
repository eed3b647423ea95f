"""Tests for the local launcher: success, exception and signal failures, teardown, env detection."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from mcpar.errors import UserError
from mcpar.launch import env, local
from mcpar.launch.env import DistEnv, detect_env

# Written at the top of every worker: its pid, so tests can check nothing outlives the launcher.
from mcpar.launch.local import LaunchFailed, WorkerFailure, launch_local

# Written at the top of every worker: its pid, so tests can check nothing outlives the launcher.
PRELUDE = """
import os, sys, time
from pathlib import Path
out = Path(sys.argv[1])
rank = int(os.environ["RANK"])
# Written under another name, then renamed: a reader never sees a half-written pid file.
(out / f".tmp-{rank}").write_text(str(os.getpid()))
os.replace(out / f".tmp-{rank}", out / f"pid-{rank}")

def wait_for_peers():
    # Fail only once every peer has started, so the test sees all pids.
    n = int(os.environ["WORLD_SIZE"])
    while len(list(out.glob("pid-*"))) < n:
        time.sleep(0.01)
"""


def _script(tmp_path: Path, body: str) -> list[str]:
    path = tmp_path / "worker.py"
    path.write_text(PRELUDE + textwrap.dedent(body))
    out = tmp_path / "out"
    out.mkdir()
    return [str(path), str(out)]


def _alive(pid: int) -> bool:
    # A zombie nobody reaped (possible in containers without an init) counts as gone.
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return " Z " not in Path(f"/proc/{pid}/stat").read_text().split(")", 1)[1][:4]
    except OSError:
        return False


def _pids(tmp_path: Path) -> list[int]:
    return [int(p.read_text()) for p in sorted((tmp_path / "out").glob("pid-*"))]


def _gone_within(pids: list[int], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not any(_alive(p) for p in pids):
            return True
        time.sleep(0.05)
    return False


def test_all_ranks_succeed(tmp_path: Path) -> None:
    argv = _script(tmp_path, """
        keys = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT", "MCPAR_LAUNCHED", "OMP_NUM_THREADS", "CALLER_VAR"]
        (out / f"env-{rank}.json").write_text(
            __import__("json").dumps({k: os.environ.get(k) for k in keys}))
    """)
    env = dict(os.environ, CALLER_VAR="kept")
    env.pop("OMP_NUM_THREADS", None)
    launch_local(3, argv, env=env)
    seen = [json.loads((tmp_path / "out" / f"env-{r}.json").read_text()) for r in range(3)]
    assert [int(e["RANK"]) for e in seen] == [0, 1, 2]
    assert [int(e["LOCAL_RANK"]) for e in seen] == [0, 1, 2]
    assert {e["WORLD_SIZE"] for e in seen} == {"3"}
    assert {e["LOCAL_WORLD_SIZE"] for e in seen} == {"3"}
    assert len({e["MASTER_PORT"] for e in seen}) == 1 and int(seen[0]["MASTER_PORT"]) > 0
    assert {e["MASTER_ADDR"] for e in seen} == {"127.0.0.1"}
    assert {e["MCPAR_LAUNCHED"] for e in seen} == {"1"}
    assert {e["CALLER_VAR"] for e in seen} == {"kept"}
    assert {e["OMP_NUM_THREADS"] for e in seen} == {str(max(1, (os.cpu_count() or 1) // 3))}


def test_caller_omp_threads_is_kept(tmp_path: Path) -> None:
    argv = _script(tmp_path, """
        (out / f"omp-{rank}").write_text(os.environ["OMP_NUM_THREADS"])
    """)
    launch_local(2, argv, env=dict(os.environ, OMP_NUM_THREADS="7"))
    assert {(tmp_path / "out" / f"omp-{r}").read_text() for r in range(2)} == {"7"}


def test_exception_is_reported_and_peers_stopped(tmp_path: Path) -> None:
    argv = _script(tmp_path, """
        from mcpar.launch.local import record_worker_errors
        with record_worker_errors():
            if rank == 1:
                wait_for_peers()
                raise RuntimeError("boom")
            time.sleep(60)
    """)
    start = time.monotonic()
    with pytest.raises(LaunchFailed) as info:
        launch_local(2, argv)
    elapsed = time.monotonic() - start
    failure = info.value.failure
    assert failure.rank == 1 and failure.exitcode == 1 and failure.signal_name is None
    assert "rank 1" in failure.describe() and "RuntimeError: boom" in failure.describe()
    assert elapsed < 10
    pids = _pids(tmp_path)
    assert len(pids) == 2 and not any(_alive(p) for p in pids)


def test_signal_death_is_reported_and_peers_stopped(tmp_path: Path) -> None:
    argv = _script(tmp_path, """
        if rank == 2:
            wait_for_peers()
            time.sleep(0.2)
            os.kill(os.getpid(), 9)
        time.sleep(60)
    """)
    start = time.monotonic()
    with pytest.raises(LaunchFailed) as info:
        launch_local(3, argv)
    elapsed = time.monotonic() - start
    failure = info.value.failure
    assert failure.rank == 2 and failure.signal_name == "SIGKILL" and failure.exitcode is None
    assert failure.describe() == "rank 2 was killed by signal SIGKILL"
    assert elapsed < 10
    pids = _pids(tmp_path)
    assert len(pids) == 3 and not any(_alive(p) for p in pids)


def test_user_error_is_recorded_as_problems(tmp_path: Path) -> None:
    argv = _script(tmp_path, """
        from mcpar.errors import UserError
        from mcpar.launch.local import record_worker_errors
        with record_worker_errors():
            raise UserError(["model.num_heads: must divide hidden_size", "data.source: missing"])
    """)
    with pytest.raises(LaunchFailed) as info:
        launch_local(1, argv)
    assert info.value.failure.describe() == (
        "rank 0 exited with code 1: model.num_heads: must divide hidden_size; data.source: missing")


def test_launcher_sigterm_stops_workers(tmp_path: Path) -> None:
    argv = _script(tmp_path, "time.sleep(60)\n")
    driver = (f"from mcpar.launch.local import launch_local\n"
              f"launch_local(2, {argv!r}, kill_grace_s=1.0)\n")
    proc = subprocess.Popen([sys.executable, "-c", driver])
    try:
        deadline = time.monotonic() + 10
        while len(_pids(tmp_path)) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        pids = _pids(tmp_path)
        assert len(pids) == 2
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 128 + signal.SIGTERM
        assert not any(_alive(p) for p in pids)
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_workers_die_with_a_killed_launcher(tmp_path: Path) -> None:
    argv = _script(tmp_path, "time.sleep(60)\n")
    driver = f"from mcpar.launch.local import launch_local\nlaunch_local(2, {argv!r})\n"
    # A SIGKILLed launcher cannot clean up its error-file directory: keep it under tmp_path.
    proc = subprocess.Popen([sys.executable, "-c", driver],
                            env=dict(os.environ, TMPDIR=str(tmp_path)))
    try:
        deadline = time.monotonic() + 10
        while len(_pids(tmp_path)) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        pids = _pids(tmp_path)
        assert len(pids) == 2
    finally:
        proc.kill()
        proc.wait()
    assert _gone_within(pids, 5)


def test_same_poll_prefers_the_root_cause() -> None:
    cascade = WorkerFailure(0, 1, None, None)
    killed = WorkerFailure(3, None, "SIGKILL", None)
    raised = WorkerFailure(2, 1, None, "RuntimeError: boom")
    assert local._pick_first([cascade, killed]) is killed
    assert local._pick_first([cascade, raised]) is raised
    assert local._pick_first([WorkerFailure(2, 1, None, None), cascade]) is cascade


# --- detect_env ------------------------------------------------------------------------------

DIST_VARS = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
             "MCPAR_LAUNCHED", "TORCHELASTIC_RUN_ID", "SLURM_PROCID", "SLURM_NTASKS",
             "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_NODEID",
             "SLURM_NNODES", "SLURM_JOB_NODELIST", "SLURM_NODELIST", "SLURM_LAUNCH_NODE_IPADDR"]


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in DIST_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def _set(mp: pytest.MonkeyPatch, **values: str) -> None:
    for k, v in values.items():
        mp.setenv(k, v)


def test_detect_none(clean_env: pytest.MonkeyPatch) -> None:
    assert detect_env() is None
    _set(clean_env, SLURM_PROCID="0", SLURM_NTASKS="1")  # a one-task srun is not distributed
    assert detect_env() is None


def test_detect_torchrun(clean_env: pytest.MonkeyPatch) -> None:
    _set(clean_env, RANK="5", WORLD_SIZE="8", LOCAL_RANK="1", LOCAL_WORLD_SIZE="4",
         MASTER_ADDR="node0", MASTER_PORT="1234", TORCHELASTIC_RUN_ID="abc")
    assert detect_env() == DistEnv(5, 8, 1, 4, "node0", 1234, "torchrun")


@pytest.mark.parametrize("values,words", [
    # Stale exports in a shell: RANK and WORLD_SIZE only.
    ({"RANK": "0", "WORLD_SIZE": "2"}, "LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT "
     "missing"),
    ({"RANK": "2", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
      "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "inconsistent"),
])
def test_a_partial_torchrun_environment_is_a_user_error(clean_env: pytest.MonkeyPatch,
                                                        values: dict[str, str],
                                                        words: str) -> None:
    _set(clean_env, **values)
    with pytest.raises(UserError, match=words):
        detect_env()


def test_detect_mcpar(clean_env: pytest.MonkeyPatch) -> None:
    _set(clean_env, RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2",
         MASTER_ADDR="127.0.0.1", MASTER_PORT="4321", MCPAR_LAUNCHED="1")
    assert detect_env() == DistEnv(1, 2, 1, 2, "127.0.0.1", 4321, "mcpar")


def test_detect_slurm(clean_env: pytest.MonkeyPatch) -> None:
    _set(clean_env, SLURM_PROCID="3", SLURM_NTASKS="4", SLURM_LOCALID="1",
         SLURM_TASKS_PER_NODE="2(x2)", SLURM_NODEID="1", SLURM_JOB_NODELIST="gpu-a,gpu-b")
    assert detect_env() == DistEnv(3, 4, 1, 2, "gpu-a", 29500, "slurm")
    _set(clean_env, MASTER_ADDR="10.0.0.9", MASTER_PORT="6000")
    assert detect_env() == DistEnv(3, 4, 1, 2, "10.0.0.9", 6000, "slurm")


def test_detect_slurm_uneven_nodes_and_fallback_addr(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("PATH", "")  # no scontrol: the launch node address is used instead
    _set(clean_env, SLURM_PROCID="8", SLURM_NTASKS="9", SLURM_LOCALID="0",
         SLURM_TASKS_PER_NODE="4,4,1", SLURM_NODEID="2", SLURM_JOB_NODELIST="gpu-[01-03]",
         SLURM_LAUNCH_NODE_IPADDR="10.1.2.3")
    assert detect_env() == DistEnv(8, 9, 0, 1, "10.1.2.3", 29500, "slurm")
    assert env._expand_tasks_per_node("4(x2),1") == [4, 4, 1]


def test_a_user_error_found_by_a_worker_exits_2_without_a_restart(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    # A config that only the workers' plan resolution can refuse: the run directory's
    # config.yaml asks for data 3 while 2 workers are started.
    from conftest import TINY

    from mcpar.config import apply_overrides, parse_config, to_yaml

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cfg = parse_config(apply_overrides({}, [*TINY, "parallelism.data=3"]))
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    restarts: list[int] = []
    with pytest.raises(LaunchFailed) as info:
        launch_local(2, ["-m", "mcpar.launch.worker", str(run_dir)], max_restarts=3,
                     on_restart=lambda attempt, failure: restarts.append(attempt))
    assert restarts == []  # a restart would only find the same problem again
    (line,) = info.value.failure.user_errors or [None]
    assert line.startswith("parallelism:") and "has 2" in line
    err = capfd.readouterr().err
    # The recorded problem is printed once, by the CLI from user_errors above (the next test);
    # a worker printing its own copy too made one problem a line per rank plus the CLI's.
    assert "Traceback" not in err and "mcpar: error:" not in err


def test_the_cli_reports_a_workers_user_error_with_exit_2(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from mcpar import cli
    from mcpar.commands import train

    def failing(args: object) -> int:
        raise LaunchFailed(WorkerFailure(1, 2, None, "cluster.ranks_per_node: uneven",
                                         ["cluster.ranks_per_node: uneven; use a divisor"]))

    monkeypatch.setattr(train, "cmd_train", failing)
    assert cli.main(["train"]) == 2
    err = capsys.readouterr().err
    assert err == "mcpar: error: cluster.ranks_per_node: uneven; use a divisor\n"


def test_forked_workers_train_bitwise_like_fresh_ones_and_are_found_by_rank(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """mcpar's workers fork from one zygote that imported torch once (``mcpar.launch.zygote``): the
    same losses, bit for bit, as workers started afresh (MCPAR_FORK_WORKERS=0), each worker in a
    session of its own, named by its rank and found by ``local_worker_pids``."""
    import contextlib
    import threading

    from conftest import TINY, sets, step_losses

    from mcpar.cli import main
    from mcpar.launch.local import local_worker_pids

    args = [*sets(*TINY, "training.steps=4"), "--nproc", "2"]

    def run(name: str) -> tuple[Path, dict[int, bytes]]:
        """Train; each worker's rank -> its parent's command line, seen while it ran."""
        run_dir, parents = tmp_path / name, {}

        def watch() -> None:
            while len(parents) < 2 and not (run_dir / "summary.json").exists():
                pids = local_worker_pids(run_dir)
                for rank, pid in pids.items():
                    with contextlib.suppress(OSError, ValueError):
                        stat = Path(f"/proc/{pid}/stat").read_text()
                        ppid = stat[stat.rindex(")") + 2:].split()[1]
                        parents[rank] = Path(f"/proc/{ppid}/cmdline").read_bytes()
                time.sleep(0.01)

        watcher = threading.Thread(target=watch)
        watcher.start()
        assert main(["train", *args, "--run-dir", str(run_dir)]) == 0
        watcher.join()
        return run_dir, parents

    forked, forked_parents = run("forked")
    assert sorted(forked_parents) == [0, 1]
    assert all(b"mcpar.launch.zygote" in cmdline for cmdline in forked_parents.values())
    monkeypatch.setenv("MCPAR_FORK_WORKERS", "0")
    fresh, fresh_parents = run("fresh")
    assert sorted(fresh_parents) == [0, 1]
    assert not any(b"mcpar.launch.zygote" in cmdline for cmdline in fresh_parents.values())
    assert step_losses(forked) == step_losses(fresh)


def test_a_start_whose_port_was_taken_is_made_again_on_a_new_port(tmp_path: Path) -> None:
    """The launcher picks a free port, and another process may bind it before rank 0 listens
    (a CI run lost a test to that): the start is made again on another port, without counting
    as a restart, and a job that keeps losing its port stops after ``PORT_RETRIES`` tries."""
    argv = _script(tmp_path, """
        from mcpar.launch.local import record_worker_errors

        class DistNetworkError(RuntimeError):
            pass

        with record_worker_errors():
            port = os.environ["MASTER_PORT"]
            if rank == 0:
                with open(out / "starts", "a") as starts:
                    starts.write(port + " ")
            tries = len((out / "starts").read_text().split()) if rank == 0 else 0
            if rank == 0 and tries <= int(os.environ["TAKEN_TIMES"]):
                raise DistNetworkError(
                    f"The server socket has failed to listen on any local network address. "
                    f"port: {port}, useIpv6: false, code: -98, name: EADDRINUSE, "
                    f"message: address already in use")
    """)
    starts = tmp_path / "out" / "starts"
    launch_local(2, argv, env=dict(os.environ, TAKEN_TIMES="2"), max_restarts=0)
    assert len(starts.read_text().split()) == 3  # two starts lost their port, the third ran
    starts.unlink()
    with pytest.raises(LaunchFailed) as info:
        launch_local(2, argv, env=dict(os.environ, TAKEN_TIMES="9"), max_restarts=0)
    assert "EADDRINUSE" in (info.value.failure.error or "")
    assert len(starts.read_text().split()) == 1 + local.PORT_RETRIES
