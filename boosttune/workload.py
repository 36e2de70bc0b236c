"""A mixed request workload for routing experiments: chat prompts of several kinds plus document
continuation, split into a train part (the learned scheduler's ``--prompts``) and a held-out part
(``boosttune bench --questions``), both in MT-bench's question format.

Sources (all outside MT-bench; ``../shared/data/SOURCES.md`` describes them):

* ShareGPT first user turns (``{id, prompt}``) after the first 2,000 records (those drafters train
  on; ``WorkloadConfig.sharegpt_skip``): the capture tools' trailing text removed
  (:func:`clean_chat`), kept when English-looking (:func:`looks_english`: >= 95 % of the letters
  ASCII, and more English function words than Spanish/French/German/Italian/Portuguese ones) and of
  a bounded length, deduplicated by text, then classified by :func:`classify`.
* OpenWebText paragraphs (blank-line separated) and C4 realnewslike documents (``input + " " +
  output``): the first N words of each document that has N become a ``continuation`` request
  (:func:`continuation_prompt`).

Kinds of a chat prompt: :data:`RULES` are tried in this order, case-insensitively (``SELECT ...
FROM`` excepted), and the first pattern found anywhere in the prompt decides; no match: ``qa``.

==============  ===================================================================================
kind            matches
==============  ===================================================================================
code            a code fence (```), ``def f(``, ``function f(``, ``class X:``/``{``/``(``,
                ``SELECT ... FROM`` (upper case), ``#include``, ``console.log``, ``public static``,
                a line starting ``import x`` / ``from x import``; a coding verb (write, fix, debug,
                implement, refactor, optimize, convert) within 80 characters before a language name
                (Python, JavaScript, JS, Java, C++, SQL, ...); a language name followed by a code noun
                (code, function, script, program, class, ...); "in/using <language>"
math            solve, calculate, compute, equation, "integral/derivative/probability of"; two
                numbers joined by ``+ * ^ = × ÷``, or by ``-`` or ``/`` with spaces around it
translation     translate / translated / translation / translating; "in/into/to <French, Spanish,
                German, Chinese, ...>" ending a phrase (before punctuation, the line's end, "please"
                or "language"); "into English"
extraction      summarize / summarise / summarization / "summary of", TL;DR; "the following / from
                this / from the" + text, passage, article, paragraph, document, email, ...; "extract"
                then text/passage/article/... within 80 characters; rewrite / rephrase / paraphrase /
                proofread: copy-heavy requests where prompt lookup should pay
roleplay        act as, pretend, role-play, "you are a/an", "you're a/an", "imagine you are/you're"
writing         write / compose / draft / create / generate followed within 40 characters by story,
                poem, essay, blog, post, email, letter, article, song, lyrics, speech, script,
                tweet, caption, slogan
qa              anything else
==============  ===================================================================================

The split (:func:`split_stratified`) is stratified by category and seeded: each category's
prompts are shuffled by ``random.Random(f"{seed}:{category}")``, so the seed alone decides it and a
category's draw does not depend on the other categories. Output files interleave the categories
(:func:`interleave`), so any prefix (the scheduler's ``--limit``) stays mixed.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from boosttune.core.prompts import Prompt
from boosttune.core.table import text_table

CONTINUATION = "continuation"
"""The category of the document-continuation requests."""

_LANGS = (r"python|javascript|typescript|java|js|c\+\+|c#|golang|rust|sql|bash|shell script|php|ruby|kotlin"
          r"|swift|react|html|css|node\.?js|matlab|scala|haskell|powershell|vba|dart|flutter")
_HUMAN_LANGS = (r"french|spanish|german|chinese|mandarin|japanese|korean|italian|portuguese|russian|arabic"
                r"|hindi|dutch|turkish|polish|vietnamese|indonesian|hebrew|greek|swedish")

RULES: tuple[tuple[str, re.Pattern[str]], ...] = tuple((kind, re.compile(pattern, re.I | re.M)) for kind, pattern in (
    ("code", r"```|\bdef [\w\\]+\s*\(|\bfunction\s*[\w\\]*\s*\(|\bclass [\w\\]+\s*[:({]|(?-i:\bSELECT\b[^;]{1,200}?\bFROM\b)"
             r"|#include\b|console\.log|\bpublic static\b|^\s*(?:import [\w.]+|from [\w.]+ import)\b"),
    ("code", rf"\b(?:write|fix|debug|implement|refactor|optimi[sz]e|convert)\b.{{0,80}}\b(?:{_LANGS})(?![\w+#])"),
    ("code", rf"\b(?:{_LANGS})(?![\w+#])\s+(?:code|function|script|program|class|method|query|snippet|app)\b"
             rf"|\b(?:in|using) (?:{_LANGS})(?![\w+#])"),
    ("math", r"\b(?:solve|calculate|compute|equation|integral of|derivative of|probability of)\b"),
    ("math", r"\d\s*[+*^=×÷]\s*\d|\d\s+[-/]\s+\d"),
    ("translation", r"\btranslat(?:e|ed|ion|ing)\b"),
    ("translation", rf"\b(?:in|into|to) (?:{_HUMAN_LANGS})(?=\s*(?:[.,!?:;)\"']|$)| please\b| language\b)"
                    r"|\binto english\b"),
    ("extraction", r"\bsummari[sz](?:e|es|ing|ation)\b|\bsummary of\b|\btl;?dr\b"),
    ("extraction", r"\b(?:the following|from this|from the) (?:text|passage|article|paragraph|document|email"
                   r"|essay|transcript|content|sentences?|information)\b"),
    ("extraction", r"\bextract\b.{0,80}\b(?:text|passage|article|paragraph|document|following|below|above)\b"),
    ("extraction", r"\b(?:rewrite|rephrase|paraphrase|proofread)\b"),
    ("roleplay", r"\bact(?:ing)? as\b|\bpretend\b|\brole[- ]?play\b|\byou(?: are|'re) an?\b|\bimagine (?:that )?you(?: are|'re)\b"),
    ("writing", r"\b(?:write|compose|draft|create|generate)\b.{0,40}\b(?:story|stories|poem|essay|blog|post|e-?mail"
                r"|letter|article|song|lyrics|speech|script|tweet|caption|slogan)s?\b"),
))
"""(kind, pattern) in the order they are tried; the first match decides the kind."""

KINDS: tuple[str, ...] = (*dict.fromkeys(kind for kind, _ in RULES), "qa")
"""Every kind :func:`classify` returns, in rule order."""

CATEGORIES: tuple[str, ...] = (*KINDS, CONTINUATION)
"""Every category of the workload, in the order tables and files list them."""

# Function words that mark a Latin-script prompt as English or as Spanish, French, German, Italian or
# Portuguese (those score the same ASCII share); each list leaves out words the other languages share.
_ENGLISH_WORDS = frozenset(
    "the a an and or is are was be to of in on at for with from by you your i my me it this that what how why which"
    " who when where can could would should will do does have has not please about tell explain give write make"
    " create list help want need".split()
)
_OTHER_WORDS = frozenset(
    "de del el la los las que y por para con como una es est les des et pour dans une der das und ist nicht mit"
    " ein eine il che di per sono um uma".split()
)


@dataclass(frozen=True)
class WorkloadConfig:
    """What `scripts/mixed_workload.py` builds; each field's flag is named in :meth:`validate`'s errors.

    Attributes:
        sharegpt: ShareGPT first human turns, JSONL ``{id, prompt}`` (``--sharegpt``).
        sharegpt_skip: leave out the first this many ShareGPT records (``--sharegpt-skip``): drafters are
            trained on the file's first records (``configs/smollm2-hour.yaml`` takes its first 1,200 of
            at most 384 tokens and its scheduler skips 2,000 for that reason).
        openwebtext: OpenWebText sample, plain text with blank-line separated paragraphs (``--openwebtext``).
        c4: C4 realnewslike sample, a JSON array of ``{input, output}`` (``--c4``).
        per_train: prompts per category in the train part (``--per-category-train``).
        per_heldout: prompts per category in the held-out part (``--per-category-heldout``).
        min_chars: shortest ShareGPT prompt kept, in characters (``--min-chars``).
        max_chars: longest ShareGPT prompt kept, in characters (``--max-chars``).
        continuation_words: words of a document a continuation request shows (``--continuation-words``).
        seed: seed of the split (``--seed``).
    """

    sharegpt: Path
    openwebtext: Path
    c4: Path
    sharegpt_skip: int = 2000
    per_train: int = 12
    per_heldout: int = 10
    min_chars: int = 20
    max_chars: int = 1500
    continuation_words: int = 64
    seed: int = 0

    def validate(self) -> None:
        """Raise ValueError naming the flag and the fix for a missing file or an out-of-range number."""
        for flag, n in (("--per-category-train", self.per_train), ("--per-category-heldout", self.per_heldout),
                        ("--min-chars", self.min_chars), ("--continuation-words", self.continuation_words)):
            if n < 1:
                raise ValueError(f"{flag} must be >= 1, got {n}")
        if self.sharegpt_skip < 0:
            raise ValueError(f"--sharegpt-skip must be >= 0 (0: use every record), got {self.sharegpt_skip}")
        if self.max_chars < self.min_chars:
            raise ValueError(f"--max-chars ({self.max_chars}) must be >= --min-chars ({self.min_chars})")
        for flag, path in (("--sharegpt", self.sharegpt), ("--openwebtext", self.openwebtext), ("--c4", self.c4)):
            if not Path(path).is_file():
                raise ValueError(f"{flag}: no such file: {path} (give the path of the file; "
                                 "../shared/data/SOURCES.md lists the samples)")


@dataclass(frozen=True)
class Split:
    """A stratified split and what it could not fill.

    Attributes:
        train: the train prompts, categories interleaved.
        heldout: the held-out prompts, categories interleaved.
        short: categories with fewer prompts than asked: category -> (available, asked).
    """

    train: list[Prompt]
    heldout: list[Prompt]
    short: dict[str, tuple[int, int]]


def classify(text: str) -> str:
    """The kind of a chat prompt: the first of :data:`RULES` that matches, else ``"qa"``."""
    return next((kind for kind, pattern in RULES if pattern.search(text)), "qa")


def looks_english(text: str, min_ascii: float = 0.95) -> bool:
    """Whether at least ``min_ascii`` of the letters are ASCII and English function words outnumber
    Spanish/French/German/Italian/Portuguese ones (a prompt with neither is not kept)."""
    letters = [c for c in text if c.isalpha()]
    if not letters or sum(c.isascii() for c in letters) < min_ascii * len(letters):
        return False
    words = re.findall(r"[a-z]+", text.lower())
    return sum(w in _ENGLISH_WORDS for w in words) > sum(w in _OTHER_WORDS for w in words)


# Text that ShareGPT's capture tools appended to the user's turn: browser extensions' buttons ("Translate
# now", in Korean or English; "Share Prompt") and ChatGPT's "1 / 1" answer-version counter; left in, they
# would fail the English test, look like a translation request or like arithmetic.
_CAPTURE_TAILS = re.compile(r"(?:\s*(?:지금 번역하기|Translate now|Share Prompt|\d+ / \d+))+\s*$")


def clean_chat(text: str) -> str:
    """A ShareGPT prompt without the capture tools' trailing text, stripped."""
    head, tail = text[:-200], text[-200:]  # the tails are short: searching only the end is 4x faster
    return (head + _CAPTURE_TAILS.sub("", tail)).strip()


