from omlx.cli import main

main()
