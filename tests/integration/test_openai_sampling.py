"""What a vLLM user expects of the sampling fields, through the official openai client and a
plain SSE client against a real local mesh: logprobs, n, penalties, logit_bias, min_tokens,
continuous usage, add_generation_prompt and system_fingerprint."""

from __future__ import annotations

import httpx
import orjson
from meshutil import API_KEY

from evenflow import SamplingParams

AUTH = {"Authorization": f"Bearer {API_KEY}"}

REPEATS = "reverse : b b b b b b b b ="  # tiny-moe answers with eight b's


def repeats(token_ids_or_text) -> int:
    items = token_ids_or_text.split() if isinstance(token_ids_or_text, str) else token_ids_or_text
    return len(items) - len(set(items))


def test_chat_logprobs_match_the_greedy_choice(client):
    out = client.chat.completions.create(
        model="tiny-moe", messages=[{"role": "user", "content": "count from 5"}],
        temperature=0, max_tokens=6, logprobs=True, top_logprobs=3)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    assert "".join(e.token for e in content).strip() == out.choices[0].message.content.strip()
    for entry in content:  # at temperature 0 the chosen token is the most likely one
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token
        assert abs(entry.top_logprobs[0].logprob - entry.logprob) < 1e-6
        assert entry.logprob <= 0 and bytes(entry.bytes).decode() == entry.token
    assert out.system_fingerprint


def test_completion_logprobs_streamed_and_not(client, mesh):
    prompt = "count from 17 :"
    out = client.completions.create(model="tiny-moe", prompt=prompt, temperature=0,
                                    max_tokens=5, logprobs=2)
    lp = out.choices[0].logprobs
    assert "".join(lp.tokens) == out.choices[0].text
    assert len(lp.token_logprobs) == 5 and all(len(t) <= 2 for t in lp.top_logprobs)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    body = {"model": "tiny-moe", "prompt": prompt, "temperature": 0, "max_tokens": 5,
            "logprobs": 2, "stream": True}
    tokens = []
    with httpx.stream("POST", mesh.url + "/v1/completions", json=body, timeout=60,
                      headers=AUTH) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                chunk = orjson.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0]["logprobs"]:
                    tokens += chunk["choices"][0]["logprobs"]["tokens"]
    assert tokens == lp.tokens


def test_n_choices_with_a_seed_reproduce(client):
    def three():
        out = client.completions.create(model="tiny-moe", prompt="count from", n=3, seed=11,
                                        temperature=1.0, max_tokens=6)
        assert sorted(c.index for c in out.choices) == [0, 1, 2]
        return [c.text for c in sorted(out.choices, key=lambda c: c.index)], out.usage

    (first, usage), (again, _) = three(), three()
    assert first == again and len(set(first)) > 1  # reproducible, and the choices differ
    assert 3 <= usage.completion_tokens <= 18  # the three choices' tokens, summed
    stream = client.chat.completions.create(
        model="tiny-moe", messages=[{"role": "user", "content": "count from 5"}], n=2,
        temperature=0, max_tokens=4, stream=True)
    texts, finished = ["", ""], [0, 0]
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            finished[c.index] += bool(c.finish_reason)
    assert texts[0] == texts[1] and texts[0] and finished == [1, 1]


def test_penalties_discourage_repeats(client, offline):
    plain = client.completions.create(model="tiny-moe", prompt=REPEATS, temperature=0,
                                      max_tokens=8)
    penalized = client.completions.create(model="tiny-moe", prompt=REPEATS, temperature=0,
                                          max_tokens=8, frequency_penalty=2.0)
    assert repeats(penalized.choices[0].text) < repeats(plain.choices[0].text)
    expected = offline.generate([REPEATS], SamplingParams(temperature=0, max_tokens=8,
                                                          frequency_penalty=2.0))[0]
    assert penalized.choices[0].text == expected.text  # the engine's own result

    def repeated_tokens(presence: float) -> int:
        out = client.completions.create(model="tiny-moe", prompt="a a a a", n=16, seed=3,
                                        temperature=1.0, max_tokens=12,
                                        presence_penalty=presence)
        return sum(repeats(c.text) for c in out.choices)

    assert repeated_tokens(2.0) < repeated_tokens(-2.0)


def test_logit_bias_and_min_tokens(client, offline):
    token = offline.tokenizer.encode(" x", add_special_tokens=False)[0]
    out = client.completions.create(model="tiny-moe", prompt="count from 5 :", temperature=0,
                                    max_tokens=3, logit_bias={str(token): 100})
    assert out.choices[0].text == " x x x"
    short = client.completions.create(model="tiny-moe", prompt="reverse : q w =",
                                      temperature=0, max_tokens=10)
    assert short.choices[0].finish_reason == "stop" and short.usage.completion_tokens < 8
    longer = client.completions.create(model="tiny-moe", prompt="reverse : q w =",
                                       temperature=0, max_tokens=10,
                                       extra_body={"min_tokens": 8})
    assert longer.usage.completion_tokens >= 8


