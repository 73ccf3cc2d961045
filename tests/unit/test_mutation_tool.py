"""tests/mutation/mutate.py (make mutate): the names it gives mutmut for changed functions are
mutmut's own, and its one class of triage (prose) takes only changes to words for people."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

SPEC = importlib.util.spec_from_file_location("mutate", os.path.join(REPO, "tests", "mutation", "mutate.py"))
mutate = importlib.util.module_from_spec(SPEC)
sys.modules["mutate"] = mutate  # its dataclasses look their module up there
SPEC.loader.exec_module(mutate)


def _lines_of(module: str, name: str) -> set[int]:
    with open(os.path.join(REPO, module), encoding="utf-8") as handle:
        tree = ast.parse(handle.read())
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name)
    return {node.lineno + 1}


def test_changed_lines_name_the_functions_as_mutmut_does():
    """mutmut 3.8 names a function's mutants gpuvfio.guest.expect.x_gates__mutmut_N and a
    method's gpuvfio.guest.expect.xǁExpectedǁto_json__mutmut_N (seen in its results)."""
    module = "gpuvfio/guest/expect.py"
    assert mutate.functions_at(module, _lines_of(module, "gates")) == ["gpuvfio.guest.expect.x_gates__mutmut_*"]
    assert mutate.functions_at(module, _lines_of(module, "to_json")) == [
        "gpuvfio.guest.expect.x\u01c1Expected\u01c1to_json__mutmut_*"]
    assert mutate.functions_at(module, {1}) == []  # the docstring: no function


def test_prose_is_only_the_words_of_a_message():
    assert mutate.prose_only('-        raise InputError(f"no such PCI function on this host: {address}")\n'
                             '+        raise InputError(f"XXno such PCI function on this host: {address}XX")')
    assert mutate.prose_only("-    return \", \".join(names)\n+    return \"XX, XX\".join(names)")
    # tokens, values and logic are not prose
    assert not mutate.prose_only('-    a, eq, b = segment.partition("=")\n+    a, eq, b = segment.rpartition("=")')
    assert not mutate.prose_only('-    value = raw if eq else ""\n+    value = raw if eq else "XXXX"')
    assert not mutate.prose_only('-    if size > limit:\n+    if size >= limit:')
    assert not mutate.prose_only('-    x = "a b"\n+    y = "a c"')
    assert not mutate.prose_only('-    if len(key) > 4 or " " in key:\n+    if len(key) > 4 or "XX XX" in key:')


def test_every_group_names_files_that_exist():
    for name, group in mutate.GROUPS.items():
        for rel in group.modules + group.tests:
            assert os.path.isfile(os.path.join(REPO, rel)), (name, rel)


def test_a_codec_name_in_other_case_is_the_same_codec_and_nothing_else_is():
    assert mutate.codec_case_only('-    x = raw.decode("utf-8", "replace")\n+    x = raw.decode("UTF-8", "replace")')
    assert not mutate.codec_case_only('-    x = raw.decode("utf-8", "replace")\n+    x = raw.decode("utf-8", "REPLACE")')
    assert not mutate.codec_case_only('-    x = raw.decode("utf-8")\n+    x = raw.decode("XXutf-8XX")')
    assert not mutate.codec_case_only('-    if kind == "utf-8":\n+    if kind == "UTF-8":')  # a value, not a codec
    assert mutate.codec_case_only("-    open(p, encoding='utf-8')\n+    open(p, encoding='UTF-8')")
    assert not mutate.codec_case_only('-    a = "utf-8"\n+    b = "UTF-8"')


def test_each_group_is_compared_with_the_commit_it_was_measured_on(tmp_path, monkeypatch):
    """A run of one group rewrites the record's commit; a group measured before keeps its own,
    or a change made to its modules in between would never be run (the fault of the first
    changed-lines run: the guest group's check changed after it was measured, unseen)."""
    scores = tmp_path / "mutation-scores.json"
    scores.write_text('{"commit": "bbbb", "groups": {"guest": {"commit": "aaaa"}}}', encoding="utf-8")
    monkeypatch.setattr(mutate, "SCORES", str(scores))
    bases = mutate.measured_bases()
    assert bases["guest"] == "aaaa"
    assert bases["bind"] == "bbbb"  # never measured: since the record's last run
    assert set(bases) == set(mutate.GROUPS)


