"""The fuzz worker: loads and runs mutants (tests/fuzz_mutants.py) one after another.

    python tests/fuzz_worker.py --serve [--base-seed S] [--mem BYTES]
        the runner's protocol: reads case ids from stdin, one a line; for each writes
        "START id", "CASE id {seed, mutation, params}" and "RESULT id {outcome...}" to stdout,
        flushed. Anything else (ember's prints, warnings) goes to stderr.

    python tests/fuzz_worker.py --case ID [--base-seed S] [--mem BYTES] [--dump model.onnx]
        rebuild one mutant, describe it, load and run it in this process and print the
        traceback of whatever it raises (or let it crash: that is the bug).

The address-space cap (RLIMIT_AS, --mem, default 3 GiB; 0 for none) is set before ember is
imported. Core dumps are off. faulthandler prints the Python stack on a fatal signal, and on
SIGUSR1 (what the runner sends a case past its timeout before killing the worker).
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import os
import resource
import signal
import sys
import tempfile

TESTS = os.path.dirname(os.path.abspath(__file__))


def _limits(mem_bytes: int) -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if mem_bytes > 0:
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        cap = mem_bytes if hard == resource.RLIM_INFINITY else min(mem_bytes, hard)
        resource.setrlimit(resource.RLIMIT_AS, (cap, hard))


def _env_defaults() -> None:
    for k, v in (("EMBER_NUMBA", "0"), ("OMP_NUM_THREADS", "1"), ("OPENBLAS_NUM_THREADS", "1"),
                 ("MKL_NUM_THREADS", "1"), ("EMBER_RANDOM_SEED", "0")):
        os.environ.setdefault(k, v)


def serve(base_seed: int, workdir: str) -> int:
    # The protocol gets a private copy of stdout; fd 1 itself goes to stderr, so nothing ember
    # (or a C library) prints can corrupt it.
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    import ember  # noqa: F401 - paid once, before the first case
    import fuzz_mutants as fm

    fm.seed_names()
    proto.write("READY\n")
    proto.flush()
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        case_id = int(line)
        proto.write(f"START {case_id}\n")
        proto.flush()
        if case_id < 0:
            info = fm.run_self_test(case_id)
            proto.write(f"RESULT {case_id} {json.dumps(info)}\n")
            proto.flush()
            continue
        try:
            mutant = fm.make_case(case_id, base_seed)
        except Exception as exc:  # a fuzzer bug, not an ember one
            where, _ = fm._frames(exc.__traceback__)
            info = {"outcome": "harness_error", "error": type(exc).__name__,
                    "message": str(exc).replace("\n", " ")[:300], "where": where}
            proto.write(f"RESULT {case_id} {json.dumps(info)}\n")
            proto.flush()
            continue
        proto.write(f"CASE {case_id} {json.dumps(mutant.describe())}\n")
        proto.flush()
        info = fm.run_mutant(mutant, workdir)
        del mutant
        proto.write(f"RESULT {case_id} {json.dumps(info, default=str)}\n")
        proto.flush()
    return 0


def one_case(case_id: int, base_seed: int, dump: str | None) -> int:
    import traceback

    import ember
    import fuzz_mutants as fm

    mutant = fm.make_case(case_id, base_seed)
    print(f"case {case_id}: seed {mutant.seed}, mutation {mutant.mutation}: {mutant.params}")
    if dump:
        with open(dump, "wb") as f:
            f.write(mutant.model_bytes())
        print(f"wrote the mutant model to {dump}")
    feeds = mutant.feeds
    print("feeds:", {k: (getattr(v, "dtype", type(v).__name__), getattr(v, "shape", None))
                     for k, v in feeds.items()} if isinstance(feeds, dict) else repr(feeds)[:200])
    workdir = tempfile.mkdtemp(prefix="ember-fuzz-case-")
    try:
        source = fm.materialize(mutant, workdir)
        sess = ember.load(source, backend="cpu")
        print("loaded")
        out = sess.run(feeds)
        print("ran:", {k: (getattr(v, "dtype", type(v).__name__), getattr(v, "shape", None))
                       for k, v in out.items()})
        print("outcome: ran")
    except ember.EmberError as exc:
        traceback.print_exc()
        if fm.internal_cause(exc) is not None:  # a bug of ember's, wrapped
            print("outcome: internal_error")
            return 1
        print("outcome: ember_error")
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
        print("outcome: python_error")
        return 1
    finally:
        import shutil

        shutil.rmtree(workdir, ignore_errors=True)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--serve", action="store_true", help="the runner's line protocol")
    mode.add_argument("--case", type=int, help="run one case in this process")
    p.add_argument("--base-seed", type=int, default=0)
    p.add_argument("--mem", type=int, default=3 << 30, help="RLIMIT_AS in bytes (0: none)")
    p.add_argument("--workdir", default=None, help="where models loaded from files are written")
    p.add_argument("--dump", metavar="MODEL.onnx", help="with --case: also write the mutant model")
    args = p.parse_args(argv)
    _env_defaults()
    _limits(args.mem)
    faulthandler.enable(all_threads=True)
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    sys.path.insert(0, TESTS)
    if args.serve:
        return serve(args.base_seed, args.workdir or tempfile.mkdtemp(prefix="ember-fuzz-"))
    return one_case(args.case, args.base_seed, args.dump)


if __name__ == "__main__":
    raise SystemExit(main())
