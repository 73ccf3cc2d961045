"""libvirt URIs by gpuvfio's policy (issue 22 item 3): libvirt runs programs some URIs name
(the ext transport's command=, the SSH transports, netcat=), even for a dry run or a plan, so
every URI is checked where it comes in (--connect, LIBVIRT_DEFAULT_URI, a testbed spec, the
Ansible modules) and again by open_connection. A refused URI is bad input (exit 2), and the
program it names never runs: each command test hands libvirt a script that would leave a file.
libvirt is real throughout (its test driver where a connection is opened)."""

import os
import uuid

import pytest

from gpuvfio.errors import InputError
from gpuvfio.testbed.spec import load_spec
from gpuvfio.virt.connection import SYSTEM_URI, URI_ENV, default_uri, open_connection
from gpuvfio.virt.uri import UNSAFE_ENV, URI_LIMIT, URI_SHOWN, check_uri, named, names_a_test_file
from tests.conftest import gpu_workstation
from tests.make_samples import sample_path
from tests.unit.test_fleet import modules, run_module  # noqa: F401  (the Ansible module fixtures)
from tests.unit.test_testbed import GOOD

ALLOWED = [
    "qemu:///system",
    "qemu:///session",
    "QEMU:///system",
    "test:///default",
    "test+unix:///default",
    "qemu+unix:///system",
    "qemu+unix:///system?socket=/nonexistent/libvirt-sock",
    "qemu:///system?socket=/tmp/lane/libvirt-sock",  # the daemon lane's private libvirtd
    "qemu://hv1.example.org/system",  # a host and no transport: TLS
    "qemu+tls://hv1.example.org/system",
    "qemu+tls://[fd00::5]/system?pkipath=/etc/pki/hv1",
    "qemu+tcp://admin@10.0.0.5:16509/system",
    "qemu:///system?mode=direct",
    "qemu:///system?mode=legacy&socket=/run/libvirt/libvirt-sock",
    "qemu:///system?socket=/run/a=b",  # the value runs from the first "=" (libvirt's virURIParseParams)
    "qemu:///system?socket=/run/~x",  # "~" is the last printable ASCII character
    "test:///default?mode=auto",  # the test driver's default, with a query, is no file
]

REFUSED = [
    ("qemu+ext:///system?command=/bin/true", "transport 'ext'"),
    ("qemu+EXT:///system", "transport 'ext'"),
    ("qemu+ext:///system", "transport 'ext' makes libvirt run the program named by command="),
    ("qemu+ssh://hv1/system", "transport 'ssh'"),
    ("qemu+ssh://hv1/system?command=/bin/true", "transport 'ssh'"),
    ("qemu+libssh://hv1/system", "no policy"),
    ("qemu+libssh2://hv1/system?known_hosts=/dev/null", "no policy"),
    ("qemu+magic:///system", "transport 'magic'"),
    ("qemu+unix:///system?command=/bin/true", "parameter 'command'"),
    ("qemu:///system?netcat=/bin/true", "parameter 'netcat'"),
    ("qemu:///system?proxy=netcat", "parameter 'proxy'"),
    ("qemu+tls://hv1/system?no_verify=1", "parameter 'no_verify'"),
    ("qemu:///system?no_tty=1", "parameter 'no_tty'"),
    ("qemu:///system?keyfile=/root/.ssh/id_ed25519", "parameter 'keyfile'"),
    ("qemu:///system?no_sanity=1", "parameter 'no_sanity'"),
    ("qemu:///system?name=qemu%2Bext:///system", "parameter 'name'"),
    ("qemu:///system?tls_priority=NORMAL", "parameter 'tls_priority'"),
    ("qemu:///system?colour=red", "parameter 'colour'"),
    ("qemu:///system?COMM%41ND=/bin/true", "parameter 'command'"),  # libvirt decodes names, ignores case
    ("qemu:///system?mode=direct;command=/bin/true", "parameter 'command'"),  # ';' separates without '&'
    ("qemu+tls://hv1/system?socket=/run/x", "parameter 'socket'"),  # remote: the netcat command line
    ("qemu:///system?socket=libvirt-sock", "absolute path"),
    ("qemu:///system?socket=/run/%0Asock", "decodes to a control"),
    ("qemu:///system?socket=/run/a%20b", "decodes to a control"),  # a space: the first character refused
    ("qemu:///system?socket=/run/a%7Fb", "decodes to a control"),  # DEL, the last
    ("qemu+tls:///system?socket=/run/x", "parameter 'socket'"),  # TLS without a host: not local either
    ("qemu:///system?mode=fast", "parameter 'mode'"),
    ("lxc:///", "driver 'lxc'"),
    ("remote:///system", "driver 'remote'"),
    ("hv1", "not of the form"),  # a libvirt.conf alias: whatever URI it names
    ("qemu:/system", "not of the form"),
    ("qemu:///system#x", "fragment"),
    ("qemu://-oProxyCommand=x/system", "not [user@]host[:port]"),
    ("qemu://hv1", "no path"),
]

