"""The server takes requests that arrive while it decodes after the current
step, prefills a burst of them in one call, and accepts a burst of
connections at once.

``mlx_lm.server``'s generation thread takes new requests from its queue only
between rounds of batch steps, and a round runs until half a second has
passed (``TimeBudget``). A request that arrives just after a round began
waits up to that half second before it is tokenized, inserted and
prefilled. Under a burst of requests that splits one wave into groups: on
the H200, 16 requests sent together had their first tokens at 0.70 s (8),
0.91 s (4) and 1.55 s (4), the last four having waited out a round
(bench/results/2026-12-04-nvidia-h200-1eba4b4).

With a lily model loaded, a round also ends once a request is waiting,
after at least one step: the server takes it at once, and its prefill runs
in the batch generator's next call, joining the batch as it would have after
a full round. What a step computes and the order of requests do not change.
A distributed server keeps stock's rounds (its ranks agree on each round's
length through ``TimeBudget``'s own synchronisation, and only rank 0 reads
the queue). ``MLX_LILY_EARLY_ADMISSION=0`` keeps stock's rounds everywhere.

A burst of requests is taken whole. The loop inserts each request it reads
(tokenizing it) and reads again; once the queue is empty it runs the batch
generator, whose next call prefills what has been inserted. Requests sent
together reach the queue a few milliseconds apart (each through its HTTP
handler's thread), so a burst of 16 on the H200 was prefilled in three
calls of 6, 2 and 8 rows, each about 0.3 s, and every first token came after
1.1 s (bench/results/2026-12-04-nvidia-h200-efe1204). With lily, a poll that
finds the queue empty less than ``BURST_GAP_S`` (10 ms) after the last
request was taken waits for the next until then (at most ``BURST_MAX_S``,
50 ms, from the burst's first request), so the burst's requests are inserted
before its first prefill call. A lone request's first token comes at most
``BURST_GAP_S`` later, and streams decoding when a burst arrives wait as long
once before their next step.

A burst's prompts in one prefill call. Stock's server prefills at most 8
prompts a call unless ``--prompt-concurrency`` says otherwise, a bound on
its prefill's memory, which grows with the rows of a call. Lily packs a
call's prompts (layers/prompt_rows.py) into calls of at most
``PACK_MAX_TOKENS`` tokens whatever the rows, so where it packs and the
command line does not set ``--prompt-concurrency``, a prefill call takes up
to ``PROMPT_ROWS`` (16) prompts, and no more than ``--decode-concurrency``:
a burst of 16 short prompts is one call, where 8 a call leave two (each
about 0.3 s on the H200 at efe1204). Given on the command line, the flag is
kept as it is.

Installed by the lily backend when ``mlx_lm.server`` loads a lily model.

A burst of connections: mlx-lm's HTTP server is the standard library's
``ThreadingHTTPServer``, whose listening socket queues 5 connections not yet
accepted (``request_queue_size``). Sixteen clients connecting together while
the generation thread keeps the interpreter busy then overflow that queue:
the kernel drops some connection attempts, which the clients retry a second
later, or resets them. On the H200 the last four of 16 requests reached the
server 1 s after the others (first tokens at 0.64 s for 8, 0.83 s for 4 and
1.58 s for 4; bench/results/2026-12-04-nvidia-h200-5b9ed7a). With lily,
``mlx_lm.server`` listens with a queue of ``LISTEN_BACKLOG`` (installed
before the server starts: ``install_backlog``, from the backend's
``check_before_serving``). ``MLX_LILY_EARLY_ADMISSION=0`` keeps stock's
queue too.
"""

from __future__ import annotations

import os
import time
from typing import Any

from ._notice import notice_once
from ._patches import Patches, program_module

ENV = "MLX_LILY_EARLY_ADMISSION"

_stock = Patches()


def enabled() -> bool:
    """Whether ``MLX_LILY_EARLY_ADMISSION`` allows it (unset: yes)."""
    value = os.environ.get(ENV, "").strip().lower()
    if value in ("", "1", "true", "yes", "on"):
        return True
    if value not in ("0", "false", "no", "off"):
        notice_once(f"admission-env:{value}", f"{ENV}={value!r} is not 0 or 1; taking requests after each step")
        return True
    return False


# A burst: requests taken less than BURST_GAP_S apart. While one is under way
# (and for at most BURST_MAX_S from its first request) the loop's poll of an
# empty queue, after which it would run a prefill or decode call, waits for
# the burst's next request until BURST_GAP_S after the last one.
BURST_GAP_S = 0.01
BURST_MAX_S = 0.05


def _next_request(self: Any, timeout: Any = None):
    """``ResponseGenerator._next_request``, which the generation loop calls
    before every round: its round budget learns the request queue, and a
    burst of requests is taken whole before the next batch call."""
    distributed = getattr(self, "_is_distributed", False)
    budget = getattr(self, "_time_budget", None)
    if budget is not None:
        budget._lily_requests = None if distributed else self.requests
    request = _stock["_next_request"](self, timeout)
    if distributed:
        return request
    now = time.perf_counter()
    last = getattr(self, "_lily_last_taken", None)
    if request is None and timeout is None and last is not None:
        began = getattr(self, "_lily_burst_began", last)
        wait = min(last + BURST_GAP_S, began + BURST_MAX_S) - now
        if wait > 0:
            request = _stock["_next_request"](self, wait)
            now = time.perf_counter()
    if request is not None:
        if last is None or now - last > BURST_GAP_S:
            self._lily_burst_began = now
        self._lily_last_taken = now
    return request


