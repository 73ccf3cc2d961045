"""make mutate: mutation testing of gpuvfio's core with mutmut, group by group.

Each group is a set of core modules and the unit-lane test files that guard them. A group runs
in a scratch copy of the working tree (mutmut keeps its mutants and results beside the
pyproject it reads), with a [tool.mutmut] section naming only that group's modules and tests;
mutmut then runs, for each mutant, the tests of that list that reach the mutated function.

A group's score is the share of its mutants that a test kills (a timeout counts as killed; a
mutant no test reaches counts as surviving). Every surviving mutant is either killed by a test
added since, or explained in tests/mutation/triage.toml (why it is equivalent, or why a
test for it would test the mutation tool rather than gpuvfio).

``--survivors``: only a group's recorded survivors, and every mutant of the functions changed
since it was measured, against today's tests (minutes, where the whole group takes up to an
hour); the other mutants' kills stand, as their code is unchanged and tests are only added.

``--changed`` (``.ci/run``): only the mutants in the functions whose lines changed since the
commit their group was last measured on (docs/mutation-scores.json; a group never measured:
since the record's last commit), at most ``--limit`` of them; any of those surviving untriaged
fails (a ratchet: what a change touches does not lose a test). ``--changed-since REV`` takes
one base for every group.

Writes docs/mutation.md (the scores, the survivors and their triage) and
docs/mutation-scores.json (the scores and the commit they were measured on).
"""

from __future__ import annotations

import argparse
import ast
import codecs
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRIAGE = os.path.join(REPO, "tests", "mutation", "triage.toml")
REPORT = os.path.join(REPO, "docs", "mutation.md")
SCORES = os.path.join(REPO, "docs", "mutation-scores.json")
GOAL = 0.90


@dataclass(frozen=True)
class Group:
    modules: tuple[str, ...]
    tests: tuple[str, ...]


def _t(*names: str) -> tuple[str, ...]:
    return tuple(f"tests/unit/{n}.py" for n in names)


GROUPS = {
    "bind": Group(("gpuvfio/bind/apply.py", "gpuvfio/bind/journal.py", "gpuvfio/bind/plan.py",
                   "gpuvfio/bind/persist.py", "gpuvfio/bind/sysfs_write.py", "gpuvfio/host/state.py"),
                  _t("test_binding", "test_bind_results", "test_bind_cli", "test_sysfs_write", "test_confined_writes",
                     "test_recovery_gaps", "test_dry_runs", "test_plans_are_run", "test_plan_runs_meet_the_world",
                     "test_health", "test_kernel_names", "test_host_use", "test_fabric_flow", "test_doctor",
                     "test_persist_edges", "test_journal_edges", "test_apply_edges", "test_plan_edges", "test_clock",
                     "test_pcie_health")),
    "host": Group(("gpuvfio/host/inventory.py", "gpuvfio/host/groups.py", "gpuvfio/host/topology.py"),
                  _t("test_inventory", "test_inventory_edges", "test_inventory_generated", "test_topology",
                     "test_topology_edges", "test_selectors", "test_switch_levels", "test_uevent_inventory",
                     "test_completion")),
    "domain": Group(("gpuvfio/domain/placement.py", "gpuvfio/domain/address_space.py", "gpuvfio/domain/nccl_topo.py"),
                    _t("test_placement", "test_address_space", "test_nccl_topo", "test_edges", "test_layout",
                       "test_pins", "test_address_record", "test_placement_record", "test_switch_levels")),
    "files": Group(("gpuvfio/files.py", "gpuvfio/tree_filler.py", "gpuvfio/read_only_tree.py"),
                   _t("test_file_layer", "test_file_layer_reads", "test_tree_reads", "test_tree_writes",
                      "test_tree_replace", "test_tree_filler", "test_confined_writes", "test_fixture_safety",
                      "test_sys_dirs", "test_bounded_recordings", "test_edges", "test_iommu_faults")),
    # sys_dirs: the walk's steps; iommu_faults: the kernel log's reader
    "uri": Group(("gpuvfio/virt/uri.py",), _t("test_libvirt_uri", "test_settings")),
    "guest": Group(("gpuvfio/guest/checks.py", "gpuvfio/guest/expect.py", "gpuvfio/guest/nccl_checks.py",
                    "gpuvfio/guest/verdicts.py"),
                   _t("test_verify", "test_verify_report", "test_plausible_guest", "test_edges", "test_fabric_flow",
                      "test_verifier_fakecuda", "test_verify_record", "test_bus_ids")),
    "stats": Group(("gpuvfio/testbed/stats.py",), _t("test_report_stats")),
    "names": Group(("gpuvfio/ops/kubevirt_names.py",), _t("test_export", "test_plugin_names_edges")),
}


