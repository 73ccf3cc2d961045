"""The testbed spec as JSON Schema (draft 2020-12), generated: docs/testbed-spec.schema.json.

The keys of [guest], [guest.ssh], [run] and [[variant]] and their shapes come from the option
table (gpuvfio.options), the rest (which keys go together, the variant kinds, [host]) from the
spec's own rules (gpuvfio.testbed.spec). ``python -m gpuvfio.cli.generate`` writes the file;
tests/unit/test_option_table.py fails while the committed one differs, and
tests/unit/test_spec_schema.py holds the schema and the validator to the same answers.
"""

from __future__ import annotations

import json

from gpuvfio.ops.vgpu import POLICIES
from gpuvfio.options import DOMAIN, RUN, SSH, USER_PATTERN, VERIFY, Option
from gpuvfio.testbed.spec import KINDS, NAME

__all__ = ["schema", "schema_text"]

# The spellings the services parse, as TOML gives them (parse_size_kib, parse_hugepages, parse_numa).
_PAGE = r"[Aa][Uu][Tt][Oo]|[Nn][Oo][Nn][Ee]|4\s*[Kk]([Ii]?[Bb])?|2\s*[Mm]([Ii]?[Bb])?|1\s*[Gg]([Ii]?[Bb])?" \
        r"|2048\s*[Kk]([Ii]?[Bb])?|1024\s*[Mm]([Ii]?[Bb])?|1048576\s*[Kk]([Ii]?[Bb])?"
_NODE = r"[Aa][Uu][Tt][Oo]|[Nn][Oo][Nn][Ee]|[Rr][Ee][Mm][Oo][Tt][Ee]|0*(10[01][0-9]|102[0-3]|[0-9]{1,3})"
SHAPES = {
    "memory": {"$ref": "#/$defs/size"},
    "hugepages": {"type": "string", "pattern": rf"^\s*({_PAGE})\s*$"},
    "numa": {"oneOf": [{"type": "string", "pattern": rf"^\s*({_NODE})\s*$"},
                       {"type": "integer", "minimum": 0, "maximum": 1023}]},
    "gpus": {"type": "array", "items": {"$ref": "#/$defs/device"}},
    "gpu_ids": {"type": "array", "items": {"$ref": "#/$defs/device_ids"}},
}
DEFS = {
    "path": {"type": "string", "pattern": "^/[^\\u0000]*$"},
    "port": {"type": "integer", "minimum": 1, "maximum": 65535},
    "size": {"description": "64G, 64GiB, 65536M; a bare number is MiB", "oneOf": [
        {"type": "string", "pattern": r"^\s*[0-9]+(\.[0-9]+)?\s*[KkMmGgTt]?([Ii]?[Bb])?\s*$"},
        {"type": "integer", "minimum": 1}]},
    "device": {"description": "[[DOMAIN:]BUS:]SLOT[.FUNC] as lspci -s (a slot: all its functions) or "
                              "pci_DDDD_BB_SS_F", "type": "string",
               "pattern": r"^\s*((([0-9a-fA-F]{4,8}:)?[0-9a-fA-F]{1,2}:)?[01]?[0-9a-fA-F](\.[0-7])?|pci_[0-9a-fA-F]"
                          r"{4,8}_[0-9a-fA-F]{2}_[01][0-9a-fA-F]_[0-7])\s*$"},
    "device_ids": {"type": "string",
                   "pattern": r"^\s*(?!:\s*$)[0-9a-fA-FxX]{0,4}:[0-9a-fA-FxX]{0,4}(:[0-9a-fA-FxX]{1,4})?\s*$"},
}
_HOST = r"^(\[[0-9A-Fa-f:.]{2,45}\]|[0-9A-Fa-f:.]{2,45}|(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?" \
        r"(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?)$"


def _spelled(name: str) -> str:
    for option_set in (DOMAIN, SSH, VERIFY, RUN):
        if name in option_set.by_name:
            return option_set[name].spec_key
    return name


def _property(option: Option) -> dict:
    """``option``'s value as the spec takes it."""
    if option.name in SHAPES:
        shape = dict(SHAPES[option.name])
    elif option.kind == "bool":
        shape = {"type": "boolean"}
    elif option.kind == "path":
        shape = {"$ref": "#/$defs/path"}
    elif option.kind in ("int", "float"):
        shape = {"type": "integer" if option.kind == "int" else "number"}
        if option.above is not None:
            shape["exclusiveMinimum"] = option.above
        else:
            shape["minimum"] = option.minimum
        shape["maximum"] = option.maximum
    elif option.choices:
        shape = {"enum": list(option.choices)}
    elif option.pattern is not None:
        shape = {"type": "string", "pattern": f"^(?:{option.pattern})$"}
    else:
        shape = {"type": "string", "minLength": 1}
    shape["description"] = option.text(_spelled)
    if option.default not in (None, []):
        shape["default"] = option.default
    return shape


