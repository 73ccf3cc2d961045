"""Lists for people and for pipes: one model of rows, four forms (``--format``).

* ``table`` (the default on a terminal): rich's table at the terminal's width. When the columns
  do not fit, the least important go first (each column has a rank); the ones marked ``keep``
  (an address, an id) are never wrapped or cut, and long free text wraps at word boundaries.
  What must be copied whole (a fix command) is never put in a cell: it goes below the table.
* ``plain`` (the default into a pipe, as lspci and virsh print): a header line and one aligned
  line per row, no box drawing, nothing cut, so grep and awk see whole values.
* ``csv``: RFC 4180 through the csv module, a header row first.
* ``json``: the command's own JSON object (``--json`` is the same).

Every string a host, a guest, a journal or a results file gave gpuvfio leaves the process
through printable() (gpuvfio.text, imported here), once, where it is printed: the
lists here, the reports in render.py, error and progress lines in app.py, the testbed report's
Markdown, HTML and plots.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Annotated, Optional

import typer

from gpuvfio.errors import InputError
# The one escape: in the lowest module that both the commands and the testbed report may import.
from gpuvfio.text import printable

FORMATS = ("table", "plain", "csv", "json")
FormatOption = Annotated[Optional[str], typer.Option(
    "--format", metavar="FORMAT", help="table | plain | csv | json (default: table on a terminal, plain in a pipe).",
    show_default=False)]


def chosen_format(value: str | None, as_json: bool) -> str:
    """The form to print in: --json, --format, else by what stdout is."""
    if value is not None and value not in FORMATS:
        raise InputError(f"--format {value!r}: expected one of {', '.join(FORMATS)}")
    if as_json:
        if value not in (None, "json"):
            raise InputError(f"--json and --format {value} ask for two forms; give one")
        return "json"
    return value or ("table" if sys.stdout.isatty() else "plain")


@dataclass
class Column:
    title: str
    rank: int = 0  # 0: always shown; higher: dropped sooner when the table does not fit
    keep: bool = False  # never wrapped or cut (addresses, ids)
    below: bool = False  # table form: printed whole under the table, "<first cell> <title>: <text>"


@dataclass
class Cell:
    text: str
    style: str = ""  # rich style in table form only


@dataclass
class Listing:
    title: str
    columns: list[Column]
    rows: list[list[Cell | str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # lines after the rows (not in CSV)
    empty: str = ""  # said, as a note, when there is no row: a bare header says nothing

    @property
    def said(self) -> list[str]:
        """The notes, led by ``empty`` when there is no row."""
        return ([self.empty] if self.empty and not self.rows else []) + self.notes

    def add(self, *cells: Cell | str) -> None:
        if len(cells) != len(self.columns):
            raise ValueError("one cell per column")
        self.rows.append([Cell(printable(c.text), c.style) if isinstance(c, Cell) else printable(c) for c in cells])


def printable_report(data, form: str = "text"):
    """A report (dicts, lists, strings, numbers) with every string in it, keys too, through
    printable(): what a command prints from it can interpolate any field as it is."""
    if isinstance(data, dict):
        return {printable_report(key, form): printable_report(value, form) for key, value in data.items()}
    if isinstance(data, (list, tuple)):
        return [printable_report(item, form) for item in data]
    if data is None or isinstance(data, (bool, int, float)):
        return data
    return printable(data, form)


def write_text(text: str, out=None) -> None:
    """Text of many lines (a diff, generated YAML) written with each line through printable():
    its line breaks kept, nothing else that a terminal would act on."""
    (out or sys.stdout).write("\n".join(printable(line) for line in text.split("\n")))


def rich_console(**kwargs):
    """A rich console for gpuvfio's human output: no emoji codes (":name:" in a host's string
    stays text); everything printed on it comes through printable(..., "markup")."""
    from rich.console import Console

    return Console(emoji=False, **kwargs)


def _text(cell: Cell | str) -> str:
    return cell.text if isinstance(cell, Cell) else cell


def _sizes(listing: Listing, i: int) -> tuple[int, int]:
    """(longest cell, narrowest honest width) of column ``i``: a kept column is never narrower
    than its longest cell, another no narrower than its longest word (words wrap whole)."""
    cells = [listing.columns[i].title] + [_text(row[i]) for row in listing.rows]
    longest = max(len(c) for c in cells)
    if listing.columns[i].keep:
        return longest, longest
    return longest, max(max((len(w) for w in c.split()), default=1) for c in cells)


def _room(width: int, columns: int) -> int:
    return width - 1 - 3 * columns  # the borders and one space each side of a cell


def _fitting_columns(listing: Listing, width: int) -> list[int]:
    """Indexes of the columns to show at ``width``: drop the highest rank first while even the
    narrowest honest layout is wider."""
    shown = list(range(len(listing.columns)))
    while sum(_sizes(listing, i)[1] for i in shown) > _room(width, len(shown)):
        droppable = [i for i in shown if listing.columns[i].rank > 0]
        if not droppable:
            break
        shown.remove(max(droppable, key=lambda i: (listing.columns[i].rank, i)))
    return shown


def _widths(listing: Listing, shown: list[int], width: int) -> list[int]:
    """Each shown column's width: its longest cell, narrowed (widest first) down to its
    narrowest honest width where the terminal is too narrow, so nothing is cut (rich's own
    narrowing folded words and overran the terminal)."""
    sizes = [_sizes(listing, i) for i in shown]
    widths = [longest for longest, _least in sizes]
    while sum(widths) > _room(width, len(shown)):
        narrowable = [k for k in range(len(widths)) if widths[k] > sizes[k][1]]
        if not narrowable:
            break
        widths[max(narrowable, key=lambda k: widths[k])] -= 1
    return widths


def print_listing(listing: Listing, fmt: str, out=None, notes=None) -> None:
    """``listing`` in ``fmt``. As lspci does in a pipe, plain and CSV carry data lines only (one
    header line): plain's notes ("group 6 not viable: ...") go to ``notes`` (stderr), CSV has
    none; a table, for a person at a terminal, shows them below it."""
    out = out or sys.stdout
    if fmt == "csv":
        import csv  # here, where it is used: a table or plain text needs none

        writer = csv.writer(out, lineterminator="\n")
        writer.writerow([c.title for c in listing.columns])
        for row in listing.rows:
            writer.writerow([_text(c) for c in row])
        return
    if fmt == "plain":
        table = [[c.title for c in listing.columns]] + [[_text(c) for c in row] for row in listing.rows]
        widths = [max(len(r[i]) for r in table) for i in range(len(listing.columns))]
        for row in table:
            out.write("  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip() + "\n")
        for note in listing.said:
            (notes or sys.stderr).write(printable(note) + "\n")
        return
    _print_table(listing, rich_console(file=out) if out is sys.stdout else rich_console(file=out, width=160))


def _markup(text: str) -> str:
    return printable(text, "markup")


def _print_table(listing: Listing, console) -> None:
    from rich.table import Table

    inside = [i for i, c in enumerate(listing.columns) if not c.below]
    fitting = Listing(listing.title, [listing.columns[i] for i in inside],
                      [[row[i] for i in inside] for row in listing.rows])
    shown = [inside[i] for i in _fitting_columns(fitting, console.width)]
    table = Table(title=_markup(listing.title), title_justify="left")
    for i, width in zip(shown, _widths(listing, shown, console.width)):
        column = listing.columns[i]
        table.add_column(column.title, no_wrap=column.keep, overflow="fold", width=width)
    for row in listing.rows:
        table.add_row(*(f"[{row[i].style}]{_markup(row[i].text)}[/]" if isinstance(row[i], Cell) and row[i].style
                        else _markup(_text(row[i])) for i in shown))
    console.print(table)
    dropped = [listing.columns[i].title for i in inside if i not in shown]
    if dropped:
        console.print(f"[dim]not shown at {console.width} columns: {', '.join(dropped)} "
                      "(a wider terminal, or --format plain)[/]", soft_wrap=True)
    for row in listing.rows:
        for i, column in enumerate(listing.columns):
            if column.below and _text(row[i]):
                # Whole and unwrapped by rich (the terminal folds it): a fix is copied as it is.
                console.print(f"{_markup(_text(row[0]))} {column.title.lower()}: {_markup(_text(row[i]))}",
                              soft_wrap=True)
    for note in listing.said:
        console.print(_markup(note), soft_wrap=True)
