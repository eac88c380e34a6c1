"""`TritonSink`: one request of `cosmos3_denoise` (decoupled), its responses: the engine's events of it (progress,
chunks, `done`, `error`) → Triton responses through the stub's responder; its answer on arrival (`arrived`). Who
sends, holds and counts what: lifecycle.py. Lives in the denoise stub's process: the model's `execute` makes it and
hands it to the engine thread, whose events call it; the responder's thread counts its end (`publish_end`), and the
holder sends its held FINAL through its `sender` (denoise.py).

Only imported inside a Triton Python stub.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from ..wire import AcceptedEvent, ChunkInfo, ErrorEvent, RequestMeta
from . import lifecycle
from .io import EMPTY_ACTIONS, EMPTY_LATENTS, EMPTY_SOUND, Responder, error_response, latents_response, log_exception
from .outcomes import Outcomes
from .state import ServerState


class TritonSink:
    """Engine events of one request → responses through the responder. The first event releases the request's
    admission ticket: it no longer waits (admission.py). How the request ends, and who counts it: lifecycle.py."""

    def __init__(
        self,
        request: Any,
        responder: Responder,
        meta: RequestMeta | None,
        state: ServerState,
        outcomes: Outcomes,
        hold: Callable[[TritonSink], None] | None = None,
        publish_end: Callable[[str], None] | None = None,
    ):
        self.request = request
        self.sender = request.get_response_sender()
        self.responder = responder
        self.meta = meta
        self.state = state
        self.outcomes = outcomes
        self.hold = hold  # keeps the request's FINAL until vae_decode is done with it (denoise.Holder.hold)
        self.publish_end = publish_end or outcomes.count_now  # counts a request the engine ended, once it is out
        self.ticket = meta is not None  # held until the first event
        self.t_arrive = time.time()  # reached the denoise model (epoch s, as meta.t0)
        self.stop: str | None = None  # why the engine ends it early: the client cancelled, or vae_decode's reason
        self.at_decode = False  # a step of it went to vae_decode (`accepted`): its last step must go there too

    @property
    def id(self) -> str:
        return self.meta.id if self.meta is not None else ""

    def _send(self, build: Callable[[], Any], final: bool, after: Callable[[], None] | None = None) -> None:
        if self.ticket:
            self.state.release(self.id)
            self.ticket = False
        self.responder.send(self.sender, build, final, after)

    @property
    def t0(self) -> float:
        return self.meta.t0 if self.meta is not None else 0.0

    def decode_gone(self) -> bool:
        """vae_decode died after this request arrived: its steps there went to the dead instance."""
        return lifecycle.gone(self.t0, self.state.died_at("vae_decode"))

    def arrived(self, refusal: str | None, outcome: str | None = None) -> bool:
        """Its answer on arrival (lifecycle.arrival): `refusal`, an error counted as `outcome`, or `accepted`. True:
        accepted, for the engine."""
        if refusal is not None:
            self.error(refusal, outcome)
            return False
        self.accepted()
        return True

    def accepted(self) -> None:
        """Before the engine may send anything, and before `execute` returns, sent from the calling thread: from the
        moment Triton has it, vae_decode holds a step of the request (a stub that dies before its execute returned
        has its requests answered by Triton itself). Not the request's first word: it still waits, its ticket is
        kept."""
        event: AcceptedEvent = {"type": "accepted", "id": self.id, "t0": self.t0}
        self.at_decode = True
        try:
            self.sender.send(latents_response(EMPTY_LATENTS, event), flags=0)
        except Exception as e:  # noqa: BLE001 - the client went away: the engine's events meet the same
            log_exception("cosmos3_denoise accepted", e)

    def progress(self, step: int, steps: int, window: int, windows: int) -> None:
        event = self.meta.progress(step, steps, window, windows)
        self._send(lambda: latents_response(EMPTY_LATENTS, event), final=False)

    def chunk(self, latents: torch.Tensor, info: ChunkInfo) -> None:
        host, event = latents.float().cpu(), self.meta.chunk(info, final=False)
        self._send(lambda: latents_response(host, event), final=False)

    def done(
        self,
        latents: torch.Tensor,
        info: ChunkInfo,
        sound: torch.Tensor | None = None,
        actions: torch.Tensor | None = None,
    ) -> None:
        """The engine's last piece: sent, and the request's FINAL held (Holder) until vae_decode is done with it."""
        # sound latents [sound_dim, T_s] and actions [chunk, D] ride with done, as does the last chunk
        s = EMPTY_SOUND if sound is None else sound.float().cpu()
        a = EMPTY_ACTIONS if actions is None else actions.float().cpu()
        # arrival → here, less prefill's own time: prefill's Triton queue and the hand-off of its outputs
        info["timings"]["to_denoise_s"] = self.t_arrive - self.meta.t0 - self.meta.prefill_s
        host, event = latents.float().cpu(), self.meta.chunk(info, final=True)
        self._send(lambda: latents_response(host, event, s, a), final=False)
        self.hold(self)

    def error(self, message: str, outcome: str | None = None) -> None:
        """The engine (or the model, `outcome`: its rejection) ends the request early."""
        do = lifecycle.engine_error(self.stop, outcome, not self.at_decode or self.decode_gone(), message)
        # counted once the end is out, by the responder's thread (the engine's never talks to the server): a stub
        # killed then loses no count that its metrics thread had not published yet
        count = lambda: self.publish_end(do.count)  # noqa: E731
        if do.send == "error":  # no step of it can reach a live vae_decode: the Triton error goes from here
            self._send(lambda: error_response(message), final=True, after=count)
        else:  # as data: vae_decode's step of it, the request's last, turns it into the Triton error
            event: ErrorEvent = {"type": "error", "id": self.id, "message": message}
            self._send(lambda: latents_response(EMPTY_LATENTS, event), final=True, after=count)
        if do.forget and self.meta is not None:
            self.state.forget(self.id)

    def cancelled(self) -> bool:
        if self.stop is None:
            if self.request.is_cancelled():  # called directly, not through the ensemble
                self.stop = "cancelled"
            elif self.meta is not None:
                self.stop = self.state.stop_reason(self.id)
        return self.stop is not None
