"""What an NVIDIA device id is, from the table gpuvfio ships (nvidia_ids.txt: every NVIDIA device
of the pci.ids bundled with NVIDIA's kubevirt-gpu-device-plugin v1.6.0, pci.ids 2025.07.11, as the
plugin names it), never from the host's pci.ids, which may be missing or old.

pci.ids names an NVIDIA GPU by its chip first ("GA100 [A100 PCIe 80GB]", "AD102 [GeForce RTX
4090]"): the letters of the chip are its architecture (NVIDIA's code names: GK Kepler, GM
Maxwell, GP Pascal, GV Volta, TU Turing, GA Ampere, AD Ada Lovelace, GH Hopper, GB Blackwell),
and the product name says whether it is a GeForce or TITAN card, NVIDIA's consumer lines.
The table also gives the KubeVirt export its names (gpuvfio.ops.kubevirt_names).
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass

from gpuvfio.errors import GpuvfioError
from gpuvfio.user_files import read_regular

__all__ = ["TABLE_FILE", "NvidiaModel", "model", "parse", "table", "table_path"]

TABLE_FILE = "nvidia_ids.txt"
TABLE_LIMIT = 1 << 20
ARCHITECTURES = {"GK": "Kepler", "GM": "Maxwell", "GP": "Pascal", "GV": "Volta", "TU": "Turing", "GA": "Ampere",
                 "AD": "Ada Lovelace", "GH": "Hopper", "GB": "Blackwell"}
_CHIP = re.compile(r"(GK|GM|GP|GV|TU|GA|AD|GH|GB)[0-9]{3}")
CONSUMER = ("GEFORCE", "TITAN")  # as the table spells names: upper case, words joined by "_"


@dataclass(frozen=True)
class NvidiaModel:
    """A device id's entry: the name as the table has it, the architecture (None: a chip of none
    of the lines above, or no chip named) and whether it is a GeForce or TITAN card."""

    device_id: str
    name: str
    architecture: str | None
    consumer: bool


def table_path() -> str:
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), TABLE_FILE)


def parse(text: str) -> tuple[dict[str, str], dict[str, str]]:
    """(the header's ``# key: value`` fields, device id -> name) of a table in nvidia_ids.txt's
    form: comment lines, then an id, a tab and a name a line."""
    header: dict[str, str] = {}
    names: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("#"):
            key, sep, value = line[1:].strip().partition(": ")
            if sep:
                header[key] = value
            continue
        device, _, name = line.partition("\t")
        names[device] = name
    return header, names


@functools.lru_cache(maxsize=1)
def table() -> tuple[dict[str, str], dict[str, str]]:
    """``parse`` of the shipped table."""
    data = read_regular(table_path(), TABLE_LIMIT)
    if data is None:
        raise GpuvfioError(f"gpuvfio's table of NVIDIA device ids is missing ({table_path()}): the installation is "
                           "incomplete")
    return parse(data.decode("utf-8"))


def model(device_id: str) -> NvidiaModel | None:
    """The shipped table's entry for an NVIDIA device id (None: not in it)."""
    name = table()[1].get(device_id.lower())
    if name is None:
        return None
    chip = _CHIP.match(name)
    return NvidiaModel(device_id.lower(), name, ARCHITECTURES[chip.group(1)] if chip else None,
                       any(word in name.split("_") for word in CONSUMER))
