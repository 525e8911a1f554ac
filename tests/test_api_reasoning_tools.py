"""--reasoning-parser, --tool-call-parser and chat_template_kwargs through a real gateway (uvicorn,
real Redis, the echo worker writing each family's output one token an event) with the openai SDK,
streaming and not."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.test_gateway_support import ServerThread, wait_until

# A Qwen3-like template: renders tools with the Hermes <tool_call> instruction (so the hermes parser
# is chosen from it) and, with enable_thinking false, writes the empty think block itself.
QWEN3_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools: {% for t in tools %}{{ t.function.name }} {% endfor %}"
    "Answer calls as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{%- endif %}")
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
QWEN3_REPLY = ("<think>\nThe user wants the weather. I should call get_weather.\n</think>\n\nChecking.\n"
               '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


def _gateway(default_model_dir, gw_redis_url, template: str | None, **settings) -> ServerThread:
    from gateway.app import create_app
    from gateway.config import Settings
    from gateway.tokenizer import PromptTokenizer

    tokenizer = PromptTokenizer(default_model_dir, chat_template=template)
    config = Settings(model_dir=default_model_dir, redis_url=gw_redis_url, max_batch_total_tokens=100_000,
                      heartbeat_interval=0.2, **settings)
    return ServerThread(create_app(config, tokenizer=tokenizer)).start()


@pytest.fixture(scope="module")
def qwen3_gateway(default_model_dir, gw_redis_url, gw_echo_worker):
    server = _gateway(default_model_dir, gw_redis_url, QWEN3_TEMPLATE, reasoning_parser="qwen3")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def r1_gateway(default_model_dir, gw_redis_url, gw_echo_worker):
    """DeepSeek-R1's parser, Llama 3's tool calls named by the flag (the model's template renders no tools)."""
    server = _gateway(default_model_dir, gw_redis_url, None, reasoning_parser="deepseek_r1",
                      tool_call_parser="llama3_json")
    yield server
    server.stop()


def _client(server: ServerThread):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _streamed(server: ServerThread, **kwargs) -> dict:
    """The streamed answer's pieces: reasoning, content, tool calls (merged by index) and the order
    the kinds first came in; `reasoning_vllm` holds the pieces of the delta's `reasoning` field."""
    out = {"reasoning": [], "reasoning_vllm": [], "content": [], "calls": {}, "order": [], "finish": None}
    for chunk in _client(server).chat.completions.create(model="", stream=True, **kwargs):
        choice = chunk.choices[0]
        delta = choice.delta
        out["finish"] = choice.finish_reason or out["finish"]
        for kind, value in (("reasoning", getattr(delta, "reasoning_content", None)), ("content", delta.content)):
            if value:
                out[kind].append(value)
                out["order"].append(kind)
        if getattr(delta, "reasoning", None):
            out["reasoning_vllm"].append(delta.reasoning)
        for call in delta.tool_calls or []:
            entry = out["calls"].setdefault(call.index, {"name": "", "arguments": ""})
            entry["name"] += call.function.name or ""
            entry["arguments"] += call.function.arguments or ""
            out["order"].append("call")
    return out


def _budget_free(server: ServerThread) -> bool:
    return wait_until(lambda: httpx.get(server.url + "/stats", timeout=5).json()["token_budget"]["in_use"] == 0)


def test_qwen3_reasoning_and_hermes_calls_chosen_from_the_template(qwen3_gateway, gw_worker):
    gw_worker.set_reply(QWEN3_REPLY)
    answer = _client(qwen3_gateway).chat.completions.create(model="", messages=MESSAGES, tools=[WEATHER])
    choice = answer.choices[0]
    assert choice.message.reasoning_content == "The user wants the weather. I should call get_weather."
    assert choice.message.reasoning == choice.message.reasoning_content  # vLLM's current field name too
    assert choice.message.content == "Checking."
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert choice.finish_reason == "tool_calls"

    streamed = _streamed(qwen3_gateway, messages=MESSAGES, tools=[WEATHER])
    assert "".join(streamed["reasoning"]) == choice.message.reasoning_content
    assert streamed["reasoning_vllm"] == streamed["reasoning"]  # each delta carries both spellings
    assert len(streamed["reasoning"]) > 3  # streamed as it came, not at the end
    assert "".join(streamed["content"]) == "Checking."
    assert streamed["calls"] == {0: {"name": "get_weather", "arguments": call.function.arguments}}
    # reasoning first, then the content, then the call
    assert streamed["order"].index("reasoning") < streamed["order"].index("content") < streamed["order"].index("call")
    assert streamed["finish"] == "tool_calls"
    assert _budget_free(qwen3_gateway)


def test_enable_thinking_reaches_the_template_and_turns_reasoning_off(qwen3_gateway, gw_worker):
    gw_worker.set_reply("Plain answer, <think>not a thought</think>.")
    client = _client(qwen3_gateway)
    answer = client.chat.completions.create(model="", messages=MESSAGES,
                                            extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    prompt = gw_worker.tok.decode(gw_worker.requests[-1].prompt_token_ids)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    message = answer.choices[0].message
    assert message.content == "Plain answer, <think>not a thought</think>."
    assert getattr(message, "reasoning_content", None) is None
    # no reasoning in the output: none in the answer, and the content as the model wrote it
    answer = client.chat.completions.create(model="", messages=MESSAGES)
    assert not gw_worker.tok.decode(gw_worker.requests[-1].prompt_token_ids).endswith("</think>\n\n")
    assert answer.choices[0].message.content == "Plain answer, <think>not a thought</think>."
    assert getattr(answer.choices[0].message, "reasoning_content", None) is None


@pytest.mark.parametrize("value,message", [
    ([1], "must be an object"),
    ({"tools": []}, "cannot set 'tools'"),
    ({"bad-name": 1}, "identifiers"),
    ({f"k{i}": 1 for i in range(40)}, "at most 32"),
    ({"big": "x" * 10_000}, "larger than"),
])
def test_chat_template_kwargs_are_checked(qwen3_gateway, value, message):
    r = httpx.post(qwen3_gateway.url + "/v1/chat/completions", timeout=10,
                   json={"messages": MESSAGES, "chat_template_kwargs": value})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "chat_template_kwargs" and message in error["message"]


def test_structured_output_applies_to_the_answer_after_the_thought(qwen3_gateway, gw_worker):
    """response_format with a reasoning parser: the constraint allows a think block before the JSON,
    and the SDK's parse reads the answer only."""
    from pydantic import BaseModel

    class City(BaseModel):
        name: str

    gw_worker.set_reply('<think>Paris is the capital.</think>\n{"name": "Paris"}')
    parsed = _client(qwen3_gateway).chat.completions.parse(model="", messages=MESSAGES, response_format=City)
    message = parsed.choices[0].message
    assert message.parsed == City(name="Paris") and message.reasoning_content == "Paris is the capital."
    structured = gw_worker.requests[-1].sampling.structured
    assert structured["kind"] == "grammar" and "<think>" in structured["spec"] and "%json" in structured["spec"]
    # tool_choice "required" too: the calls after the thought
    gw_worker.set_reply('<think>A call.</think>[{"name": "get_weather", "arguments": {"city": "Oslo"}}]')
    streamed = _streamed(qwen3_gateway, messages=MESSAGES, tools=[WEATHER], tool_choice="required")
    assert "".join(streamed["reasoning"]) == "A call."
    assert streamed["calls"] == {0: {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}


def test_a_malformed_call_is_content(qwen3_gateway, gw_worker):
    reply = 'Trying.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": </tool_call>'
    gw_worker.set_reply(reply)
    answer = _client(qwen3_gateway).chat.completions.create(model="", messages=MESSAGES, tools=[WEATHER])
    assert answer.choices[0].message.content == reply and answer.choices[0].message.tool_calls is None
    assert answer.choices[0].finish_reason == "stop"
    streamed = _streamed(qwen3_gateway, messages=MESSAGES, tools=[WEATHER])
    assert "".join(streamed["content"]) == reply and not streamed["calls"]


def test_deepseek_r1_without_an_opening_tag_and_llama3_calls_by_the_flag(r1_gateway, gw_worker):
    gw_worker.set_reply('The user asks about Paris.\n</think>\n\n'
                        '{"name": "get_weather", "parameters": {"city": "Paris"}}')
    answer = _client(r1_gateway).chat.completions.create(model="", messages=MESSAGES, tools=[WEATHER])
    message = answer.choices[0].message
    assert message.reasoning_content == "The user asks about Paris."
    assert message.content is None and answer.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("get_weather", {"city": "Paris"})]
    streamed = _streamed(r1_gateway, messages=MESSAGES, tools=[WEATHER])
    assert "".join(streamed["reasoning"]) == "The user asks about Paris." and not streamed["content"]
    assert streamed["calls"] == {0: {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    # without tools the answer after the thought is content
    gw_worker.set_reply("Hmm.</think>Hello!")
    answer = _client(r1_gateway).chat.completions.create(model="", messages=MESSAGES)
    assert (answer.choices[0].message.reasoning_content, answer.choices[0].message.content) == ("Hmm.", "Hello!")
    assert _budget_free(r1_gateway)