# Prompts a prefill call takes where lily packs them and the command line
# does not set the server's prefill batch: the fused decode kernels' most
# rows (kernels/moe/decode.MAX_BATCH), which the batch then decodes at.
PROMPT_ROWS = 16
PROMPT_FLAG = "--prompt-concurrency"
# argparse takes a flag's unambiguous abbreviations; "--prompt-c" is also
# "--prompt-cache-size"'s, so the shortest that names this flag is longer.
_PROMPT_FLAG_SHORTEST = len("--prompt-co")
# Whether the command line that started the server set PROMPT_FLAG; None
# where no command line was read (a server built in code keeps its value).
_command_line = {"prompt_rows_given": None}


def read_command_line(argv) -> None:
    """Note whether the server's command line sets ``--prompt-concurrency``
    (``backend.check_before_serving`` passes it before the server starts)."""
    def names_flag(arg: str) -> bool:
        name = arg.split("=", 1)[0]
        return len(name) >= _PROMPT_FLAG_SHORTEST and PROMPT_FLAG.startswith(name)

    _command_line["prompt_rows_given"] = any(names_flag(str(a)) for a in argv)


def prompt_rows(model: Any, asked: int, decoded: int = PROMPT_ROWS) -> int:
    """The prefill batch the server's ``BatchGenerator`` gets for ``model``
    where its flag gave ``asked`` and ``--decode-concurrency`` ``decoded``:
    up to PROMPT_ROWS, but not past the rows it decodes together, where the
    command line left the flag unset and lily packs this model's prompts;
    else ``asked``."""
    rows = min(PROMPT_ROWS, decoded)
    if _command_line["prompt_rows_given"] is not False or asked >= rows:
        return asked
    from .layers.prompt_rows import packs_prompts

    if not packs_prompts(model):
        return asked
    notice_once("prompt-rows", f"a prefill call takes up to {rows} prompts, packed "
                               f"({PROMPT_FLAG} not given; stock's default is {asked})")
    return rows


def _batch_generator(base: Any) -> Any:
    """The server's ``BatchGenerator``, its prefill batch from ``prompt_rows``."""

    class BatchGenerator(base):
        def __init__(self, model: Any, *args: Any, **kwargs: Any):
            if "prefill_batch_size" in kwargs:
                decoded = kwargs.get("completion_batch_size", PROMPT_ROWS)
                kwargs["prefill_batch_size"] = prompt_rows(model, kwargs["prefill_batch_size"], decoded)
            super().__init__(model, *args, **kwargs)

    BatchGenerator.__qualname__ = BatchGenerator.__name__ = base.__name__
    BatchGenerator.__module__ = base.__module__
    return BatchGenerator


def _iter(self: Any):
    """``TimeBudget.__iter__``: a round begins; no step has run yet."""
    self._lily_steps = 0
    return _stock["__iter__"](self)


def _next(self: Any):
    """``TimeBudget.__next__``: stock's budget, and the round's end once a
    request waits (after the round's first step)."""
    requests = getattr(self, "_lily_requests", None)
    steps = getattr(self, "_lily_steps", 0)
    self._lily_steps = steps + 1
    if requests is not None and steps > 0 and not requests.empty():
        raise StopIteration
    return _stock["_next"](self)


def install() -> None:
    """Wrap the server's ``TimeBudget`` iteration, its generator's request
    read and its ``BatchGenerator``'s prefill batch (idempotent; nothing
    where the environment turns it off or mlx-lm's server lacks them)."""
    if "_next" in _stock or not enabled():
        return
    try:
        server = program_module("mlx_lm.server")
        budget, generator = server.TimeBudget, server.ResponseGenerator
        for owner, name in ((budget, "__iter__"), (budget, "__next__"), (generator, "_next_request")):
            getattr(owner, name)
    except (ImportError, AttributeError) as exc:
        notice_once("admission-missing", f"this mlx-lm's server has no round budget to shorten ({exc}); "
                                         "requests are taken between its rounds, as stock takes them")
        return
    _stock.set("__iter__", budget, "__iter__", _iter)
    _stock.set("_next", budget, "__next__", _next)
    _stock.set("_next_request", generator, "_next_request", _next_request)
    batches = getattr(server, "BatchGenerator", None)
    if isinstance(batches, type):
        _stock.set("BatchGenerator", server, "BatchGenerator", _batch_generator(batches))


# Connections the server's listening socket queues before it accepts them
# (the standard library's socketserver: 5); Linux caps it at somaxconn.
LISTEN_BACKLOG = 128


def install_backlog() -> None:
    """Make ``mlx_lm.server`` listen with a queue of LISTEN_BACKLOG
    connections (idempotent; before the server starts; nothing where the
    environment turns admission off). The server class is the standard
    library's ``ThreadingHTTPServer``, whose ``request_queue_size`` its
    socket listens with: set on that class, which every copy of mlx-lm's
    server module uses (``python -m mlx_lm.server`` runs one that the startup
    hook cannot reach yet), in the one process that serves."""
    if "backlog" in _stock or not enabled():
        return
    import http.server

    base = http.server.ThreadingHTTPServer
    _stock.set("backlog", base, "request_queue_size", max(LISTEN_BACKLOG, base.request_queue_size))


def uninstall() -> None:
    _stock.undo()


def installed() -> bool:
    """Whether the rounds end early (``install``)."""
    return "_next" in _stock
