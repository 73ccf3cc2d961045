"""Rising correctable errors and acknowledged fatal ones (issue 38 item 1): the AER counters
count since boot, so health keeps the last sample (--record, as the health timer runs it) and
the counts an admin acknowledged (--acknowledge) in the state dir, for this boot only
(gpuvfio.host.aer_baseline)."""

from __future__ import annotations

import json
import os

import pytest

from gpuvfio.host.aer_baseline import FILE_NAME, BaselineUnreadable, parse
from tests.unit.test_pcie_health import GPU, PORT, devices, findings, fn, host

STATE = ("var", "lib", "gpuvfio")


def baseline(b) -> dict:
    with open(os.path.join(b.root, *STATE, FILE_NAME)) as handle:
        return json.load(handle)


def test_correctable_errors_above_the_last_sample_are_rising(cli, tmp_path):
    b = host(tmp_path)
    b.boot_id()
    b.aer(fn(b, GPU), correctable={"BadTLP": 5})
    first = cli("--root", b.root, "health", "--record", "--json", GPU)
    assert first.code == 0, first.out + first.err  # nothing to compare with yet: reported, ok
    kept = baseline(b)
    assert kept["boot_id"] == "0f4f2a7e-52b5-4bd4-8d7c-3f1e9c2b6a10"
    assert kept["last"][GPU]["totals"] == {"correctable": 5, "nonfatal": 0, "fatal": 0}
    assert kept["last"][PORT]["totals"]["correctable"] == 0 and kept["acknowledged"] == {}
    assert oct(os.stat(os.path.join(b.root, *STATE, FILE_NAME)).st_mode & 0o777) == "0o600"
    same = cli("--root", b.root, "health", "--json", GPU)
    assert same.code == 0 and findings(devices(same)[GPU], "aer") == [("ok", "5 correctable error(s) (BadTLP 5) since boot")]
    b.aer(fn(b, GPU), correctable={"BadTLP": 7, "Timeout": 1})
    rising = cli("--root", b.root, "health", "--json", GPU)
    assert rising.code == 1
    ((status, message),) = findings(devices(rising)[GPU], "aer")
    assert status == "degraded" and message.startswith("8 correctable error(s) (BadTLP 7, Timeout 1) since boot; "
                                                       "rising: 3 since the sample of ")
    assert cli("--root", b.root, "health", "--record", GPU).code == 1  # rated against the sample before it
    assert cli("--root", b.root, "health", GPU).code == 0  # no error since the last sample


def test_a_new_boot_starts_afresh(cli, tmp_path):
    b = host(tmp_path)
    b.boot_id()
    b.aer(fn(b, GPU), correctable={"BadTLP": 5})
    assert cli("--root", b.root, "health", "--record", GPU).code == 0
    b.boot_id("6b1d0c3e-0a6f-4b8e-9a51-0c7d4e2f9b33")
    b.aer(fn(b, GPU), correctable={"BadTLP": 9})  # another boot's counters: no sample to rise above
    assert cli("--root", b.root, "health", GPU).code == 0
    assert cli("--root", b.root, "health", "--record", GPU).code == 0
    assert baseline(b)["boot_id"].startswith("6b1d0c3e") and baseline(b)["last"][GPU]["totals"]["correctable"] == 9


def test_an_acknowledged_fatal_error_no_longer_fails_the_device_until_a_new_one(cli, tmp_path):
    b = host(tmp_path)
    b.boot_id()
    b.aer(fn(b, GPU), fatal={"MalfTLP": 1})
    assert cli("--root", b.root, "health", GPU).code == 1
    assert cli("--root", b.root, "health", "--acknowledge").code == 2  # which devices: bad input
    acked = cli("--root", b.root, "health", "--acknowledge", "--json", GPU)
    assert acked.code == 0, acked.out + acked.err
    ((status, message),) = [f for f in findings(devices(acked)[GPU], "aer") if "fatal" in f[1]]
    assert status == "ok" and message.startswith("1 fatal error(s) (MalfTLP 1) since boot; acknowledged at ")
    assert baseline(b)["acknowledged"][GPU]["totals"]["fatal"] == 1
    b.aer(fn(b, GPU), fatal={"MalfTLP": 1, "CmpltTO": 2})
    again = cli("--root", b.root, "health", "--json", GPU)
    ((status, message),) = [f for f in findings(devices(again)[GPU], "aer") if "fatal" in f[1]]
    assert again.code == 1 and status == "failed" and "; 2 since the acknowledgement of " in message
    plan = cli("--root", b.root, "bind", "--dry-run", "--json", "--connect", "none", GPU)
    assert plan.code == 1 and "2 since the acknowledgement" in plan.out + plan.err


def test_no_baseline_without_a_boot_id_or_from_a_damaged_file(cli, tmp_path):
    b = host(tmp_path)
    result = cli("--root", b.root, "health", "--record", GPU)
    assert result.code == 1 and "boot_id" in result.err and not os.path.exists(os.path.join(b.root, *STATE, FILE_NAME))
    b.boot_id()
    os.makedirs(os.path.join(b.root, *STATE), exist_ok=True)
    with open(os.path.join(b.root, *STATE, FILE_NAME), "w") as handle:
        handle.write('{"format": "gpuvfio-aer-baseline"}')
    damaged = cli("--root", b.root, "health", "--json", GPU)
    assert damaged.code == 1 and ("unknown", next(m for s, m in findings(devices(damaged)[GPU], "aer")
                                               if "baseline" in m)) in findings(devices(damaged)[GPU], "aer")
    refused = cli("--root", b.root, "health", "--record", GPU)
    assert refused.code == 1 and "move it away" in refused.err


@pytest.mark.parametrize("text, words", [
    ('{"format": "gpuvfio-aer-baseline", "version": 1, "boot_id": "x", "last": {}, "acknowledged": {}}', "boot id"),
    ('{"format": "gpuvfio-aer-baseline", "version": 1, "boot_id": null, "last": {"../x": {}}, "acknowledged": {}}',
     "not one gpuvfio writes"),
    ('{"format": "gpuvfio-aer-baseline", "version": 1, "boot_id": null, "last": {"0000:01:00.0": {"at": '
     '"2026-12-06T10:00:00Z", "totals": {"fatal": -1}}}, "acknowledged": {}}', "malformed"),
    ('{"format": "gpuvfio-aer-baseline", "version": 1, "boot_id": null, "last": {"0000:01:00.0": {"at": '
     '"now", "totals": {}}}, "acknowledged": {}}', "malformed"),
    ("[" * 50000, "not JSON|nested"),
])
def test_a_baseline_not_gpuvfios_is_refused_whole(text, words):
    with pytest.raises(BaselineUnreadable, match=words):
        parse(text.encode())
