"""The worker's adapter fetch process: `process` (the worker's side), `child` (the process). Nothing
here is imported by the package itself: the child starts without torch."""
