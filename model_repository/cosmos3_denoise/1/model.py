"""cosmos3_denoise (decoupled): hand each request to the denoise engine and return at once.

The engine thread packs every live request into one GEN forward per tick; the response thread sends
progress events and, in the final response, the finished latents. A shim over
`cosmos3_core.triton.denoise.DenoiseModel`, imported in `initialize`: a tritonserver started without
`--disable-auto-complete-config` (ours passes it) first loads every model.py in a stub of its own to auto-complete
the model config, then again in the instance's stub; top-level imports of torch and the package made that first stub
cost ~12 s of every server start.
"""


class TritonPythonModel:
    def initialize(self, args):
        from cosmos3_core.triton.stub import utf8_locale

        utf8_locale()  # first: Triton's embedded interpreter reads text as ASCII (cosmos3_core/triton/stub.py)
        from cosmos3_core.triton.denoise import DenoiseModel  # here: an auto-completing Triton loads this file too

        self.model = DenoiseModel(args)

    def execute(self, requests):
        return self.model.execute(requests)

    def finalize(self):
        self.model.finalize()
