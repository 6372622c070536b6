"""ember.config: every EMBER_* variable the package reads is in its table, parsed one way."""
from __future__ import annotations

import os
import re

import pytest

from ember import config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _variables_in_source() -> set[str]:
    found = set()
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in {"tests", "benchmarks", "models", "docs", ".git",
                                                ".venv", "build"}]
        for name in files:
            if name.endswith(".py") and name != "config.py":
                text = open(os.path.join(folder, name), encoding="utf-8").read()
                found.update(re.findall(r"\bEMBER_[A-Z_]+[A-Z]\b", text))
    return found


def test_every_variable_the_package_names_is_in_the_table():
    named = _variables_in_source()
    assert named - set(config.VARIABLES) == set()
    table = config.__doc__.split("|---|", 1)[1]
    assert set(re.findall(r"`(EMBER_[A-Z_]+)`", table)) == set(config.VARIABLES)


@pytest.mark.parametrize("value,on", [("1", True), ("yes", True), ("on", True), ("0", False),
                                      ("false", False), ("No", False), ("", False),
                                      (" FALSE ", False)])
def test_a_switch_is_off_for_zero_false_no_or_empty(monkeypatch, value, on):
    monkeypatch.setenv("EMBER_NUMBA", value)
    assert config.switch("EMBER_NUMBA", True) is on
    monkeypatch.delenv("EMBER_NUMBA")
    assert config.switch("EMBER_NUMBA", True) is True
    assert config.switch("EMBER_NUMBA", False) is False


def test_text_is_stripped_and_empty_is_unset(monkeypatch):
    monkeypatch.setenv("EMBER_BACKEND", "  opencl ")
    assert config.text("EMBER_BACKEND") == "opencl"
    monkeypatch.setenv("EMBER_BACKEND", "  ")
    assert config.text("EMBER_BACKEND") is None


def test_an_unknown_variable_is_refused():
    with pytest.raises(KeyError, match="EMBER_NOPE"):
        config.text("EMBER_NOPE")


def test_the_cache_root(monkeypatch, tmp_path):
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))
    assert config.cache_root() == str(tmp_path)
    monkeypatch.delenv("EMBER_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert config.cache_root() == str(tmp_path / "xdg" / "ember")
