"""The official ``openai`` Python client works against ``minikv serve`` (tiny-random, loopback)."""
from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")

from minikv import LLM  # noqa: E402
from minikv.serve import BackgroundServer, create_app  # noqa: E402

MODEL = "tiny"


@pytest.fixture(scope="module")
def oai(tiny_path):
    llm = LLM(str(tiny_path), enable_prefix_caching=True, num_blocks=256)
    app = create_app(llm, {"sk-test": "alice", "sk-other": "bob"}, model_name=MODEL, report_cached_tokens=True)
    with BackgroundServer(app) as srv:
        with openai.OpenAI(base_url=srv.base_url, api_key="sk-test", max_retries=0, timeout=60) as client:
            yield client


def test_models_list(oai):
    assert [m.id for m in oai.models.list()] == [MODEL]


def test_completions(oai):
    prompt = "The openai client talks to minikv " * 3
    r = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0,
                               extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and isinstance(r.choices[0].text, str)
    assert r.usage.completion_tokens == 5
    again = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0,
                                   extra_body={"ignore_eos": True})
    assert again.choices[0].text == r.choices[0].text
    assert again.usage.prompt_tokens_details.cached_tokens > 0


def test_chat(oai):
    r = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello!"}],
                                    max_tokens=4, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens >= 1


def test_chat_streaming(oai):
    stream = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Stream, please"}],
                                         max_tokens=6, temperature=0, stream=True,
                                         stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"]
    assert chunks[-1].usage.completion_tokens == 6
    full = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Stream, please"}],
                                       max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    assert text == full.choices[0].message.content


def test_errors_raise_typed_exceptions(oai):
    with pytest.raises(openai.BadRequestError):
        oai.completions.create(model=MODEL, prompt="x", max_tokens=0)
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="gpt-nope", prompt="x", max_tokens=2)
    bad = oai.with_options(api_key="sk-wrong")
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