def chat_prompts(records: Iterable[dict], min_chars: int, max_chars: int) -> list[Prompt]:
    """ShareGPT ``{id, prompt}`` records kept as classified prompts: English-looking, ``min_chars`` to
    ``max_chars`` characters after :func:`clean_chat`, first of each distinct text; ids ``sharegpt-<id>``."""
    out, seen = [], set()
    for rec in records:
        text = clean_chat(rec["prompt"])
        if min_chars <= len(text) <= max_chars and text not in seen and looks_english(text):
            seen.add(text)
            out.append(Prompt(text=text, id=f"sharegpt-{rec['id']}", category=classify(text)))
    return out


def paragraphs(text: str) -> list[str]:
    """The blank-line separated paragraphs of a text, stripped, empty ones left out."""
    return [p.strip() for p in re.split(r"\n\s*\n", text) if p.strip()]


def continuation_prompt(document: str, words: int) -> str | None:
    """"Continue this text:" and the document's first ``words`` words (None: it is shorter)."""
    head = document.split()
    return "Continue this text:\n\n" + " ".join(head[:words]) if len(head) >= words else None


def continuation_prompts(documents: Sequence[str], words: int, prefix: str) -> list[Prompt]:
    """One ``continuation`` request per document of at least ``words`` words; ids ``<prefix>-<i>``
    with ``i`` the document's index in ``documents``."""
    out = []
    for i, doc in enumerate(documents):
        text = continuation_prompt(doc, words)
        if text is not None:
            out.append(Prompt(text=text, id=f"{prefix}-{i}", category=CONTINUATION))
    return out


