from metrale_cli.cli import main

main()
