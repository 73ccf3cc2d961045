"""Daemon lane: a tiny guest that boots under libvirt + QEMU (TCG) to an SSH server.

The guest is this machine's distribution kernel (booted as the uncompressed ELF
that ``tests.lanes.kernel.uncompressed_kernel`` extracts, via PVH) plus an
initramfs built here from host binaries:

* busybox-static (the shell, ``ip``, ``insmod``, ``mount``, ...), as /bin/busybox
  with one symlink per applet;
* dropbear and the shared libraries ``ldd`` reports for it;
* the virtio-net modules of that kernel, in dependency order from modules.dep
  (virtio_ring, virtio, virtio_pci_{legacy,modern}_dev, virtio_pci, failover,
  net_failover, virtio_net);
* a dropbear host key made with ``dropbearkey`` at build time, whose public half
  is exported (``GuestImage.host_key_line``) so clients PIN it instead of trusting
  on first use;
* ``/root/.ssh/authorized_keys`` holding a test client key generated at build
  time (``GuestImage.client_key``, an OpenSSH private key file);
* ``/init``: mounts proc/sys/dev, loads the modules, configures eth0 statically
  for QEMU user networking (10.0.2.15/24, gateway 10.0.2.2 - slirp's defaults,
  no DHCP round trip), starts dropbear on port 22 and prints READY_MARKER on
  the console.

The result is cached under CACHE_DIR, keyed by a hash of every input (binaries,
libraries, modules, the init script, the format version), so a second test run
only checks that hash.  Keys are part of the cached image: they are test keys
for a throw-away guest that only listens on 127.0.0.1.

Networking is QEMU's user mode (slirp) with a host forward
127.0.0.1:PORT -> guest:22, given via ``<qemu:commandline>`` because this
libvirt (9.0, Debian) has passt disabled; the domain is then marked
"tainted: custom-argv", which is expected.
"""

from __future__ import annotations

import hashlib
import io
import gzip
import os
import re
import shlex
import shutil
import socket
import stat
import subprocess
import tempfile
import time
from dataclasses import dataclass
from typing import Iterable, Sequence
from xml.sax.saxutils import escape, quoteattr

from tests.lanes.kernel import find_kernel, uncompressed_kernel

CACHE_DIR = "/tmp/gpuvfio-guest-cache"
FORMAT_VERSION = "3"  # bump when the layout of the image changes
READY_MARKER = "GPUVFIO-GUEST-READY"
BOOT_MARKER = "GPUVFIO-GUEST-INIT"
GUEST_IP = "10.0.2.15"
GUEST_GATEWAY = "10.0.2.2"
# What the guest loads, by module name; dependencies are added from modules.dep.
NET_MODULES = ("virtio_pci", "virtio_net")
KERNEL_CMDLINE = "console=ttyS0 rdinit=/init panic=-1 quiet loglevel=3 tsc=reliable"
DEFAULT_MEMORY_MIB = 256

BUSYBOX = "/usr/bin/busybox"
DROPBEAR = "/usr/sbin/dropbear"
DROPBEARKEY = "/usr/bin/dropbearkey"
QEMU = "/usr/bin/qemu-system-x86_64"


class GuestBuildError(RuntimeError):
    pass


@dataclass(frozen=True)
class GuestImage:
    kernel: str            # the file to boot (uncompressed ELF when extraction worked)
    kernel_version: str    # e.g. "6.1.0-57-amd64": what `uname -r` prints in the guest
    initrd: str            # gzip'd cpio (newc)
    host_key_line: str     # "ssh-ed25519 AAAA..." - the guest's host key, to pin
    host_key_fingerprint: str  # "SHA256:..." as OpenSSH prints it
    client_key: str        # OpenSSH private key file accepted by the guest's root
    client_key_type: str   # "ed25519" or "rsa"
    directory: str         # the cache entry holding all of the above (but the kernel)

    @property
    def host_key_type(self) -> str:
        return self.host_key_line.split()[0]

    @property
    def host_key_base64(self) -> str:
        return self.host_key_line.split()[1]


# --- Discovery --------------------------------------------------------------------

