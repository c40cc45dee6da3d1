"""The `slimtorch` command: one module per subcommand, each thin (parse, call the API, render)."""
