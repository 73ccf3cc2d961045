"""Daemon lane: this machine as a "remote" hypervisor, reached over real SSH.

A dropbear server listens on 127.0.0.1:PORT and runs sessions as root. So that the
test does not touch this machine's /root/.ssh, dropbear runs in a private mount
namespace (``unshare -m``) where a copy of /etc/passwd naming a scratch directory as
root's home is bind-mounted over /etc/passwd; that home holds ``.ssh/authorized_keys``
with a key made for the test (root's real home stays visible: this machine's Python
may live there). The server's host key is
made here too, and its public half is what the client pins. ``-e`` hands dropbear's
environment (GPUVFIO_STATE_DIR, LIBVIRT_DEFAULT_URI, ...) to the sessions, which is how
the test points the remote gpuvfio at its own state directory.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass

from tests.lanes import guest as gl

DROPBEAR = "/usr/sbin/dropbear"
UNSHARE = shutil.which("unshare") or "/usr/bin/unshare"


def skip_reason() -> str | None:
    missing = [p for p in (DROPBEAR, gl.DROPBEARKEY, UNSHARE) if not os.access(p, os.X_OK)]
    if missing:
        return f"missing for the SSH hypervisor lane: {', '.join(missing)}"
    if os.geteuid() != 0:
        return "the SSH hypervisor lane needs root (a private mount namespace)"
    return None


@dataclass
class Hypervisor:
    port: int
    client_key: str
    known_hosts: str
    process: subprocess.Popen
    log: str

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


def start(directory: str, env: dict[str, str] | None = None) -> Hypervisor:
    home = os.path.join(directory, "home")
    os.makedirs(os.path.join(home, ".ssh"), mode=0o700, exist_ok=True)
    os.chmod(home, 0o700)
    keys = os.path.join(directory, "keys")
    os.makedirs(keys, exist_ok=True)
    host_key, host_line = gl._dropbear_host_key(keys)
    client_key, client_line, _kind = gl._client_key(keys)
    with open(os.path.join(home, ".ssh", "authorized_keys"), "w") as handle:
        handle.write(client_line + " gpuvfio-test\n")
    passwd = os.path.join(directory, "passwd")
    with open("/etc/passwd") as source, open(passwd, "w") as handle:
        for line in source:
            fields = line.rstrip("\n").split(":")
            if len(fields) == 7 and fields[2] == "0":
                fields[5] = home
            handle.write(":".join(fields) + "\n")
    port = gl.free_port()
    known_hosts = os.path.join(directory, "known_hosts")
    with open(known_hosts, "w") as handle:
        handle.write(f"[127.0.0.1]:{port} {host_line}\n")
    log = os.path.join(directory, "dropbear.log")
    argv = [UNSHARE, "-m", "--propagation", "private", "sh", "-c",
            'mount --bind "$1" /etc/passwd && shift && exec "$@"', "hypervisor", passwd,
            DROPBEAR, "-F", "-E", "-e", "-s", "-m", "-r", host_key, "-p", f"127.0.0.1:{port}",
            "-P", os.path.join(directory, "dropbear.pid")]
    full_env = {**os.environ, "PATH": f"{os.path.dirname(sys.executable)}:{os.environ.get('PATH', '/usr/bin:/bin')}",
                **(env or {})}
    with open(log, "wb") as handle:
        process = subprocess.Popen(argv, stdout=handle, stderr=subprocess.STDOUT, env=full_env,
                                   start_new_session=True)
    try:
        gl.wait_for_ssh_banner(port, timeout=20)
    except Exception:
        process.kill()
        raise
    return Hypervisor(port=port, client_key=client_key, known_hosts=known_hosts, process=process, log=log)
