"""Which libvirt URIs gpuvfio hands to libvirt: ``check_uri``, called wherever a URI comes in
(--connect, LIBVIRT_DEFAULT_URI, a testbed spec's [run] connect, the Ansible modules) and once
more by ``open_connection``, so nothing reaches libvirt unchecked.

A libvirt URI is more than an address. Its form is
``driver[+transport]://[user@][host][:port]/path[?param=value&...]`` (https://libvirt.org/uri.html,
https://libvirt.org/remote.html; as of libvirt 9.0), and libvirt's remote driver acts on parts
of it before it talks to any daemon: the ``ext`` transport runs the program named by
``command=``; the SSH transports run ``ssh`` (or ``command=``) and, on the far side, ``netcat=``
or the helper ``proxy=`` picks, with ``socket=`` on that command line; ``no_verify=1`` accepts any
TLS certificate. A URI is opened even by commands that change nothing (bind --dry-run, testbed
plan, an Ansible check run), so such a URI would run a program where the user asked for a
plan. The policy here allows what gpuvfio uses and refuses the rest, naming the part:

- drivers: ``qemu`` (the hypervisor gpuvfio provisions for) and ``test`` (libvirt's in-process
  test driver: ``test:///default``, ``test:///ABSOLUTE/PATH.xml``);
- transports: none (local, or TLS when a host is given), ``unix``, ``tls``, ``tcp``. ``ssh``,
  ``libssh`` and ``libssh2`` are refused: libvirt runs its own SSH client with its own host-key
  handling, and gpuvfio has no policy for that (its own SSH, to guests and to a testbed's
  remote hypervisor, pins host keys). ``ext`` is refused: it exists to run a program;
- parameters: ``socket`` (an absolute path, local or ``unix`` only: elsewhere libvirt puts it
  on the remote netcat's command line), ``pkipath`` (where the TLS certificates are; they are
  still verified) and ``mode``; every other one is refused, as libvirt passes names it does
  not know on to the remote end;
- no ``#fragment``, no alias without ``://`` (libvirt would look it up in libvirt.conf and open
  whatever that says).

Empty, whitespace, control and non-ASCII characters are bad input, always. Any other refusal
is lifted by GPUVFIO_ALLOW_UNSAFE_URI=1, loudly: a warning names what was let through.

The query is split the way libvirt splits it, or more finely: libvirt (virURIParseParams)
splits at ``&`` or, when there is none, at ``;``, percent-decodes the names and compares them
without case; splitting at both and decoding every name sees every name libvirt can see.
"""

from __future__ import annotations

import os
import re
import sys
import unicodedata
from typing import Callable, Iterable
from urllib.parse import unquote

from gpuvfio.errors import InputError
from gpuvfio.settings import UNSAFE_URI_ENV, Settings
from gpuvfio.user_files import read_regular

UNSAFE_ENV = UNSAFE_URI_ENV
DRIVERS = ("qemu", "test")
TRANSPORTS = ("unix", "tls", "tcp")
SSH_TRANSPORTS = ("ssh", "libssh", "libssh2")
MODES = ("auto", "legacy", "direct")
ALLOWED_PARAMS = ("socket", "pkipath", "mode")
# Why a parameter libvirt knows is refused (remote.html, "Extra parameters"); the others are
# refused as unknown.
REFUSED_PARAMS = {
    "command": "makes libvirt run that program",
    "netcat": "makes libvirt run that program on the remote host",
    "proxy": "picks the program libvirt runs on the remote host",
    "no_verify": "turns off libvirt's check of the server's TLS certificate",
    "no_sanity": "turns off libvirt's check of the program it runs on the remote host",
    "known_hosts_verify": "can turn off libvirt's SSH host-key check",
    "name": "is a second URI the remote end opens, unchecked here",
    "keyfile": "is for libvirt's own SSH, for which gpuvfio has no policy",
    "known_hosts": "is for libvirt's own SSH, for which gpuvfio has no policy",
    "sshauth": "is for libvirt's own SSH, for which gpuvfio has no policy",
    "no_tty": "is for libvirt's own SSH, for which gpuvfio has no policy",
}
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*")
# user@host:port; a leading '-' is refused in both, as ssh would read it as an option.
_AUTHORITY = re.compile(r"(?:(?P<user>[A-Za-z0-9_.][A-Za-z0-9_.-]*)@)?"
                        r"(?P<host>[A-Za-z0-9_][A-Za-z0-9_.-]*|\[[0-9A-Fa-f:.]+\])?"
                        r"(?::(?P<port>[0-9]{1,5}))?")
