"""The Triton side: one module per Python stub (door.py, prefill.py, denoise.py, decode.py; what each stub does first:
stub.py), what they share (io.py, sink.py, lifecycle.py, outcomes.py, admission.py, gpu_memory.py; state.py: the facts
that cross processes), the tritonserver launcher (launcher.py) and the supervisor that renders the model repository
and runs it (serve.py, front.py; `python -m cosmos3_core.triton.serve`). Nothing below this package imports it."""