BAD = [
    ("", "cannot be empty"),
    ("qemu:///sys tem", "whitespace"),
    ("qemu:///system\n", "whitespace"),
    ("\tqemu:///system", "whitespace"),
    ("qemu:///sys\x07tem", "control character"),
    ("qemu:///sys\x00tem", "control character"),
    ("qemu:///syst\u00e9m", "non-ASCII"),
    ("qemu:///sys\x7ftem", "control character at position 11"),  # DEL: the character after "~"
    ("qemu:///sys tem", "whitespace at position 11"),
]


@pytest.fixture(autouse=True)
def _policy_on(monkeypatch):
    monkeypatch.delenv(UNSAFE_ENV, raising=False)
    monkeypatch.delenv(URI_ENV, raising=False)


@pytest.fixture
def program(tmp_path):
    """A program a URI could name: it leaves ``canary`` when something runs it."""
    canary = tmp_path / "canary"
    prog = tmp_path / "prog"
    prog.write_text(f"#!/bin/sh\ntouch '{canary}'\n")
    prog.chmod(0o755)
    return prog, canary


@pytest.mark.parametrize("uri", ALLOWED)
def test_allowed_uris_pass_unchanged(uri):
    assert check_uri(uri, source="--connect") == uri


@pytest.mark.parametrize("uri, part", REFUSED)
def test_refused_uris_are_bad_input_naming_the_part(uri, part):
    with pytest.raises(InputError) as info:
        check_uri(uri, source="--connect")
    message = str(info.value)
    assert info.value.exit_code == 2
    assert part in message and message.startswith("--connect ") and f"{UNSAFE_ENV}=1" in message, message
    assert "\n" not in message


@pytest.mark.parametrize("uri, part", BAD)
@pytest.mark.parametrize("opt_out", ["", "1"])
def test_malformed_uris_are_bad_input_even_with_the_opt_out(monkeypatch, uri, part, opt_out):
    monkeypatch.setenv(UNSAFE_ENV, opt_out)
    with pytest.raises(InputError) as info:
        check_uri(uri, source="--connect")
    assert part in str(info.value) and "\n" not in str(info.value) and UNSAFE_ENV not in str(info.value)


def test_none_and_the_keywords_are_not_uris():
    assert check_uri(None) is None
    assert check_uri("none", keywords=("none",)) == "none"
    with pytest.raises(InputError, match="not of the form"):
        check_uri("none")


def test_the_opt_out_lets_a_refused_uri_through_with_one_warning(monkeypatch, tmp_path):
    uri = f"qemu+ext:///system?command={tmp_path}/prog"
    monkeypatch.setenv(UNSAFE_ENV, "yes")  # only 1 lifts the policy
    with pytest.raises(InputError):
        check_uri(uri)
    monkeypatch.setenv(UNSAFE_ENV, "1")
    told: list[str] = []
    assert check_uri(uri, source="--connect", warn=told.append) == uri
    assert check_uri(uri, source="--connect", warn=told.append) == uri
    assert len(told) == 1 and told[0].startswith(f"warning: {UNSAFE_ENV}=1: --connect ") and "'ext'" in told[0]


