"""The mixed workload (``boosttune/workload.py``, ``scripts/mixed_workload.py``): the kind rules on
hand-written prompts, the seeded stratified split, and the files written from ../shared/data."""

from __future__ import annotations

import json

import pytest
from conftest import SHARED_DATA, load_script

from boosttune.core.prompts import Prompt, read_prompts
from boosttune.workload import (
    CATEGORIES,
    CONTINUATION,
    WorkloadConfig,
    build,
    classify,
    clean_chat,
    continuation_prompt,
    looks_english,
    paragraphs,
    split_stratified,
)

SHAREGPT = SHARED_DATA / "sharegpt_sample" / "sharegpt_v3_first_human_turns.jsonl"
OWT = SHARED_DATA / "openwebtext_sample" / "openwebtext_sample.txt"
C4 = SHARED_DATA / "c4_realnewslike_sample" / "c4_ref.json"
needs_data = pytest.mark.skipif(not all(p.is_file() for p in (SHAREGPT, OWT, C4)),
                                reason="needs the ShareGPT, OpenWebText and C4 samples in ../shared/data")


@pytest.mark.parametrize(("text", "kind"), [
    ("Write a Python function that reverses a linked list", "code"),
    ("```\nconsole.log(x)\n```\nwhy is x undefined here?", "code"),
    ("SELECT name FROM users WHERE id = 3 returns no rows, why?", "code"),
    ("In Java, how do I read a file line by line?", "code"),
    ("Solve for x: 3x + 5 = 20", "math"),
    ("What is 12 * 7?", "math"),
    ("Translate 'good morning' into Japanese", "translation"),
    ("How do you say thank you in French?", "translation"),
    ("Summarize this article in three bullet points: The city council met on Monday ...", "extraction"),
    ("Please improve the following paragraph: Our product are good and cheap.", "extraction"),
    ("Paraphrase: the meeting has been moved to Friday.", "extraction"),
    ("I want you to act as a travel guide for Lisbon.", "roleplay"),
    ("You are a pirate captain. Greet your new crew.", "roleplay"),
    ("Write a short poem about autumn leaves", "writing"),
    ("Compose an email to my landlord about the broken heater", "writing"),
    ("What is the capital of Australia?", "qa"),
    # a negative per kind: near misses of its rules
    ("Write a story about a programmer who loves coffee", "writing"),  # code: no language, no code
    ("What year did the Second World War end?", "qa"),  # math: a number, no operator
    ("What caused the French Revolution?", "qa"),  # translation: a language name inside a phrase
    ("How do I extract juice from oranges without a juicer?", "qa"),  # extraction: "extract", no text
    ("Are you able to browse the internet?", "qa"),  # roleplay: "you are" without "a"
    ("What makes a good essay?", "qa"),  # writing: the noun without a writing verb
    ("Explain how a compiler turns code into machine instructions", "qa"),  # qa stays qa: no language named
    # first match wins: code before writing, math before extraction
    ("Write a Python script that writes a poem to a file", "code"),
    ("Summarize why 2 + 2 = 4", "math"),
])
def test_classify_by_the_first_matching_rule(text, kind):
    assert classify(text) == kind


def test_english_test_and_capture_tails():
    assert looks_english("Explain quantum computing in simple terms")
    assert not looks_english("Dame 5 rutinas de ejercicio y 5 recetas para fortalecer las rodillas")
    assert not looks_english("Datenstrukturen wie Keller, Warteschlangen, Listen und Bäume")
    assert not looks_english("如何在 Python 中读取文件？")
    assert clean_chat("Do you know Cafe24?\n \n \n \n 지금 번역하기") == "Do you know Cafe24?"
    assert clean_chat("Answer in English.Share Prompt\n 1 / 1") == "Answer in English."
    assert clean_chat("What is 3 / 4 of 12?") == "What is 3 / 4 of 12?"  # arithmetic inside stays


def test_continuation_prompt_shows_the_first_words():
    doc = " ".join(f"w{i}" for i in range(10))
    assert continuation_prompt(doc, 4) == "Continue this text:\n\nw0 w1 w2 w3"
    assert continuation_prompt(doc, 11) is None
    assert paragraphs("one\ntwo\n\n\n  three  \n \nfour") == ["one\ntwo", "three", "four"]


def _prompts(counts: dict[str, int]) -> list[Prompt]:
    return [Prompt(text=f"{cat} {i}", id=f"{cat}-{i}", category=cat) for cat, n in counts.items() for i in range(n)]


