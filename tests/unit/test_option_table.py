"""The option table (gpuvfio/options.py) held against every interface that carries its options:
the command's parameters (xml, attach, verify), the Ansible modules' argument_spec and
DOCUMENTATION, the testbed spec's validator and JSON Schema, and the services' own defaults.
Each check is a function listing the differences; the tests assert there are none, and that
each check finds an option added, renamed or re-defaulted on one side (issue 23 item 4)."""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import json
import os
import re
import sys

import pytest
import typer

from gpuvfio.cli import generate
from gpuvfio.cli.app import app
from gpuvfio.cli.tables import flag_of
from gpuvfio.domain.request import FIELDS as request_fields, READERS, DomainRequest, domain_request
from gpuvfio.errors import InputError
from gpuvfio.guest.expect import HEALTHY, HEALTHY_SHARE, Gates
from gpuvfio.ops.targets import ssh_options
from gpuvfio.ops.verify_options import verify_options
from gpuvfio.options import (ANSIBLE_MODULES, CLI_COMMANDS, DOMAIN, RUN, SETS, SSH, VERIFY, Option, OptionSet,
                             argument_spec, checked)
from gpuvfio.testbed import schema as spec_schema
from gpuvfio.testbed.plan import request_for
from gpuvfio.testbed.spec import guest_request_args, load_spec
from tests.make_samples import sample_path

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PLAYBOOKS = os.path.join(REPO, "playbooks")

# What every command takes (gpuvfio.cli.lazy.GpuvfioCommand: -v after the command as before it).
EVERY_COMMAND = {"verbose"}
# What each command and module takes besides the table's options (their own, not shared).
COMMAND_OWN = {
    "xml": {"addresses", "device_ids", "define", "update", "nccl_topo", "dry_run", "as_json", "root"},
    "attach": {"addresses", "device_ids", "yes", "no_verify", "keep_on_failure", "dry_run", "as_json",
               "root", "show_xml"},
    "verify": {"domain", "expect_device", "expect_ids", "as_json", "root"},
    "detach": {"name", "dry_run", "as_json", "root"},
    "bind": {"addresses", "device_ids", "yes", "dry_run", "as_json", "root"},
    "unbind": {"addresses", "device_ids", "yes", "dry_run", "as_json", "root"},
    "restore": {"addresses", "device_ids", "yes", "dry_run", "as_json", "root"},
    "reset": {"addresses", "device_ids", "yes", "bus", "forget", "dry_run", "as_json", "root"},
    "qualify": {"addresses", "device_ids", "yes", "dry_run", "as_json", "root"},
    "persist": {"addresses", "device_ids", "yes", "dry_run", "list_", "output_format", "as_json", "root"},
    "unpersist": {"addresses", "device_ids", "yes", "dry_run", "as_json", "root"},
    "vgpu list": {"output_format", "as_json", "root"},
    "testbed plan": {"spec_path", "yes", "as_json", "root"},
    "testbed run": {"spec_path", "out", "yes", "dry_run", "as_json", "root"},
    "vgpu create": {"address", "vgpu_type", "persist", "dry_run", "as_json", "root"},
}
MODULE_OWN = {
    "gpuvfio.gpuvfio.domain": {"root", "state_dir", "devices", "device_ids", "all_matched", "state", "update",
                       "verify", "keep_on_failure", "restore_devices"},
    "gpuvfio.gpuvfio.verify": {"root", "state_dir", "domain", "expect_devices"},
    "gpuvfio.gpuvfio.device": {"root", "state_dir", "devices", "device_ids", "all_matched", "state"},
}


def carried(table, where: str) -> list[Option]:
    return [o for option_set in table for o in option_set if where in o.cli + o.ansible]


# --- the command ----------------------------------------------------------------------------------

def command_params(command: str) -> dict:
    """The parameters of a command named by its words ("vgpu list": a subcommand)."""
    found = typer.main.get_command(app)
    for word in command.split():
        found = found.commands[word]
    return {p.name: p for p in found.params}


