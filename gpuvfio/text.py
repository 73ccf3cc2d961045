"""gpuvfio's one output escape, ``printable``: what a host's sysfs and pci.ids, a guest, a
journal, a recording or a results file says is escaped once, where it leaves the process, for
the form it goes into (a terminal line, rich markup, Markdown, a matplotlib label). A foundation
module: the commands and the testbed report both call it, and it imports nothing heavy."""

from __future__ import annotations

import re

FORMS = ("text", "markup", "markdown", "mathtext")
_MARKDOWN = {"\\": "\\\\", "`": "\\`", "*": "\\*", "_": "\\_", "[": "\\[", "]": "\\]", "|": "\\|",
             "~": "\\~", "$": "\\$", ":": "\\:", "@": "`@`", "<": "&lt;", ">": "&gt;", "&": "&amp;"}
_WWW = re.compile(r"(?i)(?<![0-9A-Za-z])(www)\.")


def printable(value, form: str = "text") -> str:
    """``value`` (a string, or anything str() makes one of) as gpuvfio may print it: the one
    escape for what a host's sysfs and pci.ids, a guest, a journal, a recording or a results
    file says, applied where it leaves the process.

    Every form: each character that is not printable (str.isprintable: C0 controls and DEL, C1
    controls with U+009B CSI, format characters with the bidi overrides U+202A-202E and isolates
    U+2066-2069, line and paragraph separators, the lone surrogates an undecodable file name
    becomes) is shown as its Python escape (\\x1b, \\x9b, \\u202e, \\n): it can neither move the
    cursor, recolour or retitle the terminal, reorder a line nor start a row of its own. This
    part is idempotent. Then, for the form the text goes into:

    * ``text``: as it is (plain lists, CSV, error and progress lines).
    * ``markup``: rich's markup escaped too (``[link=...]`` shown, not obeyed); print it on a
      console made with ``emoji=False`` (gpuvfio.cli.output.rich_console()), so ``:name:`` is not
      an emoji either.
    * ``markdown``: inline Markdown that renders as the text and nothing else: ``< > &`` as
      entities (no HTML, no ``<scheme:...>`` autolink), emphasis, code, link, table and math
      characters backslash-escaped, ``:`` too (no ``http://`` or ``javascript:`` is left in the
      file), the ``.`` of ``www.`` and ``@`` as code (GitHub's extended autolinks); an ``_``
      between two letters or digits, which CommonMark never reads as emphasis, stays as it is.
      Never at the start of a line (gpuvfio's own text starts each one).
    * ``mathtext``: ``$`` escaped, for matplotlib labels (no mathtext from a name).
    """
    if form not in FORMS:
        raise ValueError(f"unknown output form {form!r}")
    text = value if isinstance(value, str) else str(value)
    if not text.isprintable():  # (the common case, a clean name, costs one C-level scan)
        text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    if form == "markup":
        from rich.markup import escape  # rich only where rich prints

        return escape(text)
    if form == "mathtext":
        return text.replace("$", "\\$")
    if form == "markdown":
        text = _WWW.sub(lambda m: m.group(1) + "\x00", text)  # a placeholder: printable text has no NUL
        out = []
        for i, c in enumerate(text):
            if c == "_" and 0 < i < len(text) - 1 and text[i - 1].isalnum() and text[i + 1].isalnum():
                out.append(c)
            else:
                out.append(_MARKDOWN.get(c, c))
        return "".join(out).replace("\x00", "\\.")
    return text
