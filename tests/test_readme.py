"""The README and the docs against the code: the ops table (docs/ops.md) is generated from the
registry (this fails when it is stale), and the command-line synopsis (docs/cli.md) must list
exactly the parsers' commands and options.

`python tests/test_readme.py` regenerates the ops table."""
import argparse
import os
import re

import pytest

from ember.cli import ops_table_markdown

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
# the pages the README's reference sections moved to (MkDocs builds them, mkdocs.yml)
DOCS = os.path.join(ROOT, "docs")
OPS_PAGE = os.path.join(DOCS, "ops.md")
CLI_PAGE = os.path.join(DOCS, "cli.md")
API_PAGE = os.path.join(DOCS, "api.md")
NATIVE_PAGE = os.path.join(DOCS, "native.md")
START, END = "<!-- ops-table:start -->", "<!-- ops-table:end -->"


def ops_page_table() -> str:
    text = open(OPS_PAGE).read()
    match = re.search(re.escape(START) + r"\n(.*?)" + re.escape(END), text, re.S)
    assert match, "docs/ops.md lacks the ops-table markers"
    return match.group(1)


def update_ops_page() -> None:
    text = open(OPS_PAGE).read()
    start, end = text.index(START) + len(START), text.index(END)
    with open(OPS_PAGE, "w") as f:
        f.write(text[:start] + "\n" + ops_table_markdown() + text[end:])


def test_ops_table_is_current():
    assert ops_page_table() == ops_table_markdown(), \
        "docs/ops.md's ops table is stale: run python tests/test_readme.py"


if __name__ == "__main__":
    update_ops_page()


def _synopsis() -> dict[str, set[str]]:
    """Command -> the options the "Command line" block of docs/cli.md shows for it."""
    text = open(CLI_PAGE).read()
    block = text.split("# Command line", 1)[1].split("```", 2)[1]
    options: dict[str, set[str]] = {}
    command = None
    for line in block.splitlines():
        code = line.split("#", 1)[0]
        words = code.split()
        if words[:1] == ["ember"] and len(words) > 1 and not words[1].startswith("-"):
            command = words[1]
            options.setdefault(command, set())
        if command is None:
            continue
        for token in re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", code):
            options[command].add(token)
    return options


def _parser_options() -> dict[str, set[str]]:
    from ember.cli import _parser

    parser = _parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {name: {o for a in p._actions for o in a.option_strings if o not in ("-h", "--help")}
            for name, p in sub.choices.items()}


def test_readme_synopsis_matches_the_parsers():
    """Every command and option the CLI has is in docs/cli.md's synopsis, and nothing else."""
    shown, real = _synopsis(), _parser_options()
    assert set(shown) == set(real), (set(real) ^ set(shown))
    problems = []
    for command in real:
        # an option may appear by its short or its long name
        parser = _parser_for(command)
        missing = [a.option_strings for a in parser._actions
                   if a.option_strings and not set(a.option_strings) & shown[command]
                   and "-h" not in a.option_strings]
        unknown = shown[command] - real[command]
        if missing or unknown:
            problems.append(f"ember {command}: not in docs/cli.md {missing}, "
                            f"not in the parser {sorted(unknown)}")
    assert not problems, "\n".join(problems)


def _parser_for(command: str):
    from ember.cli import _parser

    sub = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


def test_every_command_has_a_description():
    for command in _parser_options():
        parser = _parser_for(command)
        assert parser.description, f"`ember {command} --help` has no description"


# -- the install section and the configuration against pyproject.toml ------------------------

PYPROJECT = os.path.join(ROOT, "pyproject.toml")
EXECUTOR = os.path.join(ROOT, "runtime", "executor.py")


def _pyproject() -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    with open(PYPROJECT, "rb") as f:
        return tomllib.load(f)


def _install_section() -> tuple[str, str]:
    """(the prose of README's Install section, its first code block)."""
    section = open(README).read().split("## Install", 1)[1].split("\n## ", 1)[0]
    prose, block, _ = section.split("```", 2)
    return prose, block


