"""mlx_lm.server --backend lily, as a subprocess on a free loopback port,
driven by a real HTTP client."""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import time

import pytest

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
def server(demo_checkpoint):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "MLX_LM_BACKEND"}
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
    events = [line[len("data: "):] for line in payload.splitlines() if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    # Greedy: the stream spells the same text as the non-streamed answer.
    _, whole = request(port, "POST", "/v1/chat/completions", CHAT)
    assert streamed == json.loads(whole)["choices"][0]["message"]["content"]


def test_malformed_request_gets_4xx_and_server_keeps_serving(server):
    port, proc = server
    status, _ = request(port, "POST", "/v1/chat/completions", raw=b"{not json")
    assert 400 <= status < 500
    status, _ = request(port, "POST", "/v1/chat/completions", {"messages": "not a list", "max_tokens": "x"})
    assert 400 <= status < 500
    assert proc.poll() is None
    status, _ = request(port, "POST", "/v1/chat/completions", CHAT)
    assert status == 200
