"""The official openai client against the gateway of a real local mesh."""

from __future__ import annotations

import pytest

from evenflow import SamplingParams

# > 16 tokens: remote prefill
LONG = "count from 100 : " + " ".join(str(i) for i in range(100, 114))
SHORT = "count from 17 :"  # < 16 tokens: prefilled on the decode worker


@pytest.mark.parametrize("prompt", [LONG, SHORT])
def test_greedy_completion_equals_offline_engine(client, offline, prompt):
    expected = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=12))[0]
    assert len(expected.text.split()) >= 5  # the model keeps counting: a real continuation
    out = client.completions.create(model="tiny-moe", prompt=prompt, max_tokens=12,
                                    temperature=0)
    assert out.choices[0].text == expected.text
    assert out.choices[0].finish_reason == expected.finish_reason
    assert out.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert out.usage.completion_tokens == len(expected.token_ids)
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    streamed = client.completions.create(model="tiny-moe", prompt=prompt, max_tokens=12,
                                         temperature=0, stream=True)
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks) == expected.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == [
        expected.finish_reason]


def test_chat_streamed_and_not(client, offline):
    messages = [{"role": "user", "content": "count from 5"}]
    expected = offline.chat(messages, SamplingParams(temperature=0, max_tokens=10))
    out = client.chat.completions.create(model="tiny-moe", messages=messages, temperature=0,
                                         max_completion_tokens=10)
    assert out.choices[0].message.content == expected.text
    assert out.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model="tiny-moe", messages=messages, temperature=0,
                                            max_tokens=10, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected.text
    assert len([c for c in chunks if c.choices and c.choices[0].finish_reason]) == 1
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(
        expected.token_ids)


def test_same_seed_same_text(client):
    # Long enough for remote prefill; the JSON object after "json =" is the model's pick.
    prompt = "reverse : a b c d e f g h i j = j i h g f e d c b a json ="

    def sample(seed):
        return client.completions.create(model="tiny-moe", prompt=prompt, max_tokens=16,
                                         temperature=1.0, seed=seed).choices[0].text

    first = sample(7)
    assert sample(7) == first
    assert any(sample(s) != first for s in (8, 9, 10))


def test_stop_string_cuts_the_text(client):
    out = client.completions.create(model="tiny-moe", prompt=SHORT, max_tokens=20,
                                    temperature=0, stop=[" 21"])
    assert out.choices[0].text == " 17 18 19 20"
    assert out.choices[0].finish_reason == "stop"
    stream = client.completions.create(model="tiny-moe", prompt=SHORT, max_tokens=20,
                                       temperature=0, stop=" 21", stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == " 17 18 19 20"


def test_cached_tokens_reported_for_a_repeated_prefix(client):
    prompt = LONG + " 125 126 127"
    client.completions.create(model="tiny-moe", prompt=prompt, max_tokens=2, temperature=0)
    again = client.completions.create(model="tiny-moe", prompt=prompt + " 128", max_tokens=2,
                                      temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens >= 16


def test_models_endpoint(client):
    assert [m.id for m in client.models.list().data] == ["tiny-moe"]
