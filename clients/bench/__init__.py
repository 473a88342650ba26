"""`loraserve bench`: a load generator for a worker, a fleet or the OpenAI endpoint (cli.py), built
from a reproducible request stream (workload.py), targets (targets.py, openai_target.py), a runner
that times each request (runner.py), the summary (results.py) and the workers' metrics
(worker_metrics.py)."""
