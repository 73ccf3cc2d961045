"""Render a DomainSpec with jinja2 and check it with libvirt's own RelaxNG schema.

Templates live in the top-level ``templates/`` (GPUVFIO_TEMPLATES overrides); they are
rendered with autoescape and StrictUndefined, parsed with lxml, and validated against
``/usr/share/libvirt/schemas/domain.rng`` (loaded from the file: the schema uses
includes, which break when loaded from a string).
"""

from __future__ import annotations

import functools
import os

from gpuvfio.domainspec import DomainSpec
from gpuvfio.errors import GpuvfioError

TEMPLATES_ENV = "GPUVFIO_TEMPLATES"
SCHEMA_ENV = "GPUVFIO_LIBVIRT_SCHEMAS"
DEFAULT_SCHEMAS = "/usr/share/libvirt/schemas"


class InvalidDomainXml(GpuvfioError):
    pass


def templates_dir() -> str:
    if os.environ.get(TEMPLATES_ENV):
        return os.environ[TEMPLATES_ENV]
    package = os.path.dirname(os.path.abspath(__file__))
    for candidate in (os.path.join(os.path.dirname(package), "templates"), os.path.join(package, "templates")):
        if os.path.isdir(candidate):
            return candidate
    raise GpuvfioError("templates/ not found next to the gpuvfio package (set GPUVFIO_TEMPLATES)")


@functools.lru_cache(maxsize=None)
def _environment(directory: str):
    import jinja2

    return jinja2.Environment(loader=jinja2.FileSystemLoader(directory), autoescape=True,
                              undefined=jinja2.StrictUndefined, keep_trailing_newline=True)


@functools.lru_cache(maxsize=None)
def _schema(path: str):
    from lxml import etree

    if not os.path.exists(path):
        raise GpuvfioError(f"libvirt's RelaxNG schema {path} is missing (install libvirt's schemas, e.g. "
                           f"the libvirt-daemon or libvirt-clients package, or set {SCHEMA_ENV})")
    return etree.RelaxNG(file=path)


def render(spec: DomainSpec, template: str = "domain.xml.j2") -> str:
    return _environment(templates_dir()).get_template(template).render(spec=spec,
                                                                       host_devices=spec.host_devices)


def validate(xml: str, kind: str = "domain") -> None:
    from lxml import etree

    try:
        document = etree.fromstring(xml.encode())
    except etree.XMLSyntaxError as exc:
        raise InvalidDomainXml(f"generated XML does not parse: {exc}") from None
    schema = _schema(os.path.join(os.environ.get(SCHEMA_ENV, DEFAULT_SCHEMAS), f"{kind}.rng"))
    if not schema.validate(document):
        error = schema.error_log.last_error
        raise InvalidDomainXml(f"generated XML fails libvirt's {kind}.rng at line {error.line}: {error.message}")


def domain_xml(spec: DomainSpec) -> str:
    xml = render(spec)
    validate(xml)
    return xml