def test_continuous_usage_and_add_generation_prompt(mesh):
    body = {"model": "tiny-moe", "messages": [{"role": "user", "content": "count from 5"}],
            "temperature": 0, "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    usages = []
    with httpx.stream("POST", mesh.url + "/v1/chat/completions", json=body, timeout=60,
                      headers=AUTH) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                usages.append(orjson.loads(line[6:])["usage"]["completion_tokens"])
    # every chunk carries the usage so far; a token of no text (the random model's greedy
    # output, which batch composition can tip) adds to the next chunk's count, not a chunk
    assert usages == sorted(usages) and usages[0] >= 1 and usages[-1] == 4
    assert 2 <= len(usages) <= 5  # (the content chunks, then the usage chunk)

    def prompt_tokens(add: bool) -> int:
        resp = httpx.post(mesh.url + "/v1/chat/completions", timeout=60, headers=AUTH, json={
            "model": "tiny-moe", "messages": [{"role": "user", "content": "count from 5"}],
            "max_tokens": 1, "add_generation_prompt": add})
        return resp.json()["usage"]["prompt_tokens"]

    assert prompt_tokens(False) < prompt_tokens(True)


def test_tokenize_detokenize_version_and_live(mesh, client):
    assert httpx.get(mesh.url + "/live", timeout=10).json() == {"status": "alive"}  # no key
    assert httpx.get(mesh.url + "/version", timeout=10).json()["version"]
    ids = httpx.post(mesh.url + "/tokenize", headers=AUTH, timeout=10, json={
        "model": "tiny-moe", "prompt": "count from 5 :"}).json()
    assert ids["count"] == len(ids["tokens"]) > 0
    text = httpx.post(mesh.url + "/detokenize", headers=AUTH, timeout=10,
                      json={"model": "tiny-moe", "tokens": ids["tokens"]}).json()["prompt"]
    assert text.endswith("count from 5 :")
    messages = [{"role": "user", "content": "count from 5"}]
    chat_ids = httpx.post(mesh.url + "/tokenize", headers=AUTH, timeout=10,
                          json={"model": "tiny-moe", "messages": messages}).json()
    out = client.chat.completions.create(model="tiny-moe", messages=messages, max_tokens=1)
    assert chat_ids["count"] == out.usage.prompt_tokens
    bad = httpx.post(mesh.url + "/detokenize", headers=AUTH, timeout=10,
                     json={"tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_vllm_compatible_metrics_on_the_gateway_and_every_worker(mesh, client):
    client.completions.create(model="tiny-moe", prompt="count from 5 :", max_tokens=4)
    gateway = httpx.get(mesh.url + "/metrics", headers=AUTH, timeout=10).text
    for name in ("vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count",
                 "vllm:e2e_request_latency_seconds_count", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total", "vllm:prefix_cache_queries_total",
                 "vllm:prefix_cache_hits_total"):
        assert f'{name}{{model_name="tiny-moe"}}' in gateway, name
    assert 'vllm:request_success_total{finished_reason="length",model_name="tiny-moe"}' in gateway
    assert 'worker="all"' not in gateway  # no synthetic total to double a sum()
    urls = mesh.metrics_urls()
    assert {"d0", "p0", "kv0"} <= set(urls)
    for worker in ("d0", "p0"):
        text = httpx.get(urls[worker], timeout=10).text
        for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                     "vllm:kv_cache_usage_perc"):
            assert f'{name}{{model_name="tiny-moe"}}' in text, (worker, name)
        assert "vllm:time_to_first_token_seconds_count" not in text  # the gateway's alone
    assert "evenflow_kv_index_events_total" in httpx.get(urls["kv0"], timeout=10).text


def test_bench_serve_against_a_running_server_writes_json_and_charts(mesh, tmp_path):
    from evenflow.bench.mesh import serve_bench

    out = tmp_path / "load.json"
    assert serve_bench.main(["--base-url", mesh.url + "/v1", "--api-key", API_KEY,
                             "--num-requests", "6", "--concurrency", "3", "--prompt-len", "16",
                             "--output-len", "4", "--request-rate", "50", "--json", str(out),
                             "--plot", str(tmp_path / "plots")]) == 0
    result = orjson.loads(out.read_bytes())
    assert result["completed"] == 6 and result["failed"] == 0
    assert result["settings"]["request_rate"] == 50 and "api_key" not in result["settings"]
    assert result["ttft_ms"]["p50"] > 0 and len(result["requests"]) == 6
    for name in ("ttft_cdf.png", "itl_cdf.png", "throughput.png"):
        assert (tmp_path / "plots" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_echo_with_prompt_logprobs_scores_a_continuation(client):
    """lm-eval's loglikelihood request: echo, logprobs, max_tokens 0."""
    def score(text: str):
        out = client.completions.create(model="tiny-moe", prompt=text, max_tokens=0,
                                        echo=True, logprobs=1, temperature=0)
        choice = out.choices[0]
        assert choice.text == text and out.usage.completion_tokens == 0
        lp = choice.logprobs
        assert "".join(lp.tokens) == text and lp.token_logprobs[0] is None
        assert all(x <= 0 for x in lp.token_logprobs[1:])
        return lp.token_logprobs

    right, wrong = score("count from 17 : 17 18 19"), score("count from 17 : 17 18 55")
    assert right[-1] > wrong[-1]  # the model expects 19 after 18
    # the same number the model gives when it generates that token itself
    generated = client.completions.create(model="tiny-moe", prompt="count from 17 : 17 18",
                                          max_tokens=1, temperature=0, logprobs=0)
    assert generated.choices[0].text == " 19"
    assert abs(generated.choices[0].logprobs.token_logprobs[0] - right[-1]) < 0.05
    # echo with generation: the prompt, then the completion; logprobs cover both
    out = client.completions.create(model="tiny-moe", prompt="count from 5 :", max_tokens=3,
                                    echo=True, logprobs=0, temperature=0)
    assert out.choices[0].text.startswith("count from 5 :")
    assert "".join(out.choices[0].logprobs.tokens) == out.choices[0].text