def _properties(*options: Option) -> dict:
    return {o.spec_key: _property(o) for o in options}


def schema() -> dict:
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "https://gpuvfio.invalid/schemas/testbed-spec/1",
        "title": "gpuvfio testbed spec",
        "description": "The TOML file gpuvfio testbed plan|run takes, as JSON Schema (TOML parses to the same "
                       "data), generated from gpuvfio/options.py by python -m gpuvfio.cli.generate. gpuvfio's own "
                       "validator (gpuvfio/testbed/spec.py) checks everything here, with line numbers, and also "
                       "what a schema cannot say: variant names unique, sizes a whole number of KiB. "
                       "tests/unit/test_spec_schema.py holds the two to the same answers.",
        "type": "object",
        "additionalProperties": False,
        "required": ["guest", "variant"],
        "properties": {
            "guest": _guest(),
            "run": {
                "type": "object",
                "additionalProperties": False,
                "properties": _properties(*RUN.in_section("run"), *VERIFY.in_section("run")),
            },
            "variant": _variants(),
            "host": _remote_host(),
        },
        "if": {"required": ["variant"],
               "properties": {"variant": {"contains": {"properties": {"kind": {"const": "vgpu"}}, "required": ["kind"]}}}},
        "then": {"required": ["run"], "properties": {"run": {"anyOf": [
            {"required": ["gpus"], "properties": {"gpus": {"minItems": 1}}},
            {"required": ["gpu_ids"], "properties": {"gpu_ids": {"minItems": 1}}}]}}},
        "$defs": DEFS,
    }


def _guest() -> dict:
    guest = _properties(*DOMAIN.in_section("guest"))
    guest["ssh"] = {
        "type": "object",
        "additionalProperties": False,
        "anyOf": [{"required": ["port"]}, {"required": ["host"]}],
        "properties": _properties(*SSH.in_section("guest.ssh")),
    }
    return {
        "description": "The guest template every variant shares.",
        "type": "object",
        "additionalProperties": False,
        "required": ["ssh"],
        "anyOf": [{"required": ["kernel"]}, {"required": ["disk"]}],
        "dependentRequired": {"loader": ["nvram_template"], "nvram_template": ["loader"],
                              "initrd": ["kernel"], "cmdline": ["kernel"]},
        "not": {"required": ["disk", "kernel"]},
        "allOf": [
            {"if": {"required": ["loader"]}, "then": {"properties": {"firmware": {"const": "efi"}}}},
            {"if": {"required": ["rom_bar"], "properties": {"rom_bar": {"const": "off"}}},
             "then": {"not": {"required": ["rom_file"]}}}],
        "properties": guest,
    }


def _variants() -> dict:
    variant = {"name": {"type": "string", "pattern": f"^{NAME.pattern}$"}, "kind": {"enum": list(KINDS)},
               **_properties(*DOMAIN.in_section("variant")),
               "profile": {"type": "string", "pattern": "\\S"},
               "scheduler": {"enum": list(POLICIES)},
               **_properties(*RUN.in_section("variant"))}
    return {
        "type": "array",
        "minItems": 1,
        "items": {
            "type": "object",
            "additionalProperties": False,
            "required": ["name", "kind"],
            "properties": variant,
            "allOf": [
                {"if": {"properties": {"kind": {"const": "vgpu"}}},
                 "then": {"required": ["profile"]},
                 "else": {"not": {"anyOf": [{"required": ["profile"]}, {"required": ["scheduler"]}]}}}],
        },
    }


def _remote_host() -> dict:
    return {
        "description": "A remote hypervisor, driven over SSH, where gpuvfio itself runs.",
        "type": "object",
        "additionalProperties": False,
        "required": ["address"],
        "anyOf": [{"required": ["known_hosts"]},
                  {"required": ["trust_on_first_use"], "properties": {"trust_on_first_use": {"const": True}}}],
        "properties": {
            "address": {"type": "string", "pattern": _HOST},
            "port": {"$ref": "#/$defs/port"},
            "user": {"type": "string", "pattern": f"^(?:{USER_PATTERN})$"},
            "key": {"$ref": "#/$defs/path"},
            "known_hosts": {"$ref": "#/$defs/path"},
            "root": {"$ref": "#/$defs/path"},
            "workdir": {"$ref": "#/$defs/path"},
            "ssh_config": {"$ref": "#/$defs/path", "description": "an ssh_config file instead of ~/.ssh/config"},
            "trust_on_first_use": {"type": "boolean"},
            "gpuvfio": {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}},
        },
    }


def schema_text() -> str:
    """The file's text: the schema, two-space indented, one trailing newline."""
    return json.dumps(schema(), indent=2, ensure_ascii=False) + "\n"
