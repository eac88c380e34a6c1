"""Cross-process cancellation marks for requests served through the ensemble.

Triton's ensemble scheduler does not cancel a composing step that is already running: the decoupled
denoise request never sees `is_cancelled()`. It does cancel the steps it schedules afterwards, so the
decode step that follows the next progress event sees the cancellation; it marks the request here
(an empty file named by the request's id) and the engine polls the mark between ticks.

No step answers with a Triton error while another step of the same request can still be in flight: Triton
2.51's ensemble then stops counting its steps' FINAL responses (`EnsembleContext::PrepareSteps` skips
`UpdateEnsembleState` once the ensemble has failed; fixed upstream in core r26.03, #466), so the ensemble request
is never released and shutdown waits out its exit timeout. So the decode step of a cancelled request answers
FINAL with no response; a chunk that fails to decode mid-stream marks the request too; and the engine ends a
request (cancelled, failed, rejected) with an `error` event in its FINAL response, which the decode step after
it, the request's last step, turns into the error the client sees.
"""

from __future__ import annotations

from pathlib import Path


class CancelMarks:
    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)

    def _path(self, request_id: str) -> Path:
        if not request_id.isalnum():
            raise ValueError(f"request id must be alphanumeric, got {request_id!r}")
        return self.dir / request_id

    def mark(self, request_id: str) -> None:
        self._path(request_id).touch()

    def is_marked(self, request_id: str) -> bool:
        return self._path(request_id).exists()

    def clear(self, request_id: str) -> None:
        self._path(request_id).unlink(missing_ok=True)

    # Graceful shutdown: `serve` marks the deployment draining before it stops tritonserver (whose ensemble can
    # no longer schedule the decode steps of in-flight requests once it is stopping).
    def drain(self) -> None:
        self.mark("DRAINING")

    def is_draining(self) -> bool:
        return self.is_marked("DRAINING")

    def undrain(self) -> None:
        self.clear("DRAINING")
