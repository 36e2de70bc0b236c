"""Stop rules cut a multi-token step exactly where token-by-token decoding would stop."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from boosttune.core.models import resolve_model_path
from boosttune.http.text import TextStream
from boosttune.serving.stops import StopCriteria


def test_max_new_tokens_and_eos_cut_inside_a_step():
    stop = StopCriteria(max_new_tokens=5, eos_token_ids=frozenset({2}))
    assert stop.cut([7, 7], [8, 9, 10, 11]) == ([8, 9, 10], "length")
    assert stop.cut([7], [8, 2, 10]) == ([8, 2], "stop")
    assert stop.cut([], [8, 9]) == ([8, 9], None)


def test_stop_string_ends_on_the_token_that_completes_it():
    tok = AutoTokenizer.from_pretrained(resolve_model_path("default"))
    ids = tok("The answer is 42. Next question please.")["input_ids"]
    stop = StopCriteria(max_new_tokens=100, stop_strings=("42.",), tokenizer=tok)
    kept, reason = stop.cut(ids[:2], ids[2:])
    assert reason == "stop"
    text = tok.decode(ids[: 2 + len(kept)])
    assert text.endswith("42.") and "42." not in tok.decode(ids[: 1 + len(kept)])
    shown = TextStream(tok, stop=("42.",))  # what a client is sent: the text before the stop string
    shown.push(ids)
    assert shown.text == "The answer is "


def test_invalid_stop_configuration_is_refused():
    with pytest.raises(ValueError, match="max_new_tokens"):
        StopCriteria(max_new_tokens=0)
    with pytest.raises(ValueError, match="tokenizer"):
        StopCriteria(max_new_tokens=3, stop_strings=("x",))
