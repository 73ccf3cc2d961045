"""Write what gpuvfio.options generates outside the package: the testbed spec's JSON Schema, the
Ansible modules' argument specs and the options part of their DOCUMENTATION, the domain
options the role's attach tasks hand each guest's settings to, and the role's argument specs
(meta/argument_specs.yml: its entry points, its variables as defaults/main.yml declares them,
and the keys of a gpuvfio_guests entry).

    python -m gpuvfio.cli.generate [--check] [REPOSITORY]

``--check`` writes nothing and exits 1 naming the files that differ (tests/unit/
test_option_table.py does the same). The docs the command's help makes are
``python -m gpuvfio.cli.manpage docs``'s.
"""

from __future__ import annotations

import fnmatch
import os
import re
import sys

from gpuvfio.user_files import user_dir
from gpuvfio.options import (ANSIBLE_MODULES, DOMAIN, RUN, SETS, SSH, VERIFY, Option, ansible_options, argument_spec,
                             documentation_options)
from gpuvfio.testbed.schema import schema_text

__all__ = ["SCHEMA", "COLLECTION", "ARGUMENT_SPECS", "BEGIN", "END", "module_path", "generated", "argument_specs_text",
           "with_documentation", "ROLE_ATTACH", "ROLE_BEGIN", "ROLE_END", "ROLE_BLOCKS", "with_role_options",
           "ROLE", "ROLE_DEFAULTS", "ROLE_ARGUMENT_SPECS", "ROLE_ENTRY_POINTS", "ROLE_GUEST_KEYS", "ROLE_GUEST_OWN",
           "role_guest_options", "role_argument_specs", "role_argument_specs_text"]

SCHEMA = os.path.join("docs", "testbed-spec.schema.json")
# The Ansible collection gpuvfio.gpuvfio: ansible-galaxy and ansible-test take a collection only at
# ansible_collections/NAMESPACE/NAME/, and collections/ beside the playbooks is where
# ansible-playbook looks first (ansible-core 2.19, "Installing collections adjacent to playbooks").
COLLECTION = os.path.join("playbooks", "collections", "ansible_collections", "gpuvfio", "gpuvfio")
ARGUMENT_SPECS = os.path.join(COLLECTION, "plugins", "module_utils", "options.py")
# The lines in a module's DOCUMENTATION between which its declared options are written.
BEGIN = "  # Generated from gpuvfio/options.py by python -m gpuvfio.cli.generate: edit the table there.\n"
END = "  # End of the generated options.\n"
# The role's attach tasks: each guest's options for the domain and device modules (guest.<name>,
# else an alias the table keeps for playbooks, else omitted), in every block between the lines
# ROLE_BEGIN and ROLE_END name for that module.
ROLE_ATTACH = os.path.join(COLLECTION, "roles", "gpuvfio", "tasks", "attach.yml")
ROLE_BEGIN = "    # Generated from gpuvfio/options.py by python -m gpuvfio.cli.generate: the {} options.\n"
ROLE_END = "    # End of the generated {} options.\n"
# What each block holds: the module's options of one set, less those the tasks set themselves
# (the domain's name; the libvirt URI, the play's gpuvfio_libvirt_uri; stop_services, which has
# the play's default). The start task's SSH and verify options come from the play's variables.
ROLE_BLOCKS = {"domain": (DOMAIN, "gpuvfio.gpuvfio.domain", ("name",)),
               "device": (RUN, "gpuvfio.gpuvfio.device", ("connect", "stop_services"))}


def argument_specs_text() -> str:
    lines = ["# Generated from gpuvfio/options.py by python -m gpuvfio.cli.generate: edit the table there.",
             "# tests/unit/test_option_table.py fails while this file differs from what it writes.",
             "# Apache-2.0, like gpuvfio.",
             '"""The argument specs of the options gpuvfio declares once (gpuvfio.options), by module,',
             'and the option names of each set, for the modules to hand them to gpuvfio\'s services."""',
             "", "ARGUMENT_SPECS = {"]
    for module in ANSIBLE_MODULES:
        lines.append(f"    {module!r}: {{")
        lines += [f"        {o.name!r}: {argument_spec(o)!r}," for o in ansible_options(module)]
        lines.append("    },")
    lines += ["}", "", "SETS = {"]
    for option_set in SETS:
        names = [o.name for o in option_set if o.ansible]
        lines.append(f"    {option_set.name!r}: (")
        line = "       "
        for name in names:
            if len(line) + len(name) + 4 > 110:
                lines.append(line.rstrip())
                line = "       "
            line += f" {name!r},"
        lines += [line, "    ),"]
    lines.append("}")
    return "\n".join(lines) + "\n"