def test_install_section_lists_exactly_the_extras():
    extras = set(_pyproject()["project"]["optional-dependencies"])
    _, block = _install_section()
    shown = set(re.findall(r'pip install -e "\.\[([\w-]+)\]"', block))
    assert shown == extras, f"in pyproject only: {sorted(extras - shown)}, " \
                            f"in the README only: {sorted(shown - extras)}"


def test_install_section_gives_the_python_version_and_the_clone_and_venv_steps():
    requires = _pyproject()["project"]["requires-python"]
    match = re.fullmatch(r">=\s*(\d+\.\d+)", requires.strip())
    assert match, f"requires-python {requires!r}: the README states only a lower bound"
    prose, block = _install_section()
    assert f"Python {match.group(1)} or newer" in prose
    assert "git clone" in block and re.search(r"python3? -m venv", block) and \
        re.search(r"^pip install -e \.(\s|$)", block, re.M)


def test_pytest_addopts_keep_the_test_names_visible():
    """`-q` in addopts would hide what ran (and the placement summary's context) by default."""
    import shlex

    addopts = _pyproject()["tool"]["pytest"]["ini_options"].get("addopts", "")
    options = shlex.split(addopts) if isinstance(addopts, str) else list(addopts)
    assert not {"-q", "--quiet"} & set(options) and \
        not any(re.fullmatch(r"-q+", o) for o in options), addopts


def _placements_in_the_source() -> set[str]:
    """The placements runtime/executor.py can give a node, read from its source: the string
    constants `Plan._place` and `host_placement` return (first of a returned pair), directly or
    through a variable they assign them to."""
    import ast

    tree = ast.parse(open(EXECUTOR).read())
    functions = {f.name: f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)}
    found = set()
    for name in ("_place", "host_placement"):
        body = list(ast.walk(functions[name]))
        assigned: dict[str, set[str]] = {}
        for node in body:
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and \
                    isinstance(node.value.value, str):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        assigned.setdefault(target.id, set()).add(node.value.value)
        for node in body:
            if not isinstance(node, ast.Return) or node.value is None:
                continue
            value = node.value.elts[0] if isinstance(node.value, ast.Tuple) else node.value
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                found.add(value.value)
            elif isinstance(value, ast.Name):
                found |= assigned.get(value.id, set())
    return found


def _documented_placements() -> set[str]:
    text = open(API_PAGE).read()
    bullet = text.split("- `Session.placement` gives", 1)[1].split("\n- ", 1)[0]
    return set(re.findall(r"`(\w+)`", bullet))


def test_every_placement_is_documented():
    import numpy as np
    from onnx import TensorProto, helper

    import ember
    from backends import present_backends

    in_source = _placements_in_the_source()
    assert not in_source - _documented_placements(), \
        f"placements docs/api.md does not describe: {sorted(in_source - _documented_placements())}"
    # the scan finds what sessions report: the CPU's, and a device's on Shape (metadata),
    # shape arithmetic, an If (control) and a Relu (device)
    branch = helper.make_graph([helper.make_node("Relu", ["x"], ["b"])], "branch", [],
                               [helper.make_tensor_value_info("b", TensorProto.FLOAT, None)])
    nodes = [helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("Gather", ["s", "zero"], ["n"]),
             helper.make_node("Relu", ["x"], ["r"]),
             helper.make_node("If", ["flag"], ["y"], then_branch=branch, else_branch=branch)]
    model = helper.make_model(helper.make_graph(
        nodes, "placements",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3]),
         helper.make_tensor_value_info("flag", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT if n != "n" else TensorProto.INT64,
                                       None) for n in ("r", "y", "n")],
        [helper.make_tensor("zero", TensorProto.INT64, [], [0])]),
        opset_imports=[helper.make_opsetid("", 18)])
    for backend in present_backends():
        session = ember.load(model, backend=backend, simplify=False)
        session.run({"x": np.ones((2, 3), np.float32), "flag": np.array(True)})
        reported = {where for _, _, where in session.placement}
        assert reported <= in_source, (backend, reported - in_source)
        if backend != "cpu":
            assert {"metadata", "shape", "control", "device"} <= reported, reported


