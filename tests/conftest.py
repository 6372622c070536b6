import os
import sys

# tests/ holds helper modules (onnx_suites, backends) imported by the test files, and the test
# files, one folder per package they test, import each other's model builders by name.
_TESTS = os.path.dirname(os.path.abspath(__file__))
_FOLDERS = [os.path.join(_TESTS, d) for d in sorted(os.listdir(_TESTS))
            if os.path.isdir(os.path.join(_TESTS, d)) and not d.startswith(("_", "."))]
sys.path[:0] = [_TESTS, *_FOLDERS]
# Unseeded random ops (Bernoulli, RandomUniformLike, ...) draw reproducibly, so their expected
# failures fail every time instead of passing by chance now and then.
os.environ.setdefault("EMBER_RANDOM_SEED", "0")


def pytest_collection_modifyitems(config, items):
    """Tests marked `realsize` (tests/devices/test_opencl_real_size.py: minutes of OpenCL work) are
    skipped unless selected with `-m realsize` or EMBER_REALSIZE=1."""
    if "realsize" in (config.getoption("markexpr", "") or "") or \
            os.environ.get("EMBER_REALSIZE", "") not in ("", "0"):
        return
    import pytest

    skip = pytest.mark.skip(reason="real-size tier: select it with -m realsize or EMBER_REALSIZE=1")
    for item in items:
        if item.get_closest_marker("realsize") is not None:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter):
    """Where the nodes of the passing cases ran, per backend: the fallback count."""
    from backends import PLACEMENT
    from ember.runtime.backends import get_backend

    for backend, counts in sorted(PLACEMENT.items()):
        if backend == "cpu":
            continue
        total = sum(counts.values())
        fallback = counts.get("fallback", 0)
        terminalreporter.write_line(
            f"{backend}: {total} nodes placed in passing cases: " + ", ".join(
                f"{k} {v}" for k, v in sorted(counts.items())) +
            f"; {fallback} nodes without a {backend} kernel ran on the CPU; "
            f"{get_backend(backend).fallbacks} kernel calls fell back to the CPU for a dtype or case")
