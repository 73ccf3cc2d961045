"""Can the guest attach plans boot, and can verify reach it? Asked before anything changes
(issue 33 item 2): a guest with nothing to boot, a network that does not exist or is down, or
no way to its SSH would otherwise be found out only after the bind, when the run waits
``boot_timeout`` for an address that never comes.

* A boot source: ``--disk`` or ``--kernel`` (with ``--initrd``), each a regular file where
  libvirt will open it: on this machine (the root gpuvfio reads is a model of sysfs and proc;
  libvirt opens the path as given). A recorded host's plan cannot look: it says so, and the run
  there checks.
* The network: ``--network NAME`` exists on the connection the guest is defined on and is
  active; or QEMU user networking with ``--user-net-ssh-port``.
* A way to SSH: an address given (``--ssh-host``), a libvirt network that leases addresses (a
  ``<dhcp>`` in its ``<ip>``, libvirt's network XML format), or the user-networking port.
"""

from __future__ import annotations

import os
import stat

from gpuvfio.domain.request import DomainRequest
from gpuvfio.errors import GpuvfioError
from gpuvfio.ops.context import Context
from gpuvfio.ops.plans import Check, CheckStatus
from gpuvfio.ops.targets import SshOptions
from gpuvfio.text import printable
from gpuvfio.virt.connection import libvirt_module

__all__ = ["reach_checks"]

NETWORK_XML_LIMIT = 1 << 20


def reach_checks(ctx: Context, request: DomainRequest, ssh: SshOptions, *, uri: str | None,
                 asked: bool) -> list[Check]:
    """The boot source, the network and the way to SSH, as checks of attach's plan."""
    checks = _boot_checks(ctx, request)
    leases = None
    if request.network is not None:
        network = _network_check(ctx, request.network, uri, asked)
        checks.append(network[0])
        leases = network[1]
    elif request.user_net_ssh_port is not None:
        checks.append(Check("network", CheckStatus.OK, f"QEMU user networking: 127.0.0.1:{request.user_net_ssh_port} "
                            "forwards to the guest's port 22"))
    checks.append(_ssh_check(request, ssh, leases))
    return checks


def _boot_checks(ctx: Context, request: DomainRequest) -> list[Check]:
    if not request.disk and not request.kernel:
        return [Check("boot", CheckStatus.REFUSE, "nothing to boot: give --disk IMAGE or --kernel FILE (the guest "
                      "would start with no boot source and never answer SSH)")]
    checks = []
    for path, what in ((request.disk, "--disk"), (request.kernel, "--kernel"), (request.initrd, "--initrd")):
        if not path:
            continue
        if ctx.host.recorded or ctx.host.files_checked_by_run:
            checks.append(Check("boot", CheckStatus.WARN, f"{what} {printable(path)} not checked here: the host is a "
                                "recording (the run there checks it)"))
            continue
        try:
            mode = os.stat(path).st_mode  # followed: libvirt opens the path as given
        except OSError as exc:
            checks.append(Check("boot", CheckStatus.REFUSE, f"{what} {printable(path)}: {exc.strerror.lower()} "
                                "on this machine"))
            continue
        if not stat.S_ISREG(mode):
            checks.append(Check("boot", CheckStatus.REFUSE, f"{what} {printable(path)} is not a regular file"))
        else:
            checks.append(Check("boot", CheckStatus.OK, f"boots from {what} {printable(path)}"))
    return checks


def _network_check(ctx: Context, name: str, uri: str | None, asked: bool) -> tuple[Check, bool | None]:
    """The network's check, and whether it leases addresses (None: not known)."""
    shown = printable(name)
    if not asked:
        return Check("network", CheckStatus.WARN, f"libvirt network {shown} not checked: libvirt not asked"), None
    libvirt = libvirt_module()
    try:
        network = ctx.libvirt(uri).networkLookupByName(name)
    except libvirt.libvirtError as exc:
        if exc.get_error_code() == libvirt.VIR_ERR_NO_NETWORK:
            return Check("network", CheckStatus.REFUSE, f"libvirt network {shown} does not exist on this connection "
                         "(virsh net-list --all)"), None
        return Check("network", CheckStatus.REFUSE, f"cannot ask libvirt for network {shown}: "
                     f"{printable(exc.get_error_message() or exc)}"), None
    except GpuvfioError as exc:
        return Check("network", CheckStatus.REFUSE, f"cannot ask libvirt for network {shown}: {exc}"), None
    try:
        active = bool(network.isActive())
        described = network.XMLDesc(0)
    except libvirt.libvirtError as exc:
        return Check("network", CheckStatus.REFUSE, f"cannot read libvirt network {shown}: "
                     f"{printable(exc.get_error_message() or exc)}"), None
    if not active:
        return Check("network", CheckStatus.REFUSE, f"libvirt network {shown} is not active (virsh net-start "
                     f"{shown})"), None
    return Check("network", CheckStatus.OK, f"libvirt network {shown} is active"), _leases(described)


def _leases(described: str) -> bool:
    """Whether a network's XML hands out addresses: an <ip> with a <dhcp> (libvirt's network XML
    format, "Addressing"). Parsed with entities and network access off, bounded."""
    from lxml import etree

    if len(described) > NETWORK_XML_LIMIT:
        return False
    parser = etree.XMLParser(resolve_entities=False, no_network=True, huge_tree=False)
    try:
        root = etree.fromstring(described.encode(), parser)
    except etree.XMLSyntaxError:
        return False
    return root.find("./ip/dhcp") is not None


def _ssh_check(request: DomainRequest, ssh: SshOptions, leases: bool | None) -> Check:
    if ssh.host is not None:
        return Check("ssh_route", CheckStatus.OK, f"SSH to the address given, {printable(ssh.host)}")
    if request.user_net_ssh_port is not None:
        return Check("ssh_route", CheckStatus.OK, f"SSH through the user-networking port {request.user_net_ssh_port}")
    if request.network is None:
        return Check("ssh_route", CheckStatus.REFUSE, "no way to the guest's SSH: give --ssh-host, --network NAME "
                     "(a libvirt network that leases addresses) or --user-net-ssh-port PORT")
    if leases is False:
        return Check("ssh_route", CheckStatus.REFUSE, f"no way to the guest's SSH: libvirt network "
                     f"{printable(request.network)} leases no addresses (no <dhcp>); give --ssh-host")
    if leases is None:
        return Check("ssh_route", CheckStatus.WARN, "the guest's address is to come from libvirt network "
                     f"{printable(request.network)}'s leases (not checked)")
    return Check("ssh_route", CheckStatus.OK, f"the guest's address from libvirt network {printable(request.network)}'s "
                 "DHCP leases")
