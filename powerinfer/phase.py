"""The "phase" logger: one line per slow first-run step (a model's download, the C build, a
PowerInfer file's runnable copy), shown by the commands at their default level.

Runs in: any process. A fetch's progress bar needs a terminal, and a log or a pipe would otherwise
see minutes of silence; ``flags.configure_logging`` lets this logger through at WARNING, and
``--log-level ERROR`` silences it.
"""

from __future__ import annotations

import logging

PHASE_LOGGER = "powerinfer.phase"
phase = logging.getLogger(PHASE_LOGGER)
