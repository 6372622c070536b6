"""Hardening (issue 13): no malformed model, hostile size or odd feed may crash the process, hang
it, or escape as anything but an EmberError; and no bad command line may print a traceback.
An EmberError wrapping an AttributeError, TypeError, IndexError (fm.INTERNAL_ERRORS) raised
by ember's own code is a bug too (issue 43): the wrapping must not hide it.

The fuzzer lives in tests/fuzz_mutants.py (mutants, runner) and tests/fuzz_worker.py (the
subprocess that loads and runs them, with an address-space cap). Reproduce one case with
`python tests/fuzz_worker.py --case ID`; a whole campaign with `benchmarks/fuzz_report.py`.

`test_fuzz_long` (20,000 mutants) is skipped unless selected with `-m fuzz_long` or
EMBER_FUZZ_LONG=1.
"""
from __future__ import annotations

import json
import os
import queue
import resource
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import fuzz_mutants as fm

CORPUS_CASES = 2000
LONG_CASES = 20000
TIMEOUT_S = 20.0
MEM_BYTES = 3 << 30
WORKERS = int(os.environ.get("EMBER_FUZZ_WORKERS", "2"))


def _campaign(case_ids, base_seed: int = 0):
    t0 = time.monotonic()
    results = fm.run_cases(case_ids, timeout_s=TIMEOUT_S, mem_bytes=MEM_BYTES, workers=WORKERS,
                           base_seed=base_seed)
    seconds = time.monotonic() - t0
    summary = fm.summarize(results)
    print(f"\nfuzz campaign (base seed {base_seed}): {seconds:.0f} s\n{summary}")
    return results, seconds, summary


def _assert_all_accepted(results, n_cases, seconds, summary):
    assert len(results) == n_cases, f"{n_cases - len(results)} cases came back without a result"
    bad = [r for r in results if r.outcome not in fm.ACCEPTED]
    assert not bad, (f"{len(bad)} of {len(results)} mutants ended other than `ran` or an "
                     f"EmberError free of internal exceptions ({seconds:.0f} s)\n"
                     f"{fm.failure_table(bad)}\n\n{summary}")


def test_fuzz_mutants_are_deterministic():
    """A case id names one mutant: the same bytes and feeds every time it is built."""
    def digest(m):
        feeds = m.feeds if isinstance(m.feeds, dict) else {"": m.feeds}
        return (m.seed, m.mutation, m.params, m.model_bytes(), m.as_file,
                sorted((k, repr(v)[:2000]) for k, v in feeds.items()))

    for case_id in list(range(0, 130)) + list(range(1000, 1040)):
        if case_id < len(fm.pinned_cases()) and fm.pinned_cases()[case_id][0] == "long_chain":
            continue  # 10k+ nodes: slow to compare, and built by a loop with no randomness
        assert digest(fm.make_case(case_id)) == digest(fm.make_case(case_id)), case_id
    kinds = {fm.make_case(i).mutation for i in range(len(fm.MUTATIONS))}
    assert kinds == set(fm.MUTATIONS)  # the pinned prefix runs every kind once


def test_fuzz_runner_classifies_crashes_hangs_and_errors():
    """The runner's self-test cases: a segfault, a sleep past the timeout, a ValueError, an
    allocation past the address-space cap, an EmberError, a pass, an EmberError wrapping an
    AttributeError raised in ember's code. The worker that crashes or hangs is replaced, and
    the cases after it still run."""
    results = fm.run_cases(sorted(fm.SELF_TESTS), timeout_s=5.0, mem_bytes=MEM_BYTES, workers=2)
    got = {r.case_id: r for r in results}
    assert {k: got[k].outcome for k in fm.SELF_TESTS} == fm.SELF_TESTS
    assert got[-1].error == "SIGSEGV"
    assert got[-4].error == "MemoryError"
    assert got[-3].error == "ValueError" and got[-3].where.startswith("tests/fuzz_mutants.py:")
    assert got[-5].error == "InvalidModelError"
    assert got[-7].error == "ExecutionError" and got[-7].cause == "AttributeError"
    assert got[-7].cause_where.startswith("runtime/executor.py:")
    assert "internal_error" not in fm.ACCEPTED  # so the campaigns below fail on one


