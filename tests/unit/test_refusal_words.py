"""A refusal says each reason once, in the same words wherever it is shown (issue 40, item 7):
"refused: " once at the front of the line, and "(--force to proceed)" once after a reason --force
overrides, in the plan as printed and in the error line."""

from __future__ import annotations

import pytest

from tests.make_samples import host_tree

FORCE = "(--force to proceed)"


@pytest.fixture(scope="module")
def samples(tmp_path_factory):
    made = {}
    for name in ("workstation", "dgx-h100"):
        made[name] = str(tmp_path_factory.mktemp(name))
        host_tree(name, made[name])
    return made


def test_a_boot_console_plan_says_force_once(cli, samples):
    result = cli("--root", samples["workstation"], "bind", "0000:01:00.0", "--dry-run", "--connect", "none")
    plan = _unwrapped(result.out)
    assert result.code == 1 and "the host loses its display " + FORCE in plan, plan
    assert plan.count("--force") == 1
    assert result.err.count(FORCE) == 1 and "the host loses its display " + FORCE in result.err


def test_a_group_shared_with_a_nic_names_force_in_the_plan_and_the_error(cli, samples):
    """The group check never said --force in its words: the plan added it, the error did not."""
    result = cli("--root", samples["workstation"], "bind", "0000:04:00.0", "--dry-run", "--connect", "none")
    plan = _unwrapped(result.out)
    assert "would take that device from the host " + FORCE in plan and plan.count("--force to proceed") == 1
    assert "would take that device from the host " + FORCE + ";" in result.err


def test_persist_says_force_after_the_reason_it_overrides(cli, samples):
    result = cli("--root", samples["workstation"], "persist", "0000:04:00.0", "--dry-run")
    assert result.code == 1 and "from the host " + FORCE in result.err, result.err
    assert result.err.count("--force") == 1 and "persists anyway" not in result.err


def test_a_refusal_from_below_a_plan_says_refused_once(cli, samples):
    """attach on one GPU of an NVSwitch baseboard: the fabric's refusal became a check of the plan,
    and the plan's refusal put "refused: " in front of it again."""
    result = cli("--root", samples["dgx-h100"], "attach", "0000:03:00.0", "--name", "x", "--dry-run", "--connect",
                 "test:///default")
    assert result.code == 1 and "NVSwitches" in result.err, result.err
    assert result.err.count("refused:") == 1 and "refused: refused:" not in result.err
    assert "refuse domain_spec: NVSwitches" in _unwrapped(result.out)


def _unwrapped(text: str) -> str:
    return " ".join(text.split())
