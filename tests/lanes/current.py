"""The current stack for the kernel lane: Debian 13's own kernel, fetched from Debian's archive.

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

    python -m tests.lanes.current [CACHE]   prints the kernel image's path
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile

SUITE = "trixie"
MIRROR = os.environ.get("GPUVFIO_DEBIAN_MIRROR", "http://deb.debian.org/debian")
META = "linux-image-amd64"
MODULES = "/lib/modules"
DEFAULT_CACHE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                             ".deps", "current")
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
    shown = _run(["apt-cache", *options, "show", META])
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


def main(argv: list[str]) -> int:
    try:
        print(fetch(*argv[:1]))
    except (FetchError, OSError, subprocess.TimeoutExpired) as exc:
        print(f"current kernel: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
