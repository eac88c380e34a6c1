"""Benchmarks: in-process engine vs diffusers vs the compute floor (`inprocess.py`), and the served path (`served.py`)."""