def test_a_groups_note_lives_until_that_group_is_measured_again(tmp_path, monkeypatch):
    """A note says what happened to a group since its measurement (tests added that kill its
    survivors); measuring another group keeps it, measuring that group drops it."""
    scores = tmp_path / "mutation-scores.json"
    measured = {"commit": "aaaa", "mutants": 2, "killed": 1, "score": 0.5, "counts": {"killed": 1, "survived": 1},
                "seconds": 60, "survivors": {}}
    scores.write_text(json.dumps({"commit": "aaaa", "groups": {"uri": {**measured, "note": "uri's own note"},
                                                               "stats": {**measured, "note": "stats's own note"}}}))
    monkeypatch.setattr(mutate, "SCORES", str(scores))
    monkeypatch.setattr(mutate, "REPORT", str(tmp_path / "mutation.md"))
    mutate.write_report([mutate.Outcome("stats", counts={"killed": 2})], {})
    groups = json.loads(scores.read_text())["groups"]
    assert groups["uri"]["note"] == "uri's own note" and "note" not in groups["stats"]
    report = (tmp_path / "mutation.md").read_text()
    assert "uri: uri's own note" in report and "stats's own note" not in report


def test_a_score_is_of_the_commit_its_tree_was_copied_from(tmp_path, monkeypatch):
    """A group's run takes minutes to an hour; a commit made meanwhile was not measured, so the
    record names the commit the run copied, or a later changed-lines run would skip that change."""
    scores = tmp_path / "mutation-scores.json"
    scores.write_text('{"commit": "aaaa", "groups": {}}')
    monkeypatch.setattr(mutate, "SCORES", str(scores))
    monkeypatch.setattr(mutate, "REPORT", str(tmp_path / "mutation.md"))
    mutate.write_report([mutate.Outcome("uri", counts={"killed": 1}, commit="cccc")], {})
    record = json.loads(scores.read_text())
    assert record["groups"]["uri"]["commit"] == "cccc" and record["commit"] == "cccc"


