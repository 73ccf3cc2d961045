"""gpuvfio's settings from the environment, read once, where a run starts.

Every variable gpuvfio itself defines is read here, by ``Settings.from_environment()``, when a
HostRoot or a Context is built -- never deep inside a service, so a run sees one set of
settings from start to end and a test hands its own in. Read elsewhere, by name, and only
these (tests/unit/test_structure.py holds the list): libvirt's own LIBVIRT_DEFAULT_URI
(gpuvfio.virt.connection follows it as virsh does), the loud GPUVFIO_ALLOW_UNSAFE_URI beside
the URI policy it opens (gpuvfio.virt.uri), TMPDIR (gpuvfio.files, as tempfile does),
SSH_AUTH_SOCK (gpuvfio.guest.ssh, as ssh does), the shell's completion request
_GPUVFIO_COMPLETE (gpuvfio.cli.app, click's protocol), and the environment handed on whole to
the host-side probe (gpuvfio.ops.guests.verify_here).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["Settings", "ROOT_ENV", "STATE_ENV", "PCI_IDS_ENV", "TEMPLATES_ENV", "SCHEMA_ENV"]

ROOT_ENV = "GPUVFIO_ROOT"  # the host root (a directory or a recording); default /
STATE_ENV = "GPUVFIO_STATE_DIR"  # the state dir; default <root>/var/lib/gpuvfio
PCI_IDS_ENV = "GPUVFIO_PCI_IDS"  # a pci.ids file before the host's own
TEMPLATES_ENV = "GPUVFIO_TEMPLATES"  # the domain templates, instead of the packaged ones
SCHEMA_ENV = "GPUVFIO_LIBVIRT_SCHEMAS"  # libvirt's RelaxNG schemas, instead of /usr/share/libvirt/schemas


@dataclass(frozen=True)
class Settings:
    root: str | None = None
    state_dir: str | None = None
    pci_ids: str | None = None
    templates: str | None = None
    schemas: str | None = None

    @classmethod
    def from_environment(cls, environ=None) -> "Settings":
        env = os.environ if environ is None else environ
        return cls(root=env.get(ROOT_ENV), state_dir=env.get(STATE_ENV), pci_ids=env.get(PCI_IDS_ENV) or None,
                   templates=env.get(TEMPLATES_ENV) or None, schemas=env.get(SCHEMA_ENV) or None)
