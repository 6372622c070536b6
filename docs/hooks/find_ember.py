"""MkDocs hook: let mkdocstrings find the `ember` package, whose folder is the repository root.

griffe, which reads the docstrings, looks for a folder or file named `ember` on sys.path.
pyproject maps the package to the checkout (`package-dir = {"ember" = "."}`), whose folder
has any name, so the first `ember` griffe meets is the console script in the venv's bin/,
which it takes for an empty namespace package. Dropping the folders that hold that script
makes griffe import ember instead, and the editable install resolves it to this checkout.
"""
import os
import sys


def on_startup(command, dirty):
    # at startup, not at import (MkDocs restores sys.path after importing a hook) nor in
    # on_config (mkdocstrings reads sys.path in its own on_config, which runs first)
    sys.path[:] = [p for p in sys.path
                   if not os.path.isfile(os.path.join(p or os.curdir, "ember"))]
