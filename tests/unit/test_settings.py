"""gpuvfio.settings: every variable gpuvfio follows, read in one place (issue 36 item 1)."""

from __future__ import annotations

from gpuvfio.settings import Settings


def test_each_variable_is_read_into_its_setting():
    env = {"GPUVFIO_ROOT": "/r", "GPUVFIO_STATE_DIR": "/s", "GPUVFIO_PCI_IDS": "/p",
           "GPUVFIO_LIBVIRT_SCHEMAS": "/x", "GPUVFIO_ALLOW_UNSAFE_URI": "1", "LIBVIRT_DEFAULT_URI": "test:///default",
           "TMPDIR": "/tmp/elsewhere", "SSH_AUTH_SOCK": "/run/agent", "_GPUVFIO_COMPLETE": "bash_complete",
           "HOME": "/root"}
    got = Settings.from_environment(env)
    assert (got.root, got.state_dir, got.pci_ids, got.schemas) == ("/r", "/s", "/p", "/x")
    assert got.allow_unsafe_uri and got.libvirt_uri == "test:///default"
    assert got.tmpdir_set and got.ssh_agent and got.completion
    assert got.environ == env and got.environ is not env  # a copy: later changes to the mapping do not leak in


def test_unset_and_empty_variables_mean_the_defaults():
    got = Settings.from_environment({"GPUVFIO_ALLOW_UNSAFE_URI": "yes", "LIBVIRT_DEFAULT_URI": "", "TMPDIR": "",
                                     "SSH_AUTH_SOCK": "", "GPUVFIO_PCI_IDS": ""})
    assert not got.allow_unsafe_uri  # only 1 lifts the URI policy
    assert got.libvirt_uri is None and got.pci_ids is None
    assert not got.tmpdir_set and not got.ssh_agent and not got.completion and got.root is None
    assert Settings.from_environment({}) == Settings()


def test_the_runs_settings_decide_the_uri_policy_not_the_environment_later(monkeypatch):
    """A URI the policy refuses goes through only when the run's settings say so: the variable
    set in the environment after they were read changes nothing for that run."""
    import pytest

    from gpuvfio.errors import InputError
    from gpuvfio.virt.connection import default_uri

    monkeypatch.setenv("GPUVFIO_ALLOW_UNSAFE_URI", "1")
    run = Settings(libvirt_uri="qemu+ext:///system?command=/bin/true")
    with pytest.raises(InputError, match="refused"):
        default_uri(run)
    allowed = Settings(libvirt_uri="qemu+ext:///system?command=/bin/true", allow_unsafe_uri=True)
    monkeypatch.delenv("GPUVFIO_ALLOW_UNSAFE_URI")
    assert default_uri(allowed).startswith("qemu+ext://")
