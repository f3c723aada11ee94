"""The `dynprobe` command: one module per subcommand."""
