"""Model suites shipped inside the onnx wheel, on every backend present: simple,
pytorch-converted, pytorch-operator, and the `light` model zoo (inputs arange(n)/n, outputs
stored next to each model), with the simplifier on, and on the CPU once more with it off
(`cpu-raw`). Expected failures per backend are in tests/xfail_<backend>.txt."""
import os

import pytest

from backends import record_placement, unavailable_reason, xfail_file
from ember.runtime.backends import BACKENDS
from onnx_suites import (light_models, load_case_dir, load_light_case, load_xfails, run_case,
                         suite_case_dirs)

XFAILS = {b: load_xfails(xfail_file(b)) for b in BACKENDS}


def _params(paths, key):
    for backend, simplify in [("cpu", False)] + [(b, True) for b in BACKENDS]:
        reason = unavailable_reason(backend)
        label = backend if simplify else f"{backend}-raw"
        for p in paths:
            name = key(p)
            marks = []
            if reason:
                marks.append(pytest.mark.skip(reason=f"{backend} unavailable: {reason}"))
            elif name in XFAILS[backend]:
                marks.append(pytest.mark.xfail(strict=True, reason=XFAILS[backend][name]))
            yield pytest.param(backend, simplify, p, id=f"{label}-{name}", marks=marks)


@pytest.mark.parametrize("backend,simplify,case_dir", list(_params(
    [d for s in ("simple", "pytorch-converted", "pytorch-operator") for d in suite_case_dirs(s)],
    lambda d: f"{os.path.basename(os.path.dirname(d))}/{os.path.basename(d)}")))
def test_shipped_model_case(backend, simplify, case_dir):
    session = run_case(load_case_dir(case_dir), backend=backend, simplify=simplify)
    record_placement(backend, session)


@pytest.mark.parametrize("backend,simplify,model_path", list(_params(
    light_models(), lambda p: os.path.splitext(os.path.basename(p))[0])))
def test_light_model(backend, simplify, model_path, tmp_path):
    session = run_case(load_light_case(model_path, str(tmp_path)), backend=backend,
                       simplify=simplify)
    record_placement(backend, session)


def test_suites_are_complete():
    # The counts the issue asks for; a changed onnx wheel must not silently shrink them.
    assert len(suite_case_dirs("simple")) == 23
    assert len(suite_case_dirs("pytorch-converted")) == 82
    assert len(suite_case_dirs("pytorch-operator")) == 35
    assert len(light_models()) == 9
