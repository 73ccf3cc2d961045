from gpuvfio.cli import run

run()