def test_the_package_ships_py_typed():
    """PEP 561: the marker sits in the package and pyproject's package data carries it."""
    import ember

    assert os.path.isfile(os.path.join(os.path.dirname(ember.__file__), "py.typed"))
    assert "py.typed" in _pyproject()["tool"]["setuptools"]["package-data"]["ember"]


def test_readme_links_resolve():
    """The README's relative links name files that exist: MkDocs fails on a broken link between
    the docs pages (mkdocs build --strict in CI), but the README is no page of the site."""
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", open(README).read())
    missing = [t for t in targets if "://" not in t and not os.path.exists(os.path.join(ROOT, t))]
    assert targets and not missing, f"README links to missing files: {missing}"


def test_readme_stays_short():
    """The README is the front page (what ember is, install, quickstart, tests); the reference
    lives in docs/ (issue 44). About 300 lines is its budget."""
    lines = open(README).read().count("\n")
    assert lines <= 300, f"README.md has {lines} lines: move reference material into docs/"


# -- what the README and the docs promise, run ----------------------------------------------

def test_readme_custom_kernel_example_leaves_its_input_alone():
    """The FastRelu kernel of docs/native.md, registered and run where its input is also read by
    a later node and is the caller's feed: both stay intact, and the results are onnxruntime's
    for the same graph with Relu."""
    import numpy as np
    from onnx import TensorProto, helper

    import ember
    from ember.ops import registry

    ort = pytest.importorskip("onnxruntime")
    text = open(NATIVE_PAGE).read()
    example = next(block for block in re.findall(r"```python\n(.*?)```", text, re.S)
                   if "class FastRelu" in block)
    key = ("cpu", registry.normalize_domain("com.example"), "FastRelu")
    assert key not in registry._TABLE
    try:
        exec(compile(example, "docs/native.md", "exec"), {})

        def model(relu_op, domain):
            nodes = [helper.make_node(relu_op, ["x"], ["y"], domain=domain),
                     helper.make_node("Neg", ["x"], ["z"])]  # reads x after the kernel ran
            info = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 5]) for n in "xyz"]
            opsets = [helper.make_opsetid("", 18)] + \
                ([helper.make_opsetid(domain, 1)] if domain else [])
            return helper.make_model(helper.make_graph(nodes, "g", info[:1], info[1:]),
                                     opset_imports=opsets)

        x = np.linspace(-2, 2, 10, dtype=np.float32).reshape(2, 5)
        feed = x.copy()
        got = ember.load(model("FastRelu", "com.example"), simplify=False).run({"x": feed})
        reference = ort.InferenceSession(model("Relu", "").SerializeToString(),
                                         providers=["CPUExecutionProvider"])
        want = dict(zip(["y", "z"], reference.run(None, {"x": x})))
        np.testing.assert_array_equal(feed, x)
        for name in ("y", "z"):
            np.testing.assert_array_equal(got[name], want[name])
    finally:
        registry._TABLE.pop(key, None)


@pytest.mark.parametrize("level, logged", [("info", True), ("", False), ("warning", False)])
def test_ember_log_sets_the_level_and_sends_records_to_stderr(level, logged):
    """EMBER_LOG=info logs each load on stderr (read at import, so a fresh process); unset or
    at warning, a load says nothing."""
    import subprocess
    import sys

    root = ROOT
    env = {k: v for k, v in os.environ.items() if k != "EMBER_LOG"}
    if level:
        env["EMBER_LOG"] = level
    code = "import ember; ember.load('models/mlp.onnx')"
    run = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert ("ember INFO: loaded" in run.stderr) == logged, run.stderr
    if not logged:
        assert run.stderr == "", run.stderr