def interleave(groups: Sequence[Sequence[Prompt]]) -> list[Prompt]:
    """Round-robin over ``groups``: the first of each, then the second of each, ..."""
    longest = max((len(g) for g in groups), default=0)
    return [g[i] for i in range(longest) for g in groups if i < len(g)]


def split_stratified(prompts: Sequence[Prompt], per_train: int, per_heldout: int, seed: int) -> Split:
    """Per category (in :data:`CATEGORIES` order, then any others sorted): ``per_train`` prompts for
    train and ``per_heldout`` others for held-out, drawn by a seeded shuffle. A category with fewer
    than ``per_train + per_heldout`` prompts is divided in the same proportion (each part keeps at
    least one when there are two or more) and reported in ``Split.short``."""
    by_cat: dict[str, list[Prompt]] = {}
    for p in prompts:
        by_cat.setdefault(p.category, []).append(p)
    order = [c for c in CATEGORIES if c in by_cat] + sorted(set(by_cat) - set(CATEGORIES))
    asked = per_train + per_heldout
    train, heldout, short = [], [], {}
    for cat in order:
        pool = sorted(by_cat[cat], key=lambda p: p.id)
        random.Random(f"{seed}:{cat}").shuffle(pool)
        n_train = per_train
        if len(pool) < asked:
            short[cat] = (len(pool), asked)
            n_train = max(1, min(round(len(pool) * per_train / asked), len(pool) - 1))
        train.append(pool[:n_train])
        heldout.append(pool[n_train:n_train + per_heldout])
    return Split(train=interleave(train), heldout=interleave(heldout), short=short)


