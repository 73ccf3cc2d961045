"""Host fixtures: a compact text record of what gpuvfio reads from a host.

Modelled on umockdev's records. One record a line:

    D <path>            a directory
    F <path> <text>     a text file (content escaped: \\n, \\\\, \\xNN)
    B <path> <hex>      a binary file (PCI config space)
    L <path> <target>   a relative symlink

Paths are relative to the host root. ``load_fixture`` materialises a fixture into a directory
that works as ``--root``, refusing absolute paths, ``..`` and links that leave the target
directory; ``open_host`` is how every command opens its root, a directory or a fixture.
gpuvfio.host.recording writes them (gpuvfio dump-host), apart: what it reads to record a host
is loaded only when a host is recorded.
"""

from __future__ import annotations

import codecs
import contextlib
import os
import stat

from gpuvfio.errors import GpuvfioError, HostReadError, InputError
from gpuvfio.files import NotRegular, Tree, scratch_dir
from gpuvfio.user_files import read_regular, user_dir
from gpuvfio.host.root import HostRoot
from gpuvfio.host.walk import MAX_COMPONENTS
from gpuvfio.settings import ROOT_ENV, Settings
from gpuvfio.tree_filler import TreeFiller

HEADER = "# gpuvfio host fixture v1"
FIXTURE_LIMIT = 256 << 20  # a recording of a host of thousands of functions is tens of MiB
# Bounds on a recording's structure (it is input from anyone): a record's path no deeper than the
# walks that read it, a record no longer than the recorder writes (a file's first MiB, each byte
# at most four characters escaped), and a record count far above the 2,119-function host's.
MAX_RECORD_CHARS = 5 << 20
MAX_RECORDS = 2_000_000

def _unesc(text: str) -> str:
    return codecs.decode(text, "unicode_escape")


def _fd_link(parts: list[str]) -> bool:
    """proc/PID/fd/N: an open file's name (/dev/nvidia0), recorded as data and only ever read
    with readlink, never followed."""
    return len(parts) == 4 and parts[0] == "proc" and parts[1].isdigit() and parts[2] == "fd" and parts[3].isdigit()


def load_fixture(text: str, target: str) -> str:
    """Materialise fixture ``text`` under directory ``target``; returns ``target``.

    A fixture is input from anyone (``gpuvfio --root bug-report.host``), and gpuvfio runs as root:
    nothing is written outside ``target``. Every record goes through the file layer
    (gpuvfio.files: each component opened with O_NOFOLLOW, so a component that is a link refuses
    the record), so links are created but never followed while loading; each link's target must
    stay inside ``target`` from where the link really is, which is checked again once all links
    exist (a chain of links inside can still lead out).
    """
    lines = text.splitlines()
    if not lines or lines[0].strip() != HEADER:
        raise InputError("not a gpuvfio host fixture (missing header line)")
    if len(lines) > MAX_RECORDS + 1:
        raise InputError(f"the host fixture has {len(lines) - 1} records; at most {MAX_RECORDS} are loaded")
    user_dir(target, create=True)  # made when missing (its parent must exist)
    top = os.path.realpath(target)
    links: list[tuple[int, str]] = []
    try:
        with TreeFiller(Tree(top)) as tree:
            _fill(tree, lines, top, links)
    except GpuvfioError as exc:
        if isinstance(exc, InputError):
            raise
        raise InputError(f"cannot load the host fixture into {target}: {exc}") from None
    for number, rel in links:  # now that every link exists: chains resolved as the kernel would
        real = os.path.realpath(os.path.join(top, rel))
        if real != top and not real.startswith(top + "/"):
            raise InputError(f"fixture line {number}: link {rel} leads outside the root")
    return target


def _fill(tree: TreeFiller, lines: list[str], top: str, links: list[tuple[int, str]]) -> None:
    """Every record of a fixture's lines, written; the links that must be checked once all exist
    are added to ``links``."""
    for number, line in enumerate(lines[1:], start=2):
        if not line or line.startswith("#"):
            continue
        if len(line) > MAX_RECORD_CHARS:
            raise InputError(f"fixture line {number}: {len(line)} characters; a record is at most "
                             f"{MAX_RECORD_CHARS} (a recorded file's first MiB, escaped)")
        kind, _, rest = line.partition(" ")
        rel_esc, _, payload = rest.partition(" ")
        try:
            rel = _unesc(rel_esc)
        except (UnicodeDecodeError, ValueError):
            raise InputError(f"fixture line {number}: malformed path") from None
        parts = rel.split("/")
        if not rel or any(p in ("", ".", "..") or "\0" in p for p in parts):
            raise InputError(f"fixture line {number}: unsafe path {rel!r}")
        if len(parts) > MAX_COMPONENTS:
            raise InputError(f"fixture line {number}: {len(parts)} path components; at most {MAX_COMPONENTS} "
                             "(the file layer's walk)")
        if not _encodable(rel):
            raise InputError(f"fixture line {number}: malformed path (not UTF-8)")
        try:
            _record(tree, kind, parts, payload, number, rel, top)
        except InputError:
            raise
        except GpuvfioError as exc:  # a link on the way, a name too long, no space left: this line
            raise InputError(f"fixture line {number}: {rel}: {exc}") from None
        if kind == "L" and not _fd_link(parts):
            links.append((number, rel))


