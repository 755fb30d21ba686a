"""The slice command channel: the control plane's slice requests for this node.

A poller thread asks every 5 s for the node's pending requests
(GET /api/v1/agent/slice-requests?node_id=&status=pending, at most 5 a round) and queues
the new ones. One worker thread takes them in order and, for each, claims it (PUT
pending → processing; a 409 means another claim won or it moved on: left alone),
re-validates and executes it with its vendor within the request's 120 s, and reports
the outcome (PUT processing → completed / failed with `result` and `error`). The claim
comes right before the run, so a request's 120 s are its own, not spent in a queue.
The drivers are not re-entrant: one request at a time, whatever the vendor.

A report is retried like a task outcome (six tries, 1 s doubling to 10 s); one that still
did not get through is kept and tried again before each later poll, until the server
takes it or answers that the request moved on (409, a timed-out request say).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import OrderedDict

from heteroflow_agent.client import AuthError, ServerClient, ServerError
from heteroflow_agent.slicing import hami, mig, mps
from heteroflow_agent.slicing.base import REQUEST_SECONDS, Budget, Outcome, Vendor

logger = logging.getLogger("heteroflow_agent.channels.slices")

POLL_SECONDS = 5.0
POLL_LIMIT = 5
PATH = "/api/v1/agent/slice-requests"
MAX_UNDELIVERED = 256


def default_vendors(root: str = "/", mps_pipe_directory: str | None = None) -> dict[str, Vendor]:
    """The vendors by the names the server's requests carry (apps.slices SliceVendor)."""
    return {
        mig.NvidiaMig.name: mig.NvidiaMig(root),
        mps.NvidiaMps.name: mps.NvidiaMps(root, pipe_directory=mps_pipe_directory),
        hami.HygonHami.name: hami.HygonHami(root),
    }


