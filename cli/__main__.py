from mopd.cli.main import main

main()
