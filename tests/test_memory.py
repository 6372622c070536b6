"""ember.runtime.memory: freed memory is kept for the next run (glibc's malloc thresholds)."""
from __future__ import annotations

import os
import resource
import subprocess
import sys

import pytest

CHILD = r"""
import resource, sys
import numpy as np
from ember.runtime import memory

def faults_of_a_run():   # six 3 MiB arrays alive at once, then freed: a run's outputs

    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    arrays = [np.empty(3 << 18, np.float32) for _ in range(6)]
    for a in arrays:
        a.fill(1.0)        # touch every page
    del arrays, a
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

if sys.argv[1] == "keep":
    assert memory.keep_freed_memory()
faults_of_a_run()          # the first time, the pages come from the kernel either way
print(faults_of_a_run(), faults_of_a_run())
"""


def _second_faults(mode: str, **env: str) -> list[int]:
    out = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True,
                         env={**os.environ, **env}, check=True)
    return [int(v) for v in out.stdout.split()]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_an_array_of_a_size_freed_before_is_served_without_page_faults():
    """18 MiB (4,608 pages) a run: without ember's setting glibc gives them back to the
    kernel after each run and faults them in again; with it, the freed pages are reused."""
    env = {"EMBER_KEEP_MEMORY": "1"}
    kept = _second_faults("keep", **env)
    plain = _second_faults("plain", **env)
    assert max(kept) < 200, kept
    assert min(plain) > 4000, plain


def test_the_users_own_malloc_settings_and_the_opt_out_are_left_alone():
    for env in ({"EMBER_KEEP_MEMORY": "0"}, {"MALLOC_TRIM_THRESHOLD_": "1000000"}):
        code = "from ember.runtime import memory; print(memory.keep_freed_memory())"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env={**os.environ, **env}, check=True)
        assert out.stdout.strip() == "False"