@dataclass
class Outcome:
    group: str
    counts: dict[str, int] = field(default_factory=dict)
    survivors: dict[str, str] = field(default_factory=dict)  # mutant -> its diff
    seconds: float = 0.0
    commit: str = ""  # HEAD when the group's tree was copied: what the score is of
    # A re-run of survivors (--survivors): the commit of the last run of every mutant, whose
    # kills stand, and how long that run took; ``seconds`` is then the re-run's time.
    full_run: str = ""
    full_seconds: float = 0.0

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def killed(self) -> int:
        return self.counts.get("killed", 0) + self.counts.get("timeout", 0)

    @property
    def score(self) -> float:
        return self.killed / self.total if self.total else 1.0


def scratch_copy(group: Group) -> str:
    """The working tree as git sees it (tracked and untracked, not ignored), in a scratch
    directory, with the group's mutmut configuration."""
    where = tempfile.mkdtemp(prefix="gpuvfio-mutate-", dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None)
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, check=True,
                            capture_output=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        source = os.path.join(REPO, rel)
        if os.path.isfile(source) and not os.path.islink(source):
            os.makedirs(os.path.join(where, os.path.dirname(rel)), exist_ok=True)
            shutil.copy2(source, os.path.join(where, rel))
    with open(os.path.join(where, "pyproject.toml"), "a", encoding="utf-8") as handle:
        handle.write("\n[tool.mutmut]\nsource_paths = [\"gpuvfio\"]\n"
                     f"only_mutate = {json.dumps(list(group.modules))}\n"
                     f"pytest_add_cli_args_test_selection = {json.dumps(list(group.tests))}\n"
                     "pytest_add_cli_args = [\"-p\", \"no:cacheprovider\", \"-p\", \"no:xdist\"]\n"
                     # what tests read beside the package (the Ansible collection, the templates)
                     "also_copy = [\"playbooks\", \"templates\", \"README.md\", \"Makefile\"]\n")
    return where


def mutmut(where: str, *args: str, timeout: float | None = None) -> str:
    """mutmut ARGS in ``where``, its output. It runs in a session of its own, killed whole once
    it returns: a mutant may fork children that outlive it (one of sysfs_write's forked writer
    kept forking after its test ended), and with its output on pipes those would keep the pipes
    open and this wait going for ever. Its output goes to files, not pipes, for the same reason."""
    tool = os.path.join(os.path.dirname(sys.executable), "mutmut")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        child = subprocess.Popen([tool, *args], cwd=where, env=env, stdout=out, stderr=err, text=True,
                                 start_new_session=True)
        try:
            returncode = child.wait(timeout=timeout)
        finally:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(child.pid, signal.SIGKILL)
            child.wait()
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if returncode not in (0, 1):  # 1: mutants survived
        raise SystemExit(f"mutmut {' '.join(args[:1])} failed in {where}:\n{stdout[-2000:]}{stderr[-2000:]}")
    return stdout


def run_group(name: str, jobs: int, patterns: list[str] | None = None, timeout: float | None = None) -> Outcome:
    group = GROUPS[name]
    commit = head()  # before the copy: a commit made during an hour's run is not what was measured
    where = scratch_copy(group)
    started = time.monotonic()
    try:
        ran = mutmut(where, "run", "--max-children", str(jobs), *(patterns or []), timeout=timeout)
        if "failed to collect stats" in ran:  # the group's tests fail unmutated: no score
            raise SystemExit(f"group {name}: its tests do not pass unmutated:\n{ran[-3000:]}")
        outcome = Outcome(name, seconds=time.monotonic() - started, commit=commit)
        alive = []
        for line in mutmut(where, "results", "--all", "true").splitlines():
            mutant, _, status = line.strip().rpartition(": ")
            if not mutant or (patterns and not any(_matches(mutant, p) for p in patterns)):
                continue
            key = status.replace(" ", "_")
            if key == "not_checked":  # mutmut stopped before it: a run that measured nothing is no score
                raise SystemExit(f"group {name}: mutmut left {mutant} unchecked; its run said:\n{ran[-3000:]}")
            outcome.counts[key] = outcome.counts.get(key, 0) + 1
            if key in ("survived", "no_tests"):
                alive.append(mutant)
        # mutmut show takes a second or two each (it starts Python): as many at once as jobs
        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            shown = pool.map(lambda mutant: _diff(mutmut(where, "show", mutant)), alive)
            outcome.survivors = dict(zip(alive, shown))
        return outcome
    finally:
        shutil.rmtree(where, ignore_errors=True)


