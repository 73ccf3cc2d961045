"""The KubeVirt export as the cluster takes it: an RFC 6902 JSON patch in YAML (kubectl patch
--type json) or the KubeVirt CR fragment (kubectl apply), each with comments that say what it
does to the cluster's lists. The export itself (which entries, which names) is
gpuvfio.ops.export's; these are its renderings, beside any other a consumer needs."""

from __future__ import annotations

import json

from gpuvfio.ops.export import KubevirtExport

__all__ = ["patch_text", "cr_text"]

CR_HEADER = ["apiVersion: kubevirt.io/v1", "kind: KubeVirt", "metadata:", "  name: kubevirt",
             "  namespace: kubevirt", "spec:", "  configuration:", "    permittedHostDevices:"]


def _yaml(value, indent: int) -> list[str]:
    """Block YAML of dicts, lists and scalars; strings JSON-quoted (a JSON string is a YAML one)."""
    pad = " " * indent
    lines: list[str] = []
    if isinstance(value, dict):
        for key, item in value.items():
            if isinstance(item, (dict, list)):
                lines.append(f"{pad}{key}:")
                lines += _yaml(item, indent + 2)
            else:
                lines.append(f"{pad}{key}: {_scalar(item)}")
    else:
        for item in value:
            inner = _yaml(item, indent + 2) if isinstance(item, (dict, list)) else [f"{pad}  {_scalar(item)}"]
            lines.append(f"{pad}- {inner[0].lstrip()}")
            lines += inner[1:]
    return lines


def _scalar(value) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else json.dumps(value)


def _comments(report: KubevirtExport) -> list[str]:
    lines = [f"# {note}" for note in report.notes]
    lines += [f"# not exported: {x.what}: {x.reason}" for x in report.left_out]
    return lines


def patch_text(report: KubevirtExport) -> str:
    """The entries as an RFC 6902 JSON patch in YAML (kubectl patch takes JSON or YAML)."""
    lines = _comments(report)
    lines += ["# Apply: kubectl patch kubevirt kubevirt -n kubevirt --type json --patch-file FILE",
              "# Each operation adds one entry at the end of its list (RFC 6902 add, path .../-): the entries the",
              "# cluster has stay. Applied twice, the entries are there twice. kubectl refuses the patch when the CR",
              "# has no such list yet (the path does not exist): then print --format cr, which makes the lists."]
    return "\n".join(lines + _yaml(report.patch(), 0)) + "\n"


def cr_text(report: KubevirtExport) -> str:
    """The KubeVirt custom resource fragment: it states that it replaces the lists."""
    lists = ", ".join(report.permitted())
    lines = _comments(report)
    lines += [f"# This fragment REPLACES the cluster's whole {lists} list(s) when applied (kubectl apply, or",
              "# kubectl patch --type merge): KubeVirt's lists are atomic, every entry not written here is removed.",
              "# To add to what the cluster has, use the default --format patch."]
    return "\n".join(lines + CR_HEADER + _yaml(report.permitted(), 6)) + "\n"
