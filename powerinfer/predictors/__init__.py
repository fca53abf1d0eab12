"""Neuron predictors on disk: our ``.predictor`` files and PowerInfer's formats (a foundation: read
by the api, the coordinator and every worker; numpy only).

Runs in: every process that runs a sparse model, and the calibration tools that write them.
"""