def head() -> str:
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()


def _matches(mutant: str, pattern: str) -> bool:
    return re.fullmatch(re.escape(pattern).replace(r"\*", ".*"), mutant) is not None


def _diff(shown: str) -> str:
    """The changed lines of ``mutmut show``: what the mutant is, in two lines."""
    return "\n".join(line for line in shown.splitlines() if line[:1] in "+-" and line[:3] not in ("+++", "---"))


STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')


def prose_only(diff: str) -> bool:
    """The mutant changes nothing but the words of a text for people: its removed and added
    lines are the same once every string literal holding a space (prose, not a token such as
    "=" or "/") is set aside."""
    removed = [line[1:] for line in diff.splitlines() if line.startswith("-")]
    added = [line[1:] for line in diff.splitlines() if line.startswith("+")]

    def shape(line: str) -> str:  # a text holds a space and more: " " alone is a token
        return STRING.sub(lambda m: '"S"' if " " in m.group(0) and m.group(0)[1:-1].strip() else m.group(0), line)

    return bool(removed) and len(removed) == len(added) and removed != added and \
        [shape(line) for line in removed] == [shape(line) for line in added]


CODEC_ARGUMENT = re.compile(r"""(?:\.encode\(|\.decode\(|encoding=)\s*("[^"]*"|'[^']*')""")


def codec_case_only(diff: str) -> bool:
    """The mutant only changes the case of a codec's name ("utf-8" -> "UTF-8"): Python looks
    codecs up by their normalized, lower-cased name (codecs.lookup), so both are one codec."""
    removed = [line[1:] for line in diff.splitlines() if line.startswith("-")]
    added = [line[1:] for line in diff.splitlines() if line.startswith("+")]
    if len(removed) != 1 or len(added) != 1 or removed == added:
        return False
    before, after = STRING.findall(removed[0]), STRING.findall(added[0])
    if STRING.sub('"S"', removed[0]) != STRING.sub('"S"', added[0]) or len(before) != len(after):
        return False
    changed = [(b, a) for b, a in zip(before, after) if b != a]
    return len(changed) == 1 and changed[0][0].lower() == changed[0][1].lower() and \
        _is_codec(changed[0][0][1:-1]) and any(m.group(1) == changed[0][0] for m in CODEC_ARGUMENT.finditer(removed[0]))


def _is_codec(name: str) -> bool:
    try:
        codecs.lookup(name)
    except LookupError:
        return False
    return True


def load_triage() -> dict[str, str]:
    """mutant -> why it may survive (an entry's ``reason`` where it is a table)."""
    return {k: str(v["reason"]) if isinstance(v, dict) else str(v) for k, v in _triage_entries().items()}


def triage_diffs() -> dict[str, str]:
    """mutant -> the mutation its entry was written for, where the entry says it (a table with
    ``reason`` and ``diff``). mutmut numbers a function's mutants in order, so an entry written
    for a mutant names another one once its function changes above it; the changed-lines run
    takes such an entry only while the mutation it describes is still the one it names."""
    return {k: str(v["diff"]) for k, v in _triage_entries().items() if isinstance(v, dict) and "diff" in v}


def _triage_entries() -> dict:
    if not os.path.exists(TRIAGE):
        return {}
    with open(TRIAGE, "rb") as handle:
        return tomllib.load(handle).get("survivors", {})


def same_mutation(described: str, shown: str) -> bool:
    """Two mutmut diffs of one mutation (each line's indentation aside)."""
    return [line[:1] + line[1:].strip() for line in described.strip().splitlines()] == \
        [line[:1] + line[1:].strip() for line in shown.strip().splitlines()]


