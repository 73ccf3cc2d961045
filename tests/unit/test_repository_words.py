"""Every tracked file reads for someone who has only the repository (issue 26).

A reader has this repository, public programs and public documents (the kernel, libvirt,
QEMU, NCCL, NVIDIA's docs, cited by name and version). They do not have the machines or
tools its authors once worked with, notes kept beside the checkout, or the checkout's place
on one machine. So no tracked file -- code, comments, tests, docs, data -- may contain:

* a phrase from that surrounding machinery (``PHRASES``): names of tools and notes outside
  the project, and "sessions" of work on it. Phrases, not single words: "session" alone is
  also an SSH session (paramiko's ``Session``, ssh's ControlMaster), which is fine;
* an absolute path that is not a public, well-known place. The rule: an absolute path may
  start only with a top-level directory of the Filesystem Hierarchy Standard 3.0 (``/bin``,
  ``/boot``, ``/dev``, ``/etc``, ``/home``, ``/lib*``, ``/media``, ``/mnt``, ``/opt``,
  ``/root``, ``/run``, ``/sbin``, ``/srv``, ``/tmp``, ``/usr``, ``/var``) or Linux's
  ``/proc`` and ``/sys``: gpuvfio reads and writes those on every host, and docs use them in
  examples (``/root/.ssh/hv1``, ``/srv/fixtures/...``). Roots that name no place on disk are
  allowed as such: ``/nonexistent``, ``/nope``, ``/path`` (deliberately absent paths in tests
  and examples) and ``/devices`` (a path into a libvirt domain's XML). Any other root
  (``/work``, ``/workspace``, ``/scratch``, ``/data``...) is one machine's layout. On top of
  that, the checkout's own absolute path followed by ``/`` (computed here, wherever the
  checkout lies) never appears: a file inside the repository is named relative to its root.

A path is taken to start where a ``/`` follows the start of a line, white space, a quote or
one of ``( [ { = ,``: that skips URLs (``https://host/x``, ``qemu:///system``), relative paths
(``tests/data/x``), XML closing tags (``</devices>``) and placeholders (``<out>/results``).
``.gitignore`` files are not read for paths (their leading ``/`` anchors at the repository
root). Binary files (a NUL byte, or not UTF-8) are skipped.
"""

from __future__ import annotations

import os
import re
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Between the words of a phrase: white space, or a comment's line break and marker.
_GAP = r"(?:\s|#|//|\*|--)+"
# Matched against the lower-cased text, one pattern at a time (each starts with a literal, which
# keeps the scan fast); written so that this file does not match itself: "[.]" for a dot, _GAP
# between words.
PHRASES = [
    "device" + _GAP + "tool",
    r"kinds[.]md", r"h200[.]md", r"[.]library/", r"lanes[.]md", r"anchors[.]md", r"[.][.]/shared\b",
    "earlier" + _GAP + r"sessions?\b", "gpu" + _GAP + r"sessions?\b", "this" + _GAP + r"session\b",
    "the" + _GAP + "session's", "next" + _GAP + r"sessions?\b",
    r"files[_]at\b", r"budget[_]left_s\b",  # that machinery's own field names
]
_PHRASES = [re.compile(p) for p in PHRASES]
FHS = {"bin", "boot", "dev", "etc", "home", "lib", "lib32", "lib64", "libx32", "media", "mnt", "opt", "root", "run",
       "sbin", "srv", "tmp", "usr", "var", "proc", "sys"}
# Roots that name no place: deliberately absent paths in tests and examples, and XPath-like
# paths into a libvirt domain's XML (``/devices/hostdev`` in a definition's difference), and
# JSON pointers into a Kubernetes object (``/spec/configuration/...`` in the KubeVirt patch).
NOWHERE = {"nonexistent", "nope", "path", "devices", "spec"}
_ROOT = re.compile(r"/(\w[\w.+-]*)(?=/)")
_STARTS = frozenset(" \t\r\n'\"`([{=,")