def with_documentation(text: str, module: str) -> str:
    """A module file's text with its generated DOCUMENTATION options replaced by the table's."""
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        raise ValueError(f"{module}: the generated options' markers are missing or out of order")
    head, rest = text.split(BEGIN)
    _old, tail = rest.split(END)
    return head + BEGIN + documentation_options(module) + END + tail


def role_options(block: str) -> str:
    """``block``'s module options as the attach tasks pass them: each from the guest's entry
    (its aliases in turn), left out when the guest does not set it."""
    option_set, module, set_by_tasks = ROLE_BLOCKS[block]
    lines = []
    for option in option_set.for_module(module):
        if option.name in set_by_tasks:
            continue
        value = "omit"
        for alias in reversed(option.aliases):
            value = f"guest.{alias} | default({value})"
        lines.append(f'    {option.name}: "{{{{ guest.{option.name} | default({value}) }}}}"\n')
    return "".join(lines)


def with_role_options(text: str) -> str:
    """The role's attach tasks with each generated block replaced by the table's options."""
    for block in ROLE_BLOCKS:
        begin, end = ROLE_BEGIN.format(block), ROLE_END.format(block)
        if not text.count(begin) or text.count(begin) != text.count(end):
            raise ValueError(f"{ROLE_ATTACH}: the generated {block} options' markers are missing or unpaired")
        head, *parts = text.split(begin)
        out = [head]
        for part in parts:
            _old, tail = part.split(end)
            out.append(begin + role_options(block) + end + tail)
        text = "".join(out)
    return text


