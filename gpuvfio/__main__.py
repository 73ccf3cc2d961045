from gpuvfio.cli import main

main()
