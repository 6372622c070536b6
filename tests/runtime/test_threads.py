"""Concurrency is part of correctness: a session shared by threads, and several sessions of one
model in threads, give the same bits as sequential runs on every device backend (OpenCL on
PoCL, and CUDA on the numpy stand-in for cupy where no GPU is present), with no crash.

The oracle is the same session run sequentially first: the kernels are deterministic, so any
difference is a race (before the launch lock, 8 threads on one OpenCL session returned values
off by up to 2e33 or aborted the process)."""
from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from backends import cuda_backend, real_cuda_device, unavailable_reason

import ember

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
THREADS, CALLS, DISTINCT_FEEDS = 8, 200, 8


def _feeds(name: str, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    if name == "cnn":
        return {"image": rng.standard_normal((2, 3, 32, 32), dtype=np.float32)}
    lengths = rng.integers(1, 8, size=2)
    return {"tokens": rng.standard_normal((2, 7, 32), dtype=np.float32),
            "mask": (np.arange(7)[None, :] < lengths[:, None]).astype(np.int64)}


def _hammer(sessions: list, name: str) -> list[str]:
    """THREADS threads, CALLS runs each, round-robin over `sessions` and DISTINCT_FEEDS feeds;
    returns a description of every result that differs from the sequential one."""
    feeds = [_feeds(name, seed) for seed in range(DISTINCT_FEEDS)]
    expected = [sessions[0].run(f) for f in feeds]
    wrong: list[str] = []
    errors: list[BaseException] = []

    def work(thread: int) -> None:
        session = sessions[thread % len(sessions)]
        try:
            for call in range(CALLS):
                i = (thread + call) % DISTINCT_FEEDS
                got = session.run(feeds[i])
                for key, want in expected[i].items():
                    if not np.array_equal(got[key], want):
                        wrong.append(f"thread {thread} call {call} output {key}: max diff "
                                     f"{float(np.max(np.abs(got[key] - want)))}")
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return wrong


def _check(backend: str, name: str, sessions_count: int) -> None:
    path = os.path.join(REPO, "models", f"{name}.onnx")
    sessions = [ember.load(path, backend=backend) for _ in range(sessions_count)]
    assert sessions[0].placement_summary().get("device", 0) > 0
    wrong = _hammer(sessions, name)
    assert not wrong, f"{len(wrong)} of {THREADS * CALLS} results differ: {wrong[:5]}"


@pytest.mark.skipif(unavailable_reason("opencl") is not None,
                    reason=str(unavailable_reason("opencl")))
@pytest.mark.parametrize("sessions", [1, 2], ids=["one-session", "two-sessions"])
@pytest.mark.parametrize("name", ["cnn", "transformer"])
def test_opencl_threads(name, sessions):
    _check("opencl", name, sessions)


@pytest.mark.parametrize("name", ["cnn", "transformer"])
def test_cuda_threads(name):
    mode = "gpu" if real_cuda_device() else "emulated"
    with cuda_backend(mode):
        _check("cuda", name, 1)
