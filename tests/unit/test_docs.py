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
TEST_HOOKS = {"GPUVFIO_PROBE_ROOT"}


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
    assert groff, "groff is not installed (the man page cannot be checked: a failure, not a skip)"
    proc = subprocess.run([groff, "-man", "-Tutf8", "-ww", "-z"], input=manpage.man(), capture_output=True,
                          text=True, timeout=60, check=False)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr[:2000]


SECTIONS = ["NAME", "SYNOPSIS", "DESCRIPTION", "COMMANDS", "GLOBAL OPTIONS", "EXAMPLES", "FILES", "ENVIRONMENT",
            "EXIT STATUS", "SEE ALSO"]


def test_man_shows_the_sections_an_admin_looks_for(tmp_path):
    """Read by man(1) itself, as an admin reads it: every section, in order (man-pages(7))."""
    man = shutil.which("man")
    assert man, "man is not installed (the page cannot be read as admins read it: a failure, not a skip)"
    page = tmp_path / "gpuvfio.1"
    page.write_text(manpage.man(), encoding="utf-8")
    proc = subprocess.run([man, "-l", str(page)], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "MANPAGER": "cat", "PAGER": "cat", "MANWIDTH": "100"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    headings = [line.strip() for line in proc.stdout.splitlines() if line and not line[0].isspace()][1:-1]
    assert headings == SECTIONS, headings
    for path, _text in manpage.FILES:
        assert path in proc.stdout.replace("\u2010", "-")


@pytest.mark.parametrize("example", [command for command, _text in manpage.EXAMPLES])
def test_every_example_is_a_command_the_parser_takes(example):
    import shlex

    import typer.main

    from gpuvfio.cli import app

    words = shlex.split(example)[1:]
    command = typer.main.get_command(app)
    path = []
    while hasattr(command, "commands") and words and words[0] in command.commands:
        path.append(words[0])
        command = command.commands[words.pop(0)]
    assert path, example
    with command.make_context(" ".join(["gpuvfio", *path]), list(words)) as ctx:  # a usage error raises
        assert ctx.params is not None


def test_every_option_and_argument_has_help_and_a_metavar_in_words():
    missing, typed = [], []
    for path, command in manpage.commands():
        for param in command.params:
            if getattr(param, "hidden", False) or param.name in ("help",):
                continue
            if not (getattr(param, "help", None) or "").strip():
                missing.append(f"gpuvfio {' '.join(path)} {param.opts[0]}")
    for name, _help in (row for path, command in manpage.commands() for row in manpage.rows(path, command)):
        if re.search(r"<[a-z\[\]]+>", name):
            typed.append(name)
    assert missing == []
    assert typed == []