class SliceChannel:
    def __init__(
        self,
        node_id: str,
        client: ServerClient,
        *,
        report_client: ServerClient | None = None,
        vendors: dict[str, Vendor] | None = None,
        poll_seconds: float = POLL_SECONDS,
        request_seconds: float = REQUEST_SECONDS,
        tool_timeout: float = 60.0,
    ):
        self.node_id, self.client = node_id, client
        self.report_client = report_client or ServerClient(
            client.base_url, client.session.headers["X-API-Key"], attempts=6, backoff=1.0, backoff_cap=10.0
        )
        self.vendors = vendors if vendors is not None else default_vendors()
        self.poll_seconds, self.request_seconds, self.tool_timeout = poll_seconds, request_seconds, tool_timeout
        self.queue: queue.Queue[dict] = queue.Queue()
        self.lock = threading.Lock()
        self.waiting: set[int] = set()  # queued or being worked on
        self.undelivered: OrderedDict[int, dict] = OrderedDict()  # request id -> report body
        self.stop = threading.Event()
        self.wake = threading.Event()
        self.threads: list[threading.Thread] = []
        self.running: int | None = None  # the request being executed (serial: at most one)
        self._unavailable_logged = False

    # --- threads ----------------------------------------------------------------------------

    def start(self) -> None:
        for name, target in (("slice-poller", self._poll_loop), ("slice-worker", self._work_loop)):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self.threads.append(thread)

    def close(self, timeout: float = 5.0) -> None:
        """Stop polling and taking requests; a request being executed finishes (its
        tools are bounded by its own time limit) unless `timeout` runs out first."""
        self.stop.set()
        self.wake.set()
        for thread in self.threads:
            thread.join(timeout=timeout)

    def _poll_loop(self) -> None:
        while not self.stop.is_set():
            try:
                self.poll()
            except Exception:
                logger.exception("slice request poll failed")
            self.wake.wait(self.poll_seconds)
            self.wake.clear()

    def _work_loop(self) -> None:
        while not self.stop.is_set():
            try:
                request = self.queue.get(timeout=0.5)
            except queue.Empty:
                continue
            try:
                self.handle(request)
            except Exception:
                logger.exception("slice request %s: the worker failed", request.get("id"))
            finally:
                with self.lock:
                    self.waiting.discard(request["id"])

    # --- the poll ---------------------------------------------------------------------------

    def poll(self) -> list[int]:
        """Retry kept reports, then fetch the pending requests and queue the new ones.
        Returns the ids queued."""
        self.redeliver()
        try:
            params = {"node_id": self.node_id, "status": "pending", "limit": POLL_LIMIT}
            response = self.client.request("GET", PATH, params=params)
        except AuthError:
            logger.debug("slice requests not fetched: the key is refused")  # the client logs it once
            return []
        except ServerError as exc:
            logger.warning("could not fetch slice requests: %s", exc)
            return []
        if response.status_code == 404 and not self._unavailable_logged:
            self._unavailable_logged = True
            logger.warning("the control plane has no slice channel (404 on %s): no slices here", PATH)
        if response.status_code != 200:
            if response.status_code != 404:
                logger.error("fetching slice requests refused: HTTP %d %s", response.status_code, response.text[:300])
            return []
        self._unavailable_logged = False
        queued = []
        for request in (response.json().get("results") or [])[:POLL_LIMIT]:
            if not isinstance(request, dict) or not isinstance(request.get("id"), int):
                continue
            with self.lock:
                if request["id"] in self.waiting or request["id"] in self.undelivered:
                    continue
                self.waiting.add(request["id"])
            self.queue.put(request)
            queued.append(request["id"])
        return queued

    # --- one request ------------------------------------------------------------------------

    def handle(self, request: dict) -> bool | None:
        """Claim, execute and report one request. None when the claim was lost; else
        whether the report got through."""
        request_id = request["id"]
        if not self.claim(request_id):
            return None
        with self.lock:
            self.running = request_id
        try:
            outcome = self.execute(request)
        finally:
            with self.lock:
                self.running = None
        level = logging.INFO if outcome.ok else logging.WARNING
        logger.log(
            level,
            "slice request %s (%s %s, slice %s): %s%s",
            request_id,
            request.get("action"),
            request.get("vendor"),
            request.get("slice_id"),
            "completed" if outcome.ok else "failed",
            "" if outcome.ok else f": {outcome.error}",
        )
        return self.report(request_id, outcome)

    def claim(self, request_id: int) -> bool:
        try:
            response = self.client.request(
                "PUT",
                f"{PATH}/{request_id}",
                json={"node_id": self.node_id, "from_status": "pending", "status": "processing"},
            )
        except AuthError:
            return False  # the client has logged the configuration error
        except ServerError as exc:
            logger.warning("could not claim slice request %s: %s", request_id, exc)
            return False
        if response.status_code == 409:
            logger.info("slice request %s: claimed elsewhere or moved on (409)", request_id)
            return False
        if response.status_code != 200:
            logger.error(
                "claiming slice request %s refused: HTTP %d %s", request_id, response.status_code, response.text[:300]
            )
            return False
        return True

    def execute(self, request: dict) -> Outcome:
        vendor = self.vendors.get(str(request.get("vendor") or ""))
        if vendor is None:
            return Outcome(False, f"refused: this agent has no slice vendor {request.get('vendor')!r}")
        budget = Budget(self.request_seconds, self.tool_timeout)
        try:
            return vendor.execute(str(request.get("action") or ""), dict(request.get("params") or {}), budget)
        except Exception as exc:  # a vendor bug: still a truthful report, never a silent drop
            logger.exception("slice request %s: the vendor failed", request.get("id"))
            return Outcome(False, f"the agent's {vendor.name} vendor failed: {type(exc).__name__}: {exc}"[:2000])

    # --- reports ----------------------------------------------------------------------------

    def report(self, request_id: int, outcome: Outcome) -> bool:
        body = {
            "node_id": self.node_id,
            "from_status": "processing",
            "status": "completed" if outcome.ok else "failed",
            "result": outcome.result(),
            "error": outcome.error[:2000],
        }
        return self.deliver(request_id, body)

    def deliver(self, request_id: int, body: dict) -> bool:
        try:
            response = self.report_client.request("PUT", f"{PATH}/{request_id}", json=body)
        except (ServerError, AuthError) as exc:
            logger.warning("slice request %s: report not delivered (%s); kept for a later attempt", request_id, exc)
            with self.lock:
                self.undelivered[request_id] = body
                self.undelivered.move_to_end(request_id)
                while len(self.undelivered) > MAX_UNDELIVERED:
                    dropped, _ = self.undelivered.popitem(last=False)
                    logger.error("slice request %s: too many reports undelivered; the oldest is given up", dropped)
            return False
        if response.status_code == 409:
            logger.warning(
                "slice request %s: the server moved on before the report (409 %s)", request_id, response.text[:300]
            )
        elif response.status_code != 200:
            logger.error(
                "slice request %s: report refused: HTTP %d %s", request_id, response.status_code, response.text[:300]
            )
        with self.lock:
            self.undelivered.pop(request_id, None)
        return True

    def redeliver(self) -> int:
        with self.lock:
            kept = list(self.undelivered.items())
        return sum(1 for request_id, body in kept if self.deliver(request_id, body))
