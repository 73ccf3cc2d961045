"""How to reach a guest over SSH: one policy for attach, verify, the testbed and Ansible.

The user's SSH options (user, key, pinned known_hosts, trust on first use, timeout) apply
the same whether the guest's address is given or discovered through libvirt; only the
address and port come from discovery. Host keys trusted on first use are recorded in the
given known_hosts file, else in gpuvfio's state directory.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass

from gpuvfio.commands import Runner
from gpuvfio.numbers import shown
from gpuvfio.errors import InputError
from gpuvfio.user_files import for_another_program
from gpuvfio.guest.ssh import SshTarget
from gpuvfio.guest.ssh_config import check_config_file, parse_jump, resolve
from gpuvfio.ops.context import Context
from gpuvfio.options import SSH, USER, checked
from gpuvfio.virt.lifecycle import AddressUnknown, ssh_address

__all__ = ["SshOptions", "ssh_options", "ssh_from_table", "valid_host", "guest_target", "configured",
           "AddressUnknown"]

_USER = USER  # the one user-name pattern (gpuvfio.options), for guests and a testbed's hypervisor
# A DNS name (labels of 1-63 characters, RFC 1123) or an IPv4/IPv6 address.
_HOST = re.compile(r"(?=.{1,253}$)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}"
                   r"[A-Za-z0-9])?)*\.?|[0-9A-Fa-f:.]{2,45}")


@dataclass(frozen=True)
class SshOptions:
    host: str | None = None  # None: discovered through libvirt
    port: int | None = None  # None: discovered, else 22
    user: str | None = None  # None: the SSH config's, else root
    key: str | None = None
    known_hosts: str | None = None
    trust_on_first_use: bool = False
    timeout: float = SSH["ssh_timeout"].default  # seconds until SSH must answer
    ssh_config: str | None = None  # an ssh_config file instead of ~/.ssh/config


def valid_host(text) -> bool:
    """A host name (RFC 1123 labels) or an IP address: what may be handed to the resolver."""
    return isinstance(text, str) and bool(_HOST.fullmatch(text))


def ssh_options(*, host: str | None = None, port: int | None = None, user: str | None = None, key: str | None = None,
                known_hosts: str | None = None, trust_on_first_use: bool = False,
                timeout: float = SSH["ssh_timeout"].default, ssh_config: str | None = None,
                wait: str = "ssh_timeout") -> SshOptions:
    """Validated SSH options (bad input: InputError, exit 2); ``timeout`` is the wait named
    ``wait`` (gpuvfio.options.SSH: verify's ssh_timeout, attach's boot_timeout), checked as declared."""
    if host is not None and not valid_host(host):
        raise InputError(f"not a host name or IP address: {shown(host)}")
    if port is not None:
        checked(SSH["ssh_port"], port)
    if user is not None:
        checked(SSH["ssh_user"], user)
    for what, path in (("SSH key", key), ("known_hosts", known_hosts)):
        if path is not None and (not isinstance(path, str) or not path or "\0" in path):
            raise InputError(f"{what} must be a file path, not {shown(path)}")
    if key is not None and not for_another_program(key):
        raise InputError(f"SSH key file not found: {key}")
    if known_hosts is not None and not trust_on_first_use and not for_another_program(known_hosts):
        raise InputError(f"known_hosts file not found: {known_hosts}")
    return SshOptions(host, port, user, key, known_hosts, bool(trust_on_first_use),
                      float(checked(SSH[wait], timeout)), check_config_file(ssh_config))


def ssh_from_table(values: dict, *, wait: str) -> SshOptions:
    """``ssh_options`` from the SSH set's values by their declared names (gpuvfio.options.SSH:
    ``ssh_host`` is ``host`` here), as the command and the Ansible modules collect them;
    ``wait``: the option whose wait applies (verify's ``ssh_timeout``, attach's ``boot_timeout``;
    its default where the values leave it out)."""
    # the key content is Ansible's, written to ssh_key first
    apart = {"ssh_timeout", "boot_timeout", "ssh_private_key"}
    timeout = values.get(wait)
    return ssh_options(**{SSH[name].spec_key: value for name, value in values.items() if name not in apart},
                       timeout=SSH[wait].default if timeout is None else timeout, wait=wait)


def guest_target(options: SshOptions, conn=None, dom=None, *, run: Runner) -> SshTarget:
    """The target for ``options``: their address, or the one libvirt knows for ``dom``, with
    the admin's SSH config applied (configured; ``run``: the Context's runner, for ssh -G)."""
    host, port = options.host, options.port
    if host is None:
        if dom is None:
            raise InputError("give --ssh-host (and --ssh-port) or a domain name")
        host, found_port = ssh_address(conn, dom)
        port = port or found_port
    given = {name for name, value in (("port", port), ("user", options.user)) if value is not None}
    return configured(SshTarget(host, port or 22, options.user or "root", options.key, options.known_hosts,
                                options.trust_on_first_use, connect_timeout=options.timeout),
                      options.ssh_config, given=given, run=run)


def configured(target: SshTarget, ssh_config: str | None, *, given: set[str], run: Runner) -> SshTarget:
    """``target`` with the admin's SSH config applied (a Host alias, its HostName, User, Port,
    IdentityFile, UserKnownHostsFile as pins, ProxyJump); ``given``: the fields ("port",
    "user") the user set explicitly, which win. The one policy for guests (attach, verify,
    Ansible) and for a testbed's remote hypervisor."""
    config = resolve(target.host, ssh_config, run=run)
    _check_from_config(config.hostname, config.user)
    user = target.user if "user" in given else (config.user or target.user)
    jump = _jump_target(config.proxy_jump, target, ssh_config, run) if config.proxy_jump else None
    result = dataclasses.replace(target, host=config.hostname, user=user,
                                 port=target.port if "port" in given else (config.port or target.port),
                                 identity_files=() if target.key else config.identity_files,
                                 pinned_files=config.known_hosts_files, jump=jump, notes=list(target.notes))
    if config.hostname != target.host or jump is not None:
        result.notes.append(f"{target.host}: {result.label()} by the SSH config"
                            + (f", through {jump.label()}" if jump else ""))
    return result


def _check_from_config(hostname: str, user: str | None) -> None:
    """What the SSH config (or a ProxyJump value) says, checked as the user's own options are."""
    if not valid_host(hostname):
        raise InputError(f"not a host name or IP address: {shown(hostname)} (from the SSH config)")
    if user is not None and not _USER.fullmatch(user):
        raise InputError(f"not a user name: {shown(user)} (from the SSH config)")


def _jump_target(spec: str, target: SshTarget, ssh_config: str | None, run: Runner) -> SshTarget:
    """The ProxyJump host ([user@]host[:port]), itself resolved through the SSH config, under the
    target's host-key policy."""
    user, host, port = parse_jump(spec)
    if not valid_host(host):
        raise InputError(f"ProxyJump host {shown(host)} is not a host name or address")
    config = resolve(host, ssh_config, run=run)
    _check_from_config(config.hostname, user or config.user)
    if config.proxy_jump:
        raise InputError(f"ProxyJump {spec} itself has a ProxyJump: one hop is supported")
    return SshTarget(config.hostname, port or config.port or 22, user or config.user or "root", None,
                     target.known_hosts, target.trust_on_first_use, connect_timeout=target.connect_timeout,
                     identity_files=config.identity_files, pinned_files=config.known_hosts_files)
