"""persist's edges: the boot-time overrides it lists and keeps (driverctl's store, gpuvfio's udev
rules), the softdep file, the initramfs hint per distribution, the diffs it shows and the
transaction that writes its files all or none."""

from __future__ import annotations

import os

import pytest

from gpuvfio.address import PciAddress
from gpuvfio.bind.persist import (HEADER, FileChange, Mechanism, Override, ChangeAction, check_addresses,
                                  commit, initramfs_hint, overrides, persisted, plan_persist)
from gpuvfio.errors import GpuvfioError, InputError, Refused
from gpuvfio.host.root import HostRoot
from gpuvfio.ops import binding
from tests.conftest import gpu_workstation
from tests.contexts import sim_context

A = PciAddress.parse
GPU, AUDIO, OTHER = "0000:01:00.0", "0000:01:00.1", "0000:04:00.0"
STORE = "etc/driverctl.d"
RULES = "etc/udev/rules.d/61-gpuvfio-vfio-pci.rules"
UNIT = "etc/systemd/system/gpuvfio-vfio-pci.service"
WANTS = "etc/systemd/system/multi-user.target.wants/gpuvfio-vfio-pci.service"
SOFTDEP = "etc/modprobe.d/gpuvfio-vfio.conf"
LOAD = "etc/modules-load.d/gpuvfio-vfio.conf"