def skip_reason() -> str | None:
    """Why a guest cannot be built here, or None."""
    missing = [p for p in (BUSYBOX, DROPBEAR, DROPBEARKEY, QEMU) if not os.access(p, os.X_OK)]
    if missing:
        return ("daemon lane guest needs " + ", ".join(missing)
                + " (apt-get install busybox-static dropbear-bin qemu-system-x86)")
    if shutil.which("ldd") is None:
        return "daemon lane guest needs ldd (libc-bin)"
    if find_kernel() is None:
        return ("daemon lane guest needs a /boot/vmlinuz-<ver> with /lib/modules/<ver> "
                "(apt-get install linux-image-amd64)")
    return None


def kernel_version_of(kernel: str) -> str:
    name = os.path.basename(kernel)
    for prefix in ("vmlinuz-", "vmlinux-"):
        if name.startswith(prefix):
            return name[len(prefix):]
    raise GuestBuildError(f"cannot tell the kernel version from {kernel!r}")


def shared_libraries(binary: str) -> list[str]:
    """Absolute paths of the shared objects ``binary`` loads (ldd), interpreter included."""
    proc = subprocess.run(["ldd", binary], capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        if "not a dynamic executable" in (proc.stdout + proc.stderr):
            return []
        raise GuestBuildError(f"ldd {binary} failed: {proc.stderr.strip()}")
    libs: list[str] = []
    for line in proc.stdout.splitlines():
        line = line.strip()
        if "=> not found" in line:
            raise GuestBuildError(f"{binary}: missing library: {line}")
        m = re.search(r"=>\s*(/\S+)", line) or re.match(r"(/\S+)", line)
        if m and m.group(1) not in libs:
            libs.append(m.group(1))
    return libs


def module_load_order(version: str, names: Iterable[str],
                      modules_root: str = "/lib/modules") -> list[str]:
    """Module files (relative to /lib/modules/<version>) to insmod, dependencies first.

    modules.dep lists, per module, all modules it needs (transitively); walking
    them depth first, each module after its own dependencies, gives an order in
    which plain ``insmod`` succeeds.  Built-in modules (modules.builtin) are skipped.
    """
    base = os.path.join(modules_root, version)
    deps: dict[str, list[str]] = {}
    with open(os.path.join(base, "modules.dep")) as f:
        for line in f:
            path, sep, rest = line.partition(":")
            if sep:
                deps[path.strip()] = rest.split()
    by_name: dict[str, str] = {}
    for path in deps:
        mod = re.sub(r"\.ko(\.(xz|gz|zst))?$", "", os.path.basename(path)).replace("-", "_")
        by_name[mod] = path
    builtin: set[str] = set()
    try:
        with open(os.path.join(base, "modules.builtin")) as f:
            for line in f:
                builtin.add(re.sub(r"\.ko$", "", os.path.basename(line.strip())).replace("-", "_"))
    except FileNotFoundError:
        pass

    order: list[str] = []

    def visit(path: str, stack: tuple[str, ...]) -> None:
        if path in order:
            return
        if path in stack:
            raise GuestBuildError(f"module dependency cycle at {path}")
        for dep in deps.get(path, []):
            visit(dep, stack + (path,))
        order.append(path)

    for name in names:
        key = name.replace("-", "_")
        if key in builtin:
            continue
        if key not in by_name:
            raise GuestBuildError(f"module {name} not found for kernel {version}")
        visit(by_name[key], ())
    for path in order:
        if not path.endswith((".ko", ".ko.xz", ".ko.gz")):
            raise GuestBuildError(f"module {path}: neither plain nor xz or gzip")
    return order


def plain_module(path: str) -> str:
    """The name a module is put in the image under: busybox's insmod reads plain modules only, so
    Debian 13's ``.ko.xz`` (Debian 12 ships plain ``.ko``) is decompressed into it."""
    return re.sub(r"\.ko\.(xz|gz)$", ".ko", path)


def _module_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        data = f.read()
    if path.endswith(".xz"):
        import lzma

        return lzma.decompress(data)
    return gzip.decompress(data) if path.endswith(".gz") else data


# --- cpio (newc) ----------------------------------------------------------------

class CpioWriter:
    """Minimal writer for the "newc" cpio format the kernel unpacks as initramfs."""

    def __init__(self) -> None:
        self._buf = io.BytesIO()
        self._ino = 1
        self._dirs: set[str] = set()

    def _entry(self, name: str, mode: int, data: bytes = b"", *, rdev: tuple[int, int] = (0, 0),
               nlink: int = 1) -> None:
        name_b = name.encode() + b"\0"
        fields = [self._ino, mode, 0, 0, nlink, 0, len(data), 0, 0, rdev[0], rdev[1],
                  len(name_b), 0]
        self._ino += 1
        header = b"070701" + b"".join(b"%08X" % v for v in fields)
        out = self._buf
        out.write(header + name_b)
        out.write(b"\0" * (-(len(header) + len(name_b)) % 4))
        out.write(data)
        out.write(b"\0" * (-len(data) % 4))

    def directory(self, name: str, mode: int = 0o755) -> None:
        name = name.strip("/")
        if not name or name in self._dirs:
            return
        parent = os.path.dirname(name)
        if parent:
            self.directory(parent)
        self._dirs.add(name)
        self._entry(name, stat.S_IFDIR | mode, nlink=2)

    def file(self, name: str, data: bytes, mode: int = 0o644) -> None:
        name = name.strip("/")
        self.directory(os.path.dirname(name))
        self._entry(name, stat.S_IFREG | mode, data)

    def symlink(self, name: str, target: str) -> None:
        name = name.strip("/")
        self.directory(os.path.dirname(name))
        self._entry(name, stat.S_IFLNK | 0o777, target.encode())

    def chardev(self, name: str, major: int, minor: int, mode: int = 0o600) -> None:
        name = name.strip("/")
        self.directory(os.path.dirname(name))
        self._entry(name, stat.S_IFCHR | mode, rdev=(major, minor))

    def finish(self) -> bytes:
        self._entry("TRAILER!!!", 0, nlink=1)
        data = self._buf.getvalue()
        return data + b"\0" * (-len(data) % 512)


# --- Keys ---------------------------------------------------------------------------

def _dropbear_host_key(directory: str) -> tuple[str, str]:
    """Make an ed25519 dropbear host key; return (key file, "ssh-ed25519 AAAA...")."""
    path = os.path.join(directory, "dropbear_ed25519_host_key")
    subprocess.run([DROPBEARKEY, "-t", "ed25519", "-f", path], check=True,
                   capture_output=True, timeout=60)
    proc = subprocess.run([DROPBEARKEY, "-y", "-f", path], check=True, capture_output=True,
                          text=True, timeout=60)
    for line in proc.stdout.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0].startswith("ssh-"):
            return path, f"{parts[0]} {parts[1]}"
    raise GuestBuildError(f"dropbearkey -y printed no public key: {proc.stdout!r}")