# --- the role's argument specs ----------------------------------------------------------------------
# ansible-core (2.11 and later) validates a role's variables against meta/argument_specs.yml before
# the role's tasks run: it prepends an ansible.builtin.validate_argument_spec task to the entry point
# the role is run with (tasks_from names it; "main" otherwise), which checks the variables the entry
# point declares under options (type and elements, choices, required, and for a dict's options the
# keys it may have: an undeclared key is refused): "Role argument validation" in Ansible's "Using
# roles" guide, https://docs.ansible.com/ansible/latest/playbook_guide/playbooks_reuse_roles.html
# (tested with ansible-core 2.19). Bounds (vcpus from 1) are the modules' to check. A spec's default is
# documentation only: the validation checks a copy of the variables and hands nothing back
# (ansible-core 2.19, plugins/action/validate_argument_spec.py), so the role's defaults/main.yml
# stays where the defaults come from; the specs below repeat its values, read from it.
ROLE = os.path.join(COLLECTION, "roles", "gpuvfio")
ROLE_DEFAULTS = os.path.join(ROLE, "defaults", "main.yml")
ROLE_ARGUMENT_SPECS = os.path.join(ROLE, "meta", "argument_specs.yml")
ROLE_PLAYBOOKS = os.path.join(COLLECTION, "playbooks")
# The entry points: the tasks files the collection's playbooks run the role with (tasks_from; the
# others are included by these). role_argument_specs() refuses a playbook's entry point missing here,
# and one named with its .yml: ansible-core looks the spec up by tasks_from as written, so
# tasks_from: attach.yml would find none and run the role unvalidated.
ROLE_ENTRY_POINTS = {
    "host_prep": "Prepare a KVM host for GPU passthrough (kernel command line, vfio modules, hugepages)",
    "facts": "Collect a host's GPUs, IOMMU groups and readiness checks",
    "report_inventory": "Write the fleet's inventory report on the controller",
    "attach": "Give each guest its GPUs: bound to vfio-pci, the guest defined and started",
    "verify": "Verify each guest's GPUs from inside the guest",
    "report_verify": "Write the guests' verify reports on the controller and fail for the failing guests",
    "testbed": "Run a comparison testbed on a host and fetch its results",
}
# The keys of a gpuvfio_guests entry the tasks read besides those of the ROLE_BLOCKS (attach.yml's
# generated blocks), each the table's option of that name in the set named, and the role variable
# the tasks take where the guest does not set it (None: the module's default, which is the table's).
ROLE_GUEST_KEYS = (
    ("name", DOMAIN, None),
    ("gpus", RUN, None),  # the modules' devices (and the testbed's [run] gpus)
    ("gpu_ids", RUN, None),  # the modules' device_ids
    ("stop_services", RUN, "gpuvfio_stop_services"),
    ("ssh_host", SSH, None),
    ("ssh_port", SSH, None),
    ("ssh_user", SSH, "gpuvfio_guest_ssh_user"),
    ("bandwidth", VERIFY, None),  # verify.yml
    ("link_efficiency", VERIFY, None),
    ("min_gbps", VERIFY, None),
)
# The keys the tasks read that the table does not declare: all_matched and verify are the modules'
# own options (module_utils/common.py's DEVICE_ARGS; the domain module's verify), persist and start
# say which of the role's tasks run for the guest. One gpuvfio_guests serves attach.yml and
# verify.yml alike, so every entry point that reads it takes every key either reads.
ROLE_GUEST_OWN = {
    "all_matched": {"type": "bool", "default": False,
                    "description": "Take every device a slot or C(gpu_ids) matched when they are more than one "
                                   "physical device (the command's C(--yes))."},
    "persist": {"type": "bool", "description": "Keep the guest's GPUs on vfio-pci across reboots "
                                               "(default: C(gpuvfio_persist))."},
    "start": {"type": "bool", "description": "Start the guest after defining it (default: "
                                             "C(gpuvfio_start_guests))."},
    "verify": {"type": "bool",
               "description": "Run gpuvfio's in-guest checks: attach.yml after SSH answers (default: "
                              "C(gpuvfio_verify_guests)), verify.yml at all (default: true)."},
}
# Role variables that stand for one of the table's options: their type (the file's value may read
# as another, 300 as an int) and no_log come from the table.
ROLE_VARIABLE_OPTIONS = {
    "gpuvfio_libvirt_uri": RUN["connect"],
    "gpuvfio_stop_services": RUN["stop_services"],
    "gpuvfio_boot_timeout": SSH["boot_timeout"],
    "gpuvfio_guest_ssh_user": SSH["ssh_user"],
    "gpuvfio_guest_ssh_private_key": SSH["ssh_private_key"],
    "gpuvfio_guest_known_hosts": SSH["known_hosts"],
}
# Role variables whose value in defaults/main.yml does not say their type: an empty list, a
# template, one of several kinds.
ROLE_VARIABLE_TYPES = {
    "gpuvfio_extra_kernel_args": {"type": "list", "elements": "str"},
    "gpuvfio_blacklist_nouveau": {"type": "raw"},  # auto, or true or false (host_prep.yml reads it as a string)
    "gpuvfio_live": {"type": "bool"},
}
_TYPES = ((bool, "bool"), (int, "int"), (float, "float"), (str, "str"), (list, "list"), (dict, "dict"))
_INCLUDED = re.compile(r"^\s*(?:ansible\.builtin\.)?(?:include|import)_tasks:\s*[\"']?(.+?)[\"']?\s*$", re.M)
_TEMPLATE = re.compile(r"[A-Za-z0-9_.-]+\.j2\b")
_VARIABLE = re.compile(r"\bgpuvfio_[a-z0-9_]+\b")
_KEY = re.compile(r"^(gpuvfio_[a-z0-9_]+):")


def _table_option(option: Option, role_default: str | None = None) -> dict:
    spec = {"description": option.text(lambda n: f"C({n})")}
    spec.update((k, v) for k, v in argument_spec(option).items() if k != "aliases")
    if role_default is not None:
        spec.pop("default", None)
        spec["description"] += f" Default: C({role_default})."
    return spec