def question_record(prompt: Prompt) -> dict:
    """MT-bench's question format with one turn: ``{question_id, category, turns}``."""
    return {"question_id": prompt.id, "category": prompt.category, "turns": [prompt.text]}


def write_questions(path: Path, prompts: Iterable[Prompt]) -> None:
    """Write ``prompts`` as MT-bench question JSONL, one record per line (non-ASCII characters escaped, so
    no Unicode line separator in a prompt can split a line for a reader that splits on those)."""
    lines = [json.dumps(question_record(p)) + "\n" for p in prompts]
    path.write_text("".join(lines), encoding="utf-8")


def category_table(split: Split) -> str:
    """A text table: category, train count, held-out count, mean prompt characters (both parts)."""
    rows = [("category", "train", "held-out", "mean chars")]
    for cat in dict.fromkeys(p.category for p in [*split.train, *split.heldout]):  # split order
        tr = [p for p in split.train if p.category == cat]
        he = [p for p in split.heldout if p.category == cat]
        chars = [len(p.text) for p in tr + he]
        rows.append((cat, str(len(tr)), str(len(he)), f"{sum(chars) / len(chars):.0f}"))
    return "\n".join(text_table(rows))


def candidates(cfg: WorkloadConfig) -> list[Prompt]:
    """Every prompt the workload can draw from: classified ShareGPT prompts (after the first
    ``sharegpt_skip`` records), then OpenWebText and C4 continuation requests (ids ``owt-<paragraph
    index>``, ``c4-<record index>``)."""
    with open(cfg.sharegpt, encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()][cfg.sharegpt_skip:]
    chat = chat_prompts(records, cfg.min_chars, cfg.max_chars)
    owt = paragraphs(Path(cfg.openwebtext).read_text(encoding="utf-8"))
    c4 = [f"{r['input']} {r['output']}" for r in json.loads(Path(cfg.c4).read_text(encoding="utf-8"))]
    words = cfg.continuation_words
    return [*chat, *continuation_prompts(owt, words, "owt"), *continuation_prompts(c4, words, "c4")]


def build(cfg: WorkloadConfig) -> Split:
    """The validated config's stratified split of :func:`candidates`."""
    cfg.validate()
    return split_stratified(candidates(cfg), cfg.per_train, cfg.per_heldout, cfg.seed)