def _client_key(directory: str) -> tuple[str, str, str]:
    """A client key pair: (private key path, "type base64" public line, type)."""
    path = os.path.join(directory, "client_key")
    ssh_keygen = shutil.which("ssh-keygen")
    if ssh_keygen:
        subprocess.run([ssh_keygen, "-q", "-t", "ed25519", "-N", "", "-C", "gpuvfio-test",
                        "-f", path], check=True, capture_output=True, timeout=60)
        with open(path + ".pub") as f:
            kind, b64 = f.read().split()[:2]
        return path, f"{kind} {b64}", "ed25519"
    import paramiko  # paramiko cannot generate ed25519 keys; RSA it is

    key = paramiko.RSAKey.generate(2048)
    key.write_private_key_file(path)
    line = f"{key.get_name()} {key.get_base64()}"
    with open(path + ".pub", "w") as f:
        f.write(line + " gpuvfio-test\n")
    return path, line, "rsa"


def fingerprint(key_line: str) -> str:
    """OpenSSH-style SHA256 fingerprint of "type base64" (what ssh-keygen -l prints)."""
    import base64

    blob = base64.b64decode(key_line.split()[1])
    return "SHA256:" + base64.b64encode(hashlib.sha256(blob).digest()).decode().rstrip("=")


# --- The image ---------------------------------------------------------------------

_INIT = r"""#!/bin/sh
# Written by tests/lanes/guest.py: PID 1 of the daemon-lane test guest.
export PATH=/bin:/sbin:/usr/bin:/usr/sbin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
mkdir -p /dev/pts /tmp /run /var/log
mount -t devpts devpts /dev/pts
mount -t tmpfs tmpfs /tmp
echo "@BOOT_MARKER@ $(uname -r) up=$(cut -d' ' -f1 /proc/uptime)"
for m in @MODULES@; do
    insmod "/lib/modules/$(uname -r)/$m" || echo "insmod $m failed"
done
i=0
while [ ! -e /sys/class/net/eth0 ] && [ $i -lt 100 ]; do sleep 0.05; i=$((i+1)); done
ip link set lo up
ip addr add @IP@/24 dev eth0
ip link set eth0 up
ip route add default via @GW@
hostname gpuvfio-guest
dropbear -r /etc/dropbear/dropbear_ed25519_host_key -p 22 -s -E 2>>/var/log/dropbear.log
echo "@READY_MARKER@ up=$(cut -d' ' -f1 /proc/uptime)"
while :; do sleep 3600; done
"""