def role_guest_options() -> dict[str, dict]:
    """The options of a gpuvfio_guests entry: every key the role's tasks read from it. An alias the
    table keeps is a key of its own here: the tasks read it as one (guest.<alias> when guest.<name>
    is not set), and ansible-lint's role argument spec schema takes no aliases."""
    out: dict[str, dict] = {}

    def add(name: str, spec: dict) -> None:
        if name in out:  # force: the device's and the domain's, one key of the guest for both
            if {k: v for k, v in out[name].items() if k != "description"} != \
                    {k: v for k, v in spec.items() if k != "description"}:
                raise ValueError(f"gpuvfio_guests: {name} is declared twice with different specs")
            return
        out[name] = spec

    keys = {name: (option_set, role_default) for name, option_set, role_default in ROLE_GUEST_KEYS}
    for name in ("name", "gpus", "gpu_ids"):
        option_set, role_default = keys.pop(name)
        add(name, _table_option(option_set[name], role_default))
    for option_set, module, set_by_tasks in ROLE_BLOCKS.values():
        for option in option_set.for_module(module):
            if option.name in set_by_tasks:
                continue
            add(option.name, _table_option(option))
            for alias in option.aliases:
                spec = {k: v for k, v in _table_option(option).items() if k not in ("default", "required")}
                spec["description"] = f"The older name of C({option.name}), taken when that is not set."
                add(alias, spec)
    for name, (option_set, role_default) in keys.items():
        add(name, _table_option(option_set[name], role_default))
    for name, spec in ROLE_GUEST_OWN.items():
        add(name, dict(spec))
    return out


def _role_variables(text: str) -> dict[str, tuple[object, str]]:
    """defaults/main.yml's variables in order: (value, description). A variable's description is
    the comment above it, or above the variables right before it (no blank line between): lines
    of an example (indented) and section rules (# --) left out."""
    import yaml  # PyYAML: ansible-core's, so present wherever the role is; not a dependency of gpuvfio

    values = yaml.safe_load(text) or {}
    out: dict[str, tuple[object, str]] = {}
    comment: list[str] = []
    previous = ""
    for line in text.splitlines():
        if not line.strip():
            comment = []
        elif line.startswith("#"):
            words = line[1:]
            if not previous.startswith("#"):
                comment = []
            if not words.startswith("  ") and not words.strip().startswith("--"):
                comment.append(words.strip())
        elif _KEY.match(line):
            name = _KEY.match(line).group(1)
            if not comment:
                raise ValueError(f"{ROLE_DEFAULTS}: {name} has no comment to describe it")
            out[name] = (values[name], " ".join(comment))
        previous = line
    if sorted(out) != sorted(values):
        raise ValueError(f"{ROLE_DEFAULTS}: the variables read {sorted(set(values) ^ set(out))} differently")
    return out


def _variable_spec(name: str, value, description: str) -> dict:
    spec: dict = {"description": description}
    if name == "gpuvfio_guests":
        spec.update(type="list", elements="dict", options=role_guest_options())
    elif name in ROLE_VARIABLE_OPTIONS:
        option = ROLE_VARIABLE_OPTIONS[name]
        spec.update({k: v for k, v in argument_spec(option).items() if k in ("type", "elements", "no_log")})
    elif name in ROLE_VARIABLE_TYPES:
        spec.update(ROLE_VARIABLE_TYPES[name])
    else:
        spec["type"] = next(kind for python_type, kind in _TYPES if isinstance(value, python_type))
        if spec["type"] == "list":  # elements when every item has the one kind
            kinds = {next((k for t, k in _TYPES if isinstance(v, t)), None) for v in value}
            if len(kinds) == 1 and None not in kinds:
                spec["elements"] = kinds.pop()
    spec["default"] = value
    return spec


def _entry_point_variables(tree, entry: str, variables: dict) -> list[str]:
    """The role variables an entry point reads: named in its tasks file, the tasks files it
    includes (a templated name: every file it can be), the templates and handlers they use, and
    in the defaults of the variables so found."""
    tasks = os.path.join(ROLE, "tasks")
    files = sorted(tree.listdir(tasks))
    read, queue, found = set(), [os.path.join(tasks, entry + ".yml")], set()
    while queue:
        path = queue.pop()
        if path in read:
            continue
        read.add(path)
        text = tree.text(path)
        if text is None:
            raise ValueError(f"{path}: missing")
        for target in _INCLUDED.findall(text):
            pattern = re.sub(r"\{\{.*?\}\}", "*", target)
            queue += [os.path.join(tasks, f) for f in fnmatch.filter(files, pattern)]
        queue += [os.path.join(ROLE, "templates", t) for t in _TEMPLATE.findall(text)]
        if "notify:" in text:
            queue.append(os.path.join(ROLE, "handlers", "main.yml"))
        names = [n for n in _VARIABLE.findall(text) if n in variables]
        while names:  # and what their defaults name
            name = names.pop()
            if name not in found:
                found.add(name)
                default = repr(variables[name][0])
                names += [n for n in _VARIABLE.findall(default) if n in variables]
                queue += [os.path.join(ROLE, "templates", t) for t in _TEMPLATE.findall(default)]
    return [name for name in variables if name in found]