def test_split_is_seeded_stratified_and_disjoint():
    prompts = _prompts({"code": 30, "qa": 40, "math": 5, "translation": 1})
    split = split_stratified(prompts, 4, 3, seed=7)
    assert split == split_stratified(list(reversed(prompts)), 4, 3, seed=7)  # the seed alone decides
    assert split != split_stratified(prompts, 4, 3, seed=8)
    train, held = [p.id for p in split.train], [p.id for p in split.heldout]
    assert len(set(train)) == len(train) and not set(train) & set(held)
    count = {cat: ([p.category for p in split.train].count(cat), [p.category for p in split.heldout].count(cat))
             for cat in ("code", "qa", "math", "translation")}
    # math has 5 of the 7 asked: divided in the same proportion; translation's one prompt trains
    assert count == {"code": (4, 3), "qa": (4, 3), "math": (3, 2), "translation": (1, 0)}
    assert split.short == {"math": (5, 7), "translation": (1, 7)}
    assert [p.category for p in split.train[:4]] == ["code", "math", "translation", "qa"]  # interleaved, rule order
    # a category's draw does not depend on the others
    alone = split_stratified(_prompts({"code": 30}), 4, 3, seed=7)
    assert alone.train == [p for p in split.train if p.category == "code"]


@needs_data
def test_script_writes_every_category_and_the_files_read_back(tmp_path, capsys):
    written = tmp_path / "mixed"
    assert load_script("mixed_workload").main(["--out", str(written), "--sharegpt", str(SHAREGPT), "--openwebtext", str(OWT),
                           "--c4", str(C4)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == ["category", "train", "held-out", "mean", "chars"]
    assert [row.split()[:3] for row in table[2:2 + len(CATEGORIES)]] == [[c, "12", "10"] for c in CATEGORIES]
    train, held = read_prompts(written / "train.jsonl"), read_prompts(written / "heldout.jsonl")
    assert {p.category for p in train} == {p.category for p in held} == set(CATEGORIES)
    assert not {p.id for p in train} & {p.id for p in held}
    records = [json.loads(line) for line in (written / "heldout.jsonl").read_text().splitlines()]
    assert all(set(r) == {"question_id", "category", "turns"} and len(r["turns"]) == 1 for r in records)
    assert [(p.id, p.category, p.text) for p in held] == [(r["question_id"], r["category"], r["turns"][0]) for r in records]
    assert all(p.id.startswith(("owt-", "c4-")) == (p.category == CONTINUATION) for p in train + held)
    assert all(p.id.startswith("sharegpt-") and 20 <= len(p.text) <= 1500 for p in train + held if p.category != CONTINUATION)
    with open(SHAREGPT) as f:  # none of the records drafters train on (the first 2,000)
        trained = {f"sharegpt-{json.loads(next(f))['id']}" for _ in range(2000)}
    assert not trained & {p.id for p in train + held}
    # deterministic: building again with the same seed gives the same files' prompts
    again = build(WorkloadConfig(sharegpt=SHAREGPT, openwebtext=OWT, c4=C4))
    assert (again.train, again.heldout) == (train, held)


def test_script_says_which_categories_are_short(tmp_path, capsys):
    """Sources too small for the counts asked: each category takes what there is, and the script says so."""
    chat = ["Write a poem about the sea", "Write a poem about rain", "What is the tallest mountain?",
            "Please translate 'cat' into German", "Is a tomato a fruit?", "Why is the sky blue?"]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps({"id": f"c{i}", "prompt": t}) + "\n" for i, t in enumerate(chat)))
    (tmp_path / "owt.txt").write_text("one two three four five six\n\ntoo short\n\nseven eight nine ten eleven twelve\n")
    (tmp_path / "c4.json").write_text(json.dumps([{"input": "a b c", "output": "d e f g"}]))
    out = tmp_path / "out"
    assert load_script("mixed_workload").main(["--out", str(out), "--sharegpt", str(tmp_path / "chat.jsonl"), "--sharegpt-skip", "0",
                           "--openwebtext", str(tmp_path / "owt.txt"), "--c4", str(tmp_path / "c4.json"),
                           "--min-chars", "5", "--continuation-words", "5", "--per-category-train", "2",
                           "--per-category-heldout", "2"]) == 0
    printed = capsys.readouterr().out
    assert "translation: only 1 prompts for the 4 asked" in printed and "qa: only 3 prompts" in printed
    assert "writing: only 2" in printed and "continuation: only 3" in printed
    train, held = read_prompts(out / "train.jsonl"), read_prompts(out / "heldout.jsonl")
    assert sorted(p.id for p in train + held) == sorted(
        [f"sharegpt-c{i}" for i in range(6)] + ["c4-0", "owt-0", "owt-2"])


@pytest.mark.parametrize(("flags", "named"), [
    (["--per-category-train", "0"], "--per-category-train"),
    (["--per-category-heldout", "-1"], "--per-category-heldout"),
    (["--sharegpt", "missing.jsonl"], "--sharegpt"),
    (["--min-chars", "100", "--max-chars", "50"], "--max-chars"),
    (["--sharegpt-skip", "-1"], "--sharegpt-skip"),
])
def test_script_refuses_a_bad_flag_naming_it(flags, named, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        load_script("mixed_workload").main(["--out", str(tmp_path / "out"), *flags])
    assert e.value.code == 2 and named in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # refused before any work
