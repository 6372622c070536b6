"""The profiler (ember.runtime.profiler): `ember.load(..., profile=True)`, `ember profile` and
`ember run --repeat`. The trace must parse as Chrome-trace JSON with one event per node and
run, on every backend this machine has."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

import ember
from ember.cli import main

from backends import present_backends

MODELS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "models")
CNN = os.path.join(MODELS, "cnn.onnx")


@pytest.mark.parametrize("backend", present_backends())
def test_profiled_runs_write_one_event_per_node_and_run(backend, tmp_path):
    session = ember.load(CNN, backend, profile=True, profile_prefix=str(tmp_path / "p_"))
    plain = ember.load(CNN, backend)
    feeds = {i.name: np.random.default_rng(0).standard_normal(
        [d if isinstance(d, int) else 1 for d in i.shape]).astype(np.float32)
        for i in session.inputs}
    for _ in range(3):
        got = session.run(feeds)
    want = plain.run(feeds)
    for name in want:  # profiling changes no result
        np.testing.assert_array_equal(got[name], want[name])
    path = session.end_profiling()
    assert path.startswith(str(tmp_path / "p_")) and path.endswith(".json")
    events = json.load(open(path))
    nodes = [e for e in events if e["cat"] == "Node"]
    steps = len([n for n, _ in session._plan.placement])
    assert len(nodes) == 3 * steps
    assert [e["name"] for e in events if e["cat"] == "Session"].count("model_run") == 3
    for e in nodes:
        assert e["ph"] == "X" and e["dur"] >= 0 and e["name"].endswith("_kernel_time")
        assert e["args"]["placement"] in ("device", "host", "metadata", "shape", "control",
                                          "fallback")
        assert all(isinstance(s, dict) for s in e["args"]["input_type_shape"])
    assert session.end_profiling() == ""


def test_profile_command_prints_tables_and_writes_a_trace(tmp_path, capsys):
    trace = tmp_path / "trace.json"
    assert main(["profile", CNN, "--repeat", "3", "--warmup", "1", "--top", "4",
                 "--trace", str(trace)]) == 0
    out = capsys.readouterr().out
    assert "op type" in out and "4 slowest nodes" in out and "total" in out
    events = json.load(open(trace))
    steps = len(ember.load(CNN)._plan.placement)
    assert len([e for e in events if e["cat"] == "Node"]) == 3 * steps


def test_run_repeat_reports_median_and_p90(capsys):
    assert main(["run", CNN, "--repeat", "5", "--warmup", "1"]) == 0
    assert "median" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["run", CNN, "--repeat", "0"], ["profile", CNN, "--warmup",
                                                                    "-1"],
                                  ["run", CNN, "--seed", "-1"]])
def test_bad_counts_exit_2(argv):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
