"""The server takes requests that arrive mid-round after the current step
(mlx_lily/server_admission.py).

mlx_lm.server's generation loop reads its request queue, then runs a round
of batch steps for as long as its ``TimeBudget`` allows (half a second).
With lily's admission installed a round also ends once a request waits,
after at least one step. These tests drive mlx-lm's own ``TimeBudget`` and
``ResponseGenerator._next_request`` the way the loop calls them.
"""

from __future__ import annotations

import json
import os
import threading
import time
from queue import Queue

import pytest

pytest.importorskip("mlx_lm.server")
from mlx_lm import server  # noqa: E402

from mlx_lily import server_admission  # noqa: E402

STEPS_AT_MOST = 40


class Loop:
    """What ``_next_request`` reads of the server's generator: its queue,
    its round budget (mlx-lm's, long enough never to end a round here) and
    whether it is distributed."""

    def __init__(self, distributed: bool = False):
        self.requests = Queue()
        self._time_budget = server.TimeBudget(budget=60.0)
        self._is_distributed = distributed
        self._rank = 0

    def _share_request(self, request):
        return request

    def round(self, arrive_after=None):
        """One pass of the loop: read the queue (empty here), then a round of
        steps; a request arrives during step ``arrive_after`` (1-based).
        Returns the steps the round ran."""
        assert server.ResponseGenerator._next_request(self) is None
        steps = 0
        for _ in self._time_budget:
            steps += 1
            if steps == arrive_after:
                self.requests.put("a request")
            if steps == STEPS_AT_MOST:
                break
        return steps


@pytest.fixture
def admission(monkeypatch):
    monkeypatch.delenv(server_admission.ENV, raising=False)
    server_admission.install()
    yield
    server_admission.uninstall()


def test_a_round_ends_after_the_step_during_which_a_request_arrived(admission):
    loop = Loop()
    assert loop.round(arrive_after=3) == 3
    # The next pass takes it, then rounds run on while nothing waits.
    assert server.ResponseGenerator._next_request(loop) == "a request"
    assert loop.round() == STEPS_AT_MOST


def test_a_round_runs_at_least_one_step(admission):
    """A request that is already waiting when a round begins (it arrived
    after the queue was read) still lets the batch take a step."""
    loop = Loop()
    assert server.ResponseGenerator._next_request(loop) is None
    loop.requests.put("a request")
    steps = sum(1 for _ in loop._time_budget)
    assert steps == 1


def test_a_distributed_server_keeps_stock_rounds(admission):
    assert Loop(distributed=True).round(arrive_after=3) == STEPS_AT_MOST


def _poll(loop):
    """The loop's poll while a batch is under way (no timeout), timed."""
    began = time.perf_counter()
    request = server.ResponseGenerator._next_request(loop)
    return request, time.perf_counter() - began


def _put_after(loop, seconds, request):
    timer = threading.Timer(seconds, loop.requests.put, args=(request,))
    timer.start()
    return timer


@pytest.fixture
def slow_burst(admission, monkeypatch):
    """Bursts measured in tenths of a second, so a loaded CI machine's
    scheduling does not decide the outcome."""
    monkeypatch.setattr(server_admission, "BURST_GAP_S", 0.4)
    monkeypatch.setattr(server_admission, "BURST_MAX_S", 1.0)


def test_a_request_arriving_just_after_another_joins_it(slow_burst):
    """The poll after a request was taken waits for the burst's next one
    (which the loop then inserts before its prefill call), and no longer."""
    loop = Loop()
    loop.requests.put("first")
    assert _poll(loop)[0] == "first"
    _put_after(loop, 0.1, "second").join()
    request, waited = _poll(loop)
    assert request == "second"
    request, waited = _poll(loop)  # nothing more comes: the gap's end, then the batch call
    assert request is None and 0.2 < waited < 0.8


def test_no_wait_once_the_gap_has_passed(slow_burst):
    loop = Loop()
    loop.requests.put("first")
    assert _poll(loop)[0] == "first"
    time.sleep(0.45)
    request, waited = _poll(loop)
    assert request is None and waited < 0.1
    # Nor before any request was taken.
    request, waited = _poll(Loop())
    assert request is None and waited < 0.1


def test_a_burst_is_taken_for_at_most_its_limit(slow_burst):
    """Requests that keep coming within the gap are taken until BURST_MAX_S
    after the burst's first; then the poll returns at once."""
    loop = Loop()
    loop.requests.put(0)
    assert _poll(loop)[0] == 0
    began = time.perf_counter()
    taken = [0]
    while time.perf_counter() - began < 2.0:
        timer = _put_after(loop, 0.25, len(taken))
        request, _ = _poll(loop)
        if request is None:
            timer.cancel()
            break
        taken.append(request)
    assert 2 <= len(taken) <= 6, taken
    assert time.perf_counter() - began < 1.6