def put(root, rel: str, data: str | bytes) -> None:
    path = os.path.join(str(root), rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb" if isinstance(data, bytes) else "w") as handle:
        handle.write(data)


def read(root, rel: str) -> str | None:
    path = os.path.join(str(root), rel)
    if not os.path.exists(path):
        return None
    with open(path) as handle:
        return handle.read()


def rule(addr: str) -> str:
    return f'ACTION=="add", SUBSYSTEM=="pci", KERNEL=="{addr}", ATTR{{driver_override}}="vfio-pci"\n'


def host_with(tmp_path, files: dict[str, str | bytes], *, driverctl: bool = False) -> HostRoot:
    """A bare host tree holding ``files`` (and driverctl's binary, when installed)."""
    root = tmp_path / "host"
    root.mkdir(exist_ok=True)
    for rel, data in files.items():
        put(root, rel, data)
    if driverctl:
        put(root, "usr/sbin/driverctl", "#!/bin/sh\n")
    return HostRoot(str(root))


def change_of(changes: list[FileChange], rel: str) -> FileChange | None:
    found = [c for c in changes if c.rel == rel]
    assert len(found) <= 1
    return found[0] if found else None


# -- persist --list ---------------------------------------------------------------------------

def test_a_driverctl_override_for_another_driver_is_listed_with_that_driver(tmp_path):
    """driverctl's store (/etc/driverctl.d/pci-<addr> holding the driver name) keeps overrides
    to any driver: persist --list shows each with its own driver, not only vfio-pci ones."""
    host = host_with(tmp_path, {f"{STORE}/pci-{GPU}": "nouveau\n", f"{STORE}/pci-{OTHER}": "vfio-pci\n"})
    listed = overrides(host)
    assert listed == [Override(A(GPU), "nouveau", Mechanism.DRIVERCTL),
                      Override(A(OTHER), "vfio-pci", Mechanism.DRIVERCTL)]
    assert [o.to_json() for o in listed] == [
        {"address": GPU, "driver": "nouveau", "mechanism": "driverctl"},
        {"address": OTHER, "driver": "vfio-pci", "mechanism": "driverctl"}]


def test_the_list_is_ordered_by_address_across_both_mechanisms(tmp_path):
    """An admin reads one list by address, whichever mechanism keeps each override: a udev rule
    for 01:00.0 comes before driverctl's entry for 04:00.0."""
    host = host_with(tmp_path, {RULES: HEADER + rule(GPU), f"{STORE}/pci-{OTHER}": "vfio-pci\n"})
    assert overrides(host) == [Override(A(GPU), "vfio-pci", Mechanism.UDEV),
                               Override(A(OTHER), "vfio-pci", Mechanism.DRIVERCTL)]
    assert [o.source for o in overrides(host)] == ["udev (gpuvfio)", "driverctl"]


def test_entries_that_are_not_pci_overrides_are_neither_listed_nor_read(tmp_path):
    """driverctl names its entries <bus>-<device> (pci-0000:01:00.0) and applies only those: a
    misnamed copy (pci_...), an editor's binary swap file or a pci- name that is no address is
    no override, and a swap file that is not UTF-8 must not break the listing."""
    host = host_with(tmp_path, {
        f"{STORE}/pci_{GPU}": "vfio-pci\n",
        f"{STORE}/.pci-{GPU}.swp": b"b0VIM 9.0\x00\xff\xfe\x80 binary",
        f"{STORE}/pci-notanaddress": "vfio-pci\n",
        f"{STORE}/pci-{OTHER}": "vfio-pci\n"})
    assert overrides(host) == [Override(A(OTHER), "vfio-pci", Mechanism.DRIVERCTL)]
    assert persisted(host) == {"udev": set(), "driverctl": {A(OTHER)}}


def test_an_empty_driverctl_entry_names_no_driver_and_is_not_listed(tmp_path):
    """An empty /etc/driverctl.d/pci-<addr> names no driver: listing it would show an override
    that driverctl cannot apply."""
    host = host_with(tmp_path, {f"{STORE}/pci-{GPU}": "", f"{STORE}/pci-{OTHER}": "  \n"})
    assert overrides(host) == []


def test_a_driver_name_of_up_to_64_characters_is_listed_and_a_longer_one_is_not(tmp_path):
    """The listing shows what the store holds within a driver name's bound (64 characters);
    anything longer is no driver name and is left out rather than printed."""
    at_bound, over = "d" * 64, "e" * 65
    host = host_with(tmp_path, {f"{STORE}/pci-{GPU}": at_bound + "\n", f"{STORE}/pci-{OTHER}": over + "\n",
                                f"{STORE}/pci-0000:05:00.0": "vfio\x1bpci\n"})
    assert overrides(host) == [Override(A(GPU), at_bound, Mechanism.DRIVERCTL)]


def test_persisted_counts_only_driverctl_entries_that_name_vfio_pci(tmp_path):
    """An entry in driverctl's store for another driver (nouveau) is not a device persisted on
    vfio-pci: persist must not count it, nor turn it into a vfio-pci rule."""
    host = host_with(tmp_path, {f"{STORE}/pci-{GPU}": "vfio-pci\n", f"{STORE}/pci-{OTHER}": "nouveau\n"})
    assert persisted(host) == {"udev": set(), "driverctl": {A(GPU)}}
    changes = plan_persist(host, [A("0000:05:00.0")], [], set())
    rules = change_of(changes, RULES)
    assert rules is not None and rules.new == HEADER + rule(GPU) + rule("0000:05:00.0")


# -- what persist plans ---------------------------------------------------------------------

def test_persisting_another_device_keeps_the_rules_already_written(tmp_path):
    """gpuvfio's udev rules file holds every persisted device: adding one must keep the ones a
    previous persist wrote, or they boot on their host driver again."""
    host = host_with(tmp_path, {RULES: HEADER + rule(OTHER)})
    changes = plan_persist(host, [A(GPU)], [], {"nvidia"})
    rules = change_of(changes, RULES)
    assert rules.action is ChangeAction.UPDATE and rules.new == HEADER + rule(GPU) + rule(OTHER)
    assert f"gpuvfio-vfio-pci {GPU} {OTHER}\n" in change_of(changes, UNIT).new


def test_with_driverctl_installed_gpuvfios_own_rules_move_into_its_store(tmp_path):
    """Once driverctl is installed its store is the one mechanism: a device gpuvfio's udev rule
    kept is migrated to /etc/driverctl.d/pci-<addr>, not dropped with the rules file."""
    host = host_with(tmp_path, {RULES: HEADER + rule(OTHER)}, driverctl=True)
    os.makedirs(os.path.dirname(os.path.join(host.root, WANTS)))
    os.symlink("/" + UNIT, os.path.join(host.root, WANTS))
    put(host.root, UNIT, "old unit\n")
    changes = plan_persist(host, [A(GPU)], [], {"nvidia"})
    commit(host, changes)
    for addr in (GPU, OTHER):
        assert read(host.root, f"{STORE}/pci-{addr}") == "vfio-pci\n"
    assert read(host.root, RULES) is None and read(host.root, UNIT) is None
    assert not os.path.lexists(os.path.join(host.root, WANTS))
    assert overrides(host) == [Override(A(GPU), "vfio-pci", Mechanism.DRIVERCTL),
                               Override(A(OTHER), "vfio-pci", Mechanism.DRIVERCTL)]


def test_unpersist_with_driverctl_removes_that_devices_store_entry(tmp_path):
    """unpersist under driverctl deletes /etc/driverctl.d/pci-<addr> (driverctl unset-override
    does the same), and leaves the other devices' entries alone."""
    host = host_with(tmp_path, {f"{STORE}/pci-{GPU}": "vfio-pci\n", f"{STORE}/pci-{OTHER}": "vfio-pci\n"},
                     driverctl=True)
    changes = plan_persist(host, [], [A(GPU)], set())
    assert change_of(changes, f"{STORE}/pci-{GPU}") == FileChange(f"{STORE}/pci-{GPU}", "vfio-pci\n", None)
    assert change_of(changes, f"{STORE}/pci-{OTHER}") is None
    commit(host, changes)
    assert read(host.root, f"{STORE}/pci-{GPU}") is None and read(host.root, f"{STORE}/pci-{OTHER}") == "vfio-pci\n"


def test_unpersist_without_driverctl_removes_a_leftover_store_entry_of_that_device_only(tmp_path):
    """driverctl's udev rule may be gone while its store remains: unpersist still removes the
    device's own pci-<addr> entry, and keeps another device's (which stays persisted, by rule)."""
    host = host_with(tmp_path, {f"{STORE}/pci-{GPU}": "vfio-pci\n", f"{STORE}/pci-{OTHER}": "vfio-pci\n"})
    changes = plan_persist(host, [], [A(GPU)], set())
    assert change_of(changes, f"{STORE}/pci-{GPU}") == FileChange(f"{STORE}/pci-{GPU}", "vfio-pci\n", None)
    assert change_of(changes, f"{STORE}/pci-{OTHER}") is None
    commit(host, changes)
    assert read(host.root, f"{STORE}/pci-{GPU}") is None and read(host.root, f"{STORE}/pci-{OTHER}") == "vfio-pci\n"
    assert read(host.root, RULES) == HEADER + rule(OTHER)


def test_the_softdep_never_makes_vfio_pci_wait_for_itself(tmp_path):
    """modprobe treats - and _ alike in module names (modprobe.d(5)): a softdep of vfio-pci or
    vfio_pci on vfio-pci is a loop, so neither spelling gets a line."""
    host = host_with(tmp_path, {SOFTDEP: HEADER + "softdep vfio_pci pre: vfio-pci\n"})
    changes = plan_persist(host, [A(GPU)], [], {"nvidia", "vfio-pci", "vfio_pci"})
    assert change_of(changes, SOFTDEP).new == HEADER + "softdep nvidia pre: vfio-pci\n"


def test_softdep_lines_naming_no_module_are_refused_by_name(tmp_path):
    """The softdep file is the host's input too: a line whose module is no module name (a ';' or
    '$' in it) is refused, naming each such word and the file, before anything is written."""
    host = host_with(tmp_path, {SOFTDEP: HEADER + "softdep nvidia pre: vfio-pci\nsoftdep x;reboot pre: vfio-pci\n"
                                "softdep b$d pre: vfio-pci\n"})
    with pytest.raises(Refused) as refused:
        plan_persist(host, [A(GPU)], [], {"nvidia"})
    assert "'b$d', 'x;reboot'" in str(refused.value) and "etc/modprobe.d/gpuvfio-vfio.conf" in str(refused.value)
    assert read(host.root, RULES) is None


@pytest.fixture
def workstation_ctx(tmp_path, monkeypatch):
    """The small workstation (GPU + audio in one group) and a context factory on it."""
    monkeypatch.setenv("GPUVFIO_STATE_DIR", str(tmp_path / "state"))
    host = gpu_workstation(tmp_path / "ws")
    return host, (lambda: sim_context(host.root))


def test_a_built_in_driver_adds_no_softdep_line(workstation_ctx):
    """A driver built into the kernel has no module link (drivers/base/module.c) and nothing for
    modprobe to order: persist goes on with a softdep for the modular driver only."""
    host, ctx = workstation_ctx
    os.unlink(host.sys_path("bus", "pci", "drivers", "snd_hda_intel", "module"))
    report = binding.plan_persist(ctx(), [A(GPU)])
    assert report.devices == [A(GPU), A(AUDIO)]
    assert change_of(report.changes, SOFTDEP).new == HEADER + "softdep nvidia pre: vfio-pci\n"


def test_a_module_link_naming_no_module_is_refused_naming_driver_and_link(workstation_ctx):
    """modprobe.d reads a newline as a new command (install X CMD): a driver's module link whose
    name holds one is refused, naming the driver and the name as read, escaped."""
    host, ctx = workstation_ctx
    ddir = host.sys_path("bus", "pci", "drivers", "nvidia")
    os.unlink(os.path.join(ddir, "module"))
    os.symlink(os.path.relpath(host.sys_path("module", "nvidia\ninstall"), ddir), os.path.join(ddir, "module"))
    with pytest.raises(Refused) as refused:
        binding.plan_persist(ctx(), [A(GPU)])
    assert "driver nvidia's module link names 'nvidia\\ninstall'" in str(refused.value)
    assert not os.path.exists(os.path.join(host.root, SOFTDEP))


def test_no_address_is_bad_input_that_says_so():
    """persist with nothing to persist is the user's mistake (exit 2), and the message says what
    is missing."""
    with pytest.raises(InputError, match="no PCI address given"):
        check_addresses({A(GPU)}, [])


def test_every_unknown_address_is_named(workstation_ctx):
    """A typo in one of several addresses is refused before anything is planned, naming each
    address the host does not have."""
    _host, ctx = workstation_ctx
    with pytest.raises(InputError) as bad:
        binding.plan_persist(ctx(), [A(GPU), A("0000:0a:00.0"), A("0000:0b:00.0")])
    assert str(bad.value).endswith(": 0000:0a:00.0, 0000:0b:00.0")


# -- the initramfs hint ---------------------------------------------------------------------

DEBIAN, ARCH, DRACUT = "update-initramfs -u -k all", "mkinitcpio -P", "dracut -f --regenerate-all"


@pytest.mark.parametrize("os_release, command", [
    ("ID=ubuntu\n", DEBIAN),
    ("ID=debian\n", DEBIAN),
    ('NAME="Mint"\nID=linuxmint\nID_LIKE="ubuntu debian"\n', DEBIAN),
    ("ID=arch\n", ARCH),
    ("ID=endeavouros\nID_LIKE=arch\n", ARCH),
    *[(f'ID="{ident}"\n', DRACUT) for ident in ("rhel", "fedora", "centos", "suse", "opensuse", "sles")],
    ('ID=mydistro\nID_LIKE="x=y ubuntu"\n', DEBIAN),
    ('ID=mydistro\nID_LIKE="ubuntu x=y"\n', DEBIAN),
])
def test_the_initramfs_hint_names_the_distributions_own_tool(tmp_path, os_release, command):
    """os-release(5): ID names the distribution and ID_LIKE its parents, each a shell-style
    VAR=value line (the value is all after the first '='); Debian/Ubuntu rebuild with
    update-initramfs, Arch with mkinitcpio -P (all presets), RHEL/Fedora/SUSE with dracut."""
    host = host_with(tmp_path, {"etc/os-release": os_release})
    assert initramfs_hint(host) == f"rebuild the initramfs so vfio-pci loads before the GPU driver there too: {command}"


def test_without_os_release_the_hint_names_every_tool(tmp_path):
    """A host without /etc/os-release gets all three tools named, for the admin to pick."""
    hint = initramfs_hint(host_with(tmp_path, {}))
    assert hint.endswith("update-initramfs -u (Debian/Ubuntu), dracut -f (RHEL/Fedora/SUSE) or mkinitcpio -P (Arch)")


# -- the diffs persist shows ------------------------------------------------------------------

def test_a_removed_enablement_link_shows_its_old_target_and_removed():
    """unpersist removes systemd's enablement link: the diff shows where it pointed and that it
    goes, not an empty target."""
    target = "/etc/systemd/system/gpuvfio-vfio-pci.service"
    assert FileChange(WANTS, target, None, link=True).diff() == (
        f"--- /{WANTS}\n+++ /{WANTS}\n-> {target}\n+> (removed)\n")


def test_an_update_diff_names_both_sides_and_keeps_each_lines_end():
    """A changed file's diff is a unified diff (a/ and b/ sides, as diff -u and git show them)
    whose removed and added lines are each a line of its own."""
    change = FileChange(SOFTDEP, HEADER + "softdep nvidia pre: vfio-pci\n",
                        HEADER + "softdep snd_hda_intel pre: vfio-pci\n")
    assert change.diff() == (f"--- a/{SOFTDEP}\n+++ b/{SOFTDEP}\n@@ -1,2 +1,2 @@\n {HEADER}"
                             "-softdep nvidia pre: vfio-pci\n+softdep snd_hda_intel pre: vfio-pci\n")


def test_a_removal_diff_goes_to_dev_null_with_no_added_line():
    """A removed file is shown as diff -u shows a deletion: its lines removed, +++ /dev/null."""
    rel = f"{STORE}/pci-{GPU}"
    assert FileChange(rel, "vfio-pci\n", None).diff() == f"--- a/{rel}\n+++ /dev/null\n@@ -1 +0,0 @@\n-vfio-pci\n"
    assert FileChange(rel, None, "vfio-pci\n").diff() == f"--- /dev/null\n+++ b/{rel}\n@@ -0,0 +1 @@\n+vfio-pci\n"


# -- the transaction --------------------------------------------------------------------------

def persisted_before(tmp_path) -> HostRoot:
    """A host persisted before: a rules file for 04:00.0 and an enablement link pointing at an
    older unit (so persisting 01:00.0 updates a file and a link)."""
    host = host_with(tmp_path, {RULES: HEADER + rule(OTHER), UNIT: "old unit\n"})
    os.makedirs(os.path.dirname(os.path.join(host.root, WANTS)))
    os.symlink("/usr/lib/systemd/system/gpuvfio-old.service", os.path.join(host.root, WANTS))
    return host


def test_a_failed_rename_puts_back_changed_files_and_the_old_enablement_link(tmp_path):
    """All or none: a rename failing late (disk full) restores every file renamed before it to
    its old content, the enablement link to its old target, and says why in the OS's words."""
    host = persisted_before(tmp_path)
    changes = plan_persist(host, [A(GPU)], [], {"nvidia"})
    assert change_of(changes, WANTS).link and change_of(changes, RULES).action is ChangeAction.UPDATE

    def disk_full(path):
        if path == "/" + LOAD:
            raise OSError(28, "No space left on device")

    with pytest.raises(GpuvfioError) as failed:
        commit(host, changes, fault=disk_full)
    assert str(failed.value) == f"persisting failed at /{LOAD}: No space left on device; earlier files were put back"
    assert read(host.root, RULES) == HEADER + rule(OTHER) and read(host.root, UNIT) == "old unit\n"
    assert os.readlink(os.path.join(host.root, WANTS)) == "/usr/lib/systemd/system/gpuvfio-old.service"
    assert read(host.root, SOFTDEP) is None and read(host.root, LOAD) is None
    assert sorted(os.listdir(os.path.dirname(os.path.join(host.root, RULES)))) == [os.path.basename(RULES)]


@pytest.mark.parametrize("error, words", [
    (GpuvfioError("the target is immutable"), "the target is immutable"),
    (OSError("rename refused"), "rename refused"),
])
def test_a_failure_without_an_os_reason_is_reported_in_its_own_words(tmp_path, error, words):
    """A failure that is not an OSError with a strerror (the file layer's own refusal, a bare
    OSError) still names its reason, and the files are put back."""
    host = persisted_before(tmp_path)
    changes = plan_persist(host, [A(GPU)], [], {"nvidia"})

    def failing(path):
        if path == "/" + SOFTDEP:
            raise error

    with pytest.raises(GpuvfioError) as failed:
        commit(host, changes, fault=failing)
    assert str(failed.value) == f"persisting failed at /{SOFTDEP}: {words}; earlier files were put back"
    assert read(host.root, RULES) == HEADER + rule(OTHER)


def test_a_failure_while_writing_the_temps_names_the_file_and_changes_nothing(tmp_path):
    """A plan written after the tree changed (a file where modules-load.d should be) fails while
    staging: it names that file, and no target nor temp file is left behind."""
    host = host_with(tmp_path, {})
    changes = plan_persist(host, [A(GPU)], [], {"nvidia"})
    put(host.root, "etc/modules-load.d", "not a directory\n")
    with pytest.raises(GpuvfioError) as failed:
        commit(host, changes)
    message = str(failed.value)
    assert message.startswith(f"persisting failed while writing /{LOAD}: ") and "is not a directory" in message
    assert message.endswith("; nothing was changed")
    left = [os.path.relpath(os.path.join(d, f), host.root) for d, _s, fs in os.walk(host.root) for f in fs]
    assert left == ["etc/modules-load.d"]
