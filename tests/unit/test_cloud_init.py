"""The cloud-init seed of ``xml --cloud-init`` and ``attach --cloud-init`` (issue 24 item 5),
checked by cloud-init itself: its schema check passes the user-data (and fails a broken one),
its NoCloud reader reads the seed's files back; xorriso reads the image back (volume id cidata,
the two files with the exact content); the pinned host key is the seed's; nothing is written
but the seed (out dir) and the pin (state dir); a missing xorriso is one line, exit 1."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess

import pytest
from cryptography.hazmat.primitives import serialization

from gpuvfio.domain.cloud_init import HostKey, fingerprint, generate_host_key, guest_hostname, seed_documents
from gpuvfio.ops.cloud_init import pin_host_key, plan_seed, write_seed
from gpuvfio.ops.context import host_context
from gpuvfio.ops.targets import ssh_options
from gpuvfio.host.root import HostRoot
from tests.make_samples import sample_path

GPU = "0000:9d:00.0"


def cloud_init() -> str:
    found = shutil.which("cloud-init")
    assert found, "cloud-init is not installed (apt-get install cloud-init): the seed is checked by it"
    return found


def xorriso() -> str:
    found = shutil.which("xorriso")
    assert found, "xorriso is not installed (apt-get install xorriso)"
    return found


def schema_check(path) -> subprocess.CompletedProcess:
    return subprocess.run([cloud_init(), "schema", "--config-file", str(path)], capture_output=True, text=True,
                          timeout=120)


def private_key(tmp_path) -> str:
    path = tmp_path / "id_ed25519"
    path.write_bytes(generate_host_key().private.encode())
    path.chmod(0o600)
    return str(path)


def authorized_of(key_file: str) -> str:
    with open(key_file, "rb") as handle:
        key = serialization.load_ssh_private_key(handle.read(), None)
    return key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH).decode()


def disk_image(tmp_path):
    """A boot disk the attach plan finds on this machine (issue 33 item 2)."""
    path = tmp_path / "guest.img"
    path.write_bytes(b"\0" * 512)
    return path


def bare_host(tmp_path) -> HostRoot:
    (tmp_path / "host").mkdir(exist_ok=True)
    return HostRoot(str(tmp_path / "host"))


def extract(seed: str, out) -> dict[str, str]:
    """The image's files, read back by xorriso (Rock Ridge names; stdio: because xorriso takes a
    path under /dev, such as /dev/shm, for a drive otherwise)."""
    out.mkdir()
    subprocess.run([xorriso(), "-osirrox", "on", "-indev", f"stdio:{seed}", "-extract", "/", str(out)], check=True,
                   capture_output=True, timeout=60)
    return {name: (out / name).read_text() for name in sorted(os.listdir(out))}


def volume_id(seed: str) -> str:
    done = subprocess.run([xorriso(), "-indev", f"stdio:{seed}", "-pvd_info"], capture_output=True, text=True,
                          timeout=60, check=True)
    return [line.split(":", 1)[1].strip() for line in done.stdout.splitlines() if line.startswith("Volume Id")][0]


@pytest.mark.parametrize("user", ["root", "cloud"])
def test_the_user_data_passes_cloud_inits_own_schema_check(tmp_path, user):
    documents = seed_documents("h100 <node1>", user, "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGuest", generate_host_key())
    path = tmp_path / "user-data"
    path.write_text(documents.user_data)
    done = schema_check(path)
    assert done.returncode == 0 and "Valid cloud-config" in done.stdout, done.stdout + done.stderr
    # The check can fail: the same document with a key cloud-init types otherwise.
    broken = json.loads(documents.user_data.split("\n", 1)[1])
    broken["ssh_deletekeys"] = "yes please"
    path.write_text("#cloud-config\n" + json.dumps(broken))
    assert schema_check(path).returncode != 0
    assert json.loads(documents.meta_data) == {"instance-id": documents.instance_id, "local-hostname": "h100-node1"}


def test_each_host_key_is_fresh_and_the_instance_id_follows_it():
    a, b = generate_host_key(), generate_host_key()
    assert a.public != b.public and a.key_type == "ssh-ed25519"
    assert "PRIVATE" not in repr(a)  # the secret half is never in a repr (logs, tracebacks)
    one = seed_documents("vm", "root", "ssh-ed25519 AAAA", a)
    assert one.instance_id != seed_documents("vm", "root", "ssh-ed25519 AAAA", b).instance_id
    assert one == seed_documents("vm", "root", "ssh-ed25519 AAAA", a)  # the same inputs, the same seed
    assert guest_hostname("win<11>&gaming") == "win-11-gaming" and guest_hostname("<>") == "gpuvfio-guest"


def test_xml_writes_the_seed_pins_its_host_key_and_writes_nothing_else(cli, tmp_path, monkeypatch):
    state, out, scratch = tmp_path / "state", tmp_path / "out", tmp_path / "scratch"
    out.mkdir()
    scratch.mkdir()
    monkeypatch.setenv("GPUVFIO_STATE_DIR", str(state))
    monkeypatch.setenv("TMPDIR", str(scratch))
    key = private_key(tmp_path)
    seed = str(out / "h100-seed.iso")
    result = cli("--root", sample_path("dgx-h100"), "xml", GPU, "--name", "h100", "--memory", "8G",
                 "--user-net-ssh-port", "2222", "--cloud-init", seed, "--ssh-key", key, "--ssh-user", "cloud",
                 "--json")
    assert result.code == 0, result.err
    report = result.json()
    said = report["cloud_init"]
    assert f"<source file='{seed}'/>" in report["xml"] and "device='cdrom'" in report["xml"]
    assert said["pinned"] == ["[127.0.0.1]:2222"] and said["user"] == "cloud"
    assert said["key_fingerprint"] == fingerprint(authorized_of(key))
    # Only the seed (0600: it holds the guest's private host key) and the pin were written.
    assert sorted(os.listdir(out)) == ["h100-seed.iso"] and os.listdir(scratch) == []
    assert sorted(os.listdir(state)) == ["known_hosts"]
    assert stat.S_IMODE(os.stat(seed).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(state / "known_hosts").st_mode) == 0o600
    assert "PRIVATE KEY" not in result.out + result.err
    # The image as the NoCloud datasource finds it: volume cidata, user-data and meta-data.
    assert volume_id(seed) == "cidata"
    files = extract(seed, tmp_path / "extracted")
    assert sorted(files) == ["meta-data", "user-data"]
    config = json.loads(files["user-data"].removeprefix("#cloud-config\n"))
    assert config["users"][0]["name"] == "cloud"
    assert config["users"][0]["ssh_authorized_keys"] == [authorized_of(key)]
    assert json.loads(files["meta-data"])["instance-id"] == said["instance_id"]
    # The pin is the seed's public host key, which is the public half of the seed's private key.
    pinned = (state / "known_hosts").read_text().split()
    assert pinned == ["[127.0.0.1]:2222", "ssh-ed25519", said["host_key"]["public"].split()[1]]
    assert config["ssh_keys"]["ed25519_public"] == said["host_key"]["public"]
    private = serialization.load_ssh_private_key(config["ssh_keys"]["ed25519_private"].encode(), None)
    derived = private.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    assert derived.decode() == said["host_key"]["public"]
    assert schema_check(tmp_path / "extracted" / "user-data").returncode == 0


def test_the_image_holds_exactly_the_planned_documents_and_cloud_init_reads_them(tmp_path):
    key = private_key(tmp_path)
    known = tmp_path / "known_hosts"
    known.write_text("# pins\n192.0.2.7 ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOld\n"
                     "other.example,192.0.2.7 ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAABAQOld\n"
                     "198.51.100.1 ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIKeep\n")
    with host_context(bare_host(tmp_path)) as ctx:
        seed = plan_seed(ctx, "vm1", str(tmp_path / "seed.iso"),
                         ssh=ssh_options(host="192.0.2.7", user="root", key=key, known_hosts=str(known)))
        assert seed.checks == () and seed.pins == ("192.0.2.7",)
        write_seed(ctx, seed)
        files = extract(seed.path, tmp_path / "extracted")
        assert files == {"user-data": seed.documents.user_data, "meta-data": seed.documents.meta_data}
        # An earlier guest's keys for the address go; other hosts' pins and comments stay.
        assert known.read_text() == ("# pins\nother.example ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAABAQOld\n"
                                     "198.51.100.1 ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIKeep\n"
                                     f"192.0.2.7 {seed.host_key.public}\n")
        pin_host_key(ctx, seed)  # pinned again: still one line for it
        assert known.read_text().count("192.0.2.7") == 1
    # cloud-init's own NoCloud reader (util.read_seeded, as the datasource reads a seed directory).
    interpreter = open(cloud_init()).readline()[2:].strip()
    done = subprocess.run([interpreter, "-c", "import json, sys\nfrom cloudinit import util\n"
                           "md, ud, _vd = util.read_seeded(sys.argv[1])\n"
                           "print(json.dumps({'md': md, 'cfg': util.load_yaml(ud)}))",
                           f"file://{tmp_path / 'extracted'}/"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    read = json.loads(done.stdout)
    assert read["md"] == {"instance-id": seed.documents.instance_id, "local-hostname": "vm1"}
    assert read["cfg"]["ssh_keys"]["ed25519_public"] == seed.host_key.public
    assert read["cfg"]["disable_root"] is False and read["cfg"]["users"][0]["name"] == "root"


def test_a_hashed_pin_for_the_address_is_replaced(tmp_path):
    import base64
    import hashlib
    import hmac

    salt = os.urandom(20)
    hashed = "|1|{}|{}".format(base64.b64encode(salt).decode(), base64.b64encode(
        hmac.new(salt, b"[127.0.0.1]:2222", hashlib.sha1).digest()).decode())
    known = tmp_path / "known_hosts"
    known.write_text(f"{hashed} ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOld\n")
    key = private_key(tmp_path)
    with host_context(bare_host(tmp_path)) as ctx:
        seed = plan_seed(ctx, "vm1", str(tmp_path / "seed.iso"), forward_port=2222,
                         ssh=ssh_options(key=key, known_hosts=str(known)))
        pin_host_key(ctx, seed)
    assert known.read_text() == f"[127.0.0.1]:2222 {seed.host_key.public}\n"


def test_an_address_found_after_boot_is_not_pinned_and_the_plan_says_so(tmp_path):
    with host_context(bare_host(tmp_path)) as ctx:
        seed = plan_seed(ctx, "vm1", str(tmp_path / "seed.iso"), ssh=ssh_options(key=private_key(tmp_path)))
    assert seed.pins == () and [c.status.value for c in seed.checks] == ["warn"]
    assert "not pinned" in seed.describe() and isinstance(seed.host_key, HostKey)


def test_bad_input_and_a_missing_xorriso(cli, tmp_path, monkeypatch):
    monkeypatch.setenv("GPUVFIO_STATE_DIR", str(tmp_path / "state"))
    args = ["--root", sample_path("dgx-h100"), "xml", GPU, "--name", "h100", "--memory", "8G"]
    key = private_key(tmp_path)
    relative = cli(*args, "--cloud-init", "seed.iso", "--ssh-key", key)
    assert relative.code == 2 and "absolute path" in relative.err
    keyless = cli(*args, "--cloud-init", str(tmp_path / "seed.iso"))
    assert keyless.code == 2 and "--ssh-key" in keyless.err
    alone = cli(*args, "--ssh-key", key)
    assert alone.code == 2 and "--cloud-init" in alone.err
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    missing = cli(*args, "--cloud-init", str(tmp_path / "seed.iso"), "--ssh-key", key)
    assert missing.code == 1 and "install the xorriso package" in missing.err
    assert len([line for line in missing.err.splitlines() if "error" in line]) == 1
    assert not (tmp_path / "seed.iso").exists() and not (tmp_path / "state").exists()


def test_attach_plans_the_seed_before_the_define(cli, workstation, tmp_path, monkeypatch):
    pytest.importorskip("libvirt")
    state = tmp_path / "state"
    monkeypatch.setenv("GPUVFIO_STATE_DIR", str(state))
    seed = tmp_path / "seed.iso"
    result = cli("--root", workstation.root, "attach", "01:00", "--name", "vm1", "--dry-run", "--json",
                 "--connect", "test:///default", "--ssh-host", "192.0.2.7", "--virt-type", "qemu",
                 "--firmware", "bios", "--cloud-init", str(seed), "--ssh-key", private_key(tmp_path),
                 "--disk", str(disk_image(tmp_path)))
    assert result.code == 0, result.err
    plan = result.json()
    assert [s["kind"] for s in plan["steps"]] == ["bind", "cloud-init seed", "define", "start", "wait for ssh",
                                                  "verify"]
    step = plan["steps"][1]["detail"]
    assert step.startswith(f"cloud-init seed {seed}: user root, key SHA256:")
    assert f"host key {plan['cloud_init']['host_key']['fingerprint']} pinned for 192.0.2.7 in " in step
    assert f"<source file='{seed}'/>" in plan["xml"]
    assert not seed.exists() and not state.exists()  # a plan writes nothing


def test_a_file_that_is_not_our_seed_is_never_replaced(cli, tmp_path, monkeypatch):
    """Issue 33 item 3: an undone attach removes the seed, so the seed path must be new, or an
    earlier seed of gpuvfio's (its ISO 9660 application id): the user's file is refused, kept
    byte for byte, and so is a seed another tool made (cloud-localds's: volume cidata too)."""
    monkeypatch.setenv("GPUVFIO_STATE_DIR", str(tmp_path / "state"))
    key = private_key(tmp_path)
    mine = tmp_path / "important.iso"
    mine.write_bytes(b"the user's own file\n" * 100)
    foreign = tmp_path / "foreign-seed.iso"
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "meta-data").write_text("instance-id: x\n")
    subprocess.run([xorriso(), "-as", "genisoimage", "-output", str(foreign), "-volid", "cidata", "-joliet", "-rock",
                    str(tmp_path / "docs" / "meta-data")], check=True, capture_output=True, timeout=60)
    kept = {path: path.read_bytes() for path in (mine, foreign)}
    for path in (mine, foreign):
        result = cli("--root", sample_path("dgx-h100"), "xml", GPU, "--name", "h100", "--memory", "8G",
                     "--user-net-ssh-port", "2222", "--cloud-init", str(path), "--ssh-key", key)
        assert result.code == 1, result.err
        assert f"{path} exists and is not a cloud-init seed gpuvfio wrote" in result.err
        assert path.read_bytes() == kept[path]
    # gpuvfio's own earlier seed is recognised and replaced by a fresh one.
    ours = tmp_path / "ours.iso"
    (tmp_path / "kh").write_text("")
    with host_context(bare_host(tmp_path)) as ctx:
        first = plan_seed(ctx, "vm1", str(ours), ssh=ssh_options(host="192.0.2.7", key=key,
                                                                 known_hosts=str(tmp_path / "kh")))
        write_seed(ctx, first)
        again = plan_seed(ctx, "vm1", str(ours), ssh=ssh_options(host="192.0.2.7", key=key,
                                                                 known_hosts=str(tmp_path / "kh")))
        assert again.refusals == []
        write_seed(ctx, again)
        assert extract(str(ours), tmp_path / "x")["meta-data"] == again.documents.meta_data
        # A file put there after the plan is still not replaced.
        late = plan_seed(ctx, "vm2", str(tmp_path / "late.iso"), ssh=ssh_options(host="192.0.2.8", key=key,
                                                                                   known_hosts=str(tmp_path / "kh")))
        (tmp_path / "late.iso").write_bytes(b"appeared meanwhile")
        with pytest.raises(Exception, match="not a cloud-init seed gpuvfio wrote"):
            write_seed(ctx, late)
        assert (tmp_path / "late.iso").read_bytes() == b"appeared meanwhile"