def cli_differences(table, command: str, params: dict) -> list[str]:
    out = []
    declared = carried(table, command)
    for option in declared:
        param = params.get(option.parameter)
        if param is None:
            out.append(f"{command}: no {option.flag}")
            continue
        expected_default = None if option.required else (False if option.negated else option.default)
        help_text = option.off_help if option.negated else option.text(flag_of)
        if param.opts != list(option.flags):
            out.append(f"{command}: {option.name} is {param.opts}, not {list(option.flags)}")
        if param.default != expected_default:
            out.append(f"{command}: {option.flag} defaults to {param.default!r}, not {expected_default!r}")
        if bool(param.required) != option.required:
            out.append(f"{command}: {option.flag} required={param.required}")
        if getattr(param, "help", None) != help_text:
            out.append(f"{command}: {option.flag} help differs")
        if option.metavar is not None and param.metavar != option.metavar:
            out.append(f"{command}: {option.flag} metavar {param.metavar}")
    names = {o.parameter for o in declared}
    out += [f"{command}: {name} is not in the table" for name in params
            if name not in names and name not in COMMAND_OWN[command] | EVERY_COMMAND]
    return out


@pytest.mark.parametrize("command", CLI_COMMANDS)
def test_the_commands_take_the_tables_options(command):
    assert cli_differences(SETS, command, command_params(command)) == []


# --- Ansible --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def modules():
    pytest.importorskip("ansible")
    collections = os.path.join(PLAYBOOKS, "collections")  # ansible_collections.gpuvfio.gpuvfio
    if collections not in sys.path:
        sys.path.insert(0, collections)
    loaded = {}
    for name in ANSIBLE_MODULES:  # FQCNs: the file is the collection's plugins/modules/<last part>.py
        spec = importlib.util.spec_from_file_location(f"_options_{name.replace('.', '_')}",
                                                      os.path.join(REPO, generate.module_path(name)))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        loaded[name] = module
    return loaded


def argument_spec_of(module, monkeypatch) -> dict:
    """The argument_spec ``module.main`` hands AnsibleModule."""
    from ansible.module_utils import basic

    class Captured(Exception):
        pass

    def capture(self, argument_spec, **kwargs):
        raise Captured(argument_spec)

    monkeypatch.setattr(basic.AnsibleModule, "__init__", capture)
    with pytest.raises(Captured) as caught:
        module.main()
    return caught.value.args[0]


def ansible_differences(table, name: str, spec: dict) -> list[str]:
    out = []
    declared = carried(table, name)
    for option in declared:
        if option.name not in spec:
            out.append(f"{name}: no {option.name}")
        elif spec[option.name] != argument_spec(option):
            out.append(f"{name}: {option.name} is {spec[option.name]}, not {argument_spec(option)}")
    names = {o.name for o in declared}
    out += [f"{name}: {key} is not in the table" for key in spec if key not in names and key not in MODULE_OWN[name]]
    return out


def documentation_differences(table, name: str, documentation: str) -> list[str]:
    import yaml

    options = yaml.safe_load(documentation)["options"]
    out = []
    declared = carried(table, name)
    for option in declared:
        documented = options.get(option.name)
        if documented is None:
            out.append(f"{name}: {option.name} not documented")
            continue
        wanted = dict(argument_spec(option), description=option.text(lambda n: f"C({n})"))
        wanted.pop("no_log", None)
        if documented != wanted:
            out.append(f"{name}: {option.name} documented as {documented}, not {wanted}")
    names = {o.name for o in declared}
    out += [f"{name}: {key} documented, not in the table" for key in options
            if key not in names and key not in MODULE_OWN[name]]
    return out


@pytest.mark.parametrize("name", ANSIBLE_MODULES)
def test_the_modules_argument_spec_is_the_tables(modules, monkeypatch, name):
    assert ansible_differences(SETS, name, argument_spec_of(modules[name], monkeypatch)) == []


@pytest.mark.parametrize("name", ANSIBLE_MODULES)
def test_the_modules_documentation_is_the_tables(modules, name):
    pytest.importorskip("yaml")
    assert documentation_differences(SETS, name, modules[name].DOCUMENTATION) == []


def test_the_generated_files_are_committed():
    """docs/testbed-spec.schema.json, the collection's plugins/module_utils/options.py, the modules'
    DOCUMENTATION options, the role's attach blocks and meta/argument_specs.yml are what
    python -m gpuvfio.cli.generate writes."""
    for path, text in generate.generated(REPO).items():
        with open(os.path.join(REPO, path), encoding="utf-8") as handle:
            assert handle.read() == text, f"{path} is stale: run python -m gpuvfio.cli.generate"


def test_the_old_port_name_still_works_in_playbooks():
    assert argument_spec(DOMAIN["user_net_ssh_port"])["aliases"] == ["ssh_forward_port"]


# --- the testbed spec -----------------------------------------------------------------------------

