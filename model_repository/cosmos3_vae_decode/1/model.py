"""cosmos3_vae_decode (decoupled, one response per request): latents → uint8 frames; progress events pass through
with an empty video.

A shim over `cosmos3_core.triton.decode.DecodeModel` (imported in `initialize`: see the denoise shim).
"""


class TritonPythonModel:
    def initialize(self, args):
        from cosmos3_core.triton.stub import utf8_locale

        utf8_locale()  # first: Triton's embedded interpreter reads text as ASCII (cosmos3_core/triton/stub.py)
        from cosmos3_core.triton.decode import DecodeModel  # here: an auto-completing Triton loads this file too

        self.model = DecodeModel(args)

    def execute(self, requests):
        return self.model.execute(requests)

    def finalize(self):
        self.model.finalize()
