"""SSH as admins have it (issue 15 item 7): ~/.ssh/config or --ssh-config, resolved by ssh -G
where OpenSSH is installed and by paramiko's parser otherwise (Host aliases, HostName, User, Port,
IdentityFile, UserKnownHostsFile, ProxyJump); keys from ssh-agent; the host-key policy unchanged.
Real connections go to this machine behind dropbear (tests/lanes/hypervisor.py), one hop direct
and one through a ProxyJump host."""

from __future__ import annotations

import shutil

import pytest

from gpuvfio.commands import Runner
from gpuvfio.errors import InputError
from gpuvfio.guest.ssh import HostKeyError, Session, SshError
from gpuvfio.guest.ssh_config import resolve
from gpuvfio.host.root import HostRoot
from gpuvfio.ops.context import Context
from gpuvfio.ops.targets import guest_target, ssh_options

SSH = shutil.which("ssh")


def write_config(tmp_path, text: str) -> str:
    path = tmp_path / "ssh_config"
    path.write_text(text)
    return str(path)


@pytest.fixture
def files(tmp_path):
    key = tmp_path / "id_test"
    key.write_text("not read here\n")
    known = tmp_path / "known"
    known.write_text("")
    return str(key), str(known)


@pytest.mark.parametrize("binary", [pytest.param("auto", id="ssh -G"), pytest.param(None, id="paramiko")])
def test_an_alias_resolves_to_its_options(tmp_path, files, binary):
    if binary == "auto" and SSH is None:
        pytest.skip("OpenSSH's ssh is not installed")
    key, known = files
    config = write_config(tmp_path, f"Host gpu-guest\n  HostName 10.1.2.3\n  User admin\n  Port 2200\n"
                                    f"  IdentityFile {key}\n  IdentityFile {tmp_path}/missing\n"
                                    f"  UserKnownHostsFile {known} {tmp_path}/missing2\n"
                                    "  ProxyJump ops@bastion:2022\n\nHost *\n  ForwardAgent no\n")
    got = resolve("gpu-guest", config, ssh=binary, run=Runner())
    assert (got.hostname, got.user, got.port) == ("10.1.2.3", "admin", 2200)
    assert got.identity_files == (key,) and got.known_hosts_files == (known,)  # existing files only
    assert got.proxy_jump == "ops@bastion:2022"
    # A host the file says nothing about: nothing from OpenSSH's defaults (the local user, the
    # default identity files, ~/.ssh/known_hosts) comes along: gpuvfio's own defaults hold.
    other = resolve("10.9.9.9", config, ssh=binary, run=Runner())
    assert (other.hostname, other.user, other.port, other.identity_files, other.known_hosts_files,
            other.proxy_jump) == ("10.9.9.9", None, None, (), (), None)


@pytest.mark.parametrize("text, words", [
    ("Host g\n  ProxyCommand nc %h %p\n", "ProxyCommand"),
    ("Host g\n  ProxyJump a/b\n", "ProxyJump"),
    ("Host g\n  Port 99999\n", "Port"),
    ("Host g\n  ProxyJump a,b\n", "more than one hop"),
])
def test_what_gpuvfio_does_not_do_is_refused(tmp_path, text, words):
    with pytest.raises(InputError, match=words):
        resolve("g", write_config(tmp_path, text), ssh=None, run=Runner())
    if SSH is not None:  # gpuvfio's refusal, or OpenSSH's own of an option it rejects
        with pytest.raises(InputError, match=f"{words}|ssh -G g: .*bad configuration option"):
            resolve("g", write_config(tmp_path, text), run=Runner())


def test_a_missing_config_file_is_bad_input(tmp_path):
    with pytest.raises(InputError, match="SSH config file not found"):
        ssh_options(host="g", ssh_config=str(tmp_path / "nope"))
    with pytest.raises(InputError, match="SSH config file not found"):
        ssh_options(host="g", ssh_config="")


@pytest.mark.parametrize("text, words", [("Host g\n  HostName bad$host\n", "not a host name"),
                                         ("Host g\n  User Root;x\n", "not a user name"),
                                         ("Host g\n  ProxyJump Bad;User@h\n", "ProxyJump")])
def test_values_from_the_config_are_checked_as_options_are(tmp_path, text, words):
    with pytest.raises(InputError, match=words):
        guest_target(ssh_options(host="g", ssh_config=write_config(tmp_path, text)), run=Runner())


def test_explicit_options_win_over_the_config(tmp_path, files):
    key, _known = files
    config = write_config(tmp_path, "Host g\n  HostName 10.1.2.3\n  User admin\n  Port 2200\n")
    target = guest_target(ssh_options(host="g", port=22, user="root", key=key, ssh_config=config), run=Runner())
    assert (target.host, target.port, target.user, target.key) == ("10.1.2.3", 22, "root", key)
    assert any("by the SSH config" in note for note in target.notes)
    plain = guest_target(ssh_options(host="g", ssh_config=config), run=Runner())
    assert (plain.port, plain.user) == (2200, "admin")


