"""Fuzzing of what PowerInfer-Py takes from outside: GGUF models, ``.predictor`` files, PowerInfer's
formats, and HTTP requests to the server.

Runs in: the process that runs the fuzzer (tests or ``python -m powerinfer.devtools.fuzz.files``) and the
child worker processes it starts to load each case (see :mod:`powerinfer.devtools.fuzz.runner`).

Nothing here is imported by the engine; the package exists so that the hostile-file checks can be
run by hand at any scale and by the test suite in a quick form. Modules:

* :mod:`~powerinfer.devtools.fuzz.gguf_layout`: a GGUF field scanner and a raw (non-validating) writer.
* :mod:`~powerinfer.devtools.fuzz.bases`: the well-formed base files that cases are derived from.
* :mod:`~powerinfer.devtools.fuzz.cases`: malformed-file generators (llama.cpp's classes) and mutators.
* :mod:`~powerinfer.devtools.fuzz.load`: what "loading" a case means (every reader we ship).
* :mod:`~powerinfer.devtools.fuzz.runner`: child processes with time and memory limits; the tally.
* :mod:`~powerinfer.devtools.fuzz.files`: the command line (``python -m powerinfer.devtools.fuzz.files``).
* :mod:`~powerinfer.devtools.fuzz.requests`: hostile HTTP requests against a running server.
"""
