"""gpuvfio imports on every Python it declares (requires-python >= 3.10), Debian 13's 3.13 among
them: what one interpreter accepts another may refuse at compile time.

Python 3.13 strips the indentation of docstrings when it compiles them (What's New in Python
3.13: "Compiler now strips indents from docstrings"), and that step encodes the docstring to UTF-8:
one holding a lone surrogate (an unescaped "\\ud800" in a docstring that is not raw) stops the
module from importing at all. gpuvfio.strictjson did, under the current stack's Python.
"""

from __future__ import annotations

import ast
import glob
import os
import shutil
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SOURCES = sorted(p for folder in ("gpuvfio", "tests", "benchmarks", "playbooks")
                 for p in glob.glob(os.path.join(REPO, folder, "**", "*.py"), recursive=True))


def _docstrings(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                yield body[0].lineno, body[0].value.value


def test_no_docstring_holds_what_utf8_cannot_encode():
    bad = []
    for path in SOURCES:
        with open(path, encoding="utf-8") as handle:
            tree = ast.parse(handle.read(), path)
        for line, text in _docstrings(tree):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as exc:
                bad.append(f"{os.path.relpath(path, REPO)}:{line}: {exc.reason} at {exc.start}")
    assert SOURCES and not bad, bad


def _pythons() -> list[str]:
    """Interpreters of each minor version 3.10-3.13 found here (on PATH, or pyenv's in ~/.pyenv)."""
    found = {}
    for minor in range(10, 14):
        name = f"python3.{minor}"
        pyenv = sorted(glob.glob(os.path.expanduser(f"~/.pyenv/versions/3.{minor}.*/bin/{name}")))
        path = pyenv[-1] if pyenv else shutil.which(name)
        if path and os.access(path, os.X_OK):
            found[name] = path
    return sorted(found.values())


@pytest.mark.parametrize("python", _pythons() or ["none"])
def test_every_module_compiles_on_each_python_found(python):
    """Every module of gpuvfio compiled by each interpreter found here."""
    if python == "none":
        pytest.skip("no other Python here: the docstring rule above stands for 3.13's compiler")
    script = ("import sys\nbad = []\nfor p in sys.argv[1:]:\n"
              "    try:\n        compile(open(p, encoding='utf-8').read(), p, 'exec')\n"
              "    except Exception as e:\n        bad.append(f'{p}: {type(e).__name__}: {e}')\n"
              "print('\\n'.join(bad)); sys.exit(1 if bad else 0)\n")
    targets = [p for p in SOURCES if p.startswith(os.path.join(REPO, "gpuvfio") + os.sep)]
    proc = subprocess.run([python, "-c", script, *targets], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
