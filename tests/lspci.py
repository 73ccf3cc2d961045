"""The real lspci, as an independent reader of the same sysfs tree."""

import re
import shutil
import subprocess


def lspci_available() -> bool:
    return shutil.which("lspci") is not None


def lspci_records(sys_bus_pci: str | None = None) -> dict[str, dict]:
    """Parse ``lspci -D -nn -k -vmm`` (optionally against ROOT/sys/bus/pci) into per-slot dicts."""
    cmd = ["lspci"]
    if sys_bus_pci:
        cmd += ["-A", "linux-sysfs", "-O", f"sysfs.path={sys_bus_pci}"]
    cmd += ["-D", "-nn", "-k", "-vmm"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    records = {}
    for block in proc.stdout.strip().split("\n\n"):
        rec = {}
        for line in block.splitlines():
            key, _, value = line.partition(":\t")
            rec[key] = value
        if "Slot" in rec:
            records[rec["Slot"]] = rec
    return records


def bracket_id(value: str) -> str:
    """'NVIDIA Corporation [10de]' -> '10de'."""
    match = re.search(r"\[([0-9a-f]{4})\]$", value)
    assert match, value
    return match.group(1)


def compare(gpuvfio_devices: list[dict], records: dict[str, dict]) -> None:
    """Addresses, IDs, class, drivers, NUMA nodes and IOMMU groups must agree."""
    ours = {d["address"]: d for d in gpuvfio_devices}
    assert sorted(ours) == sorted(records)
    for addr, rec in records.items():
        dev = ours[addr]
        assert dev["vendor_id"] == bracket_id(rec["Vendor"]), addr
        assert dev["device_id"] == bracket_id(rec["Device"]), addr
        assert dev["class_id"][:4] == bracket_id(rec["Class"]), addr
        if "ProgIf" in rec:
            assert dev["class_id"][4:] == rec["ProgIf"], addr
        assert dev["driver"] == rec.get("Driver"), addr
        numa = rec.get("NUMANode")
        assert dev["numa_node"] == (int(numa) if numa is not None else None), addr
        group = rec.get("IOMMUGroup")
        assert dev["iommu_group"] == (int(group) if group is not None else None), addr
