"""Layer 8: the `zerodist` command line. Each subcommand is a module with `register(subparsers)`."""
