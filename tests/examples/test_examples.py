"""Every example runs to completion with small arguments and says what it promises.

Each runs as its own process, the way a user runs it: ``python examples/NAME.py`` from
the repository root.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
TIMEOUT = 60

pytestmark = pytest.mark.timeout(150)


def run_example(name: str, *args: str) -> str:
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args],
        cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{name} exited {proc.returncode}:\n{out[-4000:]}"
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_prefill_decode_pair_in_one_process() -> None:
    out = run_example("prefill_decode_pair.py", "--tokens", "64")
    assert "verified bit-identical" in out
    assert "receipt:" in out and "kv_bytes            8,388,608" in out  # 64 x 128 KiB


def test_prefill_decode_pair_lossy_codec() -> None:
    out = run_example("prefill_decode_pair.py", "--tokens", "32", "--codec", "fp8")
    assert "is lossy" in out and "codec               fp8" in out


def test_prefill_decode_pair_as_two_processes() -> None:
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, str(EXAMPLES / "prefill_decode_pair.py"), "--role", "server", "--port", str(port)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        assert server.stdout is not None
        assert "listening" in server.stdout.readline()  # it prints once it is bound
        client = run_example("prefill_decode_pair.py", "--role", "client", "--port", str(port), "--tokens", "32")
        rest, _ = server.communicate(timeout=TIMEOUT)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    assert "receipt:" in client
    assert server.returncode == 0 and "verified bit-identical" in rest


def test_layerwise_streaming_overlaps_compute_and_transfer() -> None:
    out = run_example("layerwise_streaming.py", "--tokens", "64", "--compute-ms", "5")
    assert "all 32 layers verified bit-identical" in out
    assert "overlap: yes" in out
    assert "time to first layer" in out


def test_interop_runs_with_whatever_is_installed() -> None:
    out = run_example("torch_cupy_interop.py", "--tokens", "16")
    assert "DLPack-only producer" in out and "numpy bfloat16" in out
    assert "MISMATCH" not in out
    assert "case(s) verified" in out
    try:
        import torch  # noqa: F401
    except ImportError:
        assert "skipped: torch CPU and CUDA tensors (torch is not installed)" in out
    else:
        assert "torch CPU bfloat16" in out


def test_prefill_offload_on_the_trace() -> None:
    out = run_example("prefill_offload.py", "--requests", "16", "--warmup-mib", "16")
    assert "workload: trace" in out
    assert "emulated:" in out and "real:" in out  # says what is and is not emulated
    assert "prefill offload summary" in out and "offloaded fraction" in out
    assert "mean TTFT (ms)" in out and "link: final kvwire estimate" in out
    assert "all 16 of 16 caches verified" in out
    assert out.count("-> remote") + out.count("-> local") == 16
    assert out.count("-> remote") >= 1  # it offloads what the policy says, by default
    assert "to the real model at this byte and time scale" in out


def test_prefill_offload_falls_back_to_a_synthetic_workload(tmp_path: Path) -> None:
    out = run_example(
        "prefill_offload.py", "--trace", str(tmp_path / "absent.jsonl"), "--requests", "6",
        "--bandwidth", "configured", "--warmup-mib", "0", "--link-gbps", "5", "--delay-ms", "2",
    )
    assert "synthetic log-normal workload" in out
    assert "all 6 of 6 caches verified" in out
