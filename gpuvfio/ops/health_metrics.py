"""``gpuvfio health --textfile FILE``: the health report in the Prometheus text exposition format
(version 0.0.4), for node_exporter's textfile collector, which reads ``*.prom`` files from its
``--collector.textfile.directory`` at every scrape.

Names and help follow Prometheus' conventions (https://prometheus.io/docs/practices/naming/):
the ``gpuvfio_`` prefix, base units in the name, ``_total`` on counters. Every series of a device
carries its ``device`` address and ``domain`` (the libvirt domains that assign it, comma
separated; empty when none or not asked). Label values are escaped as the format says:
backslash, double quote and line feed (``\\``, ``\"``, ``\n``).

The file is written atomically beside itself (gpuvfio.files: a hidden temp file, renamed), so the
collector never reads half of it, and a temp name does not end in ``.prom``.
"""

from __future__ import annotations

from gpuvfio.host.aer import Severity
from gpuvfio.host.pcie_health import DeviceHealth, Rating
from gpuvfio.ops.health import HealthReport

__all__ = ["textfile", "METRICS"]

STATUSES = (Rating.OK, Rating.DEGRADED, Rating.FAILED)
METRICS = {
    "gpuvfio_pcie_aer_errors_total": ("counter", "PCIe AER errors the kernel counted since boot "
                                      "(drivers/pci/pcie/aer.c), by severity and by the function that "
                                      "saw them: the device itself or a port above it."),
    "gpuvfio_pcie_link_speed_gtps": ("gauge", "PCIe link speed in GT/s, as trained now (link=current) and "
                                     "the most the device can train (link=max)."),
    "gpuvfio_pcie_link_width_lanes": ("gauge", "PCIe link width in lanes, as trained now (link=current) and "
                                      "the most the device can train (link=max)."),
    "gpuvfio_iommu_faults_logged": ("gauge", "IOMMU faults the kernel log holds for the device now, by IOMMU "
                                    "(DMAR, AMD-Vi) and kind; a gauge: the log is a ring buffer that drops "
                                    "its oldest lines."),
    "gpuvfio_device_health_status": ("gauge", "1 for the device's health status (ok, degraded, failed), 0 "
                                     "for the others (gpuvfio health)."),
}


def textfile(report: HealthReport) -> str:
    """The report's metrics, each with its HELP and TYPE, its series sorted by device."""
    series: dict[str, list[str]] = {name: [] for name in METRICS}
    for device in sorted(report.devices, key=lambda d: d.address):
        _device_series(device, series)
    lines: list[str] = []
    for name, (kind, help_text) in METRICS.items():
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", *series[name]]
    return "\n".join(lines) + "\n"


def _device_series(device: DeviceHealth, series: dict[str, list[str]]) -> None:
    base = {"device": str(device.address), "domain": ",".join(device.domains or [])}
    for where, counts in sorted(device.aer.items()):
        seen_by = str(device.address) if where == "self" else where
        for severity in Severity:
            series["gpuvfio_pcie_aer_errors_total"].append(
                _sample("gpuvfio_pcie_aer_errors_total", base | {"seen_by": seen_by, "severity": severity.value},
                        counts[severity].total))
    link = device.link
    if link is not None:
        for which, speed, width in (("current", link.current_speed_gts, link.current_width),
                                    ("max", link.max_speed_gts, link.max_width)):
            if speed is not None:
                series["gpuvfio_pcie_link_speed_gtps"].append(
                    _sample("gpuvfio_pcie_link_speed_gtps", base | {"link": which}, speed))
            if width is not None:
                series["gpuvfio_pcie_link_width_lanes"].append(
                    _sample("gpuvfio_pcie_link_width_lanes", base | {"link": which}, width))
    for kind, count in sorted((device.iommu or {}).items()):
        unit, _, what = kind.partition(" ")
        series["gpuvfio_iommu_faults_logged"].append(
            _sample("gpuvfio_iommu_faults_logged", base | {"iommu": unit, "kind": what}, count))
    for status in STATUSES:
        series["gpuvfio_device_health_status"].append(
            _sample("gpuvfio_device_health_status", base | {"status": status.value}, int(device.status is status)))


def _sample(name: str, labels: dict[str, str], value: float) -> str:
    text = ",".join(f'{key}="{_escaped(str(val))}"' for key, val in labels.items())
    return f"{name}{{{text}}} {value:g}" if isinstance(value, float) else f"{name}{{{text}}} {value}"


def _escaped(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
