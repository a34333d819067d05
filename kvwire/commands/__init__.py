"""One module per ``kvwire`` subcommand: ``add_arguments(parser)`` and ``run(args) -> int``."""