_warned: set[str] = set()
# A URI is input from the user, the environment or a spec: one longer than any libvirt takes (a
# host name, a path of at most PATH_MAX, a few parameters) is refused without being echoed, and a
# refused one is echoed cut, escaped to ASCII.
URI_LIMIT = 8192
URI_SHOWN = 120
TEST_CONFIG_LIMIT = 4 << 20  # a test driver's node file: domains, networks, pools (libvirt's examples: a few KiB)
# The test driver's root element, after an optional XML declaration, comments and blanks.
_TEST_NODE = re.compile(rb"\A(?:\xef\xbb\xbf)?\s*(?:<\?xml[^>]{0,200}\?>\s*)?(?:<!--.{0,4096}?-->\s*)*<node[\s>/]",
                        re.S)


class _Unsafe(Exception):
    """A policy refusal, which GPUVFIO_ALLOW_UNSAFE_URI=1 lifts (bad input is not one)."""


def named(text: str) -> str:
    """``text`` (a URI or a part of one) for a message: ascii() of it, cut to URI_SHOWN characters."""
    shown = ascii(text)
    return shown if len(shown) <= URI_SHOWN else shown[:URI_SHOWN - 4] + "...'"


def _stderr(line: str) -> None:
    sys.stderr.write(line + "\n")


def check_uri(uri: str | None, *, source: str = "libvirt URI", keywords: Iterable[str] = (),
              warn: Callable[[str], None] | None = None, settings: Settings | None = None) -> str | None:
    """``uri`` when gpuvfio lets libvirt open it (None and the ``keywords``, such as --connect's
    ``none``, come back as they are); InputError naming ``source`` and the offending part
    otherwise. ``warn``: where the warning of GPUVFIO_ALLOW_UNSAFE_URI=1 goes (stderr), once
    per URI in a process. ``settings``: the run's (the opt-out read there; default: read now)."""
    if uri is None or uri in tuple(keywords):
        return uri
    if not isinstance(uri, str) or uri == "":
        raise InputError(f"{source}: a libvirt URI cannot be empty")
    if len(uri) > URI_LIMIT:
        raise InputError(f"{source}: {len(uri)} characters long; a libvirt URI is at most {URI_LIMIT}")
    for position, char in enumerate(uri):
        if char.isspace() or not " " < char < "\x7f":
            kind = "whitespace" if char.isspace() else \
                "a control character" if unicodedata.category(char) == "Cc" else "a non-ASCII character"
            raise InputError(f"{source} {named(uri)}: {kind} at position {position}; not a libvirt URI")
    _check_test_file(uri, source)
    try:
        _policy(uri)
    except _Unsafe as exc:
        if not (settings if settings is not None else Settings.from_environment()).allow_unsafe_uri:
            raise InputError(f"{source} {named(uri)}: {exc}; refused ({UNSAFE_ENV}=1 lets it through)") from None
        if uri not in _warned:
            _warned.add(uri)
            (warn or _stderr)(f"warning: {UNSAFE_ENV}=1: {source} {named(uri)} goes to libvirt although {exc}")
    return uri


