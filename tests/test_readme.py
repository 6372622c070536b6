"""The README's ops table is generated from the registry; this fails when it is stale."""
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
