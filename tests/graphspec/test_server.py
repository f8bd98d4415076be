"""graphspec serve through the official openai client: the outputs Pipeline.run gives alone, streaming, bad input,
cancellation, metrics, the queue limit, and the CLI's server stopping on SIGTERM.

Servers run on a free 127.0.0.1 port (tests/graphspec/_server.py) over tiny random checkpoints.
"""

import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

import graphspec
from graphspec.engine import Engine

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
try:  # the openai client's HTTP library (httpx, or its successor httpx2)
    import httpx2 as httpx
except ImportError:
    import httpx

pytestmark = pytest.mark.usefixtures("single_thread")


def _serving(engine):
    from graphspec.server import background

    return background(engine, "tiny")


@pytest.fixture(scope="module")
def tiny(tiny_pair_dirs):
    target_dir, draft_dir = tiny_pair_dirs
    target = graphspec.load_model(target_dir)
    draft = graphspec.load_model(draft_dir)
    return {"dirs": (target_dir, draft_dir),
            "plain": graphspec.Pipeline(target),
            "spec": graphspec.Pipeline(target, draft, num_speculative_tokens=4, draft_siblings=2)}


def _client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


PROMPTS = ["hello world", "the cat sat on the mat", "a b c a b c a b", "one two three four", "zzz zzz zzz"]


def _request(i):
    """A mixed request: completion or chat, greedy or seeded sampling, several lengths."""
    chat = i % 2 == 1
    kw = dict(max_tokens=4 + (5 * i) % 17)
    if i % 3 == 0:
        kw.update(temperature=0.0)
    else:
        kw.update(temperature=0.8, seed=100 + i, top_p=0.95)
    prompt = PROMPTS[i % len(PROMPTS)]
    return chat, prompt, kw


def _alone(pipe, chat, prompt, kw):
    p = [{"role": "user", "content": prompt}] if chat else prompt
    return pipe.run(p, max_new_tokens=kw["max_tokens"], temperature=kw["temperature"], seed=kw.get("seed"),
                    top_p=kw.get("top_p", 1.0))


def _ask(client, chat, prompt, kw, stream=False):
    if chat:
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}],
                                           stream=stream, **kw)
        if stream:
            return "".join(c.choices[0].delta.content or "" for c in r if c.choices)
        return r.choices[0].message.content, r
    r = client.completions.create(model="tiny", prompt=prompt, stream=stream, **kw)
    if stream:
        return "".join(c.choices[0].text for c in r if c.choices)
    return r.choices[0].text, r


@pytest.mark.parametrize("which", ["plain", "spec"])
@pytest.mark.parametrize("concurrency", [1, 4, 16])
def test_concurrent_requests_get_what_pipeline_run_gives_alone(tiny, which, concurrency):
    pipe = tiny[which]
    requests = [_request(i) for i in range(max(concurrency, 4))]
    want = [_alone(pipe, *r) for r in requests]
    engine = Engine(pipe, max_batch=concurrency, policy="off")
    with _serving(engine) as url:
        client = _client(url)
        with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
            got = list(pool.map(lambda r: _ask(client, *r), requests))
        for (text, resp), w, r in zip(got, want, requests):
            assert text == w.text, r
            assert resp.usage.completion_tokens == len(w.token_ids)
            assert resp.usage.prompt_tokens == len(w.prompt_token_ids)
            assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
            stats = resp.model_extra["graphspec"]
            assert stats["target_forwards"] == w.stats.target_forwards
            assert stats["accepted_by_position"] == w.stats.accepted_per_position
            assert stats["tested_by_position"] == w.stats.tested_per_position
        # streaming: the joined pieces are the same text
        for r, w in list(zip(requests, want))[:3]:
            assert _ask(client, *r, stream=True) == w.text
    assert engine.running == 0 and engine.live_caches() == 0


