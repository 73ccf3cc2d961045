"""Write what gpuvfio.options generates outside the package: the testbed spec's JSON Schema, the
Ansible modules' argument specs and the options part of their DOCUMENTATION, and the domain
options the role's attach tasks hand each guest's settings to.

    python -m gpuvfio.cli.generate [--check] [REPOSITORY]

``--check`` writes nothing and exits 1 naming the files that differ (tests/unit/
test_option_table.py does the same). The docs the command's help makes are
``python -m gpuvfio.cli.manpage docs``'s.
"""

from __future__ import annotations

import os
import sys

from gpuvfio.user_files import user_dir
from gpuvfio.options import ANSIBLE_MODULES, DOMAIN, RUN, SETS, ansible_options, argument_spec, documentation_options
from gpuvfio.testbed.schema import schema_text

__all__ = ["SCHEMA", "COLLECTION", "ARGUMENT_SPECS", "BEGIN", "END", "module_path", "generated", "argument_specs_text",
           "with_documentation", "ROLE_ATTACH", "ROLE_BEGIN", "ROLE_END", "ROLE_BLOCKS", "with_role_options"]

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
