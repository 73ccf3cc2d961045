"""The docs say what the parser takes: docs/reference.md and docs/gpuvfio.1 are what the command
tree writes (make docs), every environment variable gpuvfio reads is documented, and the man
page is valid roff (issue 15 item 3)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

from gpuvfio.cli import manpage

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Hooks for the test lanes, not for users.
TEST_HOOKS = {"GPUVFIO_TEST_PAUSE_AFTER_STEP", "GPUVFIO_PROBE_ROOT"}


@pytest.mark.parametrize("name, text", [("reference.md", manpage.markdown), ("gpuvfio.1", manpage.man)])
def test_committed_docs_are_the_command_trees(name, text):
    with open(os.path.join(REPO, "docs", name), encoding="utf-8") as handle:
        assert handle.read() == text(), f"docs/{name} is stale: run make docs"


def test_every_environment_variable_is_documented():
    read = set()
    for directory, _dirs, files in os.walk(os.path.join(REPO, "gpuvfio")):
        for name in files:
            if name.endswith((".py", ".sh")):
                with open(os.path.join(directory, name), encoding="utf-8") as handle:
                    read |= set(re.findall(r"\b(GPUVFIO_[A-Z_]+|LIBVIRT_DEFAULT_URI|SSH_AUTH_SOCK)\b", handle.read()))
    documented = {name for name, _text in manpage.ENVIRONMENT}
    assert read - TEST_HOOKS == documented


def test_every_command_is_in_the_reference():
    text = manpage.markdown()
    for path, _command in manpage.commands():
        assert f"## gpuvfio {' '.join(path)}".rstrip() + "\n" in text


def test_the_man_page_is_valid_roff():
    groff = shutil.which("groff")
    if groff is None:
        pytest.skip("groff is not installed")
    proc = subprocess.run([groff, "-man", "-Tutf8", "-ww", "-z"], input=manpage.man(), capture_output=True,
                          text=True, timeout=60, check=False)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr[:2000]