def test_streams_cancelled_midway_leave_nothing_behind(tiny):
    engine = Engine(tiny["spec"], max_batch=8, max_queue=128, policy="off")
    with _serving(engine) as url:
        with httpx.Client(timeout=60) as http:
            for i in range(100):
                body = {"model": "tiny", "prompt": PROMPTS[i % 5], "max_tokens": 300, "stream": True,
                        "ignore_eos": True, "temperature": 0}
                with http.stream("POST", url + "/v1/completions", json=body) as resp:
                    assert resp.status_code == 200
                    for line in resp.iter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            break  # one chunk, then hang up
        deadline = time.monotonic() + 60
        while (engine.running or engine.waiting) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine.running == 0 and engine.waiting == 0
        assert engine.live_caches() == 0
        # nobody ran to the end: every one of them was cancelled
        metrics = _metrics(url)
        assert metrics[("graphspec_requests_total", (("endpoint", "completions"), ("outcome", "cancelled")))] == 100
        # and the next request is served
        text, _ = _ask(_client(url), False, "hello world", dict(max_tokens=5, temperature=0.0))
        assert text == tiny["spec"].run("hello world", max_new_tokens=5).text


BAD = [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "n": 2}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "logprobs": 2}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "x", "best_of": 3}, 400, "best_of"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 0.5}, 400, "presence_penalty"),
    ("/v1/completions", {"prompt": "x", "no_such_field": 1}, 400, "no_such_field"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 10**6}, 400, None),
    ("/v1/completions", {"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "seed": 2**64}, 400, "seed"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": [10**9]}, 400, None),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ("/v1/completions", {"prompt": "x", "echo": True}, 400, "echo"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "messages.0.content"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]},
     400, "tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json"}},
     400, "response_format"),
    ("/v1/chat/completions", [1, 2, 3], 400, None),
]


def test_bad_input_gets_an_openai_error_and_the_server_keeps_serving(tiny):
    engine = Engine(tiny["plain"], max_batch=2, policy="off")
    with _serving(engine) as url, httpx.Client(timeout=60) as http:
        for path, body, status, param in BAD:
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            r = http.post(url + path, content=content, headers={"content-type": "application/json"})
            assert r.status_code == status, (body, r.text)
            err = r.json()["error"]
            assert err["message"] and err["type"], body
            if param is not None:
                assert err["param"] == param, (body, err)
            # the next good request still succeeds
            ok = http.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3, "temperature": 0})
            assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == tiny["plain"].run(
                "hi", max_new_tokens=3).text
        assert http.get(url + "/v1/nothing").status_code == 404
        assert http.get(url + "/v1/models").json()["data"][0]["id"] == "tiny"
        assert http.get(url + "/health").json()["status"] == "ok"
    with pytest.raises(openai.BadRequestError, match="n must be 1"):
        with _serving(Engine(tiny["plain"], policy="off")) as url:
            _client(url).completions.create(model="tiny", prompt="x", n=2)


def _metrics(url) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics").text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_metrics_parse_and_add_up_to_what_was_served(tiny):
    engine = Engine(tiny["spec"], max_batch=4, policy="off")
    with _serving(engine) as url:
        client = _client(url)
        served = [_ask(client, *_request(i))[1] for i in range(6)]
        m = _metrics(url)
    completion = sum(r.usage.completion_tokens for r in served)
    prompt = sum(r.usage.prompt_tokens for r in served)
    assert m[("graphspec_generation_tokens_total", ())] == completion
    assert m[("graphspec_prompt_tokens_total", ())] == prompt
    finished = sum(v for (name, labels), v in m.items()
                   if name == "graphspec_requests_total" and ("outcome", "finished") in labels)
    assert finished == 6
    proposed = sum(r.model_extra["graphspec"]["proposed_draft_tokens"] for r in served)
    accepted = sum(r.model_extra["graphspec"]["accepted_draft_tokens"] for r in served)
    assert m[("graphspec_draft_tokens_proposed_total", ())] == proposed
    assert m[("graphspec_draft_tokens_accepted_total", ())] == accepted
    by_position = sum(v for (name, _), v in m.items() if name == "graphspec_draft_accepted_by_position_total")
    assert by_position == accepted
    assert m[("graphspec_acceptance_rate", ())] == pytest.approx(accepted / proposed)
    assert m[("graphspec_time_to_first_token_seconds_count", ())] == 6
    assert m[("graphspec_running_sequences", ())] == 0 and m[("graphspec_queue_length", ())] == 0


