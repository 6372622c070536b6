import os
import sys

# tests/ holds helper modules (onnx_suites) imported by the test files.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# Unseeded random ops (Bernoulli, RandomUniformLike, ...) draw reproducibly, so their expected
# failures fail every time instead of passing by chance now and then.
os.environ.setdefault("EMBER_RANDOM_SEED", "0")


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