def test_a_host_alias_connects_with_the_configs_key_and_pins(tmp_path, ssh_lane, monkeypatch):
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    server = ssh_lane.start(str(tmp_path / "guest"))
    try:
        config = write_config(tmp_path, f"Host lab-guest\n  HostName 127.0.0.1\n  Port {server.port}\n  User root\n"
                                        f"  IdentityFile {server.client_key}\n"
                                        f"  UserKnownHostsFile {server.known_hosts}\n")
        target = guest_target(ssh_options(host="lab-guest", ssh_config=config, timeout=20), run=Runner())
        with Session(target, str(tmp_path / "recorded")) as session:
            assert session.run(["echo", "through the alias"]) == (0, "through the alias\n", "")
        # The policy is unchanged: the config's known_hosts pins, nothing else is trusted.
        unpinned = write_config(tmp_path, f"Host lab-guest\n  HostName 127.0.0.1\n  Port {server.port}\n"
                                          f"  IdentityFile {server.client_key}\n"
                                          f"  UserKnownHostsFile {tmp_path}/empty_known\n")
        (tmp_path / "empty_known").write_text("")
        with pytest.raises(HostKeyError):
            Session(guest_target(ssh_options(host="lab-guest", ssh_config=unpinned, timeout=20), run=Runner()),
                    str(tmp_path / "recorded")).connect()
    finally:
        server.stop()


def test_a_known_hosts_file_with_cert_authority_lines_is_an_error_not_a_traceback(tmp_path, ssh_lane):
    server = ssh_lane.start(str(tmp_path / "guest"))
    try:
        odd = tmp_path / "ca_known_hosts"
        odd.write_text("@cert-authority *.example.org ssh-ed25519 AAAAnotbase64\n")
        config = write_config(tmp_path, f"Host lab-guest\n  HostName 127.0.0.1\n  Port {server.port}\n"
                                        f"  IdentityFile {server.client_key}\n  UserKnownHostsFile {odd}\n")
        target = guest_target(ssh_options(host="lab-guest", ssh_config=config, known_hosts=server.known_hosts,
                                          timeout=10), run=Runner())
        with pytest.raises(SshError, match="cannot read the host keys"):
            Session(target, str(tmp_path / "recorded")).connect()
    finally:
        server.stop()


def test_a_jump_host_that_cannot_reach_the_guest_yet_is_asked_again(tmp_path, ssh_lane, monkeypatch):
    """While the guest boots the jump host refuses the channel: retried until the timeout, then
    one error that says so (on main: one attempt, at once)."""
    import time

    from tests.lanes import guest as gl

    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    jump = ssh_lane.start(str(tmp_path / "jump"))
    try:
        closed = gl.free_port()
        config = write_config(tmp_path, f"Host bastion\n  HostName 127.0.0.1\n  Port {jump.port}\n  User root\n"
                                        f"  IdentityFile {jump.client_key}\n  UserKnownHostsFile {jump.known_hosts}\n\n"
                                        f"Host booting\n  HostName 127.0.0.1\n  Port {closed}\n  ProxyJump bastion\n")
        target = guest_target(ssh_options(host="booting", ssh_config=config, timeout=3, trust_on_first_use=True), run=Runner())
        began = time.monotonic()
        with pytest.raises(SshError, match="did not answer SSH within 3s.*cannot open a channel"):
            Session(target, str(tmp_path / "recorded")).connect()
        assert time.monotonic() - began >= 1.5  # asked again, not once (the last wait is cut at the deadline)
    finally:
        jump.stop()


def test_proxyjump_reaches_the_target_through_the_jump_host(tmp_path, ssh_lane, monkeypatch):
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    jump = ssh_lane.start(str(tmp_path / "jump"))
    guest = ssh_lane.start(str(tmp_path / "guest"))
    try:
        config = write_config(tmp_path, f"Host bastion\n  HostName 127.0.0.1\n  Port {jump.port}\n  User root\n"
                                        f"  IdentityFile {jump.client_key}\n"
                                        f"  UserKnownHostsFile {jump.known_hosts}\n\n"
                                        f"Host inner-guest\n  HostName 127.0.0.1\n  Port {guest.port}\n  User root\n"
                                        f"  IdentityFile {guest.client_key}\n"
                                        f"  UserKnownHostsFile {guest.known_hosts}\n  ProxyJump bastion\n")
        target = guest_target(ssh_options(host="inner-guest", ssh_config=config, timeout=20), run=Runner())
        assert target.jump is not None and target.jump.port == jump.port
        with Session(target, str(tmp_path / "recorded")) as session:
            status, out, _err = session.run(["sh", "-c", "echo $SSH_CONNECTION"])
        assert status == 0 and out.split()[3] == str(guest.port)  # the guest's server answered
    finally:
        guest.stop()
        jump.stop()


def test_a_testbeds_remote_hypervisor_takes_the_ssh_config_too(tmp_path, files):
    """[host] address may be an alias of the admin's SSH config (its own ssh_config key, or
    ~/.ssh/config); what the spec sets (port, user) wins, as on the command line."""
    from gpuvfio.testbed.remote import session_for
    from gpuvfio.testbed.spec import load_spec
    from tests.unit.test_spec_schema import BASE

    key, known = files
    config = write_config(tmp_path, f"Host hv-lab\n  HostName 10.20.30.40\n  Port 2222\n  User ops\n"
                                    f"  IdentityFile {key}\n  UserKnownHostsFile {known}\n")
    spec_path = tmp_path / "spec.toml"
    spec_path.write_text(BASE + f'\n[host]\naddress = "hv-lab"\nknown_hosts = "{known}"\nssh_config = "{config}"\n')
    target = session_for(Context(host=HostRoot(str(tmp_path))), load_spec(str(spec_path)).host).target
    assert (target.host, target.port, target.user, target.identity_files) == ("10.20.30.40", 2222, "ops", (key,))
    spec_path.write_text(BASE + f'\n[host]\naddress = "hv-lab"\nknown_hosts = "{known}"\nssh_config = "{config}"\n'
                                'user = "root"\nport = 22\n')
    target = session_for(Context(host=HostRoot(str(tmp_path))), load_spec(str(spec_path)).host).target
    assert (target.host, target.port, target.user) == ("10.20.30.40", 22, "root")
