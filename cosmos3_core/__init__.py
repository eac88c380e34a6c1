"""cosmos3_core: load a Cosmos3 checkpoint (diffusers layout) and generate images/videos, structured for serving.

The three serving stages (prefill, the denoise engine, VAE decode) live in `stages.py`; the offline CLI
(`generate.py`) and the Triton models (`model_repository/`) are thin adaptors over them.
"""
