"""The admin's SSH configuration, applied to gpuvfio's SSH targets: Host aliases, HostName, User,
Port, IdentityFile, UserKnownHostsFile and ProxyJump (one hop), from ~/.ssh/config or a given
file.

OpenSSH resolves it where it is installed (``ssh -G``: the options ``ssh HOST`` would use,
with Include and Match as ssh applies them, which paramiko's parser does not all do); paramiko's
parser otherwise. Only what the file sets counts: without a file, or for options it leaves
alone, gpuvfio's own defaults hold (user root, no extra keys or known_hosts files). ``ssh -G`` evaluates the file as ssh does (``Match exec`` runs its
command): give --ssh-config only a file you would give ssh. The host-key policy does not change:
unknown keys are refused unless pinned (--known-hosts, or a UserKnownHostsFile the config
names: the admin's own pins) or trusted on first use; StrictHostKeyChecking is not read. ProxyCommand is not run: refused, with ProxyJump named instead.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass, field

from gpuvfio.commands import CommandError, Runner, last_line
from gpuvfio.errors import InputError
from gpuvfio.user_files import for_another_program
from gpuvfio.numbers import shown, uint

SSH_G_TIMEOUT = 10.0
_USER = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,31}")

@dataclass(frozen=True)
class HostConfig:
    """What the configuration says for one host (None / empty: it says nothing)."""

    hostname: str
    user: str | None = None
    port: int | None = None
    identity_files: tuple[str, ...] = ()
    known_hosts_files: tuple[str, ...] = ()
    proxy_jump: str | None = None  # the first hop: [user@]host[:port]
    source: str = "none"  # ssh -G | paramiko | none
    notes: list[str] = field(default_factory=list)


def parse_jump(spec: str, where: str = "ProxyJump") -> tuple[str | None, str, int | None]:
    """(user, host, port) of one ProxyJump hop, ``[user@]host[:port]`` (an IPv6 host in
    brackets when a port follows); bad input otherwise. The host is checked by the caller, as
    the user's own options are."""
    user, _, rest = spec.rpartition("@")
    host, port = rest, None
    if rest.startswith("["):
        host, _, tail = rest[1:].partition("]")
        port = tail[1:] if tail.startswith(":") else (tail or None)
    elif rest.count(":") == 1:
        host, _, port = rest.partition(":")
    if not host or "/" in rest or (user and not _USER.fullmatch(user)):
        raise InputError(f"{where} {shown(spec)} is not [user@]host[:port]")
    return user or None, host, _port(port, where)


def check_config_file(path: str | None) -> str | None:
    """An --ssh-config value: an existing regular file (bad input otherwise)."""
    if path is None:
        return None
    if not isinstance(path, str) or not path or "\0" in path or not for_another_program(path):
        raise InputError(f"SSH config file not found: {shown(path)}")
    return path


def _existing(paths) -> tuple[str, ...]:
    found = []
    for path in paths:
        full = os.path.expanduser(path)
        if full not in found and for_another_program(full):
            found.append(full)
    return tuple(found)


def _port(value, where: str) -> int | None:
    if value is None:
        return None
    port = uint(str(value), 65535)
    if not port:
        raise InputError(f"{where}: Port {shown(value)} is not 1-65535")
    return port


def _from_options(host: str, options: dict[str, list[str]], source: str, where: str) -> HostConfig:
    def one(key: str) -> str | None:
        values = options.get(key)
        return values[0] if values else None

    command = one("proxycommand")
    if command and command.lower() != "none":
        raise InputError(f"{where}: ProxyCommand for {host} is not run by gpuvfio; use ProxyJump")
    jump = one("proxyjump")
    if jump and jump.lower() != "none":
        if "," in jump:
            raise InputError(f"{where}: ProxyJump {jump!r} for {host} has more than one hop; gpuvfio takes one")
        jump = jump[len("ssh://"):] if jump.startswith("ssh://") else jump  # ssh's URI form, as ssh -G prints it
        parse_jump(jump, f"{where}: ProxyJump for {host}")
    else:
        jump = None
    known = [path for value in options.get("userknownhostsfile", []) for path in value.split()]
    return HostConfig(hostname=one("hostname") or host, user=one("user"), port=_port(one("port"), where),
                      identity_files=_existing(options.get("identityfile", [])),
                      known_hosts_files=_existing(known), proxy_jump=jump, source=source)


SSH_KEYS = ("hostname", "user", "port", "identityfile", "userknownhostsfile", "proxyjump", "proxycommand")


def _ssh_g(run: Runner, binary: str, host: str, config: str) -> dict[str, list[str]]:
    try:
        done = run.finish([binary, "-G", "-F", config, "--", host], SSH_G_TIMEOUT, label=f"ssh -G {host}")
    except CommandError as exc:
        raise InputError(f"ssh -G {host}: {exc.reason}") from None
    if done.status:
        raise InputError(f"ssh -G {host}: {last_line(done.stderr) or f'exit {done.status}'}")
    options: dict[str, list[str]] = {}
    for line in done.stdout.decode("utf-8", "replace").splitlines():
        key, _, value = line.partition(" ")
        if key.lower() in SSH_KEYS:
            options.setdefault(key.lower(), []).append(value.strip())
    return options


def resolve(host: str, config_file: str | None = None, *, ssh: str | None = "auto", run: Runner) -> HostConfig:
    """What the configuration sets for ``host`` (a name or address gpuvfio was given or
    discovered), and only that: ssh -G prints OpenSSH's defaults too (the local user, the default
    identity files, ~/.ssh/known_hosts), which are no part of the admin's configuration, so the
    answer without any configuration (-F /dev/null) is taken away. ``ssh``: the ssh binary
    ("auto": from PATH; None: paramiko's parser); ``run``: what starts it (the Context's runner)."""
    config_file = check_config_file(config_file)
    path = config_file or os.path.expanduser("~/.ssh/config")
    if not for_another_program(path):
        return HostConfig(hostname=host)
    binary = shutil.which("ssh") if ssh == "auto" else ssh
    if binary:
        options = _ssh_g(run, binary, host, path)
        defaults = _ssh_g(run, binary, host, os.devnull)
        options = {k: v for k, v in options.items() if v != defaults.get(k)}
        return _from_options(host, options, "ssh -G", path)
    import paramiko

    try:
        found = paramiko.SSHConfig.from_path(path).lookup(host)
    except (OSError, UnicodeError, ValueError, paramiko.SSHException) as exc:
        raise InputError(f"cannot read SSH config {path}: {exc}") from None
    options = {k.lower(): (v if isinstance(v, list) else [str(v)]) for k, v in found.items() if k.lower() in SSH_KEYS}
    return _from_options(host, options, "paramiko", path)
