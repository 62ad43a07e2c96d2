"""The `mpmd` command's subcommands: each parses its arguments and calls the library."""
