"""The cloud-init seed of ``xml --cloud-init`` and ``attach --cloud-init``: planned (the user,
our public key, a fresh host key, where it is pinned), then written -- the NoCloud image made
by xorriso, the standard tool, as cloud-utils' cloud-localds and virt-install do (virt-manager
v5.1.0 virtinst/install/installerinject.py: ``-V cidata -J -rational-rock``), and the host key
pinned in known_hosts before the guest boots, so verify's first connection meets a pinned key.

The seed is a file the user names (``--cloud-init ISO``), written mode 0600 (it holds the
guest's private host key) and attached read-only: QEMU opens it itself, so it must sit where
QEMU's user can reach it -- gpuvfio's state directory is 0700 -- e.g. /var/lib/libvirt/boot,
where virt-install puts its seeds as root; libvirt's DAC driver hands the file to QEMU's user
when the domain starts (libvirt docs, "Driver capabilities for QEMU": dynamic_ownership).
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import hmac
import io
import os
from dataclasses import dataclass, field

from gpuvfio.host.state import KNOWN_HOSTS, make_state_dir
from gpuvfio.commands import CommandNotStarted
from gpuvfio.domain.cloud_init import (META_DATA, USER_DATA, VOLUME_ID, HostKey, SeedDocuments, fingerprint,
                                       generate_host_key, seed_documents)
from gpuvfio.numbers import shown
from gpuvfio.errors import GpuvfioError, InputError, Refused
from gpuvfio.files import Tree, scratch_dir
from gpuvfio.user_files import check_output_path, read_regular, user_file
from gpuvfio.guest.ssh import KNOWN_HOSTS_LIMIT
from gpuvfio.ops.context import Context
from gpuvfio.ops.plans import Check, CheckStatus
from gpuvfio.ops.targets import SshOptions, guest_target
from gpuvfio.text import printable

__all__ = ["SeedPlan", "plan_seed", "write_seed", "remove_seed", "pin_host_key", "known_hosts_name", "XORRISO",
           "FORWARD_HOST"]

XORRISO = "xorriso"
XORRISO_PACKAGE = "xorriso"  # Debian, Ubuntu, Fedora and Arch all name the package so
FORWARD_HOST = "127.0.0.1"  # where QEMU user networking forwards the guest's port 22 (gpuvfio.domain.spec)
KEY_LIMIT = 64 << 10
# The application identifier gpuvfio writes into its seed images (ISO 9660, ECMA-119 8.4.28: 128
# characters at offset 574 of the primary volume descriptor, sector 16): an existing file at the
# seed's path is replaced only when it carries it, since undo removes what is there.
SEED_APP_ID = "GPUVFIO CLOUD-INIT SEED"
_PVD_OFFSET, _APP_ID_OFFSET = 16 * 2048, 574
SEED_LIMIT = 4 << 20  # two small documents in an ISO 9660 image: a few hundred KiB


@dataclass(frozen=True)
class SeedPlan:
    """The seed as it will be written; ``host_key.private`` never leaves it but into the image."""

    path: str  # the seed image on the host (the domain's cdrom)
    user: str
    key_file: str  # the private key verify connects with
    authorized_key: str  # its public half, as the guest takes it
    host_key: HostKey
    documents: SeedDocuments
    known_hosts: str  # the file the host key is pinned in
    pins: tuple[str, ...] = ()  # known_hosts names it is pinned for (none: the address comes after boot)
    checks: tuple[Check, ...] = field(default_factory=tuple)

    @property
    def refusals(self) -> list[str]:
        return [c.message for c in self.checks if c.status is CheckStatus.REFUSE]

    def describe(self) -> str:
        said = (f"cloud-init seed {self.path}: user {self.user}, key {fingerprint(self.authorized_key)}, "
                f"host key {self.host_key.fingerprint}")
        if self.pins:
            return f"{said} pinned for {', '.join(self.pins)} in {self.known_hosts}"
        return f"{said} (not pinned: the guest's address is known only after boot)"

    def to_json(self) -> dict:
        return {"path": self.path, "user": self.user, "key": self.key_file,
                "key_fingerprint": fingerprint(self.authorized_key),
                "host_key": {"type": self.host_key.key_type, "public": self.host_key.public,
                             "fingerprint": self.host_key.fingerprint},
                "instance_id": self.documents.instance_id, "pinned": list(self.pins),
                "known_hosts": self.known_hosts}


def known_hosts_name(host: str, port: int) -> str:
    """How known_hosts names host:port (OpenSSH sshd(8), "SSH_KNOWN_HOSTS FILE FORMAT")."""
    return host if port == 22 else f"[{host}]:{port}"


def plan_seed(ctx: Context, name: str, path: str, *, ssh: SshOptions, forward_port: int | None = None) -> SeedPlan:
    """The seed for domain ``name`` at ``path``: the user and key ``ssh`` gives (the user as
    verify will log in: the SSH config's User, else root, unless given), a fresh host key,
    pinned for the address verify will reach (``ssh.host``, else the user-networking forward
    ``forward_port``). Reads only; bad input raises, a missing xorriso is a refusal."""
    if not path or not os.path.isabs(path):
        raise InputError(f"--cloud-init needs an absolute path (libvirt opens it as given), not {shown(path)}")
    check_output_path(path)
    if ssh.key is None:
        raise InputError("--cloud-init needs --ssh-key FILE: the guest user takes its public half")
    authorized = public_key(ssh.key)
    checks: list[Check] = []
    pins: tuple[str, ...] = ()
    user = ssh.user or "root"
    address = ssh if ssh.host is not None else (
        dataclasses.replace(ssh, host=FORWARD_HOST, port=ssh.port or forward_port) if forward_port else None)
    if address is not None:
        # The name verify's connection will look up: the SSH config's HostName and Port apply.
        target = guest_target(address, run=ctx.run)
        user = target.user
        pins = (known_hosts_name(target.host, target.port),)
    else:
        checks.append(Check("cloud_init", CheckStatus.WARN, "the guest's address is known only after boot (DHCP): "
                            "its host key is not pinned; give --ssh-host (or --user-net-ssh-port) to pin it, or "
                            "compare the fingerprint when trusting it on first use"))
    try:
        ctx.run.finish([XORRISO, "-version"], 30.0)
    except CommandNotStarted:
        checks.append(Check("cloud_init", CheckStatus.REFUSE, f"{XORRISO} is missing: install the {XORRISO_PACKAGE} "
                            "package (it makes the cloud-init seed image)"))
    problem = _not_ours(path)
    if problem:
        checks.append(Check("cloud_init", CheckStatus.REFUSE, problem))
    host_key = generate_host_key()
    return SeedPlan(path, user, ssh.key, authorized, host_key, seed_documents(name, user, authorized, host_key),
                    ssh.known_hosts or ctx.state.path(KNOWN_HOSTS), pins, tuple(checks))


def public_key(key_file: str) -> str:
    """The public half of ``key_file`` as an authorized_keys line ("TYPE BASE64"): derived from
    the private key (paramiko), else from KEY.pub beside an encrypted one."""
    import paramiko

    data = read_regular(key_file, KEY_LIMIT)
    if data is None:
        raise InputError(f"SSH key file not found: {key_file}")
    text = data.decode("utf-8", "replace")
    for kind in (paramiko.Ed25519Key, paramiko.ECDSAKey, paramiko.RSAKey):
        try:
            key = kind.from_private_key(io.StringIO(text))
        except paramiko.PasswordRequiredException:
            break
        except (paramiko.SSHException, ValueError, TypeError):
            continue
        return f"{key.get_name()} {key.get_base64()}"
    public = read_regular(key_file + ".pub", KEY_LIMIT)
    parts = public.decode("utf-8", "replace").split() if public else []
    if len(parts) < 2 or not parts[0].startswith(("ssh-", "ecdsa-", "sk-")):
        raise InputError(f"{key_file}: not an SSH private key gpuvfio can read (encrypted keys need "
                         f"{key_file}.pub beside them)")
    try:
        base64.b64decode(parts[1], validate=True)
    except ValueError:
        raise InputError(f"{key_file}.pub: not an SSH public key") from None
    return f"{parts[0]} {parts[1]}"


def write_seed(ctx: Context, seed: SeedPlan) -> None:
    """The seed image at ``seed.path`` (0600), then the host key pinned: before the domain is
    defined or started. A refused plan is never written."""
    if seed.refusals:
        raise Refused("; ".join(seed.refusals))
    problem = _not_ours(seed.path)  # asked again: the plan may be older than the file
    if problem:
        raise Refused(problem)
    with scratch_dir("gpuvfio-seed-") as directory:
        scratch = Tree(directory)
        scratch.write(USER_DATA, seed.documents.user_data, 0o600, durable=False)
        scratch.write(META_DATA, seed.documents.meta_data, 0o600, durable=False)
        image = scratch.path("seed.iso")
        # genisoimage's options, as cloud-localds gives them (cloud-utils): Joliet and Rock Ridge
        # keep the file names as they are, which the NoCloud datasource looks up.
        ctx.run([XORRISO, "-as", "genisoimage", "-output", image, "-volid", VOLUME_ID, "-appid", SEED_APP_ID,
                 "-joliet", "-rock",
                 scratch.path(USER_DATA), scratch.path(META_DATA)], 120.0)
        data = scratch.read("seed.iso", SEED_LIMIT)
    if not data:
        raise Refused(f"{XORRISO} wrote no seed image")
    tree, name = user_file(seed.path)
    tree.write(name, data, 0o600)
    pin_host_key(ctx, seed)


def _not_ours(path: str) -> str | None:
    """Why the file at ``path`` must not be replaced (an undo would then delete it): anything
    there but an earlier seed of gpuvfio's, known by its application identifier. None: nothing
    there, or a seed of ours."""
    tree, name = user_file(path)
    if not tree.exists(name):
        return None
    try:
        head = tree.read(name, _PVD_OFFSET + 2048, head=True) or b""
    except GpuvfioError as exc:
        return f"{printable(path)} exists and cannot be read as a seed ({exc}): gpuvfio does not replace it"
    app_id = head[_PVD_OFFSET + _APP_ID_OFFSET:_PVD_OFFSET + _APP_ID_OFFSET + 128]
    if head[_PVD_OFFSET:_PVD_OFFSET + 6] == b"\x01CD001" and app_id.rstrip(b" ") == SEED_APP_ID.encode():
        return None
    return (f"{printable(path)} exists and is not a cloud-init seed gpuvfio wrote: gpuvfio does not replace it "
            "(an undone attach would delete it); name a new file, or move it away")


def remove_seed(seed: SeedPlan) -> bool:
    """Take the seed image away (an attach that is undone); False when it was not there."""
    tree, name = user_file(seed.path)
    return tree.remove(name)


def pin_host_key(ctx: Context, seed: SeedPlan) -> None:
    """Pin the seed's host key for its names in ``seed.known_hosts``: an earlier key recorded for
    the same name (a guest that had the address before) goes, since the first key of a type
    recorded for a host wins when the file is read (gpuvfio.guest.ssh)."""
    if not seed.pins:
        return
    if seed.known_hosts == ctx.state.path(KNOWN_HOSTS):  # the state dir's: through the Context's
        make_state_dir(ctx.state)
        tree, name = ctx.state, KNOWN_HOSTS
    else:
        tree, name = user_file(seed.known_hosts)
    kept = [line for line in (_without(line, seed.pins) for line in (tree.text(name, KNOWN_HOSTS_LIMIT) or "")
                              .splitlines()) if line is not None]
    kept.append(f"{','.join(seed.pins)} {seed.host_key.key_type} {seed.host_key.base64}")
    tree.write(name, "\n".join(kept) + "\n", 0o600)


def _without(line: str, names: tuple[str, ...]) -> str | None:
    """``line`` with ``names`` taken out of its host list (None: nothing of it is left)."""
    fields = line.split()
    if not fields or line.lstrip().startswith(("#", "@")) or len(fields) < 3:
        return line
    hosts = [h for h in fields[0].split(",") if not any(_matches(h, n) for n in names)]
    if not hosts:
        return None
    if len(hosts) == len(fields[0].split(",")):
        return line
    return " ".join([",".join(hosts)] + fields[1:])


def _matches(entry: str, name: str) -> bool:
    """A known_hosts host field names ``name``: plainly, or hashed (|1|salt|HMAC-SHA1, OpenSSH's
    HashKnownHosts)."""
    if not entry.startswith("|1|"):
        return entry == name
    try:
        _empty, _one, salt, digest = entry.split("|")
        mac = hmac.new(base64.b64decode(salt), name.encode(), hashlib.sha1).digest()
        return hmac.compare_digest(mac, base64.b64decode(digest))
    except ValueError:
        return False
