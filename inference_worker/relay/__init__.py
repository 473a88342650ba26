"""The stream relay (`--stream-process`): clients talk to a front process (`front.py`) that
sends a step's worth of generation messages to them while the worker's own interpreter runs the
engine. Generations cross a local socket between the two as frames that each carry every message
ready at that moment (`core.py`); every other call passes through the front to the worker's gRPC
server on a private loopback port, unchanged.

Why: one process serving the token streams of many requests spends most of a core in gRPC's own
sends, holding the interpreter lock that the engine's step thread must take back after each torch
call (measured: a step of 60 sequences took 6.3 ms of host time for ~2 ms of device work).
Nothing here is imported by the package itself: the front starts without torch."""