def test_a_full_queue_answers_429_at_once(tiny):
    engine = Engine(tiny["plain"], max_batch=1, max_queue=0, policy="off")
    # Once the busy request has sent its first line, its target steps wait until the test lets them go, so it
    # is still running when the second request arrives, however fast or loaded the machine is.
    step = engine._target.step
    hold, release = threading.Event(), threading.Event()
    held = []

    def held_step(*args, **kwargs):
        if hold.is_set() and not release.is_set():
            held.append(1)
            release.wait(timeout=60)
        return step(*args, **kwargs)

    engine._target.step = held_step
    with _serving(engine) as url, httpx.Client(timeout=60) as http:
        body = {"prompt": "hello", "max_tokens": 400, "stream": True, "ignore_eos": True, "temperature": 0}
        try:
            with http.stream("POST", url + "/v1/completions", json=body) as busy:
                lines = busy.iter_lines()
                next(lines)
                hold.set()
                t0 = time.monotonic()
                r = http.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
                assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
                assert time.monotonic() - t0 < 5
                assert engine.running  # the busy request was still in its slot
                deadline = time.monotonic() + 30
                while not held and time.monotonic() < deadline:
                    time.sleep(0.01)
                assert held  # its steps went through the held target
                release.set()
                for _ in lines:
                    pass
        finally:
            release.set()
        deadline = time.monotonic() + 30
        while engine.running and time.monotonic() < deadline:
            time.sleep(0.05)
        assert http.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_cli_serve_binds_localhost_and_stops_on_sigterm(tiny, tmp_path):
    target_dir, draft_dir = tiny["dirs"]
    port = _free_port()
    env = dict(os.environ)
    proc = subprocess.Popen([sys.executable, "-m", "graphspec", "serve", "--target", str(target_dir), "--draft",
                             str(draft_dir), "--dtype", "float32", "--threads", "1", "--port", str(port), "--draft-quantize", "none",
                             "--served-model-name", "tiny"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.2)
        text, _ = _ask(_client(url), True, "hello world", dict(max_tokens=6, temperature=0.0))
        assert isinstance(text, str)
        listening = subprocess.run(["ss", "-ltn"], capture_output=True, text=True).stdout if os.path.exists(
            "/usr/bin/ss") or os.path.exists("/bin/ss") else ""
        for line in listening.splitlines():
            if f":{port} " in line:
                assert "127.0.0.1:" in line, line
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        assert "Traceback" not in err
        assert "no prefix cache (auto)" in err  # an fp32 target: a row-exact prefill would cost more (auto: off)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_cli_serve_refuses_bad_flags(tiny):
    from graphspec.cli import main

    with pytest.raises(SystemExit) as e:
        main(["serve", "--target", str(tiny["dirs"][0]), "--port", "70000"])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        main(["serve", "--target", str(tiny["dirs"][0]), "--max-batch", "0"])
    assert e.value.code == 2


@pytest.mark.slow
def test_real_pair_eight_concurrent_chats_equal_pipeline_run():
    """The zoo's Qwen2.5-Coder-0.5B with the SmolLM2-135M draft (another tokenizer; int8 on the CPU), bf16
    where the level has a bf16 linear: 8 concurrent chat requests through the server, each equal to its
    Pipeline.run output alone. At the CPU level in force (the batched forward's row-exactness at every level
    is test_engine's step_many test)."""
    from graphspec.kernels import cpu

    dtype = "bfloat16" if cpu.bf16_linear() else "float32"
    target = graphspec.load_model("qwen2.5-coder-0.5b-instruct", dtype=dtype)
    draft = graphspec.load_model("smollm2-135m-instruct", dtype=dtype, quantize="int8")
    pipe = graphspec.Pipeline(target, draft, num_speculative_tokens=4)
    asks = ["Write a Python function that reverses a list.", "What is a monad? One sentence.",
            "List three prime numbers.", "def fib(n):", "Translate 'good morning' to French.",
            "Name a sorting algorithm and its complexity.", "What does HTTP 429 mean?", "Say hello in JSON."]
    want = [pipe.run([{"role": "user", "content": a}], max_new_tokens=24).text for a in asks]
    engine = Engine(pipe, max_batch=8, policy="off")
    with _serving(engine) as url:
        client = _client(url)
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            got = list(pool.map(lambda a: _ask(client, True, a, dict(max_tokens=24, temperature=0.0))[0], asks))
    assert got == want