def test_a_distributed_server_takes_no_burst(slow_burst):
    loop = Loop(distributed=True)
    loop.requests.put("first")
    assert _poll(loop)[0] == "first"
    request, waited = _poll(loop)
    assert request is None and waited < 0.1


def test_stock_rounds_without_it(monkeypatch):
    """Not installed, uninstalled, or turned off by the environment: the
    round runs on with a request waiting, as stock's does."""
    assert not server_admission.installed()
    assert Loop().round(arrive_after=3) == STEPS_AT_MOST
    server_admission.install()
    server_admission.uninstall()
    assert Loop().round(arrive_after=3) == STEPS_AT_MOST
    monkeypatch.setenv(server_admission.ENV, "0")
    server_admission.install()
    try:
        assert not server_admission.installed()
        assert Loop().round(arrive_after=3) == STEPS_AT_MOST
    finally:
        server_admission.uninstall()


def test_install_is_idempotent(admission):
    held = server.TimeBudget.__next__
    server_admission.install()
    assert server.TimeBudget.__next__ is held
    server_admission.uninstall()
    assert server.TimeBudget.__next__ is not held
    server_admission.install()  # the fixture's uninstall finds it installed


def test_the_backend_installs_it_when_the_server_loads_a_lily_model(demo_checkpoint, monkeypatch):
    from mlx_lily import backend, prefix_reuse, served_logprobs

    monkeypatch.setattr(backend, "current_program", lambda: "mlx_lm.server")
    monkeypatch.setenv("MLX_LILY_PRIME", "0")
    monkeypatch.delenv(server_admission.ENV, raising=False)
    try:
        model, _ = backend._lily_load_model(demo_checkpoint)
        assert type(model).__module__.startswith("mlx_lily") and server_admission.installed()
    finally:
        for feature in (server_admission, served_logprobs, prefix_reuse):
            feature.uninstall()
    assert Loop().round(arrive_after=3) == STEPS_AT_MOST


def test_a_value_that_is_not_0_or_1_is_named_in_one_notice(monkeypatch, fresh_notices, capsys):
    for value, meant in (("0", False), ("off", False), ("1", True), ("", True), ("yes", True)):
        monkeypatch.setenv(server_admission.ENV, value)
        assert server_admission.enabled() is meant
    assert capsys.readouterr().err == ""
    monkeypatch.setenv(server_admission.ENV, "sometimes")
    assert server_admission.enabled() and server_admission.enabled()
    said = capsys.readouterr().err
    assert said.count("\n") == 1 and f"{server_admission.ENV}='sometimes'" in said


