"""gpuvfio's settings from the environment: the one module that reads it.

Every variable gpuvfio follows is read here, by ``Settings.from_environment()``, when a run
starts (a HostRoot or a Context is built, a URI or a completion request is checked at the edge)
-- never by a service itself, so a test hands its own settings in and tests/unit/test_structure.py
forbids any other read. Besides gpuvfio's own variables: libvirt's LIBVIRT_DEFAULT_URI (followed
as virsh follows it), TMPDIR (as tempfile follows it), SSH_AUTH_SOCK (whether an agent is there,
as ssh asks), the shell's completion request (click's protocol), and the environment as a whole,
for a local program gpuvfio starts with additions of its own (the host-side probe).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Mapping

__all__ = ["Settings", "ROOT_ENV", "STATE_ENV", "PCI_IDS_ENV", "SCHEMA_ENV", "UNSAFE_URI_ENV",
           "LIBVIRT_URI_ENV", "COMPLETE_ENV", "RESET_VERDICTS_ENV"]

ROOT_ENV = "GPUVFIO_ROOT"  # the host root (a directory or a recording); default /
STATE_ENV = "GPUVFIO_STATE_DIR"  # the state dir; default <root>/var/lib/gpuvfio
PCI_IDS_ENV = "GPUVFIO_PCI_IDS"  # a pci.ids file before the host's own
SCHEMA_ENV = "GPUVFIO_LIBVIRT_SCHEMAS"  # libvirt's RelaxNG schemas, instead of /usr/share/libvirt/schemas
UNSAFE_URI_ENV = "GPUVFIO_ALLOW_UNSAFE_URI"  # 1: a libvirt URI the policy refuses goes through, loudly
LIBVIRT_URI_ENV = "LIBVIRT_DEFAULT_URI"  # libvirt's own default URI (virsh(1) ENVIRONMENT)
RESET_VERDICTS_ENV = "GPUVFIO_RESET_VERDICTS"  # the reset verdicts a fleet shares; default in the state dir
COMPLETE_ENV = "_GPUVFIO_COMPLETE"  # the shell asks for completions through it (gpuvfio completion SHELL)


@dataclass(frozen=True)
class Settings:
    root: str | None = None
    state_dir: str | None = None
    reset_verdicts: str | None = None
    pci_ids: str | None = None
    schemas: str | None = None
    allow_unsafe_uri: bool = False  # only the value 1 lifts the URI policy
    libvirt_uri: str | None = None  # LIBVIRT_DEFAULT_URI, unchecked here (gpuvfio.virt.connection checks it)
    tmpdir_set: bool = False  # TMPDIR names a directory: scratch space goes there, not /dev/shm
    ssh_agent: bool = False  # SSH_AUTH_SOCK is set: an agent may hold keys
    completion: bool = False  # the shell asked for completions
    # The whole environment, for a program gpuvfio starts with additions of its own.
    environ: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_environment(cls, environ=None) -> "Settings":
        env = dict(os.environ if environ is None else environ)
        return cls(root=env.get(ROOT_ENV), state_dir=env.get(STATE_ENV),
                   reset_verdicts=env.get(RESET_VERDICTS_ENV) or None, pci_ids=env.get(PCI_IDS_ENV) or None,
                   schemas=env.get(SCHEMA_ENV) or None,
                   allow_unsafe_uri=env.get(UNSAFE_URI_ENV) == "1", libvirt_uri=env.get(LIBVIRT_URI_ENV) or None,
                   tmpdir_set=bool(env.get("TMPDIR")), ssh_agent=bool(env.get("SSH_AUTH_SOCK")),
                   completion=bool(env.get(COMPLETE_ENV)), environ=env)
