"""Tools above the api: programs that drive the engine to check or measure it (the GPU check and
benchmark); they are entry-point helpers, not part of the runtime. Runs in: the user's process."""