def test_internal_exceptions_wrapped_in_ember_errors_are_bugs(monkeypatch):
    """An AttributeError (TypeError, IndexError...) raised by ember's own code and wrapped as
    an ExecutionError is a bug the fuzzer reports (`internal_error`), not an accepted error;
    the wrapper keeps it as __cause__. A library's refusal that ember turns into an error on
    purpose (numpy cannot convert a feed) is not."""
    import ember
    from ember.ops.registry import lookup
    from ember.runtime import executor
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    session = ember.load(model, simplify=False)
    with pytest.raises(ember.InputError) as info:
        session.run({"x": {"not": "an array"}})
    assert isinstance(info.value.__cause__, TypeError)
    assert fm.internal_cause(info.value) is None

    def broken(self, x):
        return executor._describe(None)  # AttributeError inside ember's executor

    monkeypatch.setattr(lookup("", "Relu", 17), "run", broken)
    with pytest.raises(ember.ExecutionError) as info:
        ember.load(model, simplify=False).run({"x": np.zeros(2, np.float32)})
    assert isinstance(info.value.__cause__, AttributeError)
    assert fm.internal_cause(info.value) is info.value.__cause__


def test_fuzz_corpus():
    """About 2,000 mutants of ~90 seed models: each loads and runs, or fails with an EmberError
    that wraps no internal exception of ember's (fm.INTERNAL_ERRORS)."""
    results, seconds, summary = _campaign(range(CORPUS_CASES))
    _assert_all_accepted(results, CORPUS_CASES, seconds, summary)


def _long_selected(config) -> bool:
    return "fuzz_long" in (config.getoption("markexpr", "") or "") or \
        os.environ.get("EMBER_FUZZ_LONG", "") not in ("", "0")


@pytest.mark.fuzz_long
def test_fuzz_long(request):
    """20,000 mutants (another base seed): skipped unless -m fuzz_long or EMBER_FUZZ_LONG=1."""
    if not _long_selected(request.config):
        pytest.skip("long fuzz campaign: select it with -m fuzz_long or EMBER_FUZZ_LONG=1")
    results, seconds, summary = _campaign(range(LONG_CASES), base_seed=1)
    _assert_all_accepted(results, LONG_CASES, seconds, summary)

# --------------------------------------------------------------------------------------------
# the command line

ERROR, OK, EITHER = (2,), (0,), (0, 2)