BASE = """
[guest]
kernel = "/var/lib/gpuvfio/vmlinux"
[guest.ssh]
port = 2222
known_hosts = "/root/.ssh/known_hosts"
[run]
gpus = ["0000:1b:00.0"]
[[variant]]
name = "p"
kind = "passthrough"
"""


def sample(option: Option):
    """A value of the option's shape (the spec's validator may still refuse what it means)."""
    if option.choices:
        return option.choices[-1]
    return {"bool": True, "path": "/var/lib/x", "list": [], "str": "x"}.get(
        option.kind, option.maximum if option.maximum is not None else 1)


def spec_answer(tmp_path, section: str, key: str, value) -> str | None:
    """None when the spec is accepted, else the validator's message."""
    text = BASE.replace(f"[{section}]\n", f"[{section}]\n{key} = {json.dumps(value)}\n", 1)
    path = tmp_path / "spec.toml"
    path.write_text(text)
    try:
        load_spec(str(path))
    except InputError as exc:
        return str(exc)
    return None


def spec_differences(table, tmp_path) -> list[str]:
    out = []
    for option_set in table:
        for option in option_set:
            for section in option.spec:
                if section == "variant":
                    continue  # the variant's keys: by the schema below, and test_spec_schema's mutations
                answer = spec_answer(tmp_path, section, option.spec_key, sample(option))
                if answer is not None and "unknown key" in answer:
                    out.append(f"[{section}] {option.spec_key}: {answer}")
    return out


def test_the_spec_takes_the_tables_keys(tmp_path):
    assert spec_differences(SETS, tmp_path) == []
    assert "unknown key 'colour'" in spec_answer(tmp_path, "guest", "colour", "red")


def schema_differences(table, schema: dict) -> list[str]:
    sections = {"guest": schema["properties"]["guest"]["properties"],
                "guest.ssh": schema["properties"]["guest"]["properties"]["ssh"]["properties"],
                "run": schema["properties"]["run"]["properties"],
                "variant": schema["properties"]["variant"]["items"]["properties"]}
    own = {"guest": {"ssh"}, "guest.ssh": set(), "run": set(), "variant": {"name", "kind", "profile", "scheduler"}}
    out = []
    for section, properties in sections.items():
        declared = {o.spec_key: o for option_set in table for o in option_set if section in o.spec}
        if set(properties) - own[section] != set(declared):
            out.append(f"[{section}]: {sorted(set(properties) - own[section])} != {sorted(declared)}")
        for key, option in declared.items():
            default = properties.get(key, {}).get("default")
            if option.default not in (None, []) and default != option.default:
                out.append(f"[{section}] {key} defaults to {default!r}, not {option.default!r}")
    return out


def test_the_schema_has_the_tables_keys_and_defaults():
    with open(os.path.join(REPO, "docs", "testbed-spec.schema.json"), encoding="utf-8") as handle:
        assert schema_differences(SETS, json.load(handle)) == []


def test_the_spec_gains_the_domain_options_and_they_reach_the_request(tmp_path):
    path = tmp_path / "spec.toml"
    path.write_text(BASE.replace("[guest]\n", '[guest]\ntopology = "flat"\np2p = "off"\nhide_kvm = true\n'
                                              'console_log = "/var/log/g.log"\n', 1))
    spec = load_spec(str(path))
    request = request_for(None, spec, spec.variants[0], [])
    assert (request.topology, request.p2p, request.hide_kvm, request.console_log) == (
        "flat", "off", True, "/var/log/g.log")
    assert request.user_net_ssh_port == 2222


# --- the services' defaults -----------------------------------------------------------------------

def service_differences(table) -> list[str]:
    """Each option's default where a service takes it as a parameter, and the domain request's
    fields and defaults (made from the table: a request built with no options holds each
    table default, read as the request holds it)."""
    out = []
    services = {"verify": (verify_options, lambda o: o.name), "ssh": (ssh_options, lambda o: o.spec_key)}
    for option_set in table:
        if option_set.name not in services:
            continue
        function, named = services[option_set.name]
        parameters = inspect.signature(function).parameters
        for option in option_set:
            parameter = parameters.get(named(option))
            if parameter is None or option.required or option.name == "boot_timeout":
                continue  # boot_timeout reaches ssh_options as its timeout: held by the spec's default
            if parameter.default != option.default:
                out.append(f"{function.__name__}({named(option)}={parameter.default!r}): the table says "
                           f"{option.default!r}")
    domain = next(option_set for option_set in table if option_set.name == "domain")
    fields = {f.name for f in dataclasses.fields(DomainRequest)}
    defaults = DomainRequest(name="x")
    for option in domain:
        field_name = request_fields.get(option.name, option.name)
        if field_name not in fields:
            out.append(f"DomainRequest has no {option.name}")
        elif not option.required and getattr(defaults, field_name) != read_request_value(option, option.default):
            out.append(f"DomainRequest's {option.name} defaults to {getattr(defaults, field_name)!r}, not "
                       f"{option.default!r}")
    return out