def test_open_connection_is_the_last_guard(program):
    prog, canary = program
    with pytest.raises(InputError, match="transport 'ext'"):
        open_connection(f"qemu+ext:///system?command={prog}")
    with pytest.raises(InputError, match="parameter 'netcat'"):
        open_connection(f"qemu:///system?netcat={prog}", read_only=True)
    assert not canary.exists()
    conn = open_connection("test:///default")  # libvirt's real test driver
    try:
        assert conn.getType().upper() == "TEST"
    finally:
        conn.close()


def test_libvirt_default_uri_is_checked(monkeypatch, program):
    prog, canary = program
    monkeypatch.setenv(URI_ENV, f"qemu+ext:///system?command={prog}")
    with pytest.raises(InputError) as info:
        default_uri()
    assert str(info.value).startswith(f"{URI_ENV} ") and "transport 'ext'" in str(info.value)
    monkeypatch.setenv(URI_ENV, "")
    assert default_uri() == SYSTEM_URI
    monkeypatch.setenv(URI_ENV, "test:///default")
    assert default_uri() == "test:///default"
    assert not canary.exists()


def _commands(tmp_path, uri):
    """Every command that takes a libvirt URI, given ``uri`` (the dry and read-only ones first)."""
    ws = gpu_workstation(tmp_path / "host")
    spec = tmp_path / "spec.toml"
    spec.write_text(GOOD)
    dgx = sample_path("dgx-h100")
    return {
        "bind --dry-run": ["--root", ws.root, "bind", "0000:01:00.0", "--dry-run", "--connect", uri],
        "bind": ["--root", ws.root, "bind", "0000:01:00.0", "--connect", uri],
        "reset": ["--root", ws.root, "reset", "0000:01:00.0", "--connect", uri],
        "xml": ["--root", ws.root, "xml", "0000:01:00.0", "--name", "g", "--connect", uri],
        "xml --define": ["--root", ws.root, "xml", "0000:01:00.0", "--name", "g", "--define", "--connect", uri],
        "vgpu list": ["--root", ws.root, "vgpu", "list", "--connect", uri],
        "verify": ["--root", ws.root, "verify", "g", "--no-bandwidth", "--connect", uri],
        "attach": ["--root", ws.root, "attach", "0000:01:00.0", "--name", "g", "--connect", uri],
        "detach": ["--root", ws.root, "detach", "g", "--connect", uri],
        "testbed plan": ["--root", dgx, "testbed", "plan", str(spec), "--connect", uri],
        "testbed run": ["--root", dgx, "testbed", "run", str(spec), "--out", str(tmp_path / "out"), "--connect",
                        uri],
    }


@pytest.mark.parametrize("command", ["bind --dry-run", "bind", "reset", "xml", "xml --define", "vgpu list", "verify",
                                     "attach", "detach", "testbed plan", "testbed run"])
def test_commands_refuse_an_ext_uri_before_anything_runs(cli, tmp_path, program, command):
    prog, canary = program
    result = cli(*_commands(tmp_path, f"qemu+ext:///system?command={prog}")[command])
    assert result.code == 2, (result.out, result.err)
    assert result.err.startswith("gpuvfio: error: --connect ") and "transport 'ext'" in result.err, result.err
    assert len(result.err.splitlines()) == 1
    assert not canary.exists() and not (tmp_path / "out").exists()


def test_the_canary_is_real_libvirt_runs_the_program_when_let_through(cli, tmp_path, program, monkeypatch):
    """What the refusals above prevent: with the loud opt-out, a dry run's libvirt question runs
    the URI's program (it answers no RPC, so the dry run is refused: libvirt did not answer)."""
    prog, canary = program
    monkeypatch.setenv(UNSAFE_ENV, "1")
    result = cli(*_commands(tmp_path, f"qemu+ext:///system?command={prog}")["bind --dry-run"])
    assert canary.exists()
    assert f"warning: {UNSAFE_ENV}=1: --connect " in result.err and result.code == 1, result.err