def _init_script(modules: Sequence[str]) -> str:
    return (_INIT.replace("@BOOT_MARKER@", BOOT_MARKER)
            .replace("@READY_MARKER@", READY_MARKER)
            .replace("@MODULES@", " ".join(shlex.quote(plain_module(m)) for m in modules))
            .replace("@IP@", GUEST_IP).replace("@GW@", GUEST_GATEWAY))


def _file_identity(path: str) -> str:
    st = os.stat(path)
    return f"{path}:{st.st_size}:{int(st.st_mtime)}"


def _applets() -> list[str]:
    proc = subprocess.run([BUSYBOX, "--list"], capture_output=True, text=True, check=True,
                          timeout=30)
    return [a for a in proc.stdout.split() if re.match(r"^[A-Za-z0-9_.\[\]-]+$", a)]


def build_guest(kernel: str | None = None, *, cache_dir: str = CACHE_DIR) -> GuestImage:
    """The guest for ``kernel`` (default: newest /boot/vmlinuz with modules), cached."""
    reason = skip_reason()
    if reason:
        raise GuestBuildError(reason)
    kernel = kernel or find_kernel()
    assert kernel is not None
    version = kernel_version_of(kernel)
    modules = module_load_order(version, NET_MODULES)
    libs = shared_libraries(DROPBEAR)
    init = _init_script(modules)
    inputs = [FORMAT_VERSION, init, _file_identity(BUSYBOX), _file_identity(DROPBEAR)]
    inputs += [_file_identity(os.path.realpath(p)) for p in libs]
    inputs += [_file_identity(os.path.join("/lib/modules", version, m)) for m in modules]
    key = hashlib.sha256("\n".join(inputs).encode()).hexdigest()[:16]
    entry = os.path.join(cache_dir, f"{version}-{key}")
    boot_kernel = uncompressed_kernel(kernel)

    if not os.path.exists(os.path.join(entry, "complete")):
        os.makedirs(cache_dir, exist_ok=True)
        os.chmod(cache_dir, 0o755)  # the QEMU process (user libvirt-qemu) reads the initrd
        tmp = tempfile.mkdtemp(prefix=".build-", dir=cache_dir)
        try:
            _build_into(tmp, version=version, modules=modules, libs=libs, init=init)
            os.chmod(tmp, 0o755)
            try:
                os.rename(tmp, entry)  # atomic; loses against a concurrent builder
            except OSError:
                if not os.path.exists(os.path.join(entry, "complete")):
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    with open(os.path.join(entry, "host_key.pub")) as f:
        host_line = f.read().strip()
    with open(os.path.join(entry, "client_key.type")) as f:
        client_type = f.read().strip()
    return GuestImage(kernel=boot_kernel, kernel_version=version,
                      initrd=os.path.join(entry, "initrd.cpio.gz"), host_key_line=host_line,
                      host_key_fingerprint=fingerprint(host_line),
                      client_key=os.path.join(entry, "client_key"),
                      client_key_type=client_type, directory=entry)


