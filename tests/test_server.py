"""mlx_lm.server --backend lily, as a subprocess on a free loopback port,
driven by a real HTTP client."""

from __future__ import annotations

import http.client
import json
import math
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from bench.serve import sse_chunks, sse_data

HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def request(port, method, path, body=None, raw: bytes | None = None, timeout=120):
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    payload = response.read().decode()
    conn.close()
    return response.status, payload


@pytest.fixture(scope="module")
def path_log(tmp_path_factory):
    """The file where the server records each kind of layer call's path."""
    return tmp_path_factory.mktemp("paths") / "paths.jsonl"


@pytest.fixture(scope="module")
def server(demo_checkpoint, path_log):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "MLX_LM_BACKEND"}
    env["MLX_LILY_TRACE_PATHS"] = str(path_log)
    proc = subprocess.Popen(
        ["mlx_lm.server", "--model", str(demo_checkpoint), "--backend", "lily",
         "--host", HOST, "--port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )
    deadline = time.time() + 120
    while time.time() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"server exited early:\n{proc.stdout.read()}")
        try:
            status, _ = request(port, "GET", "/v1/models", timeout=5)
            if status == 200:
                break
        except OSError:
            time.sleep(0.3)
    else:
        proc.kill()
        pytest.fail("server did not come up within 120 s")
    yield port, proc
    proc.terminate()
    try:
        output, _ = proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        output, _ = proc.communicate()
    # The model the server answered with was lily's.
    assert "runs on lily's model" in output, output


CHAT = {"messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": 12, "temperature": 0}


def test_non_streamed_chat_completion(server):
    port, _ = server
    status, payload = request(port, "POST", "/v1/chat/completions", CHAT)
    assert status == 200, payload
    body = json.loads(payload)
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["usage"]["completion_tokens"] > 0


def test_streamed_chat_completion(server):
    port, _ = server
    status, payload = request(port, "POST", "/v1/chat/completions", {**CHAT, "stream": True})
    assert status == 200
    events = list(sse_data(payload.splitlines()))
    assert events and events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    # Greedy: the stream spells the same text as the non-streamed answer.
    _, whole = request(port, "POST", "/v1/chat/completions", CHAT)
    assert streamed == json.loads(whole)["choices"][0]["message"]["content"]


def test_token_logprobs_are_the_greedy_tokens_own(server):
    """Each streamed token's log-prob (read off the decode stream for lily,
    mlx_lily/served_logprobs.py) is the largest among the top log-probs at
    its position: greedy picks the most likely token."""
    port, _ = server
    _, plain = request(port, "POST", "/v1/chat/completions", {**CHAT, "logprobs": True})
    _, top = request(port, "POST", "/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 3})
    chosen = json.loads(plain)["choices"][0]["logprobs"]["content"]
    tops = json.loads(top)["choices"][0]["logprobs"]["content"]
    assert len(chosen) == len(tops) == json.loads(plain)["usage"]["completion_tokens"]
    for mine, best in zip(chosen, tops):
        assert math.isfinite(mine["logprob"]) and mine["logprob"] <= 0
        assert mine["logprob"] == max(t["logprob"] for t in best["top_logprobs"])


def test_malformed_request_gets_4xx_and_server_keeps_serving(server):
    port, proc = server
    status, _ = request(port, "POST", "/v1/chat/completions", raw=b"{not json")
    assert 400 <= status < 500
    status, _ = request(port, "POST", "/v1/chat/completions", {"messages": "not a list", "max_tokens": "x"})
    assert 400 <= status < 500
    assert proc.poll() is None
    status, _ = request(port, "POST", "/v1/chat/completions", CHAT)
    assert status == 200


def stream_chat(port, content, max_tokens, stop_after=None, timeout=120):
    """Stream one chat completion; the text, or stop reading (and close the
    connection) after stop_after chunks."""
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True}
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body).encode(),
                 headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    text, chunks = [], 0
    for chunk in sse_chunks(response):
        if chunk["choices"]:
            text.append(chunk["choices"][0]["delta"].get("content") or "")
        chunks += 1
        if stop_after is not None and chunks >= stop_after:
            break
    conn.close()
    return "".join(text)