def _cli_fixtures(tmp) -> dict[str, str]:
    import onnx

    mlp = os.path.join(fm.REPO, "models", "mlp.onnx")  # x: float32 [batch, 4]
    data = open(mlp, "rb").read()
    paths = {}

    def write(name, content: bytes) -> str:
        path = os.path.join(tmp, name)
        with open(path, "wb") as f:
            f.write(content)
        paths[name.split(".")[0].upper()] = path
        return path

    write("m.onnx", data)
    write("corrupt.onnx", data[: len(data) // 2])
    write("empty.onnx", b"")
    write("garbage.onnx", bytes(range(256)) * 4)
    write("text.txt", b"hello, not a model\n")
    write("nota.npy", b"this is not a numpy file")
    for variant in ("split_3_of_4", "regex_undefined", "layernorm_axis_max", "if_reads_own_output"):
        out = fm.m_issue13(None, None, variant)
        write(f"{variant}.onnx", out["model"].SerializeToString())
    deep, _ = fm._nested_if(50)
    write("deep_if_50.onnx", deep.SerializeToString())
    np.save(os.path.join(tmp, "x.npy"), np.ones((2, 4), dtype=np.float32))
    np.save(os.path.join(tmp, "x64.npy"), np.ones((2, 4), dtype=np.float64))
    np.save(os.path.join(tmp, "x3d.npy"), np.ones((2, 4, 1), dtype=np.float32))
    np.save(os.path.join(tmp, "xobj.npy"), np.array([{"a": 1}], dtype=object), allow_pickle=True)
    np.savez(os.path.join(tmp, "x.npz"), x=np.ones((2, 4), dtype=np.float32))
    np.savez(os.path.join(tmp, "wrongkey.npz"), nope=np.ones((2, 4), dtype=np.float32))
    os.makedirs(os.path.join(tmp, "adir"))
    paths.update(M=os.path.join(tmp, "m.onnx"), DIR=os.path.join(tmp, "adir"),
                 MISSING=os.path.join(tmp, "missing.onnx"), NPY=os.path.join(tmp, "x.npy"),
                 NPY64=os.path.join(tmp, "x64.npy"), NPY3D=os.path.join(tmp, "x3d.npy"),
                 NPYOBJ=os.path.join(tmp, "xobj.npy"), NPZ=os.path.join(tmp, "x.npz"),
                 NPZKEY=os.path.join(tmp, "wrongkey.npz"), TMP=tmp)
    assert onnx.load(paths["M"]).graph.input[0].name == "x"
    return paths


# (arguments, accepted exit codes). {NAME} is a fixture path; relative paths are in a fresh
# folder of each invocation's own (so `convert -o missing/dir/pkg` creates nothing another sees).
CLI_CASES = [
    # top level
    ([], ERROR), (["bogus-command"], ERROR), (["--version"], OK), (["run"], ERROR),
    # run: model paths
    (["run", "{MISSING}"], ERROR), (["run", "{DIR}"], ERROR), (["run", "{EMPTY}"], ERROR),
    (["run", "{CORRUPT}"], ERROR), (["run", "{GARBAGE}"], ERROR), (["run", "{TEXT}"], ERROR),
    (["run", "{M}"], OK), (["run", "{M}", "--no-simplify"], OK), (["run", "{M}", "extra"], ERROR),
    (["run", "{SPLIT_3_OF_4}"], ERROR), (["run", "{REGEX_UNDEFINED}"], ERROR),
    (["run", "{LAYERNORM_AXIS_MAX}"], ERROR), (["run", "{IF_READS_OWN_OUTPUT}"], ERROR),
    (["run", "{DEEP_IF_50}"], EITHER),
    # run: --dim
    (["run", "{M}", "--dim", "batch=2"], OK), (["run", "{M}", "--dim", "batch=-1"], ERROR),
    (["run", "{M}", "--dim", "batch=100000000000"], ERROR),
    (["run", "{M}", "--dim", "batch=99999999999999999999999"], ERROR),
    (["run", "{M}", "--dim", "foo=3"], ERROR), (["run", "{M}", "--dim", "batch"], ERROR),
    (["run", "{M}", "--dim", "=3"], ERROR), (["run", "{M}", "--dim", "batch=abc"], ERROR),
    (["run", "{M}", "--dim", "batch=1e3"], ERROR), (["run", "{M}", "--dim", "batch=0"], EITHER),
    (["run", "{M}", "--dim", "batch=2", "--dim", "batch=3"], EITHER),
    (["run", "{M}", "--dim"], ERROR),
    # run: -o
    (["run", "{M}", "-o", "missing/dir/out.npz"], ERROR), (["run", "{M}", "-o", "{DIR}"], EITHER),
    (["run", "{M}", "-o", "out.npz"], OK), (["run", "{M}", "-o", "/proc/ember-fuzz.npz"], ERROR),
    (["run", "{M}", "-o", ""], EITHER),
    # run: -i
    (["run", "{M}", "-i", "x={NPY}"], OK), (["run", "{M}", "-i", "x={MISSING}.npy"], ERROR),
    (["run", "{M}", "-i", "x={TEXT}"], ERROR), (["run", "{M}", "-i", "x={NOTA}"], ERROR),
    (["run", "{M}", "-i", "x={DIR}"], ERROR), (["run", "{M}", "-i", "x={NPYOBJ}"], ERROR),
    (["run", "{M}", "-i", "x={NPY64}"], ERROR), (["run", "{M}", "-i", "x={NPY3D}"], ERROR),
    (["run", "{M}", "-i", "nope={NPY}"], ERROR), (["run", "{M}", "-i", "x"], ERROR),
    (["run", "{M}", "-i", "={NPY}"], ERROR), (["run", "{M}", "-i", "x={NPZ}"], ERROR),
    # run: backends, seeds, options
    (["run", "{M}", "--backend", "nope"], ERROR), (["run", "{M}", "--backend", ""], EITHER),
    (["run", "{M}", "--backend", "CPU"], EITHER), (["run", "{M}", "--backend", "cuda"], EITHER),
    (["run", "{M}", "--seed", "abc"], ERROR), (["run", "{M}", "--seed", "-1"], EITHER),
    (["run", "{M}", "--seed", str(2 ** 80)], EITHER), (["run", "{M}", "--bogus-option"], ERROR),
    # info, ops
    (["info", "{MISSING}"], ERROR), (["info", "{DIR}"], ERROR), (["info", "{CORRUPT}"], ERROR),
    (["info", "{EMPTY}"], ERROR), (["info", "{M}"], OK), (["info", "{M}", "--backend", "nope"], ERROR),
    (["info", "{SPLIT_3_OF_4}"], EITHER), (["info", "{SPLIT_3_OF_4}", "--backend", "cpu"], ERROR),
    (["ops"], OK), (["ops", "extra"], ERROR),
    # check
    (["check", "{MISSING}"], ERROR), (["check", "{DIR}"], ERROR), (["check", "{CORRUPT}"], ERROR),
    (["check", "{M}", "--ref", "nope"], ERROR), (["check", "{M}", "--ref", "{MISSING}.npz"], ERROR),
    (["check", "{M}", "--ref", "{DIR}"], ERROR), (["check", "{M}", "--backend", "nope"], ERROR),
    (["check", "{M}", "--ref", "cpu"], OK), (["check", "{M}", "--atol", "abc"], ERROR),
    (["check", "{M}", "--rtol", "x:y"], ERROR), (["check", "{M}", "--atol", "-1"], ERROR),
    (["check", "{M}", "--range", "x=5,1"], ERROR), (["check", "{M}", "--range", "x=abc"], ERROR),
    (["check", "{M}", "--chunk", "0", "--bisect"], ERROR),
    (["check", "{M}", "--chunk", "-5", "--bisect"], ERROR),
    (["check", "{M}", "--inputs", "{MISSING}.npz"], ERROR), (["check", "{M}", "--inputs", "{TEXT}"], ERROR),
    (["check", "{M}", "--inputs", "{NPZKEY}"], ERROR), (["check", "{M}", "--check", "bogus"], ERROR),
    (["check", "{M}", "--ref", "cpu", "--save-golden", "missing/dir/g.npz"], ERROR),
    (["check", "{M}", "--ref", "cpu", "--json", "missing/dir/r.json"], ERROR),
    (["check", "{M}", "--dim", "batch=-1", "--ref", "cpu"], ERROR),
    (["check", "{SPLIT_3_OF_4}", "--ref", "cpu"], ERROR),
    (["check", "{LAYERNORM_AXIS_MAX}", "--ref", "cpu"], ERROR),
    # convert
    (["convert", "{MISSING}"], ERROR), (["convert", "{DIR}"], ERROR), (["convert", "{CORRUPT}"], ERROR),
    (["convert", "{M}", "-o", "{M}"], ERROR), (["convert", "{M}", "-o", "pkg_ok", "-q"], OK),
    (["convert", "{M}", "-o", "missing/dir/pkg", "-q"], EITHER),
    (["convert", "{IF_READS_OWN_OUTPUT}", "-o", "pkg_if", "-q"], ERROR),
    (["convert", "{SPLIT_3_OF_4}", "-o", "pkg_split", "-q"], ERROR),
    # simplify
    (["simplify", "{M}"], ERROR), (["simplify", "{MISSING}", "-o", "s.onnx"], ERROR),
    (["simplify", "{CORRUPT}", "-o", "s.onnx"], ERROR),
    (["simplify", "{M}", "-o", "missing/dir/s.onnx"], ERROR), (["simplify", "{M}", "-o", "{DIR}"], ERROR),
    (["simplify", "{M}", "-o", "s1.onnx", "--skip", "nope"], ERROR),
    (["simplify", "{M}", "-o", "s2.onnx", "--backend", "nope"], ERROR),
    (["simplify", "{M}", "-o", "s3.onnx"], OK),
    (["simplify", "{M}", "-o", "s4.onnx", "--dim", "batch=-1"], ERROR),
    (["simplify", "{SPLIT_3_OF_4}", "-o", "s5.onnx"], ERROR),
    (["simplify", "{LAYERNORM_AXIS_MAX}", "-o", "s6.onnx"], ERROR),
]


# A handful of invocations run as real `python -m ember` subprocesses: the entry point itself,
# and stderr exactly as a user sees it. The others run in-process, in a worker subprocess
# (`_cli_serve`): starting Python and importing ember for each of ~100 invocations took 2-3
# minutes; one import serves them all in well under a minute.
TRUE_SUBPROCESS = [
    [], ["bogus-command"], ["run", "{M}"], ["run", "{M}", "--dim", "batch=-1"],
    ["run", "{M}", "-o", "missing/dir/out.npz"], ["check", "{M}", "--chunk", "0", "--bisect"],
    ["simplify", "{M}", "-o", "s2.onnx", "--backend", "nope"],
]
CLI_TIMEOUT_S = 120


def _limit_child():
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_AS, (MEM_BYTES, resource.getrlimit(resource.RLIMIT_AS)[1]))


def _strip_usage(lines: list[str]) -> list[str]:
    """argparse's own errors print the usage block first; the error is the line after it."""
    if lines and lines[0].startswith("usage:"):
        for i, line in enumerate(lines):
            if ": error:" in line:
                return lines[i:]
        return []
    return lines


def _verdict(args: list[str], accepted: tuple, returncode: int, stdout: str,
             err: str) -> str | None:
    """None when an invocation that ended this way behaved; else what went wrong."""
    last = next((line for line in reversed(err.splitlines()) if line.strip()), "")
    if returncode < 0:
        import signal

        return f"killed by {signal.Signals(-returncode).name}: {last[:160]}"
    if "Traceback (most recent call last)" in err:
        return f"exit {returncode} with a traceback: {last[:200]}"
    if returncode not in accepted:
        said = last or (stdout.strip().splitlines()[-1:] or [""])[0]
        return f"exit {returncode}, expected {'/'.join(map(str, accepted))}: {said[:200]}"
    if returncode == 2:
        lines = _strip_usage([line for line in err.splitlines() if line.strip()])
        if not args and not lines:
            return None  # bare `ember`: the help, on stdout
        if len(lines) != 1 or "error" not in lines[0]:
            return f"exit 2 but stderr is not one error line: {lines[:4]!r}"[:300]
    return None


def _judge(args: list[str], accepted: tuple, cwd: str) -> str | None:
    """Run `python -m ember ARGS` in `cwd` (created here) and judge it."""
    cmd = [sys.executable, "-m", "ember", *args]
    os.makedirs(cwd, exist_ok=True)
    try:
        p = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=CLI_TIMEOUT_S,
                           env=fm.worker_env(), preexec_fn=_limit_child)
    except subprocess.TimeoutExpired:
        return f"hung past {CLI_TIMEOUT_S} s"
    return _verdict(args, accepted, p.returncode, p.stdout, p.stderr)