def explain(mutant: str, diff: str, triage: dict[str, str]) -> str | None:
    """Why ``mutant`` may survive: its own entry in the triage file, or the class it belongs to."""
    if mutant in triage:
        return triage[mutant]
    if prose_only(diff):
        return triage.get("class:prose")
    if codec_case_only(diff):
        return triage.get("class:codec-case")
    return None


# -- the changed-lines run ----------------------------------------------------------------------

def measured_bases() -> dict[str, str]:
    """group -> the commit its score was measured on. One run rewrites the record's commit, so
    a group measured earlier is compared with its own commit, or a change made to its modules
    after it was measured would go unseen; a group never measured is compared with the record's."""
    with open(SCORES, encoding="utf-8") as handle:
        record = json.load(handle)
    groups = record.get("groups", {})
    return {name: groups.get(name, {}).get("commit") or record["commit"] for name in GROUPS}


def changed_patterns(bases: dict[str, str]) -> dict[str, list[str]]:
    """group -> mutmut name patterns of the functions (and methods) with lines changed since
    that group's base commit, in the core modules."""
    found: dict[str, list[str]] = {}
    for name, group in GROUPS.items():
        for module in group.modules:
            lines = changed_lines(bases[name], module)
            if lines:
                found.setdefault(name, []).extend(functions_at(module, lines))
    return {k: sorted(set(v)) for k, v in found.items() if v}


def changed_lines(base: str, module: str) -> set[int]:
    diff = subprocess.run(["git", "diff", "--unified=0", base, "--", module], cwd=REPO, check=True,
                          capture_output=True, text=True).stdout
    lines: set[int] = set()
    for start, count in re.findall(r"^@@ -\S+ \+(\d+)(?:,(\d+))? @@", diff, re.M):
        lines.update(range(int(start), int(start) + (int(count) if count else 1)))
    return lines


def functions_at(module: str, lines: set[int]) -> list[str]:
    """mutmut's names for the functions holding ``lines``: module.x_func__mutmut_* and
    module.xǁClassǁmethod__mutmut_* (mutmut 3 names them so)."""
    with open(os.path.join(REPO, module), encoding="utf-8") as handle:
        tree = ast.parse(handle.read())
    dotted = module[:-3].replace("/", ".")
    names = []
    for node in tree.body:
        targets = [(node, None)] if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else \
            [(child, node.name) for child in node.body if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))] \
            if isinstance(node, ast.ClassDef) else []
        for function, owner in targets:
            if lines & set(range(function.lineno, function.end_lineno + 1)):
                names.append(f"{dotted}.x_{function.name}__mutmut_*" if owner is None else
                             f"{dotted}.x\u01c1{owner}\u01c1{function.name}__mutmut_*")
    return names


# -- the survivors' re-run -----------------------------------------------------------------------

def rerun_survivors(name: str, jobs: int) -> Outcome:
    """The group's recorded survivors, and every mutant of its functions changed since it was
    measured, run against today's tests; the record's other kills stand (their functions are
    unchanged). A changed function's old mutants leave the count and its new ones join it."""
    with open(SCORES, encoding="utf-8") as handle:
        record = json.load(handle)["groups"].get(name)
    if record is None:
        raise SystemExit(f"group {name} was never measured: run it whole first")
    base, modules = record["commit"], GROUPS[name].modules
    changed = [p for module in modules for p in functions_at(module, changed_lines(base, module))]
    old = [m for module in modules for m in mutant_names(base, module)]
    now = {p for module in modules for p in functions_at(module, set(range(1, 1 << 20)))}
    gone = sorted({m.rsplit("__mutmut_", 1)[0] + "__mutmut_*" for m in old} - now)  # functions deleted since
    old_changed = [m for m in old if any(_matches(m, p) for p in changed + gone)]
    kept = sorted(m for m in record["survivors"] if not any(_matches(m, p) for p in changed + gone))
    old_alive_changed = len(record["survivors"]) - len(kept)
    if not changed and not kept:
        raise SystemExit(f"group {name}: no survivor and no changed function to run again")
    outcome = run_group(name, jobs, changed + kept)
    standing = record["killed"] - (len(old_changed) - old_alive_changed)  # kills in unchanged functions
    counts = dict(outcome.counts)
    # a timeout of the record stays one unless a changed function held it (then it is a kill)
    timeouts = record["counts"].get("timeout", 0) if not changed else 0
    counts["timeout"] = counts.get("timeout", 0) + timeouts
    counts["killed"] = counts.get("killed", 0) + standing - timeouts
    outcome.counts = {k: v for k, v in counts.items() if v}
    outcome.full_run = record.get("full_run", base)
    outcome.full_seconds = record["seconds"]
    return outcome