def read_paths(path_log):
    return [json.loads(line) for line in path_log.read_text().splitlines()]


PROMPTS = ["Tell me a story", "Count to ten, slowly", "Why is the sky blue?", "A poem about rivers"]


def test_every_layer_takes_lily_s_path_under_the_server(server, path_log):
    # The server generates through mlx-lm's batch generator even for one
    # request: BatchKVCache, batched ArraysCache and array masks. Every layer
    # call must take lily's path (the server records each kind of call).
    port, _ = server
    assert stream_chat(port, PROMPTS[0], 8)
    records = read_paths(path_log)
    assert records and all(r["path"].startswith("lily") for r in records), records
    assert {r["layer"] for r in records} == {"Gated DeltaNet", "full attention", "MoE"}
    calls = {(r["layer"], r["step"], r["mask"], r["cache"]) for r in records}
    assert ("full attention", "prefill", "array", "BatchKVCache+left_padding") in calls
    assert ("full attention", "decode", "array", "BatchKVCache+left_padding") in calls
    assert any(layer == "Gated DeltaNet" and step == "decode" and cache.startswith("ArraysCache")
               for layer, step, _, cache in calls)


def test_concurrent_streams_decode_together_without_cross_talk(server, path_log):
    port, _ = server
    max_tokens = 48
    alone = [stream_chat(port, p, max_tokens) for p in PROMPTS]
    assert len(set(alone)) == len(alone)  # distinct answers, so a swap would show
    results: dict[int, str] = {}
    errors = []
    start = threading.Barrier(len(PROMPTS))

    def client(i):
        try:
            start.wait()
            results[i] = stream_chat(port, PROMPTS[i], max_tokens)
        except Exception as exc:  # reported below, not lost in the thread
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    assert [results[i] for i in range(len(PROMPTS))] == alone
    # The streams did decode together, on lily's path.
    records = read_paths(path_log)
    assert all(r["path"].startswith("lily") for r in records), records
    assert any(r["step"] == "decode" and r["batch"] >= 2 for r in records), records


def test_a_client_disconnecting_mid_stream(server):
    port, proc = server
    want = stream_chat(port, PROMPTS[1], 16)
    stream_chat(port, PROMPTS[2], 400, stop_after=3)  # hangs up after 3 chunks
    # The server stays up, and the next stream is unaffected.
    assert proc.poll() is None
    assert stream_chat(port, PROMPTS[1], 16) == want
    status, _ = request(port, "POST", "/v1/chat/completions", CHAT)
    assert status == 200


@pytest.fixture
def refused_checkpoint(demo_checkpoint, tmp_path):
    """A checkpoint without one of its tensors: stock mlx-lm cannot load it
    either ("Missing 1 parameters"); lily names the tensor."""
    import shutil

    import mlx.core as mx

    path = tmp_path / "refused"
    shutil.copytree(demo_checkpoint, path)
    weights = dict(mx.load(str(path / "model.safetensors")))
    weights.pop("language_model.model.layers.1.linear_attn.A_log")
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    return path


@pytest.mark.parametrize("command", [["mlx_lm.server", "--backend", "lily"],
                                     [sys.executable, "-m", "mlx_lily", "serve"]])
def test_refused_checkpoint_stops_the_server_before_it_serves(refused_checkpoint, command):
    env = {k: v for k, v in os.environ.items() if k not in ("MLX_LM_BACKEND", "MLX_LILY_TRACEBACK")}
    proc = subprocess.Popen([*command, "--model", str(refused_checkpoint), "--host", HOST,
                             "--port", str(free_port())],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        out, err = proc.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"the server kept running with a checkpoint lily refuses:\n{out}{err}")
    assert proc.returncode == 1, out + err
    errors = [line for line in err.splitlines() if not line.startswith("[mlx-lily]")]
    assert errors == ["mlx-lily: checkpoint is missing tensor "
                      "'language_model.model.layers.1.linear_attn.A_log' (expected shape (4,))"], err
    assert "Traceback" not in out + err and "Starting httpd" not in out + err
