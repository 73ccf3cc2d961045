"""CPU topology (sys/devices/system/cpu/cpuN/topology, Documentation/ABI/stable/
sysfs-devices-system-cpu) read in one pass over held directories is what each attribute read
by its path says, on every sample and generated host; a CPU without a topology directory is a
CPU of its own, and a topology that is not what sysfs makes is an error, as for any attribute."""

import os

import pytest

from gpuvfio.errors import HostReadError
from gpuvfio.host.model import parse_cpulist
from gpuvfio.host.numa import read_cpus, read_numa
from gpuvfio.host.root import HostRoot
from tests.make_samples import EVERY_HOST, host_tree


def _root(name: str, tmp_path) -> str:
    return host_tree(name, str(tmp_path / name))


def _by_path(host: HostRoot, cpu: int) -> tuple[int, int, int, tuple[int, ...]]:
    """One attribute at a time, each by its whole path: what read_cpus answered before it held
    directories."""
    topo = host.sys_path("devices", "system", "cpu", f"cpu{cpu}", "topology")
    package = int(host.read(os.path.join(topo, "physical_package_id")) or 0)
    core = int(host.read(os.path.join(topo, "core_id")) or 0)
    siblings = tuple(parse_cpulist(host.read(os.path.join(topo, "thread_siblings_list")) or str(cpu)))
    return cpu, package, core, siblings or (cpu,)


def _answers(cpus) -> list[tuple[int, int, int, tuple[int, ...]]]:
    return [(c.cpu, c.package, c.core, c.siblings) for c in cpus.values()]


@pytest.mark.parametrize("name", EVERY_HOST)
def test_one_pass_reads_what_each_path_says(name, tmp_path):
    host = HostRoot(_root(name, tmp_path))
    cpus = [cpu for node in read_numa(host) for cpu in node.cpus]
    assert cpus
    answers = _answers(read_cpus(host, cpus))
    assert answers == [_by_path(host, cpu) for cpu in cpus]
    if len(cpus) > 2:  # a host with SMT or packages shows them
        assert len({a[1] for a in answers}) > 1 or any(len(a[3]) > 1 for a in answers)


def test_a_cpu_without_topology_is_its_own_core(tmp_path):
    root = _root("workstation", tmp_path)
    host = HostRoot(root)
    cpus = read_numa(host)[0].cpus
    gone = cpus[-1]
    topo = os.path.join(root, "sys", "devices", "system", "cpu", f"cpu{gone}", "topology")
    for name in os.listdir(topo):
        os.unlink(os.path.join(topo, name))
    os.rmdir(topo)
    answer = read_cpus(HostRoot(root), cpus)
    assert (answer[gone].package, answer[gone].core, answer[gone].siblings) == (0, 0, (gone,))
    assert answer[cpus[0]].siblings != (), answer[cpus[0]].siblings


@pytest.mark.parametrize("kind", ["fifo", "link"])
def test_an_attribute_that_is_not_a_file_is_an_error(kind, tmp_path):
    root = _root("workstation", tmp_path)
    cpu = read_numa(HostRoot(root))[0].cpus[0]
    path = os.path.join(root, "sys", "devices", "system", "cpu", f"cpu{cpu}", "topology", "core_id")
    os.unlink(path)
    if kind == "fifo":
        os.mkfifo(path)  # an open without O_NONBLOCK would hang here
    else:
        with open(tmp_path / "elsewhere", "w") as handle:
            handle.write("7\n")
        os.symlink(tmp_path / "elsewhere", path)
    with pytest.raises(HostReadError):
        read_cpus(HostRoot(root), [cpu])


def test_a_topology_directory_swapped_for_a_link_out_of_sys_is_refused(tmp_path):
    root = _root("workstation", tmp_path)
    cpu = read_numa(HostRoot(root))[0].cpus[0]
    topo = os.path.join(root, "sys", "devices", "system", "cpu", f"cpu{cpu}", "topology")
    outside = tmp_path / "outside"
    os.rename(topo, outside)
    os.symlink(outside, topo)
    with pytest.raises(HostReadError):
        read_cpus(HostRoot(root), [cpu])