def _check_test_file(uri: str, source: str) -> None:
    """libvirt's test driver opens ``test:///PATH`` as its configuration, and its parse error
    quotes the file's first line; a FIFO there hangs the open. So the driver takes
    ``test:///default``, or a regular file read here through the file layer (bounded, never a
    FIFO or a device) whose first element is the test driver's ``<node>``; an error names the
    file and never what is in it. Bad input, whatever GPUVFIO_ALLOW_UNSAFE_URI says."""
    scheme, _sep, rest = uri.partition("://")
    if scheme.lower().partition("+")[0] != "test":
        return
    authority, _slash, path = rest.partition("?")[0].partition("#")[0].partition("/")
    if authority:
        raise InputError(f"{source} {named(uri)}: the test driver runs in this process: no host in its URI")
    if path == "default":
        return
    where = "/" + path
    # libvirt percent-decodes the path and the kernel follows its links and "..": the file read
    # here must be the one libvirt opens, so only a canonical path is taken (no %, no . or ..,
    # no link on the way).
    if "%" in where or any(part in ("", ".", "..") for part in where.split("/")[1:]) \
            or os.path.realpath(where) != where:
        raise InputError(f"{source}: test driver configuration {named(where)} must be a canonical path (no %, "
                         "no . or .., no link on the way)")
    try:
        data = read_regular(where, TEST_CONFIG_LIMIT)
    except InputError as exc:
        raise InputError(f"{source}: test driver configuration {named(where)} cannot be used: "
                         f"{_without_content(str(exc), where)}") from None
    if data is None:
        raise InputError(f"{source}: test driver configuration {named(where)} does not exist")
    if not _TEST_NODE.match(data):
        raise InputError(f"{source}: {named(where)} is not a libvirt test driver configuration (its first "
                         "element is not <node>)")


def names_a_test_file(uri: str) -> bool:
    """A test driver URI on a configuration file (whose content libvirt's errors may quote)."""
    scheme, _sep, rest = uri.partition("://")
    return scheme.lower().partition("+")[0] == "test" and rest.partition("?")[0] != "/default"


def _without_content(message: str, where: str) -> str:
    """The file layer's reason, which names the path and its kind, never the bytes."""
    return message.replace(where, "it").splitlines()[0][:200]


def _policy(uri: str) -> None:
    scheme, sep, rest = uri.partition("://")
    if not sep or not _SCHEME.fullmatch(scheme):
        raise _Unsafe("not of the form driver[+transport]://[user@][host][:port]/path[?params] (a libvirt.conf "
                      "alias is not followed)")
    driver, plus, transport = scheme.lower().partition("+")
    if driver not in DRIVERS:
        raise _Unsafe(f"driver {named(driver)} is not one gpuvfio uses ({', '.join(DRIVERS)})")
    if plus and transport == "ext":
        raise _Unsafe("transport 'ext' makes libvirt run the program named by command=")
    if plus and transport in SSH_TRANSPORTS:
        raise _Unsafe(f"transport {named(transport)}: libvirt runs its own SSH client, and gpuvfio has no policy for "
                      "it (run gpuvfio on the hypervisor, or a testbed with a [host] table)")
    if plus and transport not in TRANSPORTS:
        raise _Unsafe(f"transport {named(transport)} is not one of {', '.join(TRANSPORTS)} (or none)")
    if "#" in rest:
        raise _Unsafe("a #fragment means nothing to libvirt")
    head, _q, query = rest.partition("?")
    authority, slash, _path = head.partition("/")
    if not slash:
        raise _Unsafe("no path after the host (qemu:///system, test:///default)")
    parts = _AUTHORITY.fullmatch(authority)
    if parts is None:
        raise _Unsafe(f"{named(authority)} is not [user@]host[:port]")
    local = transport == "unix" or not plus and not parts["host"]
    for segment in re.split(r"[&;]", query) if query else ():
        _check_param(segment, local)


def _check_param(segment: str, local: bool) -> None:
    raw_name, eq, raw_value = segment.partition("=")
    if not raw_name:
        return  # libvirt skips an empty section and "=value"
    name = unquote(raw_name).lower()
    value = unquote(raw_value) if eq else ""
    if name in REFUSED_PARAMS:
        raise _Unsafe(f"parameter {named(name)} {REFUSED_PARAMS[name]}")
    if name not in ALLOWED_PARAMS:
        raise _Unsafe(f"parameter {named(name)} is not one gpuvfio passes on ({', '.join(ALLOWED_PARAMS)})")
    if name == "socket" and not local:
        raise _Unsafe("parameter 'socket' is for a local or unix connection (over SSH it goes on the remote "
                      "netcat's command line)")
    if name == "socket" and not value.startswith("/"):
        raise _Unsafe(f"parameter 'socket' must be an absolute path, not {named(value)}")
    if name == "mode" and value not in MODES:
        raise _Unsafe(f"parameter 'mode' is one of {', '.join(MODES)}, not {named(value)}")
    if any(not " " < char < "\x7f" for char in value):
        raise _Unsafe(f"parameter {named(name)} decodes to a control, space or non-ASCII character")