def test_the_admission_diagnostic_times_both_settings(demo_checkpoint, tmp_path, monkeypatch):
    """``bench.diagnostics.serving.admission``: a lily server per setting, a
    short request's time to first token while a long one decodes."""
    from bench.diagnostics.serving import admission

    monkeypatch.delenv("MLX_LM_BACKEND", raising=False)
    monkeypatch.setenv(server_admission.ENV, "1")
    assert admission.main(["--model", str(demo_checkpoint), "--reps", "2", "--long-tokens", "24",
                           "--timeout-s", "240", "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "admission.json").read_text())
    assert set(record["settings"]) == {"1", "0"} and record["round_s"] == admission.ROUND_S
    for r in record["settings"].values():
        assert len(r["ttft_s"]) == 2 and all(t > 0 for t in r["ttft_s"]) and r["ttft_max_s"] == max(r["ttft_s"])
    assert (tmp_path / "server-lily-admission-0.log").exists() and (tmp_path / "server-lily-admission-1.log").exists()
    assert "| 0 |" in (tmp_path / "admission.md").read_text()
    assert os.environ[server_admission.ENV] == "1"  # put back as it was


class _Handler:
    """Stands in for mlx-lm's APIHandler, as ``_run_http_server`` builds it
    (the response generator first): answers every POST at once."""

    def __new__(cls, response_generator, *args, system_fingerprint=None, **kwargs):
        from http.server import BaseHTTPRequestHandler

        class Quick(BaseHTTPRequestHandler):
            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                self.send_response(200)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *a):
                pass

        return Quick(*args, **kwargs)


def _burst(clients: int, busy: bool = True):
    """mlx-lm's ``_run_http_server`` (as installed now) serving on a free
    port while another thread keeps the interpreter busy, as the generation
    thread does; ``clients`` connections made together. Returns the server's
    queue size and each client's seconds to its answer (None: the
    connection failed)."""
    import http.client
    import threading
    import time
    from http.server import ThreadingHTTPServer

    built = []

    class Recording(ThreadingHTTPServer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built.append(self)

    class Generator:
        def stop_and_join(self):
            pass

    serving = threading.Thread(target=server._run_http_server, args=("127.0.0.1", 0, Generator()),
                               kwargs={"server_class": Recording, "handler_class": _Handler}, daemon=True)
    serving.start()
    while not built:
        time.sleep(0.01)
    httpd = built[0]
    stop = threading.Event()

    def hold_the_interpreter():
        x = 0
        while not stop.is_set():
            for i in range(20000):
                x += i

    if busy:
        threading.Thread(target=hold_the_interpreter, daemon=True).start()
    barrier, seconds = threading.Barrier(clients), [None] * clients

    def client(i):
        barrier.wait()
        t0 = time.perf_counter()
        try:
            conn = http.client.HTTPConnection("127.0.0.1", httpd.server_address[1], timeout=10)
            conn.request("POST", "/", body=b"{}")
            conn.getresponse().read()
            seconds[i] = time.perf_counter() - t0
        except OSError:
            pass

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    stop.set()
    httpd.shutdown()
    httpd.server_close()
    return httpd.request_queue_size, seconds


def test_a_burst_of_16_connections_is_accepted_at_once(monkeypatch):
    """Installed, the server listens with LISTEN_BACKLOG: 16 clients that
    connect together while the interpreter is busy all get their answers
    well within the second after which a dropped connection is retried."""
    monkeypatch.delenv(server_admission.ENV, raising=False)
    server_admission.install_backlog()
    try:
        queue, seconds = _burst(16)
    finally:
        server_admission.uninstall()
    assert queue == server_admission.LISTEN_BACKLOG
    assert all(s is not None for s in seconds), seconds
    assert max(seconds) < 0.9, seconds


def test_the_backlog_is_stocks_without_it(monkeypatch):
    """Not installed, uninstalled, or turned off: the standard library's 5."""
    from http.server import ThreadingHTTPServer

    assert ThreadingHTTPServer.request_queue_size == 5
    queue, _ = _burst(2, busy=False)
    assert queue == 5
    monkeypatch.setenv(server_admission.ENV, "0")
    server_admission.install_backlog()
    try:
        assert "backlog" not in server_admission._stock
        assert _burst(2, busy=False)[0] == 5
    finally:
        server_admission.uninstall()
    monkeypatch.delenv(server_admission.ENV)
    server_admission.install_backlog()
    server_admission.install_backlog()  # idempotent
    server_admission.uninstall()
    assert ThreadingHTTPServer.request_queue_size == 5


def test_serving_with_lily_installs_the_backlog_before_the_server_starts(monkeypatch, demo_checkpoint):
    from http.server import ThreadingHTTPServer

    from mlx_lily import backend

    monkeypatch.delenv(server_admission.ENV, raising=False)
    monkeypatch.setitem(server_admission._command_line, "prompt_rows_given", None)
    try:
        backend.check_before_serving(["--model", str(demo_checkpoint)])
        assert ThreadingHTTPServer.request_queue_size == server_admission.LISTEN_BACKLOG
        assert server_admission._command_line["prompt_rows_given"] is False
        backend.check_before_serving(["--model", str(demo_checkpoint), "--prompt-concurrency", "2"])
        assert server_admission._command_line["prompt_rows_given"] is True
    finally:
        server_admission.uninstall()
    assert ThreadingHTTPServer.request_queue_size == 5


def test_a_server_run_as_python_m_gets_the_patches(monkeypatch, run_as_main):
    """``python -m mlx_lm.server``: the program is ``__main__``, and
    importing ``mlx_lm.server`` would load a second copy that it never calls;
    the patches made at model load land on ``__main__``'s classes."""
    import sys

    from mlx_lily._patches import loaded_program_module, program_module

    main = run_as_main("mlx_lm.server", TimeBudget=type("TimeBudget", (server.TimeBudget,), {}),
                       ResponseGenerator=type("ResponseGenerator", (server.ResponseGenerator,), {}),
                       BatchGenerator=server.BatchGenerator)
    assert program_module("mlx_lm.server") is main and loaded_program_module("mlx_lm.server") is main
    assert program_module("mlx_lm.generate") is sys.modules["mlx_lm.generate"]
    monkeypatch.delenv(server_admission.ENV, raising=False)
    held = server.TimeBudget.__dict__["__next__"]
    server_admission.install()
    try:
        assert main.TimeBudget.__dict__["__next__"] is server_admission._next
        assert server.TimeBudget.__dict__["__next__"] is held  # the copy the program never calls
        assert main.BatchGenerator is not server.BatchGenerator
    finally:
        server_admission.uninstall()
    assert main.TimeBudget.__next__ is held  # stock's again
    assert main.BatchGenerator is server.BatchGenerator


@pytest.mark.parametrize("argv, given", [
    (["--model", "m"], False),
    (["--model", "m", "--prompt-concurrency", "4"], True),
    (["--prompt-concurrency=4", "--model", "m"], True),
    (["--prompt-co", "4"], True),  # an abbreviation argparse accepts
    (["--prompt-cache-size", "3", "--prompt-cache-bytes", "1GB"], False),
    ([], False),
])
def test_the_command_line_says_whether_it_sets_the_prefill_batch(argv, given, monkeypatch):
    monkeypatch.setitem(server_admission._command_line, "prompt_rows_given", None)
    server_admission.read_command_line(argv)
    assert server_admission._command_line["prompt_rows_given"] is given


@pytest.fixture
def demo_models(demo_checkpoint):
    import mlx_lily

    lily, _ = mlx_lily.load(str(demo_checkpoint), backend="lily")
    stock, _ = mlx_lily.load(str(demo_checkpoint), backend="mlx")
    return lily, stock


def test_a_lily_server_prefills_a_burst_of_16_prompts_in_one_call(admission, demo_models, monkeypatch,
                                                                   fresh_notices, capsys):
    """Command line without --prompt-concurrency: the server's BatchGenerator
    takes 16 prompts a prefill call for lily's model (one notice), and its
    first call prefills all 16 of a burst; stock's model keeps the 8 given."""
    from mlx_lily.kernels.moe.decode import MAX_BATCH

    assert server_admission.PROMPT_ROWS <= MAX_BATCH
    lily, stock = demo_models
    monkeypatch.setitem(server_admission._command_line, "prompt_rows_given", None)
    server_admission.read_command_line(["--model", "m"])
    gen = server.BatchGenerator(lily, completion_batch_size=32, prefill_batch_size=8)
    try:
        assert isinstance(gen, server_admission._stock["BatchGenerator"])
        assert gen.prefill_batch_size == server_admission.PROMPT_ROWS
        gen.insert([[3 + i, 5, 7 + i] for i in range(16)], max_tokens=[2] * 16)
        prompts, _ = gen.next()
        assert len(prompts) == 16
    finally:
        gen.close()
    said = capsys.readouterr().err
    assert said.count("\n") == 1 and "16 prompts" in said and "--prompt-concurrency not given" in said
    assert server.BatchGenerator(stock, prefill_batch_size=8).prefill_batch_size == 8


@pytest.mark.parametrize("setting", ["flag given", "no command line", "packing off", "larger asked"])
def test_the_prefill_batch_is_the_servers_otherwise(setting, admission, demo_models, monkeypatch):
    lily, _ = demo_models
    asked = 24 if setting == "larger asked" else 8
    monkeypatch.setitem(server_admission._command_line, "prompt_rows_given", None)
    if setting != "no command line":
        server_admission.read_command_line(["--prompt-concurrency", "8"] if setting == "flag given" else [])
    if setting == "packing off":
        monkeypatch.setenv("MLX_LILY_PACK_PROMPTS", "0")
    assert server.BatchGenerator(lily, prefill_batch_size=asked).prefill_batch_size == asked


@pytest.mark.parametrize("decoded, rows", [(32, 16), (12, 12), (4, 8)])
def test_the_prefill_batch_stays_within_the_decode_concurrency(decoded, rows, admission, demo_models,
                                                              monkeypatch):
    """--decode-concurrency below 16 bounds lily's prefill batch (never
    below the 8 asked: stock's own batch then)."""
    lily, _ = demo_models
    monkeypatch.setitem(server_admission._command_line, "prompt_rows_given", None)
    server_admission.read_command_line(["--decode-concurrency", str(decoded)])
    gen = server.BatchGenerator(lily, completion_batch_size=decoded, prefill_batch_size=8)
    assert gen.prefill_batch_size == rows and gen.completion_batch_size == max(decoded, rows)


def test_uninstall_gives_the_server_its_batch_generator_back(monkeypatch):
    from mlx_lm.generate import BatchGenerator

    monkeypatch.delenv(server_admission.ENV, raising=False)
    server_admission.install()
    assert server.BatchGenerator is not BatchGenerator
    server_admission.uninstall()
    assert server.BatchGenerator is BatchGenerator