def test_commands_refuse_a_netcat_uri_and_take_none_where_it_means_do_not_ask(cli, tmp_path, program):
    prog, canary = program
    commands = _commands(tmp_path, f"qemu:///system?netcat={prog}")
    result = cli(*commands["vgpu list"])
    assert result.code == 2 and "parameter 'netcat'" in result.err, result.err
    result = cli(*_commands(tmp_path, "none")["bind --dry-run"])
    assert result.code == 0, result.err
    result = cli(*_commands(tmp_path, "none")["xml --define"])  # none: no libvirt, which a define needs
    assert result.code == 2 and "--define needs libvirt; --connect none asks none" in result.err, result.err
    assert not canary.exists()


def test_libvirt_default_uri_is_refused_at_the_command(cli, tmp_path, program, monkeypatch):
    prog, canary = program
    monkeypatch.setenv(URI_ENV, f"qemu+ext:///system?command={prog}")
    ws = gpu_workstation(tmp_path / "host")
    result = cli("--root", ws.root, "xml", "0000:01:00.0", "--name", "g", "--define")
    assert result.code == 2 and result.err.startswith(f"gpuvfio: error: {URI_ENV} "), result.err
    assert not canary.exists()


def test_the_testbed_spec_refuses_the_uri_at_its_line(cli, tmp_path, program):
    prog, canary = program
    spec = tmp_path / "spec.toml"
    spec.write_text(GOOD.replace("repetitions = 3", f'repetitions = 3\nconnect = "qemu+ext:///system?command={prog}"'))
    with pytest.raises(InputError) as info:
        load_spec(str(spec))
    assert "spec.toml:10: connect " in str(info.value) and "transport 'ext'" in str(info.value), str(info.value)
    result = cli("--root", sample_path("dgx-h100"), "testbed", "plan", str(spec))
    assert result.code == 2 and "transport 'ext'" in result.err, result.err
    assert not canary.exists()
    spec.write_text(GOOD.replace("repetitions = 3", 'repetitions = 3\nconnect = "test:///default"'))
    assert load_spec(str(spec)).connect == "test:///default"


def test_completion_opens_nothing_the_policy_refuses(cli, monkeypatch, tmp_path, program):
    from tests.unit.test_cli import _complete

    prog, canary = program
    assert _complete(cli, monkeypatch, f"gpuvfio detach --connect qemu+ext:///system?command={prog} tr") == []
    monkeypatch.setenv(UNSAFE_ENV, "1")  # a Tab never runs it, and writes no warning into the shell
    assert _complete(cli, monkeypatch, f"gpuvfio detach --connect qemu+ext:///system?command={prog} tr") == []
    assert not canary.exists()


@pytest.mark.parametrize("name, args", [
    ("device", {"devices": ["0000:01:00.0"], "libvirt_uri": "qemu+ext:///system?command=PROG"}),
    ("domain", {"name": "g", "devices": ["0000:01:00.0"], "uri": "qemu+ext:///system?command=PROG"}),
    ("domain", {"name": "g", "state": "absent", "uri": "qemu+ssh://hv1/system"}),
    ("verify", {"domain": "g", "uri": "qemu:///system?netcat=PROG"}),
])
@pytest.mark.parametrize("check", [True, False])
def test_ansible_modules_refuse_the_uri_in_check_mode_too(run_module, tmp_path, program, name, args, check):
    prog, canary = program
    ws = gpu_workstation(tmp_path / "host")
    args = {key: value.replace("PROG", str(prog)) if isinstance(value, str) else value for key, value in args.items()}
    failed, result = run_module(name, dict(args, root=ws.root, state_dir=str(tmp_path / "s")), check=check)
    # uri and libvirt_uri, the names these modules had, still work: aliases of connect
    assert failed and result["exit_code"] == 2 and result["msg"].startswith("connect "), result
    assert not canary.exists() and not os.path.exists(tmp_path / "s" / "journal.json")