def read_request_value(option: Option, value):
    try:
        return None if value is None else READERS.get(option.name, lambda v: v)(value)
    except InputError:
        return value


def parameters_of(function) -> set[str]:
    return set(inspect.signature(function).parameters)


def test_the_services_default_as_the_table_says():
    assert service_differences(SETS) == []
    help_text = VERIFY["link_efficiency"].help
    assert f"{HEALTHY_SHARE:.0%} of what healthy cards" in help_text
    assert [f"Gen{gen} " in help_text and f" {Gates().floor(gen, 16):.1f}" in help_text for gen in HEALTHY] == [
        True] * len(HEALTHY)
    defaults = guest_request_args({}, {})
    assert {k: v for k, v in defaults.items() if k != "user_net_ssh_port"} == {
        o.name: o.default for o in DOMAIN.in_section("guest")}


# --- each check finds a change on one side --------------------------------------------------------

def changed(option_set: OptionSet, which: str, **fields) -> tuple[OptionSet, ...]:
    """The table with one option changed (``name=`` renames it)."""
    options = [dataclasses.replace(o, **fields) if o.name == which else o for o in option_set]
    edited = OptionSet(option_set.name, *options)
    return tuple(edited if s is option_set else s for s in SETS)


def added(option_set: OptionSet, option: Option) -> tuple[OptionSet, ...]:
    edited = OptionSet(option_set.name, *option_set.options, option)
    return tuple(edited if s is option_set else s for s in SETS)


EVERYWHERE = dict(cli=("xml", "attach"), ansible=("gpuvfio.gpuvfio.domain",), spec=("guest",))
MUTATIONS = {
    "added": lambda: added(DOMAIN, Option("balloon", "bool", "A memory balloon.", False, **EVERYWHERE)),
    "renamed": lambda: changed(DOMAIN, "console_log", name="serial_log"),
    "re-defaulted": lambda: changed(DOMAIN, "vcpus", default=8),
    "re-defaulted ssh": lambda: changed(SSH, "boot_timeout", default=120.0),
    "re-defaulted run": lambda: changed(RUN, "repetitions", default=5),
}


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_each_check_finds_a_change_on_one_side(mutation, modules, monkeypatch, tmp_path):
    pytest.importorskip("yaml")
    table = MUTATIONS[mutation]()
    with open(os.path.join(REPO, "docs", "testbed-spec.schema.json"), encoding="utf-8") as handle:
        schema = json.load(handle)
    found = {
        "cli": [d for c in CLI_COMMANDS for d in cli_differences(table, c, command_params(c))],
        "ansible": [d for n in ANSIBLE_MODULES
                    for d in ansible_differences(table, n, argument_spec_of(modules[n], monkeypatch))],
        "documentation": [d for n in ANSIBLE_MODULES
                          for d in documentation_differences(table, n, modules[n].DOCUMENTATION)],
        "schema": schema_differences(table, schema),
        "services": service_differences(table),
    }
    if mutation in ("added", "renamed"):
        found["spec"] = spec_differences(table, tmp_path)
    # Where the changed option lives, every check that covers it sees the change.
    carried_by = {"re-defaulted": ("cli", "ansible", "documentation", "schema", "services"),
                  "re-defaulted ssh": ("cli", "ansible", "documentation", "schema"),
                  "re-defaulted run": ("schema",),
                  "added": ("cli", "ansible", "documentation", "schema", "services", "spec"),
                  "renamed": ("cli", "ansible", "documentation", "schema", "services", "spec")}[mutation]
    assert [side for side in carried_by if not found[side]] == []


def test_the_schema_is_generated_from_the_table():
    """Changing the table changes the generated schema (what the committed-file test compares)."""
    assert "console_log" in spec_schema.schema()["properties"]["guest"]["properties"]


