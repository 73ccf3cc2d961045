"""The current stack: Debian 13's own kernel for the kernel lane, and a Debian 13 root (libvirt 11,
QEMU 10, Python 3.13) for the daemon lane, both from Debian's archive.

Hosts now run newer kernels than this project's machines (Debian 12, Linux 6.1). The kernel lane
boots whatever kernel ``GPUVFIO_KL_KERNEL`` names (tests/lanes/kernel.py find_kernel); this module
gives it Debian 13's: the package ``linux-image-amd64`` of trixie depends on (so the kernel
follows trixie's point releases), downloaded by apt itself with a private state directory (the
archive's signatures checked by apt, nothing added to this machine's sources), unpacked with
dpkg-deb, its module index made with depmod.

virtme-ng boots a kernel with the modules in the host's /lib/modules/<version> (its guest sees
the host's root file system), so the modules are installed there, once, as installing the
package would; the kernel image stays in the cache. Cached by the package's version: a second run
downloads nothing but the package index.

The daemon lane runs inside a root made by debootstrap (minbase), then apt-get install of what
the lane uses, then a virtual environment that sees Debian's python3-libvirt and takes the rest of
gpuvfio's dependencies from PyPI (pyproject.toml's, and what the tests need). The root is cached by
what went into it; this checkout is bound at its own path inside and the tests run from it
(tests/lanes/inroot.sh, in a private mount namespace).

    python -m tests.lanes.current [CACHE]           prints the kernel image's path
    python -m tests.lanes.current daemon [ARG...]   runs pytest tests/daemon [ARG...] in the root
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib

SUITE = "trixie"
MIRROR = os.environ.get("GPUVFIO_DEBIAN_MIRROR", "http://deb.debian.org/debian")
META = "linux-image-amd64"
MODULES = "/lib/modules"
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_CACHE = os.path.join(REPO, ".deps", "current")
INROOT = os.path.join(REPO, "tests", "lanes", "inroot.sh")
# What the daemon lane uses (the Makefile's APT_PACKAGES, less what only other lanes need).
ROOT_PACKAGES = ("libvirt-daemon-system", "qemu-system-x86", "ovmf", "python3-venv", "python3-libvirt",
                 "busybox-static", "dropbear-bin", "linux-image-amd64", "openssh-client", "libxml2-utils",
                 "pciutils", "ca-certificates", "util-linux", "gcc", "libc6-dev")  # gcc: tests/fakecuda
# Test extras the daemon lane does not import (Ansible's, the Prometheus parser's) stay out.
LANE_EXTRAS = ("pytest", "pytest-xdist", "hypothesis", "jsonschema")
PACKAGE = re.compile(r"linux-image-(\d+\.\d+\.\d+\+deb\d+-amd64)")


class FetchError(RuntimeError):
    pass


def _apt_options(state: str) -> list[str]:
    """apt with its own sources, state and cache under ``state``: trixie only, this machine's
    configuration of sources and installed packages untouched."""
    return [f"-oDir::Etc::SourceList={state}/sources.list", "-oDir::Etc::SourceParts=/nonexistent",
            f"-oDir::State={state}/state", f"-oDir::State::status={state}/state/status",
            f"-oDir::Cache={state}/cache", "-oAPT::Architecture=amd64", "-oAPT::Sandbox::User=root",
            "-oAcquire::Languages=none", "-q"]


def _run(argv: list[str], **kwargs) -> str:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=900, **kwargs)
    if proc.returncode != 0:
        raise FetchError(f"{argv[0]} {' '.join(argv[1:3])} exited {proc.returncode}: "
                         + (proc.stderr.strip().splitlines() or ["?"])[-1])
    return proc.stdout


def _update(state: str) -> list[str]:
    for sub in ("state/lists/partial", "cache/archives/partial"):
        os.makedirs(os.path.join(state, sub), exist_ok=True)
    with open(os.path.join(state, "sources.list"), "w") as handle:
        handle.write(f"deb {MIRROR} {SUITE} main\n")
    open(os.path.join(state, "state", "status"), "a").close()
    options = _apt_options(state)
    _run(["apt-get", *options, "update"])
    return options


def current_package(options: list[str]) -> tuple[str, str]:
    """(package, kernel version) that trixie's linux-image-amd64 depends on now."""
    return kernel_package(_run(["apt-cache", *options, "show", META]))


def kernel_package(shown: str) -> tuple[str, str]:
    """(package, kernel version) from ``apt-cache show linux-image-amd64``: its Depends line."""
    depends = next((line for line in shown.splitlines() if line.startswith("Depends:")), "")
    found = PACKAGE.search(depends)
    if found is None:
        raise FetchError(f"{META} of {SUITE} names no kernel package: {depends!r}")
    return found.group(0), found.group(1)


