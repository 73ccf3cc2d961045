"""Render a DomainSpec with jinja2 and check it with libvirt's own RelaxNG schema.

Templates live in the top-level ``templates/`` (GPUVFIO_TEMPLATES overrides); they are
rendered with autoescape and StrictUndefined, parsed with lxml, and validated against
``/usr/share/libvirt/schemas/domain.rng`` (loaded from the file: the schema uses
includes, which break when loaded from a string).
"""

from __future__ import annotations

import functools
import hashlib
import os

from gpuvfio.domain.spec import DomainSpec
from gpuvfio.errors import GpuvfioError
from gpuvfio.user_files import for_another_program
from gpuvfio.settings import SCHEMA_ENV, TEMPLATES_ENV

# gpuvfio's element in a domain's <metadata>: the devices it assigned (for detach), where the
# guest's SSH is forwarded, and the digest of the document gpuvfio defined (for define).
METADATA_NS = "https://gpuvfio.invalid/xmlns/domain/1"
DIGEST_PLACEHOLDER = "sha256:" + "0" * 64
DEFAULT_SCHEMAS = "/usr/share/libvirt/schemas"


class InvalidDomainXml(GpuvfioError):
    pass


def templates_dir(named: str | None = None) -> str:
    """The domain templates: ``named`` (GPUVFIO_TEMPLATES, from the run's settings), else shipped
    in the package (a wheel maps the repository's top-level templates/ to
    gpuvfio/domain/templates), or templates/ beside the package in a checkout."""
    if named:
        return named
    here = os.path.dirname(os.path.abspath(__file__))
    checkout = os.path.dirname(os.path.dirname(here))
    for candidate in (os.path.join(here, "templates"), os.path.join(checkout, "templates")):
        if for_another_program(os.path.join(candidate, "domain.xml.j2")):
            return candidate
    raise GpuvfioError(f"the domain template is missing from {os.path.join(here, 'templates')} (a broken "
                       f"install?); set {TEMPLATES_ENV}")


@functools.lru_cache(maxsize=None)
def _environment(directory: str):
    import jinja2

    return jinja2.Environment(loader=jinja2.FileSystemLoader(directory), autoescape=True,
                              undefined=jinja2.StrictUndefined, keep_trailing_newline=True)


@functools.lru_cache(maxsize=None)
def _schema(path: str):
    from lxml import etree

    if not for_another_program(path):
        raise GpuvfioError(f"libvirt's RelaxNG schema {path} is missing (install libvirt's schemas, e.g. "
                           f"the libvirt-daemon or libvirt-clients package, or set {SCHEMA_ENV})")
    return etree.RelaxNG(file=path)


def render(spec: DomainSpec, template: str = "domain.xml.j2", *, templates: str | None = None) -> str:
    """The document, with the digest of its own text (placeholder in place) in gpuvfio's metadata:
    define compares it with the digest recorded when the domain was defined, so any change to
    what gpuvfio wants shows, whatever libvirt adds to the stored definition."""
    text = _environment(templates_dir(templates)).get_template(template).render(
        spec=spec, host_devices=spec.host_devices, metadata_ns=METADATA_NS, digest=DIGEST_PLACEHOLDER)
    if text.count(DIGEST_PLACEHOLDER) != 1:
        raise GpuvfioError(f"template {template} must carry the digest placeholder exactly once")
    return text.replace(DIGEST_PLACEHOLDER, "sha256:" + hashlib.sha256(text.encode()).hexdigest())


def validate(xml: str, kind: str = "domain", *, schemas: str | None = None) -> None:
    """``xml`` against libvirt's RelaxNG schema ``kind`` (under ``schemas``: GPUVFIO_LIBVIRT_SCHEMAS
    from the run's settings, else libvirt's installed ones)."""
    from lxml import etree

    try:
        document = etree.fromstring(xml.encode())
    except etree.XMLSyntaxError as exc:
        raise InvalidDomainXml(f"generated XML does not parse: {exc}") from None
    schema = _schema(os.path.join(schemas or DEFAULT_SCHEMAS, f"{kind}.rng"))
    if not schema.validate(document):
        error = schema.error_log.last_error
        raise InvalidDomainXml(f"generated XML fails libvirt's {kind}.rng at line {error.line}: {error.message}")


def domain_xml(spec: DomainSpec, *, templates: str | None = None, schemas: str | None = None) -> str:
    xml = render(spec, templates=templates)
    validate(xml, schemas=schemas)
    return xml
