"""A cloud-init NoCloud seed for a guest gpuvfio verifies: its user-data and meta-data, decided
here as values; gpuvfio.ops.cloud_init writes them into the seed image and pins the host key.

What a stock cloud image needs to let verify in, as virt-install's ``--cloud-init`` gives it
(virt-manager v5.1.0, virtinst/install/cloudinit.py: ``users`` with ``ssh_authorized_keys``
in a ``#cloud-config`` user-data, an ISO with volume id ``cidata`` attached as a cdrom), plus
what virt-install leaves to trust on first use: the guest's SSH host key. cloud-init's
``cc_ssh`` module (cloud-init 22.4 and later, "SSH" module docs) deletes the image's host keys
(``ssh_deletekeys``) and installs the ones ``ssh_keys`` gives, generating none of its own when
keys are given, so the key gpuvfio made is the guest's only one and can be pinned before boot.

The documents are JSON: JSON is YAML 1.2, cloud-init reads ``#cloud-config`` user-data and the
NoCloud meta-data with its YAML loader, and its own schema check (``cloud-init schema``) accepts
them (tests/unit/test_cloud_init.py runs it) -- no YAML writer is needed at run time.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from dataclasses import dataclass, field

__all__ = ["HostKey", "SeedDocuments", "generate_host_key", "fingerprint", "seed_documents", "guest_hostname",
           "USER_DATA", "META_DATA", "VOLUME_ID"]

# The NoCloud datasource's names (cloud-init docs, "NoCloud"): a filesystem labelled cidata
# holding the files user-data and meta-data.
VOLUME_ID = "cidata"
USER_DATA = "user-data"
META_DATA = "meta-data"
CLOUD_CONFIG = "#cloud-config"  # the first line that marks user-data as cloud-config


@dataclass(frozen=True)
class HostKey:
    """An ed25519 SSH host key pair: ``private`` in OpenSSH's format (a secret: never logged,
    never in JSON), ``public`` as an authorized_keys/known_hosts line's type and key."""

    private: str = field(repr=False)
    public: str

    @property
    def key_type(self) -> str:
        return self.public.split()[0]

    @property
    def base64(self) -> str:
        return self.public.split()[1]

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.public)


def generate_host_key() -> HostKey:
    """A fresh ed25519 key pair. paramiko reads ed25519 keys but cannot make them; the
    ``cryptography`` package it depends on writes both halves in OpenSSH's formats."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key = Ed25519PrivateKey.generate()
    private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                serialization.NoEncryption()).decode()
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                           serialization.PublicFormat.OpenSSH).decode()
    return HostKey(private, public)


def fingerprint(public: str) -> str:
    """OpenSSH's SHA256 fingerprint of a public key line ("TYPE BASE64 [comment]"), as
    ``ssh-keygen -l`` and gpuvfio's SSH notes print it."""
    blob = base64.b64decode(public.split()[1])
    return "SHA256:" + base64.b64encode(hashlib.sha256(blob).digest()).decode().rstrip("=")


def guest_hostname(name: str) -> str:
    """The domain name as a host name (RFC 1123: letters, digits, hyphens, 63 at most): libvirt
    takes names a host name cannot be (``win<11>&gaming``)."""
    label = re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-")[:63].strip("-")
    return label or "gpuvfio-guest"


@dataclass(frozen=True)
class SeedDocuments:
    """The two files of the seed, as they go into the image."""

    user_data: str
    meta_data: str
    instance_id: str


def seed_documents(name: str, user: str, authorized_key: str, host_key: HostKey) -> SeedDocuments:
    """user-data and meta-data for domain ``name``: ``user`` logs in with ``authorized_key`` (the
    public half of the key verify connects with) and the guest's SSH host key is ``host_key``.

    The instance-id carries the host key's digest: cloud-init runs its per-instance modules
    (users, ssh) again only when the instance-id changes (cloud-init docs, "Boot stages" /
    "First boot determination"), so a guest whose disk already ran cloud-init takes a new
    seed's key and user, and the pin made for that seed holds."""
    digest = hashlib.sha256(host_key.public.encode()).hexdigest()[:12]
    instance_id = f"{guest_hostname(name)}-{digest}"
    entry: dict = {"name": user, "ssh_authorized_keys": [authorized_key]}
    if user != "root":
        # cloud images lock the default user's password and log in by key: the same here, with
        # sudo for verify's probes (they read the PCI tree and run nvidia-smi as root).
        entry.update({"lock_passwd": True, "shell": "/bin/bash", "sudo": "ALL=(ALL) NOPASSWD:ALL"})
    config = {
        "users": [entry],
        # root: cloud images set disable_root, which makes root's key refuse with a message.
        "disable_root": user != "root",
        "ssh_pwauth": False,
        "ssh_deletekeys": True,
        "ssh_keys": {"ed25519_private": host_key.private, "ed25519_public": host_key.public},
    }
    user_data = f"{CLOUD_CONFIG}\n{json.dumps(config, indent=2, sort_keys=True)}\n"
    meta_data = json.dumps({"instance-id": instance_id, "local-hostname": guest_hostname(name)}, indent=2,
                           sort_keys=True) + "\n"
    return SeedDocuments(user_data, meta_data, instance_id)