def _line(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def findings(name: str, text: str, checkouts: tuple[str, ...] = ()) -> list[str]:
    """``name:line: what`` for every forbidden phrase or path in one file's text."""
    lower = text.lower()
    found = [f"{name}:{_line(text, m.start())}: {text[m.start():m.end()]!r}"
             for pattern in _PHRASES for m in pattern.finditer(lower)]
    if os.path.basename(name) != ".gitignore":
        found += [f"{name}:{_line(text, m.start())}: absolute path under /{m.group(1)}"
                  for m in _ROOT.finditer(text)
                  # in any case: mutation testing's record quotes "/proc/..." upper-cased by a mutant
                  if (m.start() == 0 or text[m.start() - 1] in _STARTS) and m.group(1).lower() not in FHS | NOWHERE]
    for checkout in checkouts:
        start = text.find(checkout + "/")
        while start >= 0:
            found.append(f"{name}:{_line(text, start)}: the checkout's own absolute path {checkout!r}")
            start = text.find(checkout + "/", start + 1)
    return found


def _checkouts() -> tuple[str, ...]:
    return tuple(sorted({os.path.abspath(REPO), os.path.realpath(REPO)} - {"/"}))


def _tracked() -> list[str]:
    try:
        proc = subprocess.run(["git", "-C", REPO, "ls-files", "-z"], capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        proc = None
    if proc is None or proc.returncode != 0:
        pytest.skip("not a git checkout (or no git): nothing is tracked")
    return [p for p in proc.stdout.decode("utf-8", "surrogateescape").split("\0") if p]


def _text(path: str) -> str | None:
    try:
        with open(path, "rb") as handle:
            data = handle.read()
    except (FileNotFoundError, IsADirectoryError):  # deleted in the working tree, or a submodule
        return None
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def test_no_tracked_file_names_what_a_reader_does_not_have():
    checkouts = _checkouts()
    found, read = [], 0
    for name in _tracked():
        text = _text(os.path.join(REPO, name))
        if text is None:
            continue
        read += 1
        found += findings(name, text, checkouts)
    assert read > 50  # the scan saw the repository, not an empty list
    assert not found, "words or paths a reader of the repository does not have:\n" + "\n".join(found)


@pytest.mark.parametrize("line", [
    "run it with the " + "device" + " tool's run call",
    "# as the device\n# " + "tool returns",
    "see KINDS" + ".md for the image",
    "the notes in H200" + ".md",
    "cat /" + "work/.lib" + "rary/device/README.md",
    "from earlier " + "sessions' runs",
    "what a GPU " + "session will run",
    "in this " + "session",
    "into the " + "session's note",
    "the next " + "session",
    "lanes" + ".md and anchors" + ".md",
    "cp x ../sha" + "red/y",
    "under files" + "_at",
    'OUT = "/' + 'work/main/out"',
    "path=/" + "scratch/x.txt",
    "  /" + "workspace/repo/tests",
])
def test_the_scan_finds_a_sample_line(line):
    """The scan is not vacuous: each kind of word and path it forbids is found in a sample."""
    assert findings("sample.md", line), line


def test_the_scan_finds_the_checkout_path_and_passes_what_is_allowed():
    checkout = "/home/alice/src/gpuvfio"
    assert findings("x.py", f'LOG = "{checkout}/build/log"', (checkout,))
    assert not findings("Vagrantfile", f'REPO_IN_BOX = "{checkout}"', (checkout,))  # the place itself, not a file
    allowed = ["echo 1 > /sys/bus/pci/drivers/vfio-pci/bind", "key = \"/root/.ssh/hv1\"", "qemu:///system",
               "https://gitlab.com/qemu-project/qemu/-/blob/v9.0.0/docs/x.rst", "tests/data/gpu-lane-h200/raw",
               "<out>/results/<variant>/rep-0.json", "</devices>", "--loader /nope/CODE.fd",
               "socket=/nonexistent/libvirt-sock", "root: /srv/fixtures/dgx-h100.host",
               "an SSH session to the host", "paramiko's Session", "the session to the remote hypervisor",
               "/usr/share/OVMF/OVMF_CODE.fd", "OUT=/tmp/lane sh tests/lanes/gpu_lane.sh"]
    for line in allowed:
        assert not findings("sample.md", line), line
    assert not findings(".gitignore", "/" + "build/\n/" + ".venv/\n")


def test_this_file_passes_its_own_scan():
    """Its phrases and samples are written so as not to match themselves (tracked or not yet)."""
    with open(os.path.abspath(__file__), encoding="utf-8") as handle:
        assert findings("tests/unit/test_repository_words.py", handle.read(), _checkouts()) == []
