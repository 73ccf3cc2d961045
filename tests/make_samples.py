#!/usr/bin/env python3
"""Build the bundled sample hosts and record them as ``gpuvfio/samples/<name>.host``.

    python tests/make_samples.py --regenerate [NAME ...]   write the fixture files
    python tests/make_samples.py --check [NAME ...]        exit 1 if a committed file is stale

Each sample (``tests/sample_hosts.py``) is built in a temporary directory with
HostBuilder and recorded with ``gpuvfio.host.recording.dump_host`` -- the same recorder
``gpuvfio dump-host`` uses on a live host -- so a sample is exactly what gpuvfio would
have recorded on such a machine. Generation is deterministic: ``--check`` compares text.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
SAMPLES_DIR = os.path.join(REPO, "gpuvfio", "samples")
SUFFIX = ".host"

for _path in (REPO, HERE):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from gpuvfio.host.recording import dump_host  # noqa: E402
from gpuvfio.host.root import HostRoot  # noqa: E402

try:
    from tests.sample_hosts import SAMPLES  # noqa: E402
except ImportError:  # a foreign "tests" package shadows ours
    from sample_hosts import SAMPLES  # type: ignore  # noqa: E402


def sample_path(name: str) -> str:
    return os.path.join(SAMPLES_DIR, name + SUFFIX)


# Every sample and a host generated at scale (tests/hostbuilder.py build_sriov_server): the hosts
# on which two readers of the same facts are checked to agree.
EVERY_HOST = sorted(SAMPLES) + ["generated"]


def host_tree(name: str, directory: str) -> str:
    """Host ``name`` of EVERY_HOST as a tree under ``directory``; the root."""
    if name == "generated":
        from tests.hostbuilder import build_sriov_server

        build_sriov_server(directory, switches_per_socket=1, nic_vfs=6)
        return directory
    from gpuvfio.host.fixture import load_fixture

    with open(sample_path(name), encoding="utf-8") as handle:
        return load_fixture(handle.read(), directory)


def generate(name: str) -> str:
    """The fixture text of sample ``name`` (KeyError for an unknown name)."""
    build = SAMPLES[name]
    with tempfile.TemporaryDirectory(prefix=f"gpuvfio-sample-{name}-") as tmp:
        build(tmp)
        return dump_host(HostRoot(tmp))


def _diff_summary(name: str, old: str, new: str, limit: int = 40) -> str:
    diff = list(difflib.unified_diff(old.splitlines(), new.splitlines(), f"committed/{name}{SUFFIX}",
                                     f"generated/{name}{SUFFIX}", lineterm="", n=0))
    added = sum(1 for line in diff if line.startswith("+") and not line.startswith("+++"))
    removed = sum(1 for line in diff if line.startswith("-") and not line.startswith("---"))
    shown = [line if len(line) <= 200 else line[:197] + "..." for line in diff[:limit]]
    more = f"\n  ... {len(diff) - limit} more diff lines" if len(diff) > limit else ""
    return f"{name}: {removed} record(s) removed, {added} added\n  " + "\n  ".join(shown) + more


def check(names: list[str]) -> list[str]:
    """Problems (one string each) where committed files differ from generated ones."""
    problems = []
    for name in names:
        path = sample_path(name)
        new = generate(name)
        try:
            with open(path, encoding="utf-8") as handle:
                old = handle.read()
        except FileNotFoundError:
            problems.append(f"{name}: {os.path.relpath(path, REPO)} is missing")
            continue
        if old != new:
            problems.append(_diff_summary(name, old, new))
    if names == list(SAMPLES):
        stray = sorted(f for f in os.listdir(SAMPLES_DIR) if f.endswith(SUFFIX)
                       and f[: -len(SUFFIX)] not in SAMPLES) if os.path.isdir(SAMPLES_DIR) else []
        problems += [f"{f}: no sample of that name in tests/sample_hosts.py" for f in stray]
    return problems


def regenerate(names: list[str]) -> None:
    os.makedirs(SAMPLES_DIR, exist_ok=True)
    for name in names:
        text = generate(name)
        path = sample_path(name)
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.replace(tmp, path)
        print(f"wrote {os.path.relpath(path, REPO)} ({len(text.encode())} bytes, {text.count(chr(10)) - 1} records)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--regenerate", action="store_true", help="write gpuvfio/samples/<name>.host")
    mode.add_argument("--check", action="store_true", help="exit 1 when a committed sample is stale")
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"samples (default: all of {', '.join(SAMPLES)})")
    args = parser.parse_args(argv)
    unknown = [n for n in args.names if n not in SAMPLES]
    if unknown:
        parser.error(f"unknown sample(s): {', '.join(unknown)} (known: {', '.join(SAMPLES)})")
    names = args.names or list(SAMPLES)
    if args.regenerate:
        regenerate(names)
        return 0
    problems = check(names)
    for problem in problems:
        print(problem, file=sys.stderr)
    if problems:
        print("samples are stale: run python tests/make_samples.py --regenerate", file=sys.stderr)
        return 1
    print(f"{len(names)} sample(s) up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