def test_a_rerun_of_survivors_keeps_the_standing_kills_and_recounts_changed_functions(tmp_path, monkeypatch):
    """--survivors runs the recorded survivors and every mutant of a function changed since; a
    changed function's old mutants leave the count (its mutants are renumbered), a deleted
    function's too, and the other kills stand."""
    uri = "gpuvfio.virt.uri."
    survivors = {f"{uri}x__policy__mutmut_3": "-a\n+b", f"{uri}x__policy__mutmut_5": "-a\n+b",
                 f"{uri}x_check_uri__mutmut_1": "-a\n+b", f"{uri}x_gone__mutmut_1": "-a\n+b"}
    scores = tmp_path / "mutation-scores.json"
    scores.write_text(json.dumps({"commit": "aaaa", "groups": {"uri": {
        "commit": "aaaa", "mutants": 10, "killed": 6, "score": 0.6, "counts": {"killed": 5, "timeout": 1, "survived": 4},
        "seconds": 600, "survivors": survivors}}}))
    monkeypatch.setattr(mutate, "SCORES", str(scores))
    monkeypatch.setattr(mutate, "REPORT", str(tmp_path / "mutation.md"))
    check_uri = _lines_of("gpuvfio/virt/uri.py", "check_uri")
    monkeypatch.setattr(mutate, "changed_lines", lambda base, module: check_uri if base == "aaaa" else set())
    old = [f"{uri}x__policy__mutmut_{n}" for n in range(1, 6)] + [f"{uri}x_check_uri__mutmut_{n}" for n in (1, 2, 3)] \
        + [f"{uri}x_gone__mutmut_{n}" for n in (1, 2)]
    monkeypatch.setattr(mutate, "mutant_names", lambda commit, module: old if commit == "aaaa" else [])
    ran = []

    def run_group(name, jobs, patterns=None, timeout=None):
        ran.append(patterns)
        return mutate.Outcome(name, counts={"killed": 4, "survived": 2}, commit="cccc", seconds=30,
                              survivors={f"{uri}x__policy__mutmut_5": "-a\n+b", f"{uri}x_check_uri__mutmut_4": "-c\n+d"})

    monkeypatch.setattr(mutate, "run_group", run_group)
    outcome = mutate.rerun_survivors("uri", 2)
    assert ran == [[f"{uri}x_check_uri__mutmut_*", f"{uri}x__policy__mutmut_3", f"{uri}x__policy__mutmut_5"]]
    # standing: 6 killed less check_uri's 2 and gone's 1 old kills; then the re-run's 4
    assert (outcome.killed, outcome.total) == (7, 9)
    assert outcome.counts == {"killed": 7, "survived": 2}  # the timeout's function may have changed: a kill
    assert (outcome.full_run, outcome.full_seconds) == ("aaaa", 600)
    mutate.write_report([outcome], {})
    entry = json.loads(scores.read_text())["groups"]["uri"]
    assert (entry["commit"], entry["full_run"], entry["seconds"], entry["rerun_seconds"]) == ("cccc", "aaaa", 600, 30)
    assert "every mutant run at aaaa; its survivors" in (tmp_path / "mutation.md").read_text()


def test_a_rerun_with_nothing_changed_keeps_the_records_timeouts(tmp_path, monkeypatch):
    scores = tmp_path / "mutation-scores.json"
    scores.write_text(json.dumps({"commit": "aaaa", "groups": {"stats": {
        "commit": "aaaa", "mutants": 4, "killed": 3, "score": 0.75, "counts": {"killed": 2, "timeout": 1, "survived": 1},
        "seconds": 60, "survivors": {"gpuvfio.testbed.stats.x_t_cdf__mutmut_1": "-a\n+b"}}}}))
    monkeypatch.setattr(mutate, "SCORES", str(scores))
    monkeypatch.setattr(mutate, "changed_lines", lambda base, module: set())
    monkeypatch.setattr(mutate, "mutant_names", lambda commit, module: [])
    monkeypatch.setattr(mutate, "run_group", lambda name, jobs, patterns=None, timeout=None: mutate.Outcome(
        name, counts={"killed": 1}, commit="cccc"))
    outcome = mutate.rerun_survivors("stats", 2)
    assert outcome.counts == {"killed": 3, "timeout": 1} and outcome.score == 1.0


def test_the_report_lists_each_unexplained_survivor_or_says_there_is_none(tmp_path, monkeypatch):
    """A survivor neither the triage file nor a class explains is listed with its diff; with none
    left the section says so rather than ending on its heading."""
    scores = tmp_path / "mutation-scores.json"
    living = {"gpuvfio.virt.uri.x_f__mutmut_1": "-    n = 1\n+    n = 2"}
    scores.write_text(json.dumps({"commit": "aaaa", "groups": {"uri": {
        "commit": "aaaa", "mutants": 2, "killed": 1, "score": 0.5, "counts": {"killed": 1, "survived": 1},
        "seconds": 60, "survivors": living}}}))
    monkeypatch.setattr(mutate, "SCORES", str(scores))
    monkeypatch.setattr(mutate, "REPORT", str(tmp_path / "mutation.md"))
    mutate.write_report([], {})
    report = (tmp_path / "mutation.md").read_text()
    assert "- `gpuvfio.virt.uri.x_f__mutmut_1`" in report and "+    n = 2" in report and "None:" not in report
    mutate.write_report([], {"gpuvfio.virt.uri.x_f__mutmut_1": "equivalent: n is not read"})
    report = (tmp_path / "mutation.md").read_text()
    assert "x_f__mutmut_1" not in report and report.endswith("None: every survivor of the groups measured is explained.\n")