def _record(tree: TreeFiller, kind: str, parts: list[str], payload: str, number: int, rel: str, top: str) -> None:
    if kind == "D":
        tree.make_dir(parts)
    elif kind in ("F", "B"):
        try:
            data = _unesc(payload).encode("utf-8") if kind == "F" else bytes.fromhex(payload)
        except (ValueError, UnicodeError):
            raise InputError(f"fixture line {number}: bad {'text' if kind == 'F' else 'hex'} data") from None
        try:
            tree.write(parts, data)
        except NotRegular:
            raise InputError(f"fixture line {number}: {rel} is a link or a directory already") from None
    elif kind == "L":
        try:
            link_target = _unesc(payload)
        except (UnicodeDecodeError, ValueError):
            raise InputError(f"fixture line {number}: malformed link target") from None
        if not link_target or "\0" in link_target:
            raise InputError(f"fixture line {number}: empty link target")
        if not _encodable(link_target):
            raise InputError(f"fixture line {number}: malformed link target (not UTF-8)")
        if not _fd_link(parts):
            where = os.path.join(top, *parts[:-1])  # the link's real parent: walked without links
            resolved = os.path.normpath(os.path.join(where, link_target))
            if os.path.isabs(link_target) or not resolved.startswith(top + "/"):
                raise InputError(f"fixture line {number}: link {rel} leaves the root")
        current = tree.lstat(parts)
        if current is not None and stat.S_ISDIR(current.st_mode):
            raise InputError(f"fixture line {number}: {rel} is a directory already")
        tree.symlink(parts, link_target)
    else:
        raise InputError(f"fixture line {number}: unknown record {kind!r}")


def _encodable(text: str) -> bool:
    """A name the OS takes: \\ud800 escapes decode to lone surrogates, which UTF-8 has no bytes for."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _read_fixture(path: str) -> str:
    """A recording's text: a regular file (no FIFO waited on), its header checked before the
    rest is read, at most FIXTURE_LIMIT bytes, UTF-8."""
    try:
        head = read_regular(path, len(HEADER) + 1, head=True)
    except InputError as exc:
        raise HostReadError(f"cannot read host fixture {path}: {exc}") from None
    if head is None or not head.startswith(HEADER.encode()):
        raise InputError(f"{path}: not a gpuvfio host fixture (missing header line)")
    try:
        data = read_regular(path, FIXTURE_LIMIT)
    except InputError as exc:
        raise HostReadError(f"cannot read host fixture {path}: {exc}") from None
    try:
        return (data or b"").decode("utf-8")
    except UnicodeDecodeError:
        raise InputError(f"{path}: not a gpuvfio host fixture (not UTF-8)") from None


@contextlib.contextmanager
def host_from_record(text: str, settings: Settings | None = None):
    """A HostRoot over a recording's text, loaded into a private scratch directory."""
    with scratch_dir("gpuvfio-host-") as tmp:
        load_fixture(text, tmp)
        host = HostRoot(tmp, settings=settings)
        host.recorded = True
        yield host


@contextlib.contextmanager
def open_host(root: str | None, settings: Settings | None = None):
    """The host behind ``--root``: a directory, or a fixture file loaded into a temp dir.

    Yields (HostRoot, label for titles). ``None`` means GPUVFIO_ROOT or ``/``; an empty
    string is bad input (``--root "$UNSET"`` must not mean the live host). ``settings``: the
    run's (default: read from the environment now).
    """
    settings = settings if settings is not None else Settings.from_environment()
    if root is None:
        root = settings.root
        if root is not None and not root.strip():
            raise InputError(f"{ROOT_ENV} is empty (give a directory, a host fixture file, or unset it for /)")
        root = root or "/"
    if not root or not root.strip() or "\0" in root:
        raise InputError("--root is empty (give a directory, a host fixture file, or leave it out for /)")
    if os.path.exists(root) and not os.path.isdir(root):
        with host_from_record(_read_fixture(root), settings) as host:
            yield host, os.path.basename(root)
        return
    yield HostRoot(root, settings=settings), root
