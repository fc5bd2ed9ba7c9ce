"""OpenAI's request and response shapes (`coordinator/openai_api.py`), without a cluster: what a
body asks for, what is refused rather than ignored, and the chunks' text offsets."""

from __future__ import annotations

import pytest

from layerline.coordinator.generation import Delta, Finished
from layerline.coordinator.openai_api import Answer, asked, messages_of, prompt_of
from layerline.shared.errors import InvalidInput


def test_a_chat_body_becomes_sampling_limits_and_stream_options() -> None:
    body = {
        "model": "m",
        "max_completion_tokens": 7,
        "max_tokens": 99,  # max_completion_tokens wins, as OpenAI's newer name
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": -1,  # vLLM's "every token"
        "seed": 3,
        "stop": "END",
        "logprobs": True,
        "top_logprobs": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
        "user": "ignored: it changes nothing",
    }
    got = asked(body, chat=True)
    assert (got.max_tokens, got.stop, got.model, got.stream, got.include_usage, got.logprobs) == (
        7, ["END"], "m", True, True, True,
    )  # fmt: skip
    s = got.sampling
    assert (s.temperature, s.top_p, s.top_k, s.seed, s.logprobs) == (0.5, 0.9, 0, 3, 2)
    completion = asked({"prompt": "x", "logprobs": 0}, chat=False)
    assert completion.logprobs and completion.sampling.logprobs == 0 and completion.sampling.temperature == 1.0
    assert completion.speculate is None  # the coordinator's --speculate
    assert asked({"prompt": "x", "speculate": 4}, chat=False).speculate == 4  # layerline's extra field
    with pytest.raises(InvalidInput, match="speculate must be an integer"):
        asked({"prompt": "x", "speculate": "4"}, chat=False)


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"n": 2}, "n = 2: only n = 1 is served"),
        ({"n": "1"}, "n must be an integer"),
        ({"presence_penalty": 0.1}, "presence_penalty = 0.1 is not served; repetition_penalty"),
        ({"response_format": {"type": "json_object"}}, "response_format is not served"),
        ({"tool_choice": "auto"}, "tool_choice is not served"),
        ({"min_tokens": 3}, "min_tokens is not served"),
        ({"max_completion_tokens": 0}, "max_completion_tokens = 0 must be >= 1"),
        ({"logprobs": True, "top_logprobs": 25}, "top_logprobs = 25 must be in [0, 20]"),
        ({"top_logprobs": 2}, "top_logprobs needs logprobs = true"),
        ({"stream_options": {"include_usage": True}}, "stream_options needs stream = true"),
        ({"stream": True, "stream_options": {"include_usage": "yes"}}, "include_usage must be a bool"),
        ({"temperature": True}, "temperature must be a number"),
        ({"stop": [1]}, "stop must be a string or a list of strings"),
    ],
)
def test_what_is_not_served_is_refused_naming_the_field(body: dict, words: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(InvalidInput) as raised:
        asked(body, chat=True)
    assert words in str(raised.value)


def test_prompts_and_messages() -> None:
    assert prompt_of({"prompt": ["one"]}) == "one"
    for prompt, words in [([1, 2], "token ids is not served"), (["a", "b"], "a list of 2 prompts"), (None, "string")]:
        with pytest.raises(InvalidInput, match=words):
            prompt_of({"prompt": prompt})
    parts = [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "world"}]
    assert [(m.role, m.content) for m in messages_of({"messages": [{"role": "user", "content": parts}]})] == [
        ("user", "Hello, world")
    ]
    with pytest.raises(InvalidInput, match=r"messages\[0\].content: only text parts"):
        messages_of({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})


def test_streamed_completion_logprobs_offsets_run_on_across_chunks() -> None:
    answer = Answer(chat=False, model="m", request_id="cmpl-1", token_text=lambda t: {1: "ab", 2: "c", 3: "de"}[t])
    first = answer.chunk(Delta("ab", (1,), ((-0.1, ()),)), logprobs=True)
    second = answer.chunk(Delta("cde", (2, 3), ((-0.2, ()), (-0.3, ()))), logprobs=True)
    assert first["choices"][0]["logprobs"]["text_offset"] == [0]
    assert second["choices"][0]["logprobs"]["text_offset"] == [2, 3]
    answer.take(Finished("length", prompt_tokens=4, completion_tokens=3), logprobs=False)
    assert answer.usage_chunk()["choices"] == [] and answer.usage_chunk()["usage"]["total_tokens"] == 7