def _unpack(options: list[str], package: str, version: str, cache: str) -> str:
    """Download and unpack ``package``; the modules installed in /lib/modules; the image's path."""
    with tempfile.TemporaryDirectory(dir=cache) as work:
        _run(["apt-get", *options, "download", package], cwd=work)
        deb = next(name for name in os.listdir(work) if name.endswith(".deb"))
        tree = os.path.join(work, "tree")
        _run(["dpkg-deb", "-x", os.path.join(work, deb), tree])
        modules = os.path.join(tree, "usr", "lib", "modules", version)
        if not os.path.isdir(modules):
            raise FetchError(f"{deb} has no usr/lib/modules/{version}")
        _run(["depmod", "-b", os.path.join(tree, "usr"), version])
        if not os.path.isdir(os.path.join(MODULES, version)):
            shutil.copytree(modules, os.path.join(MODULES, version), symlinks=True)
        target = os.path.join(cache, f"vmlinuz-{version}")
        shutil.move(os.path.join(tree, "boot", f"vmlinuz-{version}"), target)
    return target


def fetch(cache: str = DEFAULT_CACHE) -> str:
    """The path of Debian 13's current kernel image, its modules installed for virtme-ng."""
    os.makedirs(cache, exist_ok=True)
    options = _update(os.path.join(cache, "apt"))
    package, version = current_package(options)
    image = os.path.join(cache, f"vmlinuz-{version}")
    if os.path.isfile(image) and os.path.isfile(os.path.join(MODULES, version, "modules.dep")):
        return image
    return _unpack(options, package, version, cache)


def _requirements() -> list[str]:
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as handle:
        project = tomllib.load(handle)["project"]
    extras = [r for r in project["optional-dependencies"]["test"] if re.split(r"[<>=!; ]", r)[0] in LANE_EXTRAS]
    extras += project["optional-dependencies"]["report"]  # testbed report's plots
    return list(project["dependencies"]) + extras


def _in_root(root: str, *argv: str, timeout: int = 1800) -> subprocess.CompletedProcess:
    """``argv`` inside ``root`` with this checkout bound there, in a private mount namespace."""
    return subprocess.run(["unshare", "--mount", "--propagation", "private", INROOT, root, REPO, *argv],
                          timeout=timeout)


def rootfs(cache: str = DEFAULT_CACHE) -> str:
    """The Debian 13 root for the daemon lane, made once per package list and requirements."""
    requirements = _requirements()
    key = hashlib.sha256("\n".join((SUITE, MIRROR, *ROOT_PACKAGES, *requirements)).encode()).hexdigest()[:12]
    root = os.path.join(cache, f"root-{key}")
    if os.path.isfile(os.path.join(root, ".complete")):
        return root
    build = root + ".build"
    shutil.rmtree(build, ignore_errors=True)
    os.makedirs(cache, exist_ok=True)
    _run(["debootstrap", "--variant=minbase", SUITE, build, MIRROR])
    # debootstrap's --include cannot order systemd on trixie: apt-get in the root can.
    steps = [("apt-get", "install", "-y", "-q", "--no-install-recommends", *ROOT_PACKAGES),
             ("python3", "-m", "venv", "--system-site-packages", "/opt/venv"),
             ("/opt/venv/bin/pip", "install", "-q", *requirements)]
    # pip in the root trusts what this machine trusts (a proxy's authority included).
    # minbase has no ca-certificates yet: its certs directory comes with the package, later.
    certs = os.path.join(build, "etc", "ssl", "certs")
    os.makedirs(certs, exist_ok=True)
    shutil.copy("/etc/ssl/certs/ca-certificates.crt", os.path.join(certs, "host-ca-certificates.crt"))
    for step in steps:
        if _in_root(build, "env", "DEBIAN_FRONTEND=noninteractive", *step).returncode != 0:
            raise FetchError(f"{' '.join(step[:3])} failed in the Debian 13 root")
    open(os.path.join(build, ".complete"), "w").close()
    os.rename(build, root)
    return root


# What the root cannot run: the benchmarks time the console script a venv of this machine has
# (benchmarks/ratios.py GPUVFIO); the root reaches gpuvfio through a .pth to the checkout only.
NOT_IN_ROOT = ("tests/daemon/test_benchmarks.py",)


def main(argv: list[str]) -> int:
    if argv[:1] == ["daemon"]:
        try:
            root = rootfs()
        except (FetchError, OSError, subprocess.TimeoutExpired) as exc:
            print(f"Debian 13 root: {exc}", file=sys.stderr)
            return 1
        return _in_root(root, "python", "-m", "pytest", "-p", "no:cacheprovider", "tests/daemon",
                        *(f"--ignore={path}" for path in NOT_IN_ROOT), *argv[1:], timeout=5400).returncode
    try:
        print(fetch(*argv[:1]))
    except (FetchError, OSError, subprocess.TimeoutExpired) as exc:
        print(f"current kernel: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
