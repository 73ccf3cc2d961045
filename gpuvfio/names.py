"""The kernel's names that gpuvfio reads from links and attributes and writes back into sysfs,
its journal and boot-time files: one rule each, for the reader, the journal and the writer.

* A driver name (a ``driver`` link's target, ``driver_override``): what the kernel's PCI
  drivers are called (``struct device_driver.name``: ``snd_hda_intel``, ``nvidia-gpu``,
  ``vfio-pci``): printable, no blank, no ``/``, bounded.
* A module name (a driver's ``module`` link, written into modprobe.d's ``softdep``): letters,
  digits, ``_`` and ``-`` (modprobe treats both alike), fewer than MODULE_NAME_LEN (64 less a
  pointer: include/linux/module.h) characters.

A name that fails its rule is refused where it enters: a newline in a link's target must never
become a line of modprobe.d (which modprobe would run: ``install X CMD``).
"""

from __future__ import annotations

import re

__all__ = ["DRIVER_NAME", "MODULE_NAME", "is_driver_name", "is_module_name"]

DRIVER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+:-]{0,63}")
MODULE_NAME = re.compile(r"[A-Za-z0-9_-]{1,55}")


def is_driver_name(value) -> bool:
    return isinstance(value, str) and DRIVER_NAME.fullmatch(value) is not None


def is_module_name(value) -> bool:
    return isinstance(value, str) and MODULE_NAME.fullmatch(value) is not None
