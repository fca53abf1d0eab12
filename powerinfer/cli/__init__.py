"""Command-line entry points (`powerinfer ...`). Runs in the user's process (the coordinator)."""
