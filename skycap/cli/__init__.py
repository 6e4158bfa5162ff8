"""The `skycap` command line: one module per subcommand, loaded only when it runs."""