def _build_into(out: str, *, version: str, modules: Sequence[str], libs: Sequence[str],
                init: str) -> None:
    keys = os.path.join(out, "keys")
    os.mkdir(keys, 0o700)
    host_key, host_line = _dropbear_host_key(keys)
    client_path, client_line, client_type = _client_key(keys)

    cpio = CpioWriter()
    for d in ("bin", "sbin", "usr/bin", "usr/sbin", "etc/dropbear", "proc", "sys", "dev",
              "tmp", "run", "var/log", "lib64", "lib/x86_64-linux-gnu"):
        cpio.directory(d)
    cpio.directory("root", 0o700)
    cpio.directory("root/.ssh", 0o700)
    cpio.chardev("dev/console", 5, 1)
    cpio.chardev("dev/null", 1, 3, 0o666)
    with open(BUSYBOX, "rb") as f:
        cpio.file("bin/busybox", f.read(), 0o755)
    for applet in _applets():
        if applet != "busybox":
            cpio.symlink(f"bin/{applet}", "/bin/busybox")
    with open(DROPBEAR, "rb") as f:
        cpio.file("sbin/dropbear", f.read(), 0o755)
    for lib in libs:
        with open(lib, "rb") as f:  # follows symlinks: the soname gets the real file
            cpio.file(lib, f.read(), 0o755)
    for m in modules:
        cpio.file(f"lib/modules/{version}/{plain_module(m)}", _module_bytes(os.path.join("/lib/modules", version, m)))
    with open(host_key, "rb") as f:
        cpio.file("etc/dropbear/dropbear_ed25519_host_key", f.read(), 0o600)
    cpio.file("root/.ssh/authorized_keys", (client_line + " gpuvfio-test\n").encode(), 0o600)
    cpio.file("etc/passwd", b"root:x:0:0:root:/root:/bin/sh\n")
    cpio.file("etc/group", b"root:x:0:\n")
    cpio.file("etc/shadow", b"root:*:19000:0:99999:7:::\n", 0o600)
    cpio.file("etc/shells", b"/bin/sh\n")
    cpio.file("etc/hosts", b"127.0.0.1 localhost gpuvfio-guest\n")
    cpio.file("init", init.encode(), 0o755)
    data = cpio.finish()

    with open(os.path.join(out, "initrd.cpio.gz"), "wb") as f:
        f.write(gzip.compress(data, compresslevel=6, mtime=0))
    os.chmod(os.path.join(out, "initrd.cpio.gz"), 0o644)
    with open(os.path.join(out, "host_key.pub"), "w") as f:
        f.write(host_line + "\n")
    shutil.copy(client_path, os.path.join(out, "client_key"))
    os.chmod(os.path.join(out, "client_key"), 0o600)
    shutil.copy(client_path + ".pub", os.path.join(out, "client_key.pub"))
    with open(os.path.join(out, "client_key.type"), "w") as f:
        f.write(client_type + "\n")
    shutil.rmtree(keys)
    with open(os.path.join(out, "complete"), "w") as f:
        f.write("ok\n")


# --- Domain XML --------------------------------------------------------------------

QEMU_NS = "http://libvirt.org/schemas/domain/qemu/1.0"


def hostdev_pci_xml(address: str = "0000:01:00.0", *, managed: bool = False) -> str:
    """A ``<hostdev mode='subsystem' type='pci'>`` element for ``DDDD:BB:SS.F``."""
    m = re.fullmatch(r"([0-9a-fA-F]{4}):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])", address)
    if not m:
        raise ValueError(f"not a PCI address: {address!r}")
    dom, bus, slot, fn = m.groups()
    return (f"<hostdev mode='subsystem' type='pci' managed='{'yes' if managed else 'no'}'>"
            f"<source><address domain='0x{dom}' bus='0x{bus}' slot='0x{slot}' "
            f"function='0x{fn}'/></source></hostdev>")


def domain_xml(name: str, kernel: str, initrd: str, ssh_port: int,
               memory_mib: int = DEFAULT_MEMORY_MIB, *, console_log: str | None = None,
               cmdline: str = KERNEL_CMDLINE, vcpus: int = 1, cpu_mode: str = "maximum",
               extra_devices: Sequence[str] = ()) -> str:
    """Libvirt domain XML for the test guest (TCG, q35, direct kernel boot, slirp + SSH).

    ``ssh_port`` is forwarded from 127.0.0.1 on the host to the guest's port 22.
    ``console_log``: a file that receives the serial console (ttyS0); the
    directory must be reachable by the QEMU user.  Without it the console goes to
    a pty.  ``extra_devices``: raw XML elements (trusted, e.g. hostdev_pci_xml())
    appended to ``<devices>``.  ``cpu_mode='maximum'`` (libvirt >= 7.9) gives the
    guest RDRAND, so the kernel's RNG and dropbear do not wait for entropy.
    """
    if not re.fullmatch(r"[A-Za-z0-9_.+-]+", name):
        raise ValueError(f"unsafe domain name {name!r}")
    port = int(ssh_port)
    if not 0 < port < 65536:
        raise ValueError(f"bad port {ssh_port!r}")
    if console_log:
        serial = (f"<serial type='file'><source path={quoteattr(console_log)} append='off'/>"
                  "<target port='0'/></serial>")
    else:
        serial = "<serial type='pty'><target port='0'/></serial>"
    qemu_args = ["-netdev", f"user,id=gpuvfio-net0,hostfwd=tcp:127.0.0.1:{port}-:22",
                 "-device", "virtio-net-pci,netdev=gpuvfio-net0,romfile="]
    args_xml = "".join(f"<qemu:arg value={quoteattr(a)}/>" for a in qemu_args)
    return f"""<domain type='qemu' xmlns:qemu='{QEMU_NS}'>
  <name>{escape(name)}</name>
  <memory unit='MiB'>{int(memory_mib)}</memory>
  <vcpu>{int(vcpus)}</vcpu>
  <os>
    <type arch='x86_64' machine='q35'>hvm</type>
    <kernel>{escape(kernel)}</kernel>
    <initrd>{escape(initrd)}</initrd>
    <cmdline>{escape(cmdline)}</cmdline>
  </os>
  <features><acpi/></features>
  <cpu mode={quoteattr(cpu_mode)}/>
  <clock offset='utc'/>
  <on_poweroff>destroy</on_poweroff>
  <on_reboot>destroy</on_reboot>
  <on_crash>destroy</on_crash>
  <devices>
    <emulator>{QEMU}</emulator>
    {serial}
    <controller type='usb' model='none'/>
    <memballoon model='none'/>
    {''.join(extra_devices)}
  </devices>
  <qemu:commandline>{args_xml}</qemu:commandline>
</domain>
"""


