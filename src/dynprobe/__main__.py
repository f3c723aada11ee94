"""`python -m dynprobe`: the CLI, as the `dynprobe` command runs it."""

from dynprobe.cli.main import command

command()
