"""What a request streams: verified tokens as text, cut before a stop string, UTF-8 intact."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from hetspec.daemon.decode.autoregressive import (
    ALONE_CALL_S,
    MAX_ALONE_TOKENS,
    TRIAL_TOKENS,
    alone_tokens,
)
from hetspec.daemon.decode.text_output import TextOutput

# single ASCII letters, a two-letter token, and the two halves of "é" (0xC3 0xA9)
TOKENS = [b"a", b"b", b"c", b"ab", b"\xc3", b"\xa9", b"\n"]


def run(tokens: list[int], stops: list[str]) -> tuple[str, bool, int]:
    """Everything streamed, whether it stopped, and how many tokens it took."""
    output, pieces = TextOutput(TOKENS, stops), []
    for used, token in enumerate(tokens, 1):
        pieces.append(output.add(token))
        if output.stopped:
            return "".join(pieces), True, used
    return "".join(pieces) + output.flush(), False, len(tokens)


@settings(max_examples=400, deadline=None)
@given(
    st.lists(st.integers(0, len(TOKENS) - 1), max_size=30),
    st.lists(st.text(alphabet="abcé\n", min_size=1, max_size=4), max_size=3),
)
def test_the_stream_is_the_text_up_to_the_first_stop_string(tokens, stops) -> None:
    full = b"".join(TOKENS[t] for t in tokens).decode("utf-8", errors="replace")
    streamed, stopped, used = run(tokens, stops)
    ends = [full.find(stop) for stop in stops if stop in full]
    if not ends:
        assert (streamed, stopped) == (full, False)
        return
    assert stopped
    assert streamed == full[: min(ends)]
    # it stopped at the token that completed the first stop string, not later
    text_so_far = b"".join(TOKENS[t] for t in tokens[: used - 1]).decode("utf-8", "replace")
    assert not any(stop in text_so_far for stop in stops)


def test_text_that_may_begin_a_stop_string_waits_for_the_next_token() -> None:
    output = TextOutput(TOKENS, ["bc"])
    assert output.add(0) == "a"
    assert output.add(1) == ""  # "b" may begin "bc"
    assert output.add(0) == "ba"  # it did not
    assert output.add(1) == ""
    assert output.add(2) == ""  # "bc": stop, nothing of it is sent
    assert output.stopped


def test_a_character_split_across_tokens_comes_out_whole() -> None:
    output = TextOutput(TOKENS, [])
    assert output.add(4) == ""
    assert output.add(5) == "é"


def test_control_tokens_end_a_turn_or_render_as_nothing() -> None:
    """A sampled completion may draw <|im_start|> or <|im_end|>: markup, not text. The turn's
    end stops a chat answer (its template's stop string) with the text held before it sent;
    elsewhere a control token adds nothing."""
    tokens = [*TOKENS, b"<|im_end|>", b"<|im_start|>"]
    end, start = len(TOKENS), len(TOKENS) + 1
    plain = TextOutput(tokens, [], special=[end, start])
    assert [plain.add(t) for t in (0, end, 1, start, 2)] == ["a", "", "b", "", "c"]
    assert not plain.stopped
    chat = TextOutput(tokens, ["<|im_end|>", "ab!"], special=[end, start])
    assert chat.add(0) == ""  # "a" may begin "ab!"
    assert chat.add(end) == "a"  # the turn ended: what was held is text
    assert chat.stopped


def test_the_target_alone_decodes_about_a_fixed_time_per_call() -> None:
    """A fast target decodes many tokens per call (the call's round trip is amortised), a
    slow one token by token (the stream stays fluent); unknown speed: two, to measure it."""
    assert alone_tokens(None) == 2
    assert alone_tokens(ALONE_CALL_S / 6) == 6
    assert alone_tokens(1e-6) == MAX_ALONE_TOKENS
    assert alone_tokens(0.1) == 1
    assert alone_tokens(ALONE_CALL_S / 6, trial=True) == TRIAL_TOKENS  # a short trial call
    assert alone_tokens(0.1, trial=True) == 1