# --- Reaching the guest ------------------------------------------------------------

def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free right now (QEMU binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_for_ssh_banner(port: int, timeout: float = 60.0, host: str = "127.0.0.1") -> str:
    """Poll until the guest's SSH server sends its banner; return it ("SSH-2.0-...").

    slirp accepts the TCP connection on the host side before anything listens in
    the guest, then closes it; so a successful connect() means nothing, only the
    banner does.  Each try is short; raises TimeoutError after ``timeout``.
    """
    deadline = time.monotonic() + timeout
    last = "no attempt"
    while True:
        try:
            with socket.create_connection((host, port), timeout=1.0) as s:
                s.settimeout(1.5)
                data = b""
                while b"\n" not in data and len(data) < 256:
                    chunk = s.recv(256)
                    if not chunk:
                        break
                    data += chunk
                if data.startswith(b"SSH-"):
                    return data.split(b"\n")[0].decode(errors="replace").strip()
                last = f"got {data!r}"
        except OSError as exc:
            last = f"{type(exc).__name__}: {exc}"
        if time.monotonic() >= deadline:
            raise TimeoutError(f"no SSH banner on {host}:{port} within {timeout}s (last: {last})")
        time.sleep(0.2)


def _known_hosts_name(host: str, port: int) -> str:
    return host if port == 22 else f"[{host}]:{port}"


def ssh_client(image: GuestImage, port: int, host: str = "127.0.0.1",
               timeout: float = 30.0):
    """A connected paramiko SSHClient as root, with the guest's host key PINNED.

    The only known host key is the image's (RejectPolicy for anything else), so a
    different server on that port fails with paramiko.BadHostKeyException /
    SSHException instead of being trusted.
    """
    import base64

    import paramiko

    kind, b64 = image.host_key_line.split()[:2]
    host_key = paramiko.PKey.from_type_string(kind, base64.b64decode(b64))
    client = paramiko.SSHClient()
    client.get_host_keys().add(_known_hosts_name(host, port), kind, host_key)
    client.set_missing_host_key_policy(paramiko.RejectPolicy())
    pkey = paramiko.PKey.from_path(image.client_key)
    client.connect(host, port=port, username="root", pkey=pkey, timeout=timeout,
                   banner_timeout=timeout, auth_timeout=timeout, allow_agent=False,
                   look_for_keys=False)
    return client


def ssh_run(image: GuestImage, port: int, command: str | Sequence[str], *,
            host: str = "127.0.0.1", timeout: float = 30.0) -> tuple[int, str, str]:
    """Run a command in the guest over SSH (pinned host key); return (rc, stdout, stderr).

    A list is quoted with shlex.join for the guest's shell; a string is passed as is
    (it is a shell command line - only give literal strings).
    """
    if not isinstance(command, str):
        command = shlex.join(command)
    client = ssh_client(image, port, host=host, timeout=timeout)
    try:
        _, stdout, stderr = client.exec_command(command, timeout=timeout)
        out = stdout.read().decode(errors="replace")
        err = stderr.read().decode(errors="replace")
        rc = stdout.channel.recv_exit_status()
        return rc, out, err
    finally:
        client.close()


def read_console(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""
