"""One module per ``weightsync`` subcommand: ``add_arguments(parser)`` and ``run(args)``."""
