"""bind, persist, held and the persisted overrides as typed results (issue 23 item 5): dataclasses
with enums inside, and to_json() giving the JSON the commands printed before they were typed.

The golden files in tests/golden/bind/ are that JSON, recorded from the dict-returning code
(``--regenerate`` rewrites them): ``gpuvfio --root SAMPLE bind|persist|unpersist ... --dry-run
--json`` on the bundled sample hosts, and the reports of a bind, its dry run, a refusal and a
persist on a simulated workstation.
"""

from __future__ import annotations

import json
import os

import pytest

from gpuvfio.address import PciAddress
from gpuvfio.errors import Refused
from gpuvfio.ops import binding
from gpuvfio.ops.binding import (BindPolicy, BindReport, BindStatus, CheckStatus, HeldDevice, Mechanism, Override,
                                 PersistedOverrides, PersistReport, PersistStatus, Check)
from tests.conftest import REPO, golden_text, gpu_workstation
from tests.contexts import sim_context
from tests.make_samples import sample_path
from tests.simkernel import SimKernel

GOLDEN = os.path.join(REPO, "tests", "golden", "bind")
A = PciAddress.parse
GPU, AUDIO, OTHER = "0000:01:00.0", "0000:01:00.1", "0000:04:00.0"
ALL_FLAGS = ["--force", "--stop-services", "--allow-unsafe-host"]

# name -> (sample, gpuvfio arguments after --root, exit status): a plan of each kind the CLI prints.
CLI_CASES = {
    "dgx-h100-bind-full-passthrough": ("dgx-h100", ["bind", "0000:1b:00.0", *ALL_FLAGS], 0),
    "pcie-switch-bind": ("pcie-switch", ["bind", "0000:18:00.0", *ALL_FLAGS], 0),
    "epyc-mixed-bind-nothing-to-do": ("epyc-mixed", ["bind", "0000:81:00.0"], 0),
    "workstation-bind-refused": ("workstation", ["bind", "0000:04:00.0", "--connect", "none"], 1),
    "epyc-mixed-persist": ("epyc-mixed", ["persist", "0000:81:00.0"], 0),
    "epyc-mixed-unpersist": ("epyc-mixed", ["unpersist", "0000:41:00.0"], 0),
}


def golden(name: str, text: str, regenerate: bool) -> None:
    """``text`` (a command's --json line) is exactly the recorded one: same keys, order, values."""
    path = os.path.join(GOLDEN, f"{name}.json")
    expected = golden_text(path, text, regenerate)
    assert json.loads(text) == json.loads(expected), f"{name} differs from {path} (pytest --regenerate to accept)"
    assert text == expected, f"{name}: same values as {path}, but not the same text (key order?)"


def as_line(report) -> str:
    """As the CLI prints it (gpuvfio.cli.app.emit_json)."""
    return json.dumps(report, ensure_ascii=True) + "\n"


@pytest.mark.parametrize("name", sorted(CLI_CASES))
def test_the_clis_json_is_what_it_was(cli, name, regenerate, tmp_path, monkeypatch):
    monkeypatch.setenv("GPUVFIO_STATE_DIR", str(tmp_path / "state"))
    sample, args, code = CLI_CASES[name]
    result = cli("--root", sample_path(sample), *args, "--dry-run", "--json")
    assert result.code == code, result.err
    golden(f"cli-{name}", result.out, regenerate)


@pytest.fixture
def ws(tmp_path, monkeypatch):
    """The small workstation (GPU + audio in one group; a second GPU sharing a group with the
    NIC) on a simulated kernel: (context factory, kernel)."""
    monkeypatch.setenv("GPUVFIO_STATE_DIR", str(tmp_path / "state"))
    host = gpu_workstation(tmp_path / "host")
    kernel = SimKernel(host.root)
    return (lambda: sim_context(host.root, kernel)), kernel


