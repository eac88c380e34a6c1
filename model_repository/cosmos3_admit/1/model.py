"""cosmos3_admit: the ensemble's first step; takes a ticket for each request or refuses it at once (load shedding).

A shim over `cosmos3_core.triton.door.AdmitModel` (imported in `initialize`: the auto-complete stub loads this file
too).
"""


class TritonPythonModel:
    def initialize(self, args):
        from cosmos3_core.triton.door import AdmitModel

        self.model = AdmitModel(args)

    def execute(self, requests):
        return self.model.execute(requests)

    def finalize(self):
        self.model.finalize()
