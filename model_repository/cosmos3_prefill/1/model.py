"""cosmos3_prefill: validate the request, tokenize, run the understanding tower once, VAE-encode an i2v image, the
v2v clip's conditioning frames or an action request's anchor frame (inverse dynamics: its clip).

A shim over `cosmos3_core.triton.prefill.PrefillModel` (imported in `initialize`: see the denoise shim).
"""


class TritonPythonModel:
    def initialize(self, args):
        from cosmos3_core.triton.stub import utf8_locale

        utf8_locale()  # first: Triton's embedded interpreter reads text as ASCII (cosmos3_core/triton/stub.py)
        from cosmos3_core.triton.prefill import PrefillModel  # here: an auto-completing Triton loads this file too

        self.model = PrefillModel(args)

    def execute(self, requests):
        return self.model.execute(requests)
