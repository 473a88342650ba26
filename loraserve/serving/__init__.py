"""Plumbing both servers use: a server on a background loop, port binding, bearer checks, settings from flags and environment, JSON logs."""
