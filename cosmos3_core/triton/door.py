"""`cosmos3_admit`, the ensemble's first step: take a ticket for each request or refuse it at once (admission.py).

Input `prompt` (BYTES [1, 1]: the model batches, each request is a batch of one; only so that the ensemble runs this
step first, not read); output `ticket` (BYTES [1, 1], `admission.Ticket`) for prefill. Each execute answers every
request queued meanwhile (up to the config's max_batch_size) in one round trip. A refusal is a Triton error whose text
is `errors.OVER_CAPACITY` (or `errors.DRAINING` while the server drains), counted as
`cosmos3_requests_total{outcome="rejected"}` with this model's labels (outcomes.py; published by a thread of its own
every PUBLISH_S). Its execute reads the server's state (state.py) and counts the tickets once per batch, then touches one file per admitted
request: its own Triton queue (bounded by the config's queue policy) holds at most what arrived during one execute, so
the answer comes within milliseconds of arrival.

Imports no torch: the stub of this step starts in well under a second. Only imported inside a Triton Python stub.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils
import yaml

from ..errors import DRAINING, OVER_CAPACITY, part_restarting
from .admission import Ticket
from .outcomes import Outcomes
from .state import ServerState

PUBLISH_S = 0.05  # how often the refusals are handed to Triton: a killed door loses those of its last PUBLISH_S


class AdmitModel:
    """`cosmos3_admit`'s model.py, as its `TritonPythonModel` calls it."""

    def __init__(self, args: dict[str, Any]):
        config = json.loads(args["model_config"])
        # the rendered deployment (plain YAML: reading it through `Deployment` would import torch)
        deployment = yaml.safe_load(Path(config["parameters"]["deployment"]["string_value"]).read_text())
        self.max_queue = int(deployment["max_queue"])
        self.state = ServerState(deployment["state_dir"])
        self.state.clear_tickets("door")  # those of a dead incarnation; a live request is counted again by the engine
        # counted in execute, handed to Triton by a thread: a metric update is a round trip to the server, which a
        # refusal must not wait for
        self.outcomes = Outcomes({"model": args["model_name"], "instance": args["model_instance_name"]}, ("rejected",))
        self._stop = threading.Event()
        self._publisher = threading.Thread(target=self._publish, name="cosmos3-door-metrics", daemon=True)
        self._publisher.start()

    def execute(self, requests: list[Any]) -> list[Any]:
        """One answer for the whole batch (the arrivals queued during the previous execute), in arrival order."""
        refusal = self._refusal()
        tickets = [] if refusal else [Ticket(*t) for t in self.state.take(self.max_queue, len(requests))]
        responses = []
        for i in range(len(requests)):
            if i < len(tickets):
                out = pb_utils.Tensor("ticket", np.array([[tickets[i].encode().encode()]], dtype=np.object_))
                responses.append(pb_utils.InferenceResponse(output_tensors=[out]))  # a batch of one
            else:
                self.outcomes.count("rejected")
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(refusal or OVER_CAPACITY)))
        return responses

    def _refusal(self) -> str | None:
        """Why every request now is refused whatever the queue, or None."""
        # a part the supervisor reloads (docs/operations.md): Triton would send the request to its dead instance
        down = next((p for p in self.state.down_parts() if p != "admit"), None)
        if down is not None:
            return part_restarting(down)
        return DRAINING if self.state.draining() else None

    def _publish(self) -> None:
        while not self._stop.wait(PUBLISH_S):
            self.outcomes.publish()

    def finalize(self) -> None:
        self._stop.set()
        self._publisher.join(5)
        self.outcomes.publish()