def test_a_test_driver_file_is_a_regular_node_file_and_its_content_never_shows(tmp_path, cli):
    """Issue 34 item 3: test:///PATH made libvirt print the first line of any file (a shadow-like
    file's hash appeared) and a FIFO hung the command. The file is read through the file layer
    (bounded, never a FIFO), must be a test driver <node>, and no error quotes it."""
    import os
    import threading

    secret = tmp_path / "shadow"
    secret.write_text("root:$6$SECRETHASH$abcdef:19000:0:99999:7:::\n")
    node = tmp_path / "host.xml"
    node.write_text("<?xml version='1.0'?>\n<!-- the tests' node -->\n<node>\n</node>\n")
    broken = tmp_path / "broken.xml"
    broken.write_text("<node><domain type='test'>SECRETHASH<</node>\n")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert check_uri(f"test://{node}", source="--connect") == f"test://{node}"
    for uri, words in ((f"test://{secret}", "is not a libvirt test driver configuration"),
                       (f"test+unix://{secret}", "is not a libvirt test driver configuration"),
                       (f"test://{fifo}", "it is a FIFO, not a regular file"),
                       (f"test://{tmp_path}/none.xml", "does not exist"),
                       ("test://hv1/default", "no host in its URI"),
                       (f"test://{tmp_path}", "cannot be used")):
        with pytest.raises(InputError, match=words) as info:
            check_uri(uri, source="--connect")
        assert "SECRETHASH" not in str(info.value)
    # The commands: one line, exit 2, no content, and no hang on the FIFO (a thread would block).
    done = []
    worker = threading.Thread(target=lambda: done.append(cli("vgpu", "list",
                                                             "--connect", f"test://{fifo}")))
    worker.start()
    worker.join(30)
    assert done and done[0].code == 2 and "FIFO" in done[0].err
    result = cli("vgpu", "list", "--connect", f"test://{secret}")
    assert result.code == 2 and "SECRETHASH" not in result.out + result.err
    # A <node> libvirt cannot load: the connection's error names the file, not its lines.
    from gpuvfio.virt.connection import open_connection
    from gpuvfio.errors import GpuvfioError

    with pytest.raises(GpuvfioError) as info:
        open_connection(f"test://{broken}")
    assert "SECRETHASH" not in str(info.value) and str(broken) in str(info.value)


def test_a_test_driver_path_must_be_the_file_libvirt_opens(tmp_path):
    """libvirt percent-decodes the path and the kernel resolves links and ".." after them: a
    path that is not canonical was checked as one file and opened as another (a FIFO: a hang)."""
    import os

    node = tmp_path / "a" / "node.xml"
    node.parent.mkdir()
    node.write_text("<node></node>\n")
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "a" / "sub").mkdir()
    os.symlink(tmp_path / "a", tmp_path / "link")
    for path in (f"{tmp_path}/a/sub/../node.xml", f"{tmp_path}/a/./node.xml", f"{tmp_path}/a/%6eode.xml",
                 f"{tmp_path}/link/node.xml", f"{tmp_path}/a//node.xml"):
        with pytest.raises(InputError, match="must be a canonical path"):
            check_uri(f"test://{path}", source="--connect")
    assert check_uri(f"test://{node}", source="--connect") == f"test://{node}"


@pytest.mark.parametrize("uri, names", [
    ("test:///default", False), ("test:///default?mode=auto", False), ("TEST+unix:///default", False),
    ("qemu:///system", False), ("qemu:///tmp/node.xml", False), ("test:///tmp/node.xml", True),
    ("test+unix:///tmp/node.xml?mode=auto", True), ("test:///DEFAULT", True),
    ("test:///tmp/a://b.xml", True),  # the first "://" ends the scheme
])
def test_which_uris_name_a_test_driver_file(uri, names):
    """A test driver file's content may be quoted by libvirt's errors (gpuvfio.virt.connection);
    only the test driver on a path other than its default names one."""
    assert names_a_test_file(uri) is names


