"""Every CUDA C source the CUDA backend carries compiles, with no GPU or driver needed.

Each ops/cuda module lists its RawKernel sources and its ElementwiseKernel bodies (wrapped into
full __global__ functions) in a module-level `CUDA_SOURCES = {name: source}`. This test
compiles each of them to SASS for sm_80 (A100) and sm_90 (H100/H200) with NVRTC from the
`nvidia-cuda-nvrtc-cu12` wheel, loaded through ctypes; it is skipped only when that wheel is
not installed. Also here: the ops/cuda modules import without cupy, and the backend says
clearly why it cannot start on a machine without cupy or without a CUDA driver.
"""
from __future__ import annotations

import ctypes
import glob
import importlib
import os
import pkgutil
import subprocess
import sys

import pytest

ARCHS = ("sm_80", "sm_90")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cuda_modules():
    import ember.ops.cuda as pkg

    return [importlib.import_module(f"ember.ops.cuda.{m.name}")
            for m in pkgutil.iter_modules(pkg.__path__) if not m.name.startswith("_")]


def _all_sources() -> dict[str, str]:
    found = {}
    for module in _cuda_modules():
        for name, source in getattr(module, "CUDA_SOURCES", {}).items():
            found[f"{module.__name__.rsplit('.', 1)[1]}.{name}"] = source
    return found


SOURCES = _all_sources()


def _find_nvrtc() -> str | None:
    try:
        import nvidia.cuda_nvrtc as wheel  # the nvidia-cuda-nvrtc-cu12 wheel
    except ImportError:
        return None
    for root in list(getattr(wheel, "__path__", [])):
        libs = sorted(glob.glob(os.path.join(root, "lib", "libnvrtc.so*")))
        libs = [p for p in libs if "builtins" not in os.path.basename(p)]
        if libs:
            return libs[0]
    return None


@pytest.fixture(scope="module")
def nvrtc():
    path = _find_nvrtc()
    if path is None:
        pytest.skip("NVRTC not installed: pip install nvidia-cuda-nvrtc-cu12")
    lib = ctypes.CDLL(path)
    lib.nvrtcGetErrorString.restype = ctypes.c_char_p
    return lib


def compile_source(lib, source: str, name: str, arch: str) -> tuple[bool, str, int]:
    """Compile `source` with NVRTC for `arch`: (ok, log, size of the CUBIN)."""
    prog = ctypes.c_void_p()
    rc = lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), f"{name}.cu".encode(),
                                0, None, None)
    assert rc == 0, f"nvrtcCreateProgram: {lib.nvrtcGetErrorString(rc).decode()}"
    try:
        opts = [f"--gpu-architecture={arch}".encode(), b"--std=c++14"]
        rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        text = log.value.decode(errors="replace")
        if rc != 0:
            return False, f"{lib.nvrtcGetErrorString(rc).decode()}\n{text}", 0
        cubin = ctypes.c_size_t()
        assert lib.nvrtcGetCUBINSize(prog, ctypes.byref(cubin)) == 0
        return True, text, cubin.value
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def test_sources_are_collected():
    assert SOURCES, "no CUDA_SOURCES found in ember.ops.cuda"
    for module in _cuda_modules():
        text = open(module.__file__).read()
        if "raw_kernel(" in text or "elementwise_kernel(" in text:
            assert getattr(module, "CUDA_SOURCES", None), \
                f"{module.__name__} builds CUDA kernels but lists no CUDA_SOURCES"
    for name, source in SOURCES.items():
        kernel = name.split(".", 1)[1]
        assert f"void {kernel}(" in source, f"{name}: no __global__ function named {kernel}"


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", sorted(SOURCES))
def test_source_compiles(nvrtc, name, arch):
    ok, log, cubin = compile_source(nvrtc, SOURCES[name], name.replace(".", "_"), arch)
    assert ok, f"{name} does not compile for {arch}:\n{log}"
    assert cubin > 0
    assert "warning" not in log.lower(), f"{name} ({arch}) compiles with warnings:\n{log}"


def test_a_broken_source_is_caught(nvrtc):
    ok, log, _ = compile_source(nvrtc, 'extern "C" __global__ void k(float* y) { y[0] = z; }',
                                "broken", "sm_80")
    assert not ok and "z" in log


# ---------------------------------------------------------------------------------------------
# without a GPU: import-safety and a clear error


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=REPO, timeout=300)


def test_cuda_ops_import_without_cupy():
    result = _python(
        "import sys; sys.modules['cupy'] = None\n"  # `import cupy` raises ImportError
        "from ember.ops.registry import supported_ops\n"
        "ops = supported_ops('cuda')\n"
        "assert ('', 'Conv') in ops and ('', 'MatMul') in ops and ('', 'Relu') in ops, ops\n"
        "assert 'cupy' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
        "print(len(ops))\n")
    assert result.returncode == 0, result.stderr
    assert int(result.stdout.split()[-1]) > 100


def test_backend_without_cupy_says_how_to_install():
    result = _python(
        "import sys; sys.modules['cupy'] = None\n"
        "from ember.errors import BackendUnavailableError\n"
        "from ember.runtime.backends.cuda import CudaBackend\n"
        "try:\n    CudaBackend()\nexcept BackendUnavailableError as e:\n    print(e)\n"
        "else:\n    raise SystemExit('no error')\n")
    assert result.returncode == 0, result.stderr
    assert "needs cupy" in result.stdout and "pip install 'ember[cuda]'" in result.stdout


def _has_cuda_device() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def test_backend_without_driver_says_what_is_missing():
    pytest.importorskip("cupy")
    if _has_cuda_device():
        pytest.skip("this machine has a CUDA device")
    import ember
    from ember.errors import BackendUnavailableError
    from ember.runtime.backends.cuda import CudaBackend

    with pytest.raises(BackendUnavailableError, match="NVIDIA|CUDA device"):
        CudaBackend()
    with pytest.raises(BackendUnavailableError):
        ember.load(os.path.join(REPO, "models", "mlp.onnx"), backend="cuda")