def test_the_roles_attach_tasks_pass_every_domain_and_device_option():
    """Issue 36 item 3: the role's define and start tasks hand each guest's settings to the domain
    module for every option the module takes (they listed 18 by hand, missing topology, p2p, mdev,
    vgpu, uuid, console_log and qemu_version), an alias the table keeps taken too; the bind task
    hands the device module its options (it passed force only, never take_host_devices or the
    timeouts), and so does the persist task (it passed none: a GPU a bind took with force could
    not be persisted)."""
    import yaml

    with open(os.path.join(REPO, generate.ROLE_ATTACH), encoding="utf-8") as handle:
        tasks = yaml.safe_load(handle)
    for block, (option_set, module, set_by_tasks) in generate.ROLE_BLOCKS.items():
        bodies = [t[module] for t in tasks if module in t and t[module].get("state") in ("vfio", "persisted",
                                                                                        "defined", "running")]
        assert len(bodies) == 2
        for body in bodies:
            for option in option_set.for_module(module):
                if option.name in set_by_tasks:  # the persist task asks no libvirt, stops no service
                    assert option.name == "name" or option.name in body or body["state"] == "persisted", option.name
                    continue
                assert f"guest.{option.name} |" in body.get(option.name, ""), option.name
                assert all(f"guest.{alias} |" in body[option.name] for alias in option.aliases), option.name


# --- the role's argument specs (meta/argument_specs.yml) -------------------------------------------

def role_file(*parts: str) -> str:
    return os.path.join(REPO, generate.ROLE, *parts)


def role_specs() -> dict:
    import yaml

    with open(role_file("meta", "argument_specs.yml"), encoding="utf-8") as handle:
        return yaml.safe_load(handle)["argument_specs"]


def role_defaults() -> dict:
    import yaml

    with open(role_file("defaults", "main.yml"), encoding="utf-8") as handle:
        return yaml.safe_load(handle)


def guest_keys_read() -> dict[str, set[str]]:
    """Each tasks file's keys of a gpuvfio_guests entry (the loop's guest): guest.X and guest['X']."""
    out = {}
    tasks = role_file("tasks")
    for name in sorted(os.listdir(tasks)):
        with open(os.path.join(tasks, name), encoding="utf-8") as handle:
            text = handle.read()
        keys = set(re.findall(r"\bguest\.([a-z_][a-z0-9_]*)", text))
        keys |= set(re.findall(r"\bguest\[[\"']([a-z_][a-z0-9_]*)[\"']\]", text))
        if keys:
            out[name] = keys
    return out


def test_the_role_spec_declares_every_key_the_tasks_read_from_a_guest_and_no_other():
    """ansible-core refuses a gpuvfio_guests entry with a key the spec does not declare: a key the
    tasks read but the spec misses would refuse good guests, one the spec declares but no task
    reads would let a misspelt setting pass and do nothing."""
    read = guest_keys_read()
    assert set(read) == {"attach.yml", "verify.yml"}, read  # the files that loop over the guests
    every = set().union(*read.values())
    specs = role_specs()
    for entry in ("attach", "verify"):
        declared = specs[entry]["options"]["gpuvfio_guests"]["options"]
        assert sorted(every - set(declared)) == [], f"{entry}: read, not declared"
        assert sorted(set(declared) - every) == [], f"{entry}: declared, never read"
    # The table's options as attach.yml's generated blocks pass them, and the table's spec of each.
    guests = specs["attach"]["options"]["gpuvfio_guests"]
    assert guests["type"] == "list" and guests["elements"] == "dict"
    for option_set, module, set_by_tasks in generate.ROLE_BLOCKS.values():
        for option in option_set.for_module(module):
            if option.name in set_by_tasks:
                continue
            spec = {k: v for k, v in argument_spec(option).items() if k != "aliases"}
            assert {k: v for k, v in guests["options"][option.name].items() if k != "description"} == spec
            for alias in option.aliases:
                assert guests["options"][alias]["type"] == spec["type"]
    assert guests["options"]["name"]["required"] is True
    assert guests["options"]["rom_bar"]["choices"] == list(DOMAIN["rom_bar"].choices)


