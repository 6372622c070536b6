"""CPU micro-benchmark of the kernels small models spend their time in (RNN / GRU / LSTM,
depthwise / grouped / pointwise / small-spatial Conv, MaxPool / AveragePool /
GlobalAveragePool), plus two small models (a hand-written MobileNetV2 at 224x224 and a 2-layer
LSTM + 2-layer GRU), ember against onnxruntime.

    python benchmarks/bench_kernels_cpu.py [--cases lstm,dw,...] [--rounds 5]
        [--baseline DIR] [--json FILE]

Every runtime (and, with --baseline, an older ember: DIR is a folder holding a copy of the
`ember` package, e.g. one made with `git worktree add DIR/ember REV`) runs in a process of its
own, one per round, and the rounds interleave the runtimes (ember, onnxruntime, baseline,
ember, ...) so that machine noise hits them alike. Within a process each case is timed over
repeated runs (at least `--min-runs`, about `--seconds` of work) and reports its median; the
figure printed is the median over rounds of those medians. `--cases` takes case names or the
prefixes before the first ':' (lstm, gru, rnn, dw, group, pw, conv, pool, model); `all` (the
default) runs every case.

Models are written as ONNX files under .cache/bench-kernels/ (single nodes with onnx.helper;
the two models exported from torch, which is needed only for them). `--threads N` runs both
runtimes on N threads (OPENBLAS_NUM_THREADS / intra_op_num_threads): on a machine shared with
other work, `--threads 1` gives the steadier comparison. The depthwise 3x3 kernel uses numba
when it is importable; EMBER_NUMBA=0 in the environment measures the numpy kernel instead.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE = os.path.join(REPO, ".cache", "bench-kernels")


# ----------------------------------------------------------------------------------------------
# cases: name -> builder returning (onnx.ModelProto, feeds)


def _rng(seed=0):
    return np.random.default_rng(seed)


def _rnn_case(op, batch, seq=64, inp=256, hidden=256, direction="forward", lbr=1):
    gates = {"RNN": 1, "GRU": 3, "LSTM": 4}[op]
    d = 2 if direction == "bidirectional" else 1
    r = _rng(1)
    s = 1.0 / np.sqrt(hidden)
    X = r.standard_normal((seq, batch, inp)).astype(np.float32)
    W = (r.uniform(-s, s, (d, gates * hidden, inp))).astype(np.float32)
    R = (r.uniform(-s, s, (d, gates * hidden, hidden))).astype(np.float32)
    B = (r.uniform(-s, s, (d, 2 * gates * hidden))).astype(np.float32)
    attrs = {"hidden_size": hidden, "direction": direction}
    if op == "GRU":
        attrs["linear_before_reset"] = lbr
    return lambda: _rnn_model(op, X, W, R, B, attrs)


def _rnn_model(op, X, W, R, B, attrs):
    from onnx import TensorProto, helper, numpy_helper

    n_out = 3 if op == "LSTM" else 2
    outs = ["Y", "Y_h", "Y_c"][:n_out]
    node = helper.make_node(op, ["X", "W", "R", "B"], outs, **attrs)
    graph = helper.make_graph(
        [node], op.lower(), [helper.make_tensor_value_info("X", TensorProto.FLOAT, X.shape)],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outs],
        [numpy_helper.from_array(W, "W"), numpy_helper.from_array(R, "R"),
         numpy_helper.from_array(B, "B")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model, {"X": X}


def _conv_case(cin, cout, size, k=3, stride=1, group=1, pad=None, batch=1, bias=True):
    def build():
        from onnx import TensorProto, helper, numpy_helper

        r = _rng(2)
        x = r.standard_normal((batch, cin, size, size)).astype(np.float32)
        w = (r.standard_normal((cout, cin // group, k, k)) * 0.1).astype(np.float32)
        b = r.standard_normal(cout).astype(np.float32)
        p = (k // 2) if pad is None else pad
        inputs = ["x", "w"] + (["b"] if bias else [])
        node = helper.make_node("Conv", inputs, ["y"], kernel_shape=[k, k], strides=[stride] * 2,
                                pads=[p] * 4, group=group)
        inits = [numpy_helper.from_array(w, "w")] + ([numpy_helper.from_array(b, "b")]
                                                     if bias else [])
        graph = helper.make_graph([node], "conv",
                                  [helper.make_tensor_value_info("x", TensorProto.FLOAT, x.shape)],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                                  inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        model.ir_version = 8
        return model, {"x": x}
    return build


def _pool_case(op, c, size, k=3, stride=2, pad=1, batch=1, **extra):
    def build():
        from onnx import TensorProto, helper

        x = _rng(3).standard_normal((batch, c, size, size)).astype(np.float32)
        attrs = {} if op.startswith("Global") else dict(kernel_shape=[k, k],
                                                        strides=[stride] * 2, pads=[pad] * 4,
                                                        **extra)
        node = helper.make_node(op, ["x"], ["y"], **attrs)
        graph = helper.make_graph([node], "pool",
                                  [helper.make_tensor_value_info("x", TensorProto.FLOAT, x.shape)],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        model.ir_version = 8
        return model, {"x": x}
    return build


def _torch_model(kind, batch=1):
    def build():
        import io
        import contextlib
        import warnings

        import onnx
        import torch
        from torch import nn

        torch.manual_seed(0)
        if kind == "mobilenetv2":
            module = _mobilenet_v2(nn)
            x = _rng(4).standard_normal((batch, 3, 224, 224)).astype(np.float32)
        else:
            module = _lstm_gru(nn)
            x = _rng(5).standard_normal((batch, 64, 128)).astype(np.float32)
        module.eval()
        with torch.no_grad():
            for layer in module.modules():
                if isinstance(layer, nn.BatchNorm2d):
                    layer.running_mean.uniform_(-0.5, 0.5)
                    layer.running_var.uniform_(0.5, 2.0)
                    layer.weight.uniform_(0.5, 1.5)
                    layer.bias.uniform_(-0.5, 0.5)
        buf = io.BytesIO()
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), \
                contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            torch.onnx.export(module, (torch.from_numpy(x),), buf, dynamo=False,
                              opset_version=17, input_names=["x"])
        return onnx.load_from_string(buf.getvalue()), {"x": x}
    return build


def _mobilenet_v2(nn):
    """torchvision's MobileNetV2 (width 1.0, 1000 classes), written out by hand."""

    def conv_bn(cin, cout, k, stride, groups=1, act=True):
        layers = [nn.Conv2d(cin, cout, k, stride, k // 2, groups=groups, bias=False),
                  nn.BatchNorm2d(cout)]
        return layers + ([nn.ReLU6()] if act else [])

    class Inverted(nn.Module):
        def __init__(self, cin, cout, stride, t):
            super().__init__()
            mid = cin * t
            layers = [] if t == 1 else conv_bn(cin, mid, 1, 1)
            layers += conv_bn(mid, mid, 3, stride, groups=mid) + conv_bn(mid, cout, 1, 1, act=False)
            self.body = nn.Sequential(*layers)
            self.res = stride == 1 and cin == cout

        def forward(self, x):
            y = self.body(x)
            return x + y if self.res else y

    class MobileNetV2(nn.Module):
        def __init__(self):
            super().__init__()
            cfg = [(1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1),
                   (6, 160, 3, 2), (6, 320, 1, 1)]
            layers = conv_bn(3, 32, 3, 2)
            cin = 32
            for t, c, n, s in cfg:
                for i in range(n):
                    layers.append(Inverted(cin, c, s if i == 0 else 1, t))
                    cin = c
            layers += conv_bn(cin, 1280, 1, 1)
            self.features = nn.Sequential(*layers)
            self.classifier = nn.Linear(1280, 1000)

        def forward(self, x):
            x = self.features(x)
            return self.classifier(nn.functional.adaptive_avg_pool2d(x, 1).flatten(1))

    return MobileNetV2()


def _lstm_gru(nn):
    class LstmGru(nn.Module):
        """2-layer LSTM then 2-layer GRU, hidden 256, on (batch, 64, 128) sequences."""

        def __init__(self):
            super().__init__()
            self.lstm = nn.LSTM(128, 256, num_layers=2, batch_first=True)
            self.gru = nn.GRU(256, 256, num_layers=2, batch_first=True)
            self.head = nn.Linear(256, 10)

        def forward(self, x):
            y, _ = self.lstm(x)
            y, _ = self.gru(y)
            return self.head(y[:, -1])

    return LstmGru()


# MobileNetV2's depthwise convolutions (channels, input size, stride) at 224x224
_DW = [(32, 112, 1), (96, 112, 2), (144, 56, 1), (144, 56, 2), (192, 28, 1), (192, 28, 2),
       (384, 14, 1), (576, 14, 1), (576, 14, 2), (960, 7, 1)]
# its pointwise convolutions (cin, cout, size)
_PW = [(32, 16, 112), (16, 96, 112), (24, 144, 56), (144, 24, 56), (32, 192, 28),
       (192, 32, 28), (64, 384, 14), (384, 64, 14), (576, 96, 14), (160, 960, 7),
       (960, 160, 7), (320, 1280, 7)]

CASES = {}
for _op in ("LSTM", "GRU", "RNN"):
    for _b in (1, 8):
        CASES[f"{_op.lower()}:b{_b}"] = _rnn_case(_op, _b)
CASES["lstm:bidir:b8"] = _rnn_case("LSTM", 8, direction="bidirectional")
CASES["gru:lbr0:b8"] = _rnn_case("GRU", 8, lbr=0)
for _c, _s, _st in _DW:
    CASES[f"dw:{_c}x{_s}:s{_st}"] = _conv_case(_c, _c, _s, 3, _st, group=_c)
CASES["dw:32x112:s1:b4"] = _conv_case(32, 32, 112, 3, 1, group=32, batch=4)
CASES["dw5x5:240x14:s1"] = _conv_case(240, 240, 14, 5, 1, group=240)
for _ci, _co, _s in _PW:
    CASES[f"pw:{_ci}-{_co}x{_s}"] = _conv_case(_ci, _co, _s, 1, 1, pad=0)
CASES["group:g32-256x28"] = _conv_case(256, 256, 28, 3, 1, group=32)
CASES["group:g32-512x14:s2"] = _conv_case(512, 512, 14, 3, 2, group=32)
CASES["group:g8-64x56"] = _conv_case(64, 64, 56, 3, 1, group=8)
CASES["conv:3-32x224:s2"] = _conv_case(3, 32, 224, 3, 2)
CASES["conv:256x14"] = _conv_case(256, 256, 14, 3, 1)
CASES["conv:512x7"] = _conv_case(512, 512, 7, 3, 1)
CASES["conv:64x8:b8"] = _conv_case(64, 64, 8, 3, 1, batch=8)
CASES["pool:max3s2:64x112"] = _pool_case("MaxPool", 64, 112)
CASES["pool:avg3s2:64x112"] = _pool_case("AveragePool", 64, 112)
CASES["pool:avg3s1:256x28:incl"] = _pool_case("AveragePool", 256, 28, stride=1,
                                              count_include_pad=1)
CASES["pool:max2s2:128x56"] = _pool_case("MaxPool", 128, 56, k=2, pad=0)
CASES["pool:gap:1280x7"] = _pool_case("GlobalAveragePool", 1280, 7)
CASES["pool:gap:2048x7:b8"] = _pool_case("GlobalAveragePool", 2048, 7, batch=8)
CASES["pool:gap:256x56"] = _pool_case("GlobalAveragePool", 256, 56)
CASES["model:mobilenetv2"] = _torch_model("mobilenetv2")
CASES["model:lstm_gru:b1"] = _torch_model("lstm_gru", 1)
CASES["model:lstm_gru:b8"] = _torch_model("lstm_gru", 8)


def case_files(name):
    """Path of the case's ONNX model and its feeds (.npz), written on first use."""
    import onnx

    stem = os.path.join(CACHE, name.replace(":", "_"))
    path = stem + ".onnx"
    if not os.path.exists(path) or not os.path.exists(stem + ".npz"):
        os.makedirs(CACHE, exist_ok=True)
        model, feeds = CASES[name]()
        onnx.save(model, path)
        np.savez(stem + ".npz", **feeds)
    return path, stem + ".npz"


# ----------------------------------------------------------------------------------------------
# worker: one runtime, every case, in this process


def worker(runtime, names, seconds, min_runs, baseline, threads):
    if runtime == "baseline":
        sys.path.insert(0, baseline)
    results = {}
    for name in names:
        path, npz = case_files(name)
        feeds = dict(np.load(npz))
        if runtime == "onnxruntime":
            import onnxruntime as ort

            opts = ort.SessionOptions()
            if threads:
                opts.intra_op_num_threads = threads
                opts.inter_op_num_threads = 1
            sess = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
            run = lambda: sess.run(None, feeds)  # noqa: E731
        else:
            import ember

            sess = ember.load(path)
            run = lambda: sess.run(feeds)  # noqa: E731
        run()
        t0 = time.perf_counter()
        run()
        once = time.perf_counter() - t0
        n = max(min_runs, int(seconds / max(once, 1e-6)))
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
        results[name] = statistics.median(times) * 1e3
    print(json.dumps(results))


def _select(spec):
    if spec in ("", "all"):
        return list(CASES)
    names = []
    for item in spec.split(","):
        hits = [n for n in CASES if n == item or n.startswith(item + ":")]
        if not hits:
            raise SystemExit(f"no case matches {item!r}; cases: {', '.join(CASES)}")
        names += [h for h in hits if h not in names]
    return names


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="all")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=0.3,
                        help="work per case per round (runs = seconds / one run)")
    parser.add_argument("--min-runs", type=int, default=5)
    parser.add_argument("--baseline", help="folder holding an older `ember` package")
    parser.add_argument("--no-ort", action="store_true", help="skip onnxruntime")
    parser.add_argument("--threads", type=int, default=0,
                        help="threads for both runtimes (OpenBLAS / OpenMP for ember, "
                             "intra_op_num_threads for onnxruntime); 0: their defaults")
    parser.add_argument("--json", help="write the per-round figures here")
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    names = _select(args.cases)
    if args.list:
        print("\n".join(names))
        return 0
    if args.worker:
        worker(args.worker, names, args.seconds, args.min_runs, args.baseline, args.threads)
        return 0
    for n in names:  # build the files once, outside the timed processes
        case_files(n)
    runtimes = ["ember"] + ([] if args.no_ort else ["onnxruntime"]) \
        + (["baseline"] if args.baseline else [])
    per = {rt: {n: [] for n in names} for rt in runtimes}
    for r in range(args.rounds):
        order = runtimes if r % 2 == 0 else runtimes[::-1]
        for rt in order:
            cmd = [sys.executable, os.path.abspath(__file__), "--worker", rt, "--cases",
                   ",".join(names), "--seconds", str(args.seconds), "--min-runs",
                   str(args.min_runs)] + (["--baseline", args.baseline] if args.baseline else [])
            env = dict(os.environ)
            if args.threads:
                cmd += ["--threads", str(args.threads)]
                for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
                    env[var] = str(args.threads)
            out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env,
                                 cwd=REPO if rt != "baseline" else args.baseline).stdout
            for n, v in json.loads(out.strip().splitlines()[-1]).items():
                per[rt][n].append(v)
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    med = {rt: {n: statistics.median(v) for n, v in d.items()} for rt, d in per.items()}
    head = f"{'case':<26}" + "".join(f"{rt[:11] + ' ms':>15}" for rt in runtimes)
    if "onnxruntime" in runtimes:
        head += f"{'ember/ort':>10}" + (f"{'base/ort':>10}" if args.baseline else "")
    if args.baseline:
        head += f"{'base/ember':>11}"
    print(head)
    for n in names:
        line = f"{n:<26}" + "".join(f"{med[rt][n]:>15.3f}" for rt in runtimes)
        if "onnxruntime" in runtimes:
            o = med["onnxruntime"][n]
            line += f"{med['ember'][n] / o:>10.2f}"
            if args.baseline:
                line += f"{med['baseline'][n] / o:>10.2f}"
        if args.baseline:
            line += f"{med['baseline'][n] / med['ember'][n]:>11.2f}"
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(per, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