def role_argument_specs(tree) -> dict:
    """The role's argument_specs: per entry point, the role variables it reads."""
    run_with = set()
    for name in tree.listdir(ROLE_PLAYBOOKS):
        text = tree.text(os.path.join(ROLE_PLAYBOOKS, name)) or ""
        run_with |= set(re.findall(r"tasks_from:\s*[\"']?([\w.-]+)", text))
    named = sorted(n for n in run_with if n.endswith((".yml", ".yaml")))
    if named:  # ansible-core takes tasks_from as written for the entry point's name (Role._prepend_validation_task)
        raise ValueError(f"{ROLE_PLAYBOOKS}: tasks_from: {named[0]} would run the role unvalidated: name the entry "
                         f"point without the extension")
    if run_with != set(ROLE_ENTRY_POINTS):
        raise ValueError(f"{ROLE_PLAYBOOKS} run the role with {sorted(run_with)}, ROLE_ENTRY_POINTS names "
                         f"{sorted(ROLE_ENTRY_POINTS)}")
    variables = _role_variables(tree.text(ROLE_DEFAULTS) or "")
    specs = {}
    for entry, short in ROLE_ENTRY_POINTS.items():
        specs[entry] = {"short_description": short,
                        "options": {name: _variable_spec(name, *variables[name])
                                    for name in _entry_point_variables(tree, entry, variables)}}
    return {"argument_specs": specs}


def role_argument_specs_text(tree) -> str:
    import yaml

    head = ("---\n"
            "# Generated from gpuvfio/options.py and defaults/main.yml by python -m gpuvfio.cli.generate: edit\n"
            "# those. tests/unit/test_option_table.py fails while this file differs from what it writes.\n"
            "# ansible-core 2.11 and later check the role's variables against this before an entry point's\n"
            "# tasks run (\"Role argument validation\", Ansible's \"Using roles\" guide); a default here is\n"
            "# documentation only, the role takes its defaults from defaults/main.yml.\n")

    class Dumper(yaml.SafeDumper):
        def ignore_aliases(self, data) -> bool:  # an entry point's spec whole, not an &anchor of another's
            return True

        def increase_indent(self, flow: bool = False, indentless: bool = False):  # a list indented under its key
            return super().increase_indent(flow, False)

    return head + yaml.dump(role_argument_specs(tree), Dumper=Dumper, sort_keys=False, width=110, allow_unicode=True,
                            default_flow_style=False, indent=2)


def module_path(module: str) -> str:
    """The file of a module named by its FQCN (gpuvfio.gpuvfio.domain), in the repository."""
    return os.path.join(COLLECTION, "plugins", "modules", module.rsplit(".", 1)[-1] + ".py")


def generated(repository: str) -> dict[str, str]:
    """Each generated file (a path in ``repository``) and the text it should have."""
    tree = user_dir(repository)
    out = {SCHEMA: schema_text(), ARGUMENT_SPECS: argument_specs_text()}
    for module in ANSIBLE_MODULES:
        path = module_path(module)
        out[path] = with_documentation(tree.text(path) or "", module)
    out[ROLE_ATTACH] = with_role_options(tree.text(ROLE_ATTACH) or "")
    out[ROLE_ARGUMENT_SPECS] = role_argument_specs_text(tree)
    return out


def main(argv: list[str]) -> int:
    check = "--check" in argv
    rest = [a for a in argv if a != "--check"]
    repository = rest[0] if rest else "."
    tree = user_dir(repository)
    stale = []
    for path, text in generated(repository).items():
        if tree.text(path) == text:
            continue
        stale.append(path)
        if not check:
            tree.write(path, text)
    for path in stale:
        print(f"{'differs' if check else 'wrote'}: {path}")
    return 1 if check and stale else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
