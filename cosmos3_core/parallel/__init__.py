"""Several GPUs for one request: CFG-parallel, Ulysses sequence parallel and the patch-parallel VAE decode.

config.py (the deployment's `parallel:` block) · comm.py (subgroups, commands) · group.py (rank 0's handle: spawn,
commands, failure, restart) · worker.py (the worker processes' loop) · denoise.py (the pool shard and the step over
the group) · ulysses.py (all-to-all attention) · vae.py (the decode split by rows).
"""
