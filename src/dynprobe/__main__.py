"""`python -m dynprobe`: the CLI, as the `dynprobe` command runs it."""

import sys

from dynprobe.cli.main import main

sys.exit(main())
