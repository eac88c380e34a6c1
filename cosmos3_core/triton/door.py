"""`cosmos3_admit`, the ensemble's first step: take a ticket for each request or refuse it at once (admission.py).

Input `prompt` (BYTES [1, 1]: the model batches, each request is a batch of one; only so that the ensemble runs this
step first, not read); output `ticket` (BYTES [1, 1], `admission.Ticket`) for prefill. Each execute answers every
request queued meanwhile (up to the config's max_batch_size) in one round trip. A refusal is a Triton error whose text
is `errors.OVER_CAPACITY` (or `errors.DRAINING` while the server drains), counted as
`cosmos3_requests_total{outcome="rejected"}` with this model's labels. Its execute touches a few small files per request: its own Triton queue (bounded by the config's queue policy)
holds at most what arrived during one execute, so the answer comes within milliseconds of arrival.

Imports no torch: the stub of this step starts in well under a second. Only imported inside a Triton Python stub.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils
import yaml

from ..errors import DRAINING, OVER_CAPACITY, down_mark, part_restarting
from .admission import Tickets, tickets_dir
from .cancel import CancelMarks


class AdmitModel:
    """`cosmos3_admit`'s model.py, as its `TritonPythonModel` calls it."""

    def __init__(self, args: dict[str, Any]):
        config = json.loads(args["model_config"])
        # the rendered deployment (plain YAML: reading it through `Deployment` would import torch)
        deployment = yaml.safe_load(Path(config["parameters"]["deployment"]["string_value"]).read_text())
        self.max_queue = int(deployment["max_queue"])
        self.marks = CancelMarks(deployment["cancel_dir"])
        self.tickets = Tickets(tickets_dir(deployment["cancel_dir"]))
        self.tickets.clear("door")  # those of a dead incarnation; a live request is counted again by the engine
        self._family = pb_utils.MetricFamily(
            name="cosmos3_requests_total", description="Requests ended, by outcome", kind=pb_utils.MetricFamily.COUNTER
        )
        labels = {"model": args["model_name"], "instance": args["model_instance_name"], "outcome": "rejected"}
        self.rejected = self._family.Metric(labels=labels)

    def execute(self, requests: list[Any]) -> list[Any]:
        return [self._one() for _ in requests]

    def _one(self) -> Any:
        # a part the supervisor reloads (docs/operations.md): Triton would send the request to its dead instance
        down = next((p for p in ("prefill", "denoise", "vae_decode") if self.marks.is_marked(down_mark(p))), None)
        if down is not None:
            self.rejected.increment(1)
            return pb_utils.InferenceResponse(error=pb_utils.TritonError(part_restarting(down)))
        ticket = None if self.marks.is_draining() else self.tickets.take(self.max_queue)
        if ticket is None:
            self.rejected.increment(1)
            message = DRAINING if self.marks.is_draining() else OVER_CAPACITY
            return pb_utils.InferenceResponse(error=pb_utils.TritonError(message))
        out = pb_utils.Tensor("ticket", np.array([[ticket.encode().encode()]], dtype=np.object_))  # a batch of one
        return pb_utils.InferenceResponse(output_tensors=[out])