def test_the_role_spec_declares_every_role_variable_with_its_default():
    """Each variable of defaults/main.yml is declared by the entry points that read it, with the
    file's value as its (documented) default; the entry points are the ones the collection's
    playbooks run the role with."""
    import yaml

    defaults = role_defaults()
    specs = role_specs()
    declared: dict[str, dict] = {}
    for entry, spec in specs.items():
        assert spec["short_description"]
        for name, option in spec["options"].items():
            assert name in defaults, f"{entry}: {name} is not in defaults/main.yml"
            assert option["default"] == defaults[name], name
            assert option["type"] and option["description"], name
            declared.setdefault(name, option)
    assert sorted(declared) == sorted(defaults)
    run_with = set()
    playbooks = os.path.join(REPO, generate.ROLE_PLAYBOOKS)
    for name in os.listdir(playbooks):
        with open(os.path.join(playbooks, name), encoding="utf-8") as handle:
            for play in yaml.safe_load(handle):
                for task in play.get("tasks", []):
                    role = task.get("ansible.builtin.import_role") or task.get("ansible.builtin.include_role")
                    if role:
                        run_with.add(role.get("tasks_from", "main"))
    assert run_with == set(specs)  # as written: ansible-core looks the entry point up by tasks_from
    # An entry point declares at least the role variables its own tasks file names.
    for entry, spec in specs.items():
        with open(role_file("tasks", entry + ".yml"), encoding="utf-8") as handle:
            named = set(re.findall(r"\bgpuvfio_[a-z0-9_]+\b", handle.read())) & set(defaults)
        assert sorted(named - set(spec["options"])) == [], entry


def test_the_role_spec_takes_the_defaults_and_the_sample_guests_and_refuses_bad_guests():
    """What ansible-core's validate_argument_spec does with the spec (its ArgumentSpecValidator):
    defaults/main.yml's values and the example inventory's guests pass, a guest with a value
    outside its choices, of the wrong type or with an unknown key does not."""
    pytest.importorskip("ansible")
    import yaml
    from ansible.module_utils.common.arg_spec import ArgumentSpecValidator

    # A template (gpuvfio_live's) is Ansible's to render, in the variable and in the spec's default alike.
    defaults = {k: v for k, v in role_defaults().items() if not (isinstance(v, str) and "{{" in v)}
    for entry, spec in role_specs().items():
        options = {k: v for k, v in spec["options"].items() if k in defaults}
        values = {k: v for k, v in defaults.items() if k in options}
        assert ArgumentSpecValidator(options).validate(values).error_messages == [], entry
    guests_spec = {"gpuvfio_guests": role_specs()["attach"]["options"]["gpuvfio_guests"]}
    host_vars = os.path.join(PLAYBOOKS, "inventory", "host_vars")
    samples = []
    for name in sorted(os.listdir(host_vars)):
        with open(os.path.join(host_vars, name), encoding="utf-8") as handle:
            samples += yaml.safe_load(handle).get("gpuvfio_guests", [])
    assert len(samples) >= 3
    assert ArgumentSpecValidator(guests_spec).validate({"gpuvfio_guests": samples}).error_messages == []
    good = {"name": "g", "gpus": ["0000:1b:00.0"], "ssh_forward_port": 2222, "rom_bar": "off", "persist": True}
    assert ArgumentSpecValidator(guests_spec).validate({"gpuvfio_guests": [good]}).error_messages == []
    for bad, word in (({"rom_bar": "maybe"}, "rom_bar"), ({"romm_bar": "on"}, "romm_bar"),
                      ({"vcpus": "many"}, "vcpus"), ({"persist": "perhaps"}, "persist")):
        errors = ArgumentSpecValidator(guests_spec).validate({"gpuvfio_guests": [dict(good, **bad)]}).error_messages
        assert len(errors) == 1 and word in errors[0], (bad, errors)
    errors = ArgumentSpecValidator(guests_spec).validate({"gpuvfio_guests": [{"gpus": ["1b:00"]}]}).error_messages
    assert errors and "name" in errors[0]


# --- no option declared outside the table ---------------------------------------------------------

# How a command is driven, not what its service takes: the devices it acts on, how its answer is
# printed, where the host is. Every other option two commands share is the table's.
INTERFACE_FLAGS = {"--device-id", "--yes", "--dry-run", "--json", "--format", "--root", "--verbose", "--help",
                   "--version", "--install-completion", "--show-completion"}


def every_command(group=None, words: tuple[str, ...] = ()):
    group = group or typer.main.get_command(app)
    for name, command in group.commands.items():
        if hasattr(command, "commands"):
            yield from every_command(command, words + (name,))
        else:
            yield " ".join(words + (name,)), command


