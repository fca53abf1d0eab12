"""The OpenAI-compatible server: HTTP app (app.py), request parsing (requests.py), response shapes
(responses.py), continuous-batching scheduler (scheduler.py), metrics, and the `powerinfer-server`
entry point (main.py). Runs in: the server process."""
