"""The README against the code: the ops table is generated from the registry (this fails when
it is stale), and the command-line synopsis must list exactly the parsers' commands and options."""
import argparse
import os
import re

from ember.cli import ops_table_markdown

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")
START, END = "<!-- ops-table:start -->", "<!-- ops-table:end -->"


def readme_table() -> str:
    text = open(README).read()
    match = re.search(re.escape(START) + r"\n(.*?)" + re.escape(END), text, re.S)
    assert match, "README.md lacks the ops-table markers"
    return match.group(1)


def update_readme() -> None:
    text = open(README).read()
    start, end = text.index(START) + len(START), text.index(END)
    with open(README, "w") as f:
        f.write(text[:start] + "\n" + ops_table_markdown() + text[end:])


def test_ops_table_is_current():
    assert readme_table() == ops_table_markdown(), \
        "README ops table is stale: run python tests/test_readme.py"


if __name__ == "__main__":
    update_readme()


def _synopsis() -> dict[str, set[str]]:
    """Command -> the options the README's "Command line" block shows for it."""
    text = open(README).read()
    block = text.split("## Command line", 1)[1].split("```", 2)[1]
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
    """Every command and option the CLI has is in the README's synopsis, and nothing else."""
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
            problems.append(f"ember {command}: not in the README {missing}, "
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
