"""Unit tests of the gateway's pure parts: incremental detokenization and stop sequences."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.detokenizer import IncrementalDetokenizer, StopMatcher


TEXTS = st.lists(st.sampled_from(list("ab ,.\n中文字😀🎉é—ß🇯🇵") + ["\u200d", " the", "ing"]),
                 min_size=1, max_size=30).map("".join)


def stream(tok, ids: list[int], prompt: list[int] | None = None) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt or [])
    pieces = [detok.push(i) for i in ids]
    pieces.append(detok.flush())
    return pieces


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=TEXTS)
def test_incremental_detokenization_equals_full_decode(gw_tokenizer, text):
    ids = gw_tokenizer.hf(text, add_special_tokens=False)["input_ids"]
    pieces = stream(gw_tokenizer, ids, prompt=gw_tokenizer.encode_text("Prompt: "))
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text


def test_special_tokens_are_skipped(gw_tokenizer):
    ids = gw_tokenizer.hf("hi there", add_special_tokens=False)["input_ids"] + [gw_tokenizer.eos_token_id]
    assert "".join(stream(gw_tokenizer, ids)) == "hi there"


def test_special_tokens_are_kept_when_a_parser_reads_them(gw_tokenizer):
    """gpt-oss's harmony parsers read its special tokens: decoded with them kept, streamed as whole."""
    from gateway.parsers.harmony import keeps_markers

    assert keeps_markers("openai_gptoss", None) and keeps_markers(None, "openai")
    assert not keeps_markers("qwen3", "hermes")
    ids = gw_tokenizer.hf("hi there", add_special_tokens=False)["input_ids"] + [gw_tokenizer.eos_token_id]
    detok = IncrementalDetokenizer(gw_tokenizer, [], skip_special_tokens=False)
    text = "".join([detok.push(i) for i in ids] + [detok.flush()])
    assert text == "hi there" + gw_tokenizer.hf.eos_token


def test_prompt_ending_mid_character_does_not_shift_output(gw_tokenizer):
    ids = gw_tokenizer.hf("😀 ok", add_special_tokens=False)["input_ids"]
    prompt = ids[:1]  # half an emoji
    assert "\ufffd" in gw_tokenizer.decode(prompt)
    assert "".join(stream(gw_tokenizer, ids[1:], prompt)) == gw_tokenizer.decode(ids[1:])


def run_stops(stops: list[str], pieces: list[str]) -> tuple[str, bool, str]:
    m = StopMatcher(stops)
    out = []
    for p in pieces:
        released, hit = m.push(p)
        out.append(released)
        if hit:
            return "".join(out), True, m.text
    out.append(m.flush())
    return "".join(out), False, m.text


@pytest.mark.parametrize("stops,pieces,expected,hit", [
    ([], ["a", "b"], "ab", False),
    (["STOP"], ["abc ST", "OP more"], "abc ", True),
    (["STOP"], ["abc ST", "AR"], "abc STAR", False),
    (["\n\n"], ["x\n", "\n", "y"], "x", True),
    (["ab", "b"], ["xab"], "x", True),  # the earliest match wins
    (["bc", "abcd"], ["abcd"], "", True),  # "abcd" starts first
    (["END"], ["E", "N", "D"], "", True),
    (["xyz"], ["xy"], "xy", False),  # held back, released when generation ends
])
def test_stop_matcher(stops, pieces, expected, hit):
    text, matched, final = run_stops(stops, pieces)
    assert (text, matched) == (expected, hit)
    assert final == text


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet="abc\n", max_size=30), stop=st.text(alphabet="abc\n", min_size=1, max_size=4),
       cuts=st.lists(st.integers(0, 30), max_size=6))
def test_stop_matcher_matches_str_find(text, stop, cuts):
    bounds = sorted({0, len(text), *[c for c in cuts if c <= len(text)]})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    released, matched, _ = run_stops([stop], pieces)
    at = text.find(stop)
    assert matched == (at != -1)
    assert released == (text[:at] if at != -1 else text)


def test_stop_strings_before_min_tokens_are_not_matched():
    m = StopMatcher(["STOP"])
    assert m.push("a STOP b", armed=False) == ("a STOP b", False)  # released whole, no match
    assert m.push(" ST", armed=True) == (" ", False)  # held back: might become STOP
    assert m.push("OP tail") == ("", True)
    assert m.text == "a STOP b "  # cut at the armed match only
