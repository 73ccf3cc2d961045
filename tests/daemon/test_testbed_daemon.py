"""A two-variant testbed end to end on the daemon lane, interrupted once and resumed."""

from __future__ import annotations

import json
import os

import pytest

from tests.lanes import daemon as dl
from tests.lanes import guest as gl
from tests.testbed_data import tiny_guest_toml

_REASON = dl.skip_reason() or gl.skip_reason()
if _REASON:
    pytest.skip(_REASON, allow_module_level=True)

from gpuvfio.errors import GpuvfioError  # noqa: E402
from gpuvfio.ops.context import live_context  # noqa: E402
from gpuvfio.testbed.report import write_report  # noqa: E402
from gpuvfio.testbed.run import run_testbed  # noqa: E402
from gpuvfio.testbed.spec import load_spec  # noqa: E402


def spec_file(tmp_path, image, port, known):
    text = tiny_guest_toml(image, port, known) + """
[run]
repetitions = 2
size_mib = 64
stop_timeout = 10  # the tiny guest's ACPI shutdown gets 10 s, then it is destroyed

[[variant]]
name = "tiny-4k"
kind = "passthrough"
hugepages = "none"
numa = "none"

[[variant]]
name = "tiny-auto"
kind = "passthrough"
hugepages = "auto"
numa = "none"

[[variant]]
name = "baremetal"
kind = "baremetal"
"""
    path = tmp_path / "testbed.toml"
    path.write_text(text)
    return str(path)


def test_two_variants_interrupted_resumed_and_reported(daemon, tmp_path, monkeypatch):
    monkeypatch.setenv("GPUVFIO_STATE_DIR", str(tmp_path / "state"))
    image = gl.build_guest()
    port = gl.free_port()
    known = tmp_path / "known_hosts"
    known.write_text(f"[127.0.0.1]:{port} {image.host_key_line}\n")
    spec = load_spec(spec_file(tmp_path, image, port, known))
    out = str(tmp_path / "out")
    conn = daemon.connect()
    seen = []

    def interrupt_once(line):
        seen.append(line)
        if line == "tiny-auto: repetition 2/2" and not any("resumed" in s for s in seen):
            raise KeyboardInterrupt

    try:
        with pytest.raises(GpuvfioError, match="interrupted"):
            with live_context("/", progress=interrupt_once, writable=True) as ctx:
                run_testbed(ctx, spec, out, uri=daemon.uri)
        assert [d.name() for d in conn.listAllDomains(0) if d.name().startswith("gpuvfio-tb-")] == []
        done = sorted(os.listdir(os.path.join(out, "results", "tiny-4k")))
        assert done == ["rep-0.json", "rep-1.json", "steps.json"]
        assert sorted(os.listdir(os.path.join(out, "results", "tiny-auto"))) == ["rep-0.json", "steps.json"]
        # The interrupted variant's record: its plan, and the steps it took before the signal.
        record = json.load(open(os.path.join(out, "results", "tiny-auto", "steps.json")))
        assert [s["kind"] for s in record["planned"]] == ["attach", "measure", "teardown"]
        assert [s["kind"] for s in record["taken"]] == ["attach", "teardown"]
        seen.append("resumed")
        with live_context("/", progress=seen.append, writable=True) as ctx:
            run_testbed(ctx, spec, out, uri=daemon.uri)
        assert "tiny-4k: done already (2 repetitions)" in seen
        assert sorted(os.listdir(os.path.join(out, "results", "tiny-auto"))) == ["rep-0.json", "rep-1.json",
                                                                                 "steps.json"]
        for rep in ("rep-0.json", "rep-1.json"):  # the attach's repetition measured with [run]'s settings too
            with open(os.path.join(out, "results", "tiny-4k", rep)) as handle:
                assert json.load(handle)["verify_settings"]["size_mib"] == 64, rep
        assert [d.name() for d in conn.listAllDomains(0) if d.name().startswith("gpuvfio-tb-")] == []
    finally:
        conn.close()
    record = json.load(open(os.path.join(out, "results", "tiny-4k", "rep-0.json")))
    assert record["placement"]["vcpus"] == 1 and record["placement"]["hugepage_kib"] is None
    assert record["placement"]["memory_kib"] == 262144 and record["provisioning"] == {"hugepages": "none",
                                                                                      "numa": "none"}
    ident = json.load(open(os.path.join(out, "identity.json")))
    assert ident["qemu_version"] and ident["libvirt_version"] and ident["host_kernel"] == os.uname().release
    summary = write_report(out)
    assert summary["baseline"] == "baremetal"
    md = open(os.path.join(out, "report.md")).read()
    assert "Attach to verified guest" in md and "| tiny-auto |" in md