def test_a_triage_entry_for_a_renumbered_mutant_is_not_taken_in_the_changed_run(tmp_path, monkeypatch, capsys):
    """mutmut numbers a function's mutants in order, so a change above a triaged mutant makes its
    number name another mutation (RunLock.__enter__'s 28 became 26 when it took the clock, and 28
    then named another). An entry that says which mutation it was written for explains only that
    one in the changed-lines run; the record's report still reads its reason."""
    triage = tmp_path / "triage.toml"
    triage.write_text('[survivors]\n"m.x_f__mutmut_3" = {reason = "equivalent", diff = "-    a < b\\n+    a <= b"}\n'
                      '"m.x_f__mutmut_4" = "equivalent, by number only"\n', encoding="utf-8")
    monkeypatch.setattr(mutate, "TRIAGE", str(triage))
    assert mutate.load_triage()["m.x_f__mutmut_3"] == "equivalent"
    assert mutate.same_mutation("-    a < b\n+    a <= b", "-        a < b\n+        a <= b")  # indentation aside
    outcome = mutate.Outcome("bind", seconds=1.0, commit="c")
    monkeypatch.setattr(mutate, "changed_patterns", lambda bases: {"bind": ["m.x_f__mutmut_*"]})

    def run_group(name, jobs, patterns):
        outcome.counts = {"killed": 8, "survived": 2}
        return outcome

    monkeypatch.setattr(mutate, "run_group", run_group)
    outcome.survivors = {"m.x_f__mutmut_3": "-    a < b\n+    a <= b", "m.x_f__mutmut_4": "-    x\n+    y"}
    assert mutate.changed_run({"bind": "c"}, 2, 10, mutate.load_triage()) == 0
    outcome.survivors = {"m.x_f__mutmut_3": "-    a = 1\n+    a = 2"}  # the number names another mutation now
    assert mutate.changed_run({"bind": "c"}, 2, 10, mutate.load_triage()) == 1
    assert "SURVIVED m.x_f__mutmut_3 (its triage entry describes another mutation: renumbered?)" in capsys.readouterr().out


def test_a_module_younger_than_the_measured_commit_has_no_old_mutants():
    """A module added to a group after the group was measured (host/state.py joined bind after
    f3e0cb2): its old mutants are none, and every function of it counts as changed."""
    first = subprocess.run(["git", "rev-list", "--max-parents=0", "HEAD"], cwd=mutate.REPO, check=True,
                           capture_output=True, text=True).stdout.split()[0]
    assert mutate.mutant_names(first, "gpuvfio/host/state.py") == []
    assert mutate.functions_at("gpuvfio/host/state.py", mutate.changed_lines(first, "gpuvfio/host/state.py"))
    with pytest.raises(subprocess.CalledProcessError):  # a commit that is not one stays an error
        mutate.mutant_names("0" * 40, "gpuvfio/host/state.py")


def test_a_mutant_that_leaves_children_behind_does_not_hang_the_run(tmp_path, monkeypatch):
    """A mutant of sysfs_write's forked writer kept forking after its test ended; its children
    held mutmut's output pipe open and the refresh waited on it for an hour. mutmut now runs in
    a session of its own, killed whole when it returns, and writes its output to files."""
    import time
    tool = tmp_path / "mutmut"
    tool.write_text("#!/bin/sh\n(sleep 60; echo late) &\necho done\nexit 0\n")
    tool.chmod(0o755)
    monkeypatch.setattr(mutate.sys, "executable", str(tmp_path / "python"))
    started = time.monotonic()
    assert mutate.mutmut(str(tmp_path), "run") == "done\n"
    assert time.monotonic() - started < 20
    left = subprocess.run(["pgrep", "-f", "sleep 60"], capture_output=True, text=True).stdout.split()
    assert left == [], left