def mutant_names(commit: str, module: str) -> list[str]:
    """mutmut's names of the mutants it makes of ``module`` as it was at ``commit`` (mutmut's
    own generator, in a child with a configuration of its own: mutmut reads one at import); none
    for a module ``commit`` did not have (one added to a group since the group was measured)."""
    listed = subprocess.run(["git", "ls-tree", "--name-only", commit, "--", module], cwd=REPO, check=True,
                            capture_output=True, text=True).stdout
    if not listed.strip():
        return []
    source = subprocess.run(["git", "show", f"{commit}:{module}"], cwd=REPO, check=True, capture_output=True,
                            text=True).stdout
    dotted = module[:-3].replace("/", ".")
    with tempfile.TemporaryDirectory(prefix="gpuvfio-names-") as where:
        with open(os.path.join(where, "pyproject.toml"), "w", encoding="utf-8") as handle:
            handle.write('[tool.mutmut]\nsource_paths = ["."]\n')
        program = ("import sys; from mutmut.mutation.file_mutation import mutate_file_contents; "
                   "print('\\n'.join(mutate_file_contents(sys.argv[1], sys.stdin.read()).mutant_names))")
        names = subprocess.run([sys.executable, "-c", program, os.path.basename(module)], cwd=where, input=source,
                               check=True, capture_output=True, text=True).stdout.split()
    return [f"{dotted}.{n}" for n in names]


# -- the report -----------------------------------------------------------------------------------

def write_report(outcomes: list[Outcome], triage: dict[str, str]) -> None:
    """Fold ``outcomes`` into docs/mutation-scores.json (the record: each group's counts and
    survivors, and the commit it was measured on; groups not run now keep their last
    measurement, and its note, written by hand, on what happened since) and render
    docs/mutation.md from it. A group measured again loses its note: it was of the last one."""
    record = {"goal": GOAL, "groups": {}}
    if os.path.exists(SCORES):
        with open(SCORES, encoding="utf-8") as handle:
            record["groups"] = json.load(handle).get("groups", {})
    for o in outcomes:
        entry = {"commit": o.commit or head(), "mutants": o.total, "killed": o.killed, "score": round(o.score, 4),
                 "counts": o.counts, "seconds": round(o.full_seconds if o.full_run else o.seconds),
                 "survivors": o.survivors}
        if o.full_run:
            entry.update(full_run=o.full_run, rerun_seconds=round(o.seconds))
        record["groups"][o.group] = entry
    record["commit"] = (outcomes[-1].commit if outcomes else "") or head()  # the last group run
    with open(SCORES, "w", encoding="utf-8") as handle:
        json.dump(record, handle, indent=1, ensure_ascii=False)
        handle.write("\n")
    render_report(record, triage)


