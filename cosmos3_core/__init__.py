"""cosmos3_core: load a Cosmos3 checkpoint (diffusers layout) and generate images/videos, structured for serving.

The three serving stages (prefill, the denoise engine, VAE decode) live in `stages.py`; the offline CLI
(`generate.py`) and the Triton models (`model_repository/`) are thin adaptors over them.
"""

import time as _time

# when the package's import began: a Triton stub imports it first in `initialize`, so the time from here to the model's
# construction is the stub's imports (`triton.io.imports_s`), the part of a reload's start that is ours
IMPORT_STARTED = _time.perf_counter()
