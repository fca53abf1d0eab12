#!/usr/bin/env python3
"""Entry point without installing console scripts: ``python launch.py [powerinfer args]``.

Runs in: the user's process, which becomes the coordinator. Same flags and subcommands as the
``powerinfer`` command.
"""

import sys

from powerinfer.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
