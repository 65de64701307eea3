"""Every HTTP error of the gateway is OpenAI-shaped, {"error": {message, type, param, code}},
with `param` naming the field at fault and the message saying it in the user's terms: unknown
routes and methods, empty and malformed bodies, each validation error, a context overflow
(the prompt's fault or max_tokens'), a bad schema / regex / grammar. The app runs in-process
with its Gateway built but never started: every request here is refused before any worker
would be asked."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from evenflow.gateway.app import create_app
from evenflow.gateway.jobs import Gateway
from evenflow.services.config import MeshConfig

CHAT = "/v1/chat/completions"
HI = [{"role": "user", "content": "count from 5"}]


@pytest.fixture(scope="module")
def http() -> TestClient:
    config = MeshConfig(model="tiny-moe")
    app = create_app(config)
    app.state.gateway = Gateway(config)  # (not started: no NATS; nothing here reaches it)
    return TestClient(app, raise_server_exceptions=False)


@pytest.fixture(scope="module")
def context(http) -> int:
    return http.app.state.gateway.max_model_len


def error(resp, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    err = body["error"]
    assert err["message"] and err["type"] and err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


def test_an_unknown_route_is_an_openai_404(http):
    err = error(http.get("/v1/nope"), 404, code="unknown_url")
    assert err["message"] == "Invalid URL (GET /v1/nope): no such route."
    assert err["type"] == "invalid_request_error"
    error(http.post("/v1/chat/completion", json={}), 404)


def test_a_wrong_method_is_an_openai_405_with_allow(http):
    resp = http.get(CHAT)
    err = error(resp, 405, code="method_not_allowed")
    assert resp.headers["allow"] == "POST" and "allowed: POST" in err["message"]
    assert "GET" in err["message"] and CHAT in err["message"]
    assert error(http.delete("/v1/models"), 405)["message"].endswith("(allowed: GET).")


def test_an_empty_body_names_the_missing_field(http):
    err = error(http.post(CHAT), 400, "model", "missing_required_parameter")
    assert "empty" in err["message"] and "'model' and 'messages'" in err["message"]
    err = error(http.post(CHAT, json={}), 400, "model", "missing_required_parameter")
    assert err["message"] == "Missing required parameter: 'model'."
    err = error(http.post(CHAT, json={"model": "tiny-moe"}), 400, "messages")
    assert err["message"] == "Missing required parameter: 'messages'."
    err = error(http.post("/v1/completions", json={"model": "tiny-moe"}), 400, "prompt")
    assert "'prompt'" in err["message"]


@pytest.mark.parametrize("content, words", [
    (b"{not json", "could not parse the JSON body"),
    (b'{"model": "tiny-moe", "messages": [], "temperature": NaN}', "could not parse"),
    (b'{"model": "tiny-moe",', "at character"),
    (b"[1, 2]", "must be a JSON object, not an array"),
    (b'"hi"', "must be a JSON object, not a string"),
])
def test_a_body_that_is_not_a_json_object_says_so(http, content, words):
    resp = http.post(CHAT, content=content, headers={"content-type": "application/json"})
    assert words in error(resp, 400)["message"]


def test_a_body_sent_as_a_form_says_to_send_json(http):
    resp = http.post(CHAT, content=b'{"model": "tiny-moe"}',
                     headers={"content-type": "application/x-www-form-urlencoded"})
    assert "Content-Type: application/json" in error(resp, 400, code="invalid_type")["message"]


@pytest.mark.parametrize("body, param, code, words", [
    ({"temperature": "hot"}, "temperature", "invalid_type", "Invalid type for 'temperature'"),
    ({"temperature": 5}, "temperature", "invalid_value", "less than or equal to 2"),
    ({"messages": [{"role": "user"}, {"role": "x", "content": "a"}]}, "messages[1].role",
     "invalid_value", "'system', 'user'"),
    ({"messages": [{"content": "a"}]}, "messages[0].role", "missing_required_parameter",
     "Missing required parameter: 'messages[0].role'."),
    ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content", "invalid_type",
     "a valid string or a valid list"),
    ({"stop_token_ids": [-1]}, "stop_token_ids[0]", "invalid_value", "'stop_token_ids[0]'"),
    ({"logit_bias": {"5": 101}}, "logit_bias.5", "invalid_value", "'logit_bias.5'"),
    ({"best_of": 3}, "best_of", "invalid_value", "best_of must equal n"),
    ({"messages": []}, "messages", "invalid_value", "at least 1 item"),
])
def test_each_validation_error_names_its_field(http, body, param, code, words):
    err = error(http.post(CHAT, json={"model": "tiny-moe", "messages": HI, **body}), 400,
                param, code)
    assert words in err["message"] and "Value error" not in err["message"], err


def test_a_bad_query_parameter_is_named_without_its_location(http):
    err = error(http.post("/admin/profile?worker=w&steps=x"), 400, "steps")
    assert "'steps'" in err["message"]


def test_max_tokens_past_the_context_blames_max_tokens(http, context):
    for field in ("max_tokens", "max_completion_tokens"):
        err = error(http.post(CHAT, json={"model": "tiny-moe", "messages": HI, field: 10**5}),
                    400, field, "context_length_exceeded")
        assert err["message"].startswith(f"'{field}' is too large: 100000.")
        assert f"maximum context length is {context} tokens" in err["message"]
        assert "input tokens" in err["message"]
    err = error(http.post("/v1/completions", json={"model": "tiny-moe", "prompt": "count",
                                                   "max_tokens": context}),
                400, "max_tokens", "context_length_exceeded")
    assert f"({context} > {context} - " in err["message"]


def test_the_completions_default_max_tokens_is_named_as_the_default(http, context):
    prompt = " ".join(["count"] * (context - 4))  # fits, but not with 16 more
    err = error(http.post("/v1/completions", json={"model": "tiny-moe", "prompt": prompt}), 400,
                "max_tokens", "context_length_exceeded")
    assert "16 (the default)" in err["message"]


def test_only_a_prompt_too_long_by_itself_blames_the_prompt(http, context):
    long = " ".join(["count"] * (context + 10))
    err = error(http.post(CHAT, json={"model": "tiny-moe", "max_tokens": 1,
                                      "messages": [{"role": "user", "content": long}]}),
                400, "messages", "context_length_exceeded")
    assert f"maximum context length is {context} tokens" in err["message"]
    assert "input tokens" in err["message"] and "messages" in err["message"]
    err = error(http.post("/v1/completions", json={"model": "tiny-moe", "prompt": long}), 400,
                "prompt", "context_length_exceeded")
    assert "reduce the length of the prompt" in err["message"]


@pytest.mark.parametrize("extra, param, said", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nonsense"}}}},
     "response_format", "response_format: invalid JSON schema: invalid type: nonsense"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "required": 3}}}},
     "response_format", "response_format: invalid JSON schema: expected array for 'required'"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "string", "pattern": "(a"}}}},
     "response_format", 'response_format: invalid JSON schema: invalid regex "(a": unclosed'),
    ({"guided_json": {"$ref": "#/defs/none"}}, "guided_json",
     "guided_json: invalid JSON schema: pointer '/defs/none' does not exist"),
    ({"guided_regex": "(unclosed"}, "guided_regex",
     'guided_regex: invalid regex "(unclosed": unclosed group'),
    ({"guided_grammar": "start: foo bar"}, "guided_grammar",
     'guided_grammar: invalid grammar: line 1, column 8: unknown name: "foo"'),
])
def test_a_bad_guide_says_why_in_the_users_terms(http, extra, param, said):
    err = error(http.post(CHAT, json={"model": "tiny-moe", "messages": HI, "max_tokens": 4,
                                      **extra}), 400, param)
    assert err["message"].startswith(said), err["message"]
    for internal in ("LEADING_SPACE", "%json", " | ", "start:", "at 3(8)"):
        assert internal not in err["message"].removeprefix(said), err["message"]


def test_an_unexpected_failure_is_an_openai_500(http, monkeypatch):
    def broken(*_args, **_kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(http.app.state.gateway, "build_job", broken)
    err = error(http.post(CHAT, json={"model": "tiny-moe", "messages": HI}), 500)
    assert err["type"] == "server_error" and "boom" not in err["message"]
