"""What runs: sequences, block manager, scheduler, sampler, model runner and the step loop.
The adapter seams are described in engine/README.md and engine/adapter_hooks.py."""
