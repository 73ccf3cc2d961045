#!/usr/bin/env python3
"""Write the table of the names NVIDIA's kubevirt-gpu-device-plugin registers, and its test excerpt.

    git -C kubevirt-gpu-device-plugin show v1.6.0:utils/pci.ids > plugin-pci.ids
    python tests/make_plugin_names.py --excerpt plugin-pci.ids   # tests/golden/kubevirt-plugin-v1.6.0.pci.ids
    python tests/make_plugin_names.py --regenerate               # gpuvfio/host/nvidia_ids.txt
    python tests/make_plugin_names.py --check                    # exit 1 if the table is stale

The excerpt is the plugin's pci.ids (NVIDIA/kubevirt-gpu-device-plugin v1.6.0, utils/pci.ids,
Version 2025.07.11) cut to what getDeviceName reads: its header comment, the 10de vendor block
whole (devices, subsystems, comments) and the next vendor's line, which ends the scan. Nothing
before the 10de line can change a name (locateVendor skips it). The table is made from the
excerpt with gpuvfio.ops.kubevirt_names, the same code the export uses; tests/unit/test_export.py
checks both.
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from gpuvfio.ops.kubevirt_names import NVIDIA_VENDOR, table_path, table_text  # noqa: E402

EXCERPT = os.path.join(HERE, "golden", "kubevirt-plugin-v1.6.0.pci.ids")
EXCERPT_NOTE = ("#\n# gpuvfio's excerpt of NVIDIA/kubevirt-gpu-device-plugin v1.6.0 utils/pci.ids: this header, the 10de\n"
                "# block and the next vendor's line (what getDeviceName reads); tests/make_plugin_names.py --excerpt.\n")


def excerpt(data: str) -> str:
    lines = data.split("\n")
    header = []
    for line in lines:
        if not line.startswith("#"):
            break
        header.append(line)
    start = next(i for i, line in enumerate(lines) if line.startswith(NVIDIA_VENDOR))
    end = next(i for i in range(start + 1, len(lines)) if lines[i] and lines[i][0] not in "\t#")
    return "\n".join(header) + "\n" + EXCERPT_NOTE + "\n".join(lines[start:end + 1]) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--excerpt", metavar="PCI_IDS", help="cut the plugin's pci.ids to the test excerpt")
    group.add_argument("--regenerate", action="store_true", help="write the table from the excerpt")
    group.add_argument("--check", action="store_true", help="exit 1 when the table is not the excerpt's")
    args = parser.parse_args(argv)
    if args.excerpt:
        with open(args.excerpt, encoding="utf-8") as handle:
            text = excerpt(handle.read())
        with open(EXCERPT, "w", encoding="utf-8") as handle:
            handle.write(text)
        print(f"wrote {EXCERPT}")
        return 0
    with open(EXCERPT, "rb") as handle:
        wanted = table_text(handle.read())
    if args.check:
        with open(table_path(), encoding="utf-8") as handle:
            stale = handle.read() != wanted
        print(f"{table_path()}: {'stale' if stale else 'current'}")
        return 1 if stale else 0
    with open(table_path(), "w", encoding="utf-8") as handle:
        handle.write(wanted)
    print(f"wrote {table_path()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
