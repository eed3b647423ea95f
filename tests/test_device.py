"""The device module: explicit device choice and the CPU workers' host-memory settings."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest
import torch

from mcpar.device import select_device, setup_worker
from mcpar.errors import UserError


def test_cpu_is_taken_when_asked_and_cuda_is_never_guessed() -> None:
    info = select_device("cpu")
    assert (info.type, info.backend) == ("cpu", "gloo") and "asked for" in info.reason
    if not torch.cuda.is_available():
        assert select_device("auto").type == "cpu"
        with pytest.raises(UserError, match="training.device"):
            select_device("cuda")


def test_the_torch_free_probe_agrees_with_torch() -> None:
    """``auto`` decided without torch (``mcpar check``) is torch's own decision: CUDA ruled out
    only where torch sees none, and ``cuda_available`` is ``torch.cuda.is_available()``."""
    from mcpar.device_select import cuda_available, cuda_ruled_out

    if cuda_ruled_out():
        assert not torch.cuda.is_available()
    assert cuda_available() == torch.cuda.is_available()
    assert select_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_glibc_takes_the_host_memory_settings() -> None:
    # In a fresh process (the settings are process-wide): mallopt refuses values out of its
    # range (e.g. an mmap threshold above 32 MiB) by returning 0.
    code = "from mcpar.device import keep_freed_host_memory as k; print(k())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "True", out.stdout + out.stderr


def test_cpu_workers_keep_freed_host_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    import mcpar.device as device

    calls: list[bool] = []
    monkeypatch.setattr(device, "keep_freed_host_memory", lambda: calls.append(True) or True)
    threads = torch.get_num_threads()
    try:
        setup_worker(select_device("cpu"), 0, 1)
    finally:
        torch.set_num_threads(threads)
    assert calls == [True]


def test_setup_worker_gives_the_cpu_share_of_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    threads = torch.get_num_threads()
    try:
        monkeypatch.setenv("MCPAR_NUM_THREADS", "1")
        assert setup_worker(select_device("cpu"), 0, 1) == torch.device("cpu")
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
