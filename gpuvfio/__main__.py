from gpuvfio.main import run

run()
