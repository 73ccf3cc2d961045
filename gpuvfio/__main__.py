from gpuvfio.main import main

main()