def render_report(record: dict, triage: dict[str, str]) -> None:
    groups = record["groups"]
    total = sum(g["mutants"] for g in groups.values())
    killed = sum(g["killed"] for g in groups.values())
    lines = ["# Mutation testing of the core (make mutate)", "",
             f"mutmut 3.8.1 over {len(groups)} of the {len(GROUPS)} groups of tests/mutation/mutate.py: "
             f"**{killed} of {total} mutants killed ({killed / max(total, 1):.1%})**; the goal is {GOAL:.0%}. A timeout "
             "counts as killed, a mutant no test reaches as surviving. Survivors are explained in "
             "tests/mutation/triage.toml (two classes: a change to the words of a message only, and a codec "
             "name in another case).", "",
             "| group | modules | measured on | mutants | killed | survived | no tests | explained | score | minutes |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, g in groups.items():
        explained = sum(1 for m, d in g["survivors"].items() if explain(m, d, triage))
        lines.append(f"| {name} | {', '.join(m.removeprefix('gpuvfio/') for m in GROUPS[name].modules)} | "
                     f"{g['commit'][:12]} | {g['mutants']} | {g['killed']} | {g['counts'].get('survived', 0)} | "
                     f"{g['counts'].get('no_tests', 0)} | {explained} | {g['score']:.1%} | {g['seconds'] / 60:.1f} |")
    missing = [name for name in GROUPS if name not in groups]
    if missing:
        lines += ["", f"Not measured yet: {', '.join(missing)}."]
    lines += [f"\n{name}: every mutant run at {g['full_run'][:12]}; its survivors, and every mutant of the "
              f"functions changed since, run again at {g['commit'][:12]} ({g['rerun_seconds'] / 60:.1f} minutes)."
              for name, g in groups.items() if g.get("full_run")]
    lines += [f"\n{name}: {g['note']}" for name, g in groups.items() if g.get("note")]
    unexplained = [(mutant, diff) for g in groups.values() for mutant, diff in sorted(g["survivors"].items())
                   if explain(mutant, diff, triage) is None]
    lines += ["", "## Surviving mutants not explained", "",
              "Each is a missing test until one kills it or the triage file says why it may live.", ""]
    if not unexplained:
        lines.append("None: every survivor of the groups measured is explained.")
    for mutant, diff in unexplained:
        lines += [f"- `{mutant}`", "", "  ```diff", *[f"  {d}" for d in diff.splitlines()], "  ```"]
    with open(REPORT, "w", encoding="utf-8") as handle:
        handle.write("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--group", action="append", choices=sorted(GROUPS), help="a group (all by default)")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--changed", action="store_true",
                        help="only the functions changed since their group was measured")
    parser.add_argument("--changed-since", metavar="REV", help="only the functions changed since REV")
    parser.add_argument("--limit", type=int, default=400, help="with --changed or --changed-since: at most this many functions")
    parser.add_argument("--survivors", action="store_true",
                        help="only the recorded survivors and the functions changed since (of --group, or all)")
    parser.add_argument("--report", action="store_true", help="render docs/mutation.md from the scores file only")
    args = parser.parse_args(argv)
    triage = load_triage()
    if args.report:
        with open(SCORES, encoding="utf-8") as handle:
            render_report(json.load(handle), triage)
        return 0
    if args.changed_since:
        return changed_run(dict.fromkeys(GROUPS, args.changed_since), args.jobs, args.limit, triage)
    if args.changed:
        return changed_run(measured_bases(), args.jobs, args.limit, triage)
    outcomes = []
    for name in args.group or list(GROUPS):
        outcome = rerun_survivors(name, args.jobs) if args.survivors else run_group(name, args.jobs)
        print(f"{name}: {outcome.killed}/{outcome.total} killed ({outcome.score:.1%}) in {outcome.seconds:.0f}s",
              flush=True)
        outcomes.append(outcome)
        write_report(outcomes, triage)  # after each group: an hour's run stopped half-way keeps what it measured
    return 0


def changed_run(bases: dict[str, str], jobs: int, limit: int, triage: dict[str, str]) -> int:
    patterns = changed_patterns(bases)
    if not patterns:
        print("mutation: no core function changed since its group was measured "
              f"({', '.join(sorted({base[:12] for base in bases.values()}))})")
        return 0
    untriaged, diffs = [], triage_diffs()
    for name, group_patterns in patterns.items():
        outcome = run_group(name, jobs, group_patterns[:limit])
        print(f"mutation {name}: {outcome.killed}/{outcome.total} killed in the changed functions "
              f"({', '.join(p.rsplit('.', 1)[-1].removesuffix('__mutmut_*') for p in group_patterns)})", flush=True)
        untriaged += [(m, d) for m, d in outcome.survivors.items() if explain(m, d, triage) is None
                      or (m in diffs and not same_mutation(diffs[m], d))]
    for mutant, diff in untriaged:
        stale = " (its triage entry describes another mutation: renumbered?)" if mutant in diffs else ""
        print(f"SURVIVED {mutant}{stale}\n{diff}")
    if untriaged:
        print(f"mutation: {len(untriaged)} mutant(s) in changed functions survive untriaged: add a test that kills "
              "each, or explain it in tests/mutation/triage.toml")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