def test_a_test_driver_file_is_read_within_its_bound_and_named_by_its_source(tmp_path):
    big = tmp_path / "node.xml"
    big.write_bytes(b"<node>" + b" " * (4 << 20))
    with pytest.raises(InputError) as refused:
        check_uri(f"test://{big}", source="--connect")
    assert str(refused.value).startswith("--connect: test driver configuration") and "larger than" in str(refused.value)
    fits = tmp_path / "fits.xml"  # over the file layer's 1 MiB for text, within the test driver's 4 MiB
    fits.write_bytes(b"<node>" + b" " * (2 << 20) + b"</node>")
    assert check_uri(f"test://{fits}") == f"test://{fits}"


@pytest.mark.parametrize("uri", ["test:////tmp/node.xml", "test:///tmp/a://b.xml"])
def test_a_test_driver_path_that_only_looks_canonical_is_refused(uri):
    """POSIX leaves a leading "//" to the system (os.path.normpath keeps it; CPython 3.11's
    realpath collapses it, so there the component check and the realpath check both refuse it),
    and a second "://" must not hide the path from the check."""
    with pytest.raises(InputError, match="must be a canonical path"):
        check_uri(uri)


def test_the_opt_out_warns_on_stderr_in_one_line_and_keeps_the_default_test_driver(monkeypatch, capsys):
    monkeypatch.setenv(UNSAFE_ENV, "1")
    uri = f"test:///default#{uuid.uuid4().hex}"  # its own: a URI is warned about once per process
    assert check_uri(uri) == uri  # a fragment, let through: still no file
    assert capsys.readouterr().err == (f"warning: {UNSAFE_ENV}=1: libvirt URI '{uri}' goes to libvirt "
                                       "although a #fragment means nothing to libvirt\n")


@pytest.mark.parametrize("uri, part", [
    ("qemu+" + "x" * 100_000 + ":///system", "driver"),  # past the limit: not echoed at all
    ("x" * 200 + "://h/system", "driver"), ("qemu+" + "t" * 300 + ":///system", "transport"),
    ("qemu://" + "@" * 300 + "/system", "[user@]host"), ("qemu:///system?" + "n" * 300 + "=1", "parameter"),
    ("qemu:///system?socket=" + "s" * 300, "socket"), ("qemu:///system?mode=" + "\u202e" * 300, "mode"),
    ("test:///" + "d/" * 300 + "node.xml", "test driver")])
def test_a_refused_uri_is_echoed_cut_and_in_ascii(uri, part):
    """A URI is hostile input (a flag, LIBVIRT_DEFAULT_URI, a spec): its refusal is one short
    line, whatever its length, the URI and each part of it cut and escaped (ascii)."""
    with pytest.raises(InputError) as refused:
        check_uri(uri, source="--connect")
    message = str(refused.value)
    assert len(message) < 2 * URI_SHOWN + 300 and message.isascii() and "\n" not in message, len(message)
    assert part in message or "characters long" in message


def test_a_uri_is_named_whole_up_to_its_bound_and_cut_past_it():
    fits = "q" * (URI_SHOWN - 2)  # ascii() adds the quotes
    assert named(fits) == f"'{fits}'" and len(named(fits)) == URI_SHOWN
    cut = named(fits + "q")
    assert len(cut) == URI_SHOWN and cut.endswith("q...'") and cut.startswith("'qq")
    assert named("\u202e") == "'\\u202e'"  # a right-to-left override escaped, never printed
    long = "test:///" + "a" * (URI_LIMIT - 8)
    with pytest.raises(InputError, match=f"^--connect: {URI_LIMIT + 1} characters long; a libvirt URI is at most"):
        check_uri(long + "a", source="--connect")
    with pytest.raises(InputError, match="test driver configuration .* cannot be used"):  # at the limit: checked
        check_uri(long, source="--connect")