def declared_apart(table) -> dict[str, list[str]]:
    """Each flag declared outside the table that more than one command takes, or that spells a
    table option, with the commands that declare it."""
    table_flags = {flag for option_set in table for option in option_set for flag in option.flags}
    by_flag: dict[str, list[str]] = {}
    for name, command in every_command():
        params = {p.name: p for p in command.params}
        owned = {o.parameter for o in carried(table, name)}
        for param in params.values():
            if param.param_type_name != "option" or param.name in owned:
                continue
            for flag in (o for o in param.opts if o.startswith("--") and o not in INTERFACE_FLAGS):
                by_flag.setdefault(flag, []).append(name)
    return {flag: names for flag, names in by_flag.items() if len(names) > 1 or flag in table_flags}


def test_options_shared_by_commands_are_declared_in_the_table():
    """Issue 36 item 3: connect, the timeouts, force, stop-services and the rest were declared in
    each command (--connect five times); now an option two commands take, or one the table
    declares, comes from gpuvfio.options."""
    assert declared_apart(SETS) == {}


def test_the_declared_apart_check_sees_a_hand_written_option():
    """With bind's options taken out of the table, bind's --force (hand-written, as before) and
    its --connect, shared with other commands, show."""
    bind_free = tuple(OptionSet(s.name, *(dataclasses.replace(o, cli=tuple(c for c in o.cli if c != "bind"))
                                          for o in s)) for s in SETS)
    found = declared_apart(bind_free)
    assert "bind" in found["--connect"] and "bind" in found["--force"]


# --- messages name the options as each interface spells them ----------------------------------------

def test_a_bad_domain_option_is_named_as_the_command_and_the_spec_spell_it(tmp_path):
    """One rule (--rom-bar off with --rom-file), three spellings: the command's flags, the spec's
    keys (the module's names: tests/unit/test_fleet.py)."""
    with pytest.raises(InputError) as caught:
        domain_request("x", rom_bar="off", rom_file="/var/lib/gpuvfio/clean.rom")
    assert str(caught.value) == "--rom-bar off hides the ROM that --rom-file gives: one of them"
    path = tmp_path / "spec.toml"
    path.write_text(BASE.replace("[guest]\n", '[guest]\nrom_bar = "off"\nrom_file = "/var/lib/g.rom"\n', 1))
    with pytest.raises(InputError) as caught:
        load_spec(str(path))
    assert "[guest]: rom_bar off hides the ROM that rom_file gives" in str(caught.value)
    assert "--" not in str(caught.value)


@pytest.mark.parametrize("line, words", [
    ("vcpus = 5000", "vcpus must be from 1 to 4096, not 5000"),
    ('rom_bar = "maybe"', "rom_bar must be on or off, not 'maybe'"),
    ('disk = "relative.qcow2"', "disk must be an absolute path, not 'relative.qcow2'")])
def test_a_spec_value_is_checked_by_the_table_in_the_commands_words(tmp_path, line, words):
    """A spec's value is checked by gpuvfio.options.checked, as the command's is: the same words,
    the spec's key for the flag (no second checker with words of its own)."""
    path = tmp_path / "spec.toml"
    path.write_text(BASE.replace("[guest]\n", f"[guest]\n{line}\n", 1))
    with pytest.raises(InputError) as caught:
        load_spec(str(path))
    assert str(caught.value).endswith(words), str(caught.value)


def test_a_testbed_plan_names_a_missing_file_by_its_spec_key(cli, tmp_path):
    """A variant's domain check (a ROM image this host lacks) is told in the spec's words: the
    spec's author wrote rom_file, never --rom-file."""
    path = tmp_path / "spec.toml"
    spec = BASE.replace('known_hosts = "/root/.ssh/known_hosts"\n', "trust_on_first_use = true\n")
    path.write_text(spec.replace("[guest]\n", '[guest]\nrom_file = "/usr/share/vbios/none.rom"\n', 1))
    planned = cli("--root", sample_path("dgx-h100"), "testbed", "plan", str(path))
    assert planned.code == 2, planned.err
    assert "rom_file '/usr/share/vbios/none.rom': no such file on this host" in planned.err
    assert "--rom-file" not in planned.err


def test_a_value_out_of_the_tables_bounds_is_refused_by_the_table():
    """The request's bounds are the table's: a narrower table refuses what the wider one took."""
    with pytest.raises(InputError, match="--vcpus must be from 1 to 4096, not 4097"):
        domain_request("x", vcpus=4097)
    assert domain_request("x", vcpus=4096).vcpus == 4096
    narrow = dataclasses.replace(DOMAIN["vcpus"], maximum=8)
    with pytest.raises(InputError, match="--vcpus must be from 1 to 8, not 9"):
        checked(narrow, 9)


