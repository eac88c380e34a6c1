"""cosmos3_admit: the ensemble's first step; takes a ticket for each request or refuses it at once (load shedding).

A shim over `cosmos3_core.triton.door.AdmitModel` (imported in `initialize`: an auto-completing Triton loads this
file in a stub of its own too).
"""


class TritonPythonModel:
    def initialize(self, args):
        from cosmos3_core.triton.stub import utf8_locale

        utf8_locale()  # first: Triton's embedded interpreter reads text as ASCII (cosmos3_core/triton/stub.py)
        from cosmos3_core.triton.door import AdmitModel

        self.model = AdmitModel(args)

    def execute(self, requests):
        return self.model.execute(requests)

    def finalize(self):
        self.model.finalize()
