"""gpuvfio's command line: one typer app (app.py) whose commands live one module per command
group and load when they run (the index: lazy.py).

``main`` runs one command and returns its exit status, ``run`` is the console script.
"""

from gpuvfio.cli.app import app, main, run

__all__ = ["app", "main", "run"]
