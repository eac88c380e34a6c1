"""cosmos3_denoise (decoupled): hand each request to the denoise engine and return at once.

The engine thread packs every live request into one GEN forward per tick; the response thread sends
progress events and, in the final response, the finished latents. A shim over
`cosmos3_core.triton.adaptors.DenoiseModel` (why it imports in `initialize`: that module's docstring).
"""


class TritonPythonModel:
    def initialize(self, args):
        from cosmos3_core.triton.adaptors import DenoiseModel  # here: the auto-complete stub loads this file too

        self.model = DenoiseModel(args)

    def execute(self, requests):
        return self.model.execute(requests)

    def finalize(self):
        self.model.finalize()