def test_a_bind_and_its_dry_run_are_typed_and_print_as_before(ws, regenerate):
    ctx, kernel = ws
    dry = binding.plan_operation(ctx(), [A(GPU)], BindPolicy(), uri="none").shown()
    assert isinstance(dry, BindReport) and dry.status is BindStatus.DRY_RUN
    assert dry.devices == [A(GPU), A(AUDIO)] and dry.moving == [A(GPU), A(AUDIO)] and dry.refused == []
    assert all(isinstance(c, Check) and isinstance(c.status, CheckStatus) for c in dry.checks)
    (libvirt,) = [c for c in dry.checks if c.check_id == "libvirt"]
    assert libvirt.status is CheckStatus.SKIP and "--connect none" in libvirt.message
    assert [s.kind for s in dry.steps] == ["modprobe", "override", "override", "unbind", "unbind", "probe", "probe"]
    assert kernel.writes() == [] and kernel.driver_of(GPU) == "nvidia"  # a dry run changes nothing
    golden("sim-bind-dry-run", as_line(dry.to_json()), regenerate)

    done = binding.bind(ctx(), [A(GPU)], BindPolicy(), uri="none")
    assert done.status is BindStatus.APPLIED and kernel.driver_of(GPU) == kernel.driver_of(AUDIO) == "vfio-pci"
    assert done.devices == dry.devices and done.steps == dry.steps and done.checks == dry.checks
    golden("sim-bind-applied", as_line(done.to_json()), regenerate)

    again = binding.bind(ctx(), [A(AUDIO)], BindPolicy(), uri="none")
    assert again.status is BindStatus.NOTHING_TO_DO and again.steps == [] and again.moving == []
    golden("sim-bind-nothing-to-do", as_line(again.to_json()), regenerate)
    again_dry = binding.plan_operation(ctx(), [A(GPU), A(AUDIO)], BindPolicy(), uri="none").shown()
    assert again_dry.status is BindStatus.NOTHING_TO_DO  # a dry run says what the run would: nothing

    held = binding.held(ctx(), [A(AUDIO)])  # the whole group, as bind took it
    assert list(held) == [GPU, AUDIO] and all(isinstance(d, HeldDevice) for d in held.values())
    assert held[GPU] == HeldDevice(GPU, "vfio-pci", "vfio-pci", "nvidia", None, held[GPU].group)
    assert held[AUDIO].original_driver == "snd_hda_intel" and held[GPU].group is not None
    assert binding.restore(ctx(), []).restored == {GPU: "nvidia", AUDIO: "snd_hda_intel"}
    assert binding.held(ctx(), [A(GPU)]) == {}


def test_a_refusal_carries_the_report_as_json(ws, regenerate):
    """The error's report is the JSON edge (--json prints it, Ansible returns it): result refused."""
    ctx, kernel = ws
    with pytest.raises(Refused) as dry:
        binding.plan_operation(ctx(), [A(OTHER)], BindPolicy(), uri="none").shown()
    with pytest.raises(Refused) as real:
        binding.bind(ctx(), [A(OTHER)], BindPolicy(), uri="none")
    assert str(dry.value) == str(real.value) and dry.value.report == real.value.report
    assert dry.value.report["result"] == BindStatus.REFUSED.value
    assert [c["id"] for c in dry.value.report["refused"]] == ["group_viable"]
    assert kernel.writes() == []
    golden("sim-bind-refused", as_line(dry.value.report), regenerate)
    operation = binding.plan_operation(ctx(), [A(OTHER)], BindPolicy(), uri="none")
    assert operation.outcome.status is BindStatus.REFUSED and operation.report == dry.value.report
    assert [c.check_id for c in operation.outcome.refused] == ["group_viable"]
    assert operation.outcome.refused[0].status is CheckStatus.REFUSE and operation.outcome.refused[0].overridable
    forced = binding.plan_operation(ctx(), [A(OTHER)], BindPolicy(force=True), uri="none")
    assert forced.refusals == [] and forced.outcome.status is None  # planned, not judged as a run yet
    assert "result" not in forced.report


def test_persist_and_its_list_are_typed_and_print_as_before(ws, regenerate):
    ctx, _kernel = ws
    dry = binding.plan_persist(ctx(), [A(GPU)])
    assert isinstance(dry, PersistReport) and dry.status is PersistStatus.DRY_RUN
    assert dry.mechanism is Mechanism.UDEV and dry.devices == [A(GPU), A(AUDIO)]
    assert {c.action.value for c in dry.changes} == {"create"} and dry.next_step and "initramfs" in dry.next_step
    golden("sim-persist-dry-run", as_line(dry.to_json()), regenerate)
    done = binding.persist(ctx(), [A(GPU)])
    assert done.status is PersistStatus.APPLIED and [c.path for c in done.changes] == [c.path for c in dry.changes]
    golden("sim-persist-applied", as_line(done.to_json()), regenerate)
    again = binding.persist(ctx(), [A(GPU)])
    assert again.status is PersistStatus.NOTHING_TO_DO and again.changes == [] and again.next_step is None
    assert "next" not in again.to_json()
    listed = binding.persisted_overrides(ctx())
    assert isinstance(listed, PersistedOverrides) and listed.mechanism is Mechanism.UDEV
    assert listed.overrides == [Override(A(a), "vfio-pci", Mechanism.UDEV) for a in (GPU, AUDIO)]
    golden("sim-persist-list", as_line(listed.to_json()), regenerate)
    removed = binding.persist(ctx(), [A(GPU)], remove=True)
    assert removed.status is PersistStatus.APPLIED and {c.action.value for c in removed.changes} == {"remove"}
    assert removed.next_step is None and binding.persisted_overrides(ctx()).overrides == []


def test_the_restore_run_reads_the_journal_once(ws):
    """The run plans under its lock with the journal it loaded, not a second read of it."""
    ctx, _kernel = ws
    binding.bind(ctx(), [A(GPU)], BindPolicy(), uri="none")
    context = ctx()
    loads = []
    read = context.journal

    def counted():
        loads.append(1)
        return read()

    context.journal = counted
    assert binding.restore(context, [A(GPU)]).restored == {GPU: "nvidia"}  # restore goes by device
    assert len(loads) == 1
