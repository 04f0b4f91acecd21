"""The passthrough routes: one request to one engine, its answer relayed (docs/behaviour.md "The request path", "The
other P/D endpoints").

``/tokenize``, ``/detokenize``, ``/v1/embeddings``, ``/pooling``, ``/score``, ``/v1/score``,
``/rerank`` and ``/v1/rerank`` (the registry's ``passthrough`` endpoints,
``narwhal.engines.endpoints``) have no prefill/decode split: the router admits the request as it
admits every other (client key, deadline, body read once and parsed once, 4xx in OpenAI's
shape), picks one engine serving the model (:mod:`narwhal.fleet.passthrough`: consumers first,
least loaded, a slot held while it runs), sends it the body re-encoded from the parsed dict with
no ``kv_transfer_params``, and relays the engine's 2xx answer — status, bytes and content type
— untouched. Engine errors take the "The request path" mapping (``narwhal.engines.failures``); failures that
count go to the engine's breaker through :class:`narwhal.request.outcomes.Outcomes`, as a leg's
do, charged in the role the engine served in. A success resets no streak: an answered
``/tokenize`` proves no more about decoding than a passed health check.

No retries: each goes to *one* engine (docs/behaviour.md "Passthrough routes"), and each is cheap
for a client to repeat. The router (``narwhal.request.router``) owns what every request shares: the
access-log line (``mode: "passthrough"``), ``narwhal_requests_total``, ``x-request-id``, client
disconnects and the graceful drain.
"""

from __future__ import annotations

import time

from aiohttp import web

from narwhal.engines.client import EngineClient
from narwhal.errors import EngineError
from narwhal.request.accesslog import AccessRecord
from narwhal.request.admission import ClientRequest
from narwhal.request.ids import new_id
from narwhal.request.outcomes import Outcomes
from narwhal.request.slot_wait import WaitingEngine, WaitingPlacement
from narwhal.settings import Settings

MODE = "passthrough"  # the access log's "mode" for these routes


class Passthrough:
    """The passthrough routes' handler: one engine per request, no retries; the router owns the rest."""

    def __init__(
        self, settings: Settings, placement: WaitingPlacement, client: EngineClient, outcomes: Outcomes
    ) -> None:
        self.settings = settings
        self.client = client
        self.outcomes = outcomes
        self.engines = WaitingEngine(placement)

    async def serve(self, req: ClientRequest, rec: AccessRecord, started: float) -> web.Response:
        """Reserve one engine, send, relay ``req`` (admitted by ``Admission.admit``, the one door);
        ``started`` in ``perf_counter`` time. Raises ``NarwhalError`` for the router to answer."""
        rec.mode = MODE
        model = req.model
        deadline = req.deadline
        slot = await self.engines.reserve(model, deadline)
        engine = slot.engine
        rec.attempts = 1
        if slot.phase == "decode":
            rec.consumer = engine.name
        else:
            rec.producer = engine.name
        try:
            status, data, content_type = await self.client.passthrough(
                engine, req.endpoint.path, req.body, request_id=new_id(), phase=slot.phase, deadline=deadline,
                headers=req.forward,
            )
        except EngineError as exc:
            # The request was sent to this engine alone: whatever failed failed there.
            self.outcomes.failure(engine, engine, exc, before_first_token=True)
            raise
        finally:
            slot.release()
        rec.first_byte_s = time.perf_counter() - started
        return web.Response(
            status=status, body=data, headers={"Content-Type": content_type, "x-request-id": rec.request_id}
        )
