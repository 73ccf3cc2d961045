"""gpuvfio's command line: one typer app (app.py), one module per command group.

Importing this package registers every command; ``main`` runs one and returns its exit
status, ``run`` is the console script.
"""

from gpuvfio.cli import binding, completion, domain, export, guest, inventory, testbed, topology, vgpu  # noqa: F401  (they register commands)
from gpuvfio.cli.app import app, main, run

__all__ = ["app", "main", "run"]