# -- the in-process worker

def _cli_serve() -> int:
    """The worker's loop: reads `[cwd, args]` JSON lines on stdin; for each runs
    ember.cli.main(args) in cwd with file descriptors 1 and 2 captured (C libraries' output
    included, as a subprocess would capture it) and writes {"code", "stdout", "stderr"} as
    one JSON line on its protocol channel, a private copy of the original stdout."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    import ember.cli  # noqa: F401 - imported once, for every invocation

    for line in sys.stdin:
        cwd, args = json.loads(line)
        code, out, err = _captured(lambda: _call_main(args), cwd)
        proto.write(json.dumps({"code": code, "stdout": out, "stderr": err}) + "\n")
    return 0


def _call_main(args: list[str]) -> int:
    """ember.cli.main(args)'s exit status as `python -m ember` would have it: its return
    value, a SystemExit's code (argparse), or 1 with the traceback on stderr when an
    exception escapes (what the interpreter prints for an uncaught exception)."""
    from ember.cli import main

    try:
        code = main(args)
    except SystemExit as exc:
        code = exc.code
    except BaseException:  # noqa: BLE001 - an exception escaping main is what is detected
        traceback.print_exc()
        return 1
    if code is None or isinstance(code, int):
        return code or 0
    print(code, file=sys.stderr)  # SystemExit("message"): printed, exit 1
    return 1


def _captured(fn, cwd: str) -> tuple[int, str, str]:
    """(fn(), what it wrote to fd 1, to fd 2), run in `cwd`."""
    os.makedirs(cwd, exist_ok=True)
    here = os.getcwd()
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        os.chdir(cwd)
        try:
            code = fn()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
            os.chdir(here)
        texts = []
        for f in (out, err):
            f.seek(0)
            texts.append(f.read().decode("utf-8", "replace"))
    return code, texts[0], texts[1]


class _CliWorker:
    """A worker subprocess (`_cli_serve`) under the same limits as the real subprocesses."""

    def __init__(self, cwd: str):
        here = os.path.dirname(os.path.abspath(__file__))
        boot = (f"import sys; sys.path[:0] = [{fm.TESTS!r}, {here!r}]; import test_fuzz; "
                f"sys.exit(test_fuzz._cli_serve())")
        self.proc = subprocess.Popen([sys.executable, "-c", boot], cwd=cwd, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, env=fm.worker_env(),
                                     preexec_fn=_limit_child)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)  # the worker is gone

    def ask(self, args: list[str], cwd: str) -> tuple[int, str, str] | None:
        """(exit code, stdout, stderr) of one invocation, or None if the worker died (a
        signal) or hung on it; the worker is then stopped."""
        try:
            self.proc.stdin.write(json.dumps([cwd, args]) + "\n")
            self.proc.stdin.flush()
            line = self.lines.get(timeout=CLI_TIMEOUT_S)
        except (BrokenPipeError, queue.Empty):
            line = None
        if line is None:
            self.close()
            return None
        result = json.loads(line)
        return result["code"], result["stdout"], result["stderr"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def _judge_in_process(cases: list[tuple[int, list[str], tuple]], root: str) -> dict[int, str | None]:
    """Verdicts of `cases` ((index, args, accepted)), run one after another in a worker; an
    invocation that kills or hangs the worker runs again as a plain subprocess (whose verdict
    says how it died), and a new worker takes the cases after it."""
    verdicts = {}
    worker = None
    for i, args, accepted in cases:
        cwd = os.path.join(root, f"cwd{i}")
        worker = worker or _CliWorker(root)
        result = worker.ask(args, cwd)
        if result is None:
            worker = None
            verdicts[i] = _judge(args, accepted, cwd + "-subprocess")
            continue
        verdicts[i] = _verdict(args, accepted, *result)
    if worker is not None:
        worker.close()
    return verdicts


def test_cli_bad_invocations(tmp_path):
    """Every bad command line exits 2 with one error line on stderr (argparse's usage block
    before it is allowed), never a traceback or a signal; the valid ones exit 0."""
    assert all(args in [a for a, _ in CLI_CASES] for args in TRUE_SUBPROCESS)
    paths = _cli_fixtures(str(tmp_path))
    cases = [(i, [a.format(**paths) for a in args], accepted)
             for i, (args, accepted) in enumerate(CLI_CASES)]
    real = [c for c in cases if CLI_CASES[c[0]][0] in TRUE_SUBPROCESS]
    assert len(real) >= 5
    with ThreadPoolExecutor(max_workers=1) as pool:  # the real ones beside the worker
        futures = {i: pool.submit(_judge, args, accepted, str(tmp_path / f"cwd{i}"))
                   for i, args, accepted in real}
        verdicts = _judge_in_process([c for c in cases if c[0] not in futures], str(tmp_path))
        verdicts.update((i, f.result()) for i, f in futures.items())
    failures = [(" ".join(args).replace(str(tmp_path) + os.sep, ""), verdicts[i])
                for i, args, _ in cases if verdicts[i] is not None]
    assert not failures, f"{len(failures)} of {len(cases)} invocations misbehaved:\n" + \
        "\n".join(f"  ember {a}\n      -> {v}" for a, v in failures)


def test_cli_worker_reports_like_a_subprocess(tmp_path):
    """The in-process path sees what a subprocess would: exit codes (argparse's SystemExit
    included), stdout, an exception escaping main as a traceback; a worker that dies answers
    None, so the runner falls back to a subprocess."""
    root = str(tmp_path)
    worker = _CliWorker(root)
    try:
        code, out, err = worker.ask(["ops"], os.path.join(root, "a"))
        assert code == 0 and "Relu" in out and not err
        code, out, err = worker.ask(["run", "--bogus"], os.path.join(root, "b"))
        assert code == 2 and err.startswith("usage:") and "error:" in err
        code, out, err = worker.ask(["run", 7], os.path.join(root, "c"))  # TypeError in argparse
        assert code == 1 and "Traceback (most recent call last)" in err
        assert _verdict(["run", 7], ERROR, code, out, err).startswith("exit 1 with a traceback")
        os.kill(worker.proc.pid, 9)
        assert worker.ask(["ops"], os.path.join(root, "d")) is None
    finally:
        worker.close()
