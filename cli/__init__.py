"""mopd.cli: the `mopd` command line. Thin: parse, load config, call one library function."""