def test_a_value_is_checked_at_every_edge_before_anything_runs(cli, tmp_path):
    """A dry run exits as the run would: unbind, restore and reset dry runs took a negative
    --write-timeout or --lock-timeout the run refuses (their dry runs never built the Context
    that checked them); now the command checks every table value at its edge."""
    from tests.conftest import gpu_workstation

    root = gpu_workstation(tmp_path / "host").root
    for args in (("unbind", "01:00.0", "--connect", "none", "--timeout", "-1", "--dry-run"),
                 ("restore", "--dry-run", "--lock-timeout", "-1"),
                 ("reset", "01:00.0", "--dry-run", "--write-timeout", "1e999")):  # inf, past the parser
        refused = cli("--root", root, *args)
        assert refused.code == 2 and "-timeout must be" in refused.err, (args, refused.err)


def test_the_services_check_their_waits_by_the_table_and_name_the_wait_that_applies():
    """The SSH wait is verify's --ssh-timeout or attach's --boot-timeout: the service checks the
    one that applies by its declared bounds and names it (no second check with its own words)."""
    with pytest.raises(InputError, match=r"^--boot-timeout must be above 0 and at most 86400, not -1$"):
        ssh_options(host="g", timeout=-1, wait="boot_timeout")
    with pytest.raises(InputError, match=r"^--ssh-timeout must be a number, not nan$"):
        ssh_options(host="g", timeout=float("nan"))
    assert ssh_options(host="g", timeout=86400, wait="boot_timeout").timeout == 86400.0
    with pytest.raises(InputError, match=r"^--probe-timeout must be a number, not inf$"):
        verify_options(probe_timeout=float("inf"))
    with pytest.raises(InputError, match=r"^--verify-timeout must be "):
        verify_options(verify_timeout=0)


@pytest.mark.parametrize("given", [{"host": "h" * 100_000}, {"host": "g\nfake: line"},
                                   {"key": ""}, {"known_hosts": 7 ** 5000}])
def test_a_refused_ssh_value_is_echoed_cut(given):
    """An SSH host or file from a task or a spec is hostile input: refused in one short line."""
    with pytest.raises(InputError) as refused:
        ssh_options(**given)
    assert len(str(refused.value)) < 120 and "\n" not in str(refused.value), str(refused.value)


def test_braces_in_a_value_are_not_taken_for_an_option():
    """The message keeps {option} marks until each interface spells them; a value holding such
    a mark stayed a mark and was spelled too ('{vcpus}' became '--vcpus')."""
    with pytest.raises(InputError) as caught:
        domain_request("x", hugepages="{vcpus}")
    assert str(caught.value) == "--hugepages must be auto, none, 4K, 2M or 1G, not '{vcpus}'"
    assert caught.value.spelled(str) == "hugepages must be auto, none, 4K, 2M or 1G, not '{vcpus}'"


@pytest.mark.parametrize("options, words", [
    ({"kernel": "/k", "cmdline": "a\x01b"}, "--cmdline must be one line without control characters"),
    ({"kernel": "/k", "cmdline": "a\rb"}, "--cmdline must be one line without control characters"),
    ({"disk": "/a\x01b"}, r"--disk must be a file path \(no control character\)"),
    ({"network": "n\x7f"}, "--network must be a libvirt network name"),
    ({"disk": "relative.qcow2"}, "--disk must be an absolute path")])
def test_control_characters_are_refused_where_the_value_comes_in(options, words):
    """A control character in a path, a network name or the kernel command line passed the
    checks and failed later as 'generated XML does not parse', naming no option."""
    with pytest.raises(InputError, match=words):
        domain_request("x", **options)


def test_none_is_an_option_not_given():
    assert domain_request("x", vcpus=None, memory=None, firmware=None).vcpus == DOMAIN["vcpus"].default


def test_the_spec_reader_never_echoes_a_huge_key_or_value(tmp_path):
    """An unknown key or a wrong-typed value was echoed whole: a 100 KB key made a 100 KB
    message. Now each is cut as numbers.shown cuts it."""
    huge = "k" * 100_000
    for text in (BASE.replace("[guest]\n", f"[guest]\n{huge} = 1\n", 1),
                 BASE.replace("[run]\n", f'[run]\nforce = "{huge}"\n', 1)):
        path = tmp_path / "spec.toml"
        path.write_text(text)
        with pytest.raises(InputError) as caught:
            load_spec(str(path))
        assert len(str(caught.value)) < 1000, len(str(caught.value))
