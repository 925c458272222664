"""One module per subcommand; each exposes `add_parser(subparsers)` or `main(args) -> int`."""
