"""Examples the demo model learns from: facts about open-ended names (cpchat.demo.names), in several
phrasings, put into real prose (cpchat.demo.prose); and the text its tokenizer is trained on."""

from __future__ import annotations

import random
import textwrap
from collections.abc import Sequence
from typing import TYPE_CHECKING

from cpchat.demo.data import ABSENT_VALUE, NOT_FOUND, QUESTION_TAILS, Example, Fact, make_example
from cpchat.demo.names import Names, kind_of

if TYPE_CHECKING:
    from cpchat.demo.prose import Source

PROSE_FACTS = (
    "The {attr} for the {ent} is {val}.",
    "The {attr} for the {ent} is {val}.",
    "The {attr} of the {ent} is {val}.",
    "The {ent}'s {attr} is {val}.",
    "For the {ent}, the {attr} is {val}.",
    "The {ent}'s {attr}: {val}.",
    "{Attr} of the {ent} — {val}.",
    "Note that the {attr} for the {ent} is {val}.",
    "Please remember: the {attr} of the {ent} is {val}.",
)
PROSE_QUESTIONS = (
    "What is the {attr} for the {ent}?",
    "What is the {attr} of the {ent}?",
    "What's the {ent}'s {attr}?",
    "Tell me the {attr} for the {ent}.",
    "According to the document, what is the {attr} of the {ent}?",
    "Which {attr} does the document give for the {ent}?",
    "Please look up the {attr} for the {ent}.",
    "Find the {attr} of the {ent}.",
    "I need the {attr} for the {ent}.",
)
DOC_NAMES = ("{w}.txt", "{w}.md", "notes-{n}.txt", "{w}-{n}.txt", "README", "LICENSE", "{w}_report.txt")


def fact_block(rng: random.Random, facts: list[Fact]) -> str:
    """Several facts as a Markdown list or table, a paragraph of their own."""
    if rng.random() < 0.5:
        return "\n".join(f"- {_capitalised(f.attribute)} for the {f.entity}: {f.value}" for f in facts)
    rows = "\n".join(f"| {f.entity} | {f.attribute} | {f.value} |" for f in facts)
    return f"| Item | Detail | Value |\n|---|---|---|\n{rows}"


def draw_prose(rng: random.Random, sources: Sequence[Source], n_chars: int) -> list[list[str]]:
    """Paragraphs of consecutive sentences from random sources, about `n_chars` characters in all."""
    weights = [s.chars for s in sources]
    paragraphs: list[list[str]] = []
    total = 0
    while total < n_chars:
        source = rng.choices(sources, weights)[0]
        start = rng.randrange(len(source.paragraphs))
        for para in source.paragraphs[start:]:
            paragraphs.append(list(para))
            total += sum(len(s) + 1 for s in para)
            if total >= n_chars:
                break
    last = paragraphs[-1]
    while len(last) > 1 and total - len(last[-1]) - 1 >= n_chars:  # trim the overshoot
        total -= len(last.pop()) + 1
    return paragraphs


def make_prose_example(
    rng: random.Random,
    pool: str,
    n_chars: int,
    n_facts: int | None = None,
    position: str | None = None,
    n_questions: int = 1,
    p_absent: float = 0.15,
    p_wrapped: float = 0.3,
) -> Example:
    """A document of real prose from `pool` ("train" or "heldout") with facts about open-ended names.

    Facts come in several phrasings, some as a list or a table; the answer is
    always "The {attribute} for the {entity} is {value}.", or absent_answer(). With
    probability `p_wrapped` the text is hard-wrapped, as plain-text files are.
    Names and values use only words of the same pool (cpchat.demo.names).
    """
    from cpchat.demo.prose import load_pool

    names = Names(pool, rng)
    n_facts = n_facts if n_facts is not None else rng.randint(1, 6)
    facts: list[Fact] = []

    def taken(key: tuple[str, str]) -> bool:
        return any(blurred(key, fact.key) for fact in facts)

    while len(facts) < n_facts:
        if facts and rng.random() < 0.5:  # a distractor sharing the entity or the attribute
            ent, attr = _near_key(rng, names, rng.choice(facts))
        else:
            ent, attr = names.entity(), names.attribute()[0]
        if taken((ent, attr)):
            continue
        facts.append(Fact(ent, attr, names.value(kind_of(attr))))

    paragraphs = draw_prose(rng, load_pool(pool), n_chars)
    boundaries = [(p, i) for p, para in enumerate(paragraphs) for i in range(len(para) + 1)]
    spots: list[tuple[int, int]] = []
    for i in range(n_facts):
        if i == 0 and position is not None:
            lo, hi = {"start": (0.0, 0.1), "middle": (0.45, 0.55), "end": (0.9, 1.0)}[position]
            spots.append(boundaries[min(len(boundaries) - 1, int(len(boundaries) * rng.uniform(lo, hi)))])
        else:
            spots.append(rng.choice(boundaries))
    # facts at one spot: a list or table sometimes, single sentences otherwise
    by_spot: dict[tuple[int, int], list[Fact]] = {}
    for fact, spot in zip(facts, spots):
        by_spot.setdefault(spot, []).append(fact)
    blocks: dict[tuple[int, int], str] = {}  # a list or table: a paragraph of its own
    sentences: dict[tuple[int, int], list[str]] = {}
    for spot, group in by_spot.items():
        if (len(group) > 1 or rng.random() < 0.15) and rng.random() < 0.5:
            blocks[spot] = fact_block(rng, group)
        else:
            sentences[spot] = [_prose_fact(rng, f) for f in group]
    text: list[str] = []
    for p, para in enumerate(paragraphs):
        out: list[str] = []
        for i in range(len(para) + 1):
            if (p, i) in blocks:
                text.extend(_join(out, first=not text))
                text.append(("\n\n" if text else "") + blocks[p, i])
                out = []
            out.extend(sentences.get((p, i), []))
            if i < len(para):
                out.append(para[i])
        text.extend(_join(out, first=not text))
    first = facts[0]
    at = text.index(next(s for s in text if first.value in s and first.entity in s))
    pos = position or ("start", "middle", "end")[min(2, 3 * at // max(1, len(text)))]
    if rng.random() < p_wrapped:
        text = wrapped(rng, "".join(text))

    turns: list[tuple[str, str]] = []
    asked = [facts[0]] + rng.sample(facts[1:], len(facts) - 1)
    for q in range(n_questions):
        if rng.random() < p_absent:
            while True:
                ent, attr = _near_key(rng, names, rng.choice(facts))
                if not taken((ent, attr)):
                    break
            turns.append((_prose_question(rng, attr, ent), absent_answer(attr, ent)))
        else:
            fact = asked[q % len(asked)]
            turns.append((_prose_question(rng, fact.attribute, fact.entity), fact.sentence()))
    name = rng.choice(DOC_NAMES).format(w=names.word(capital=False), n=rng.randint(1, 999))
    return Example(name, text, turns, facts, pos)


def _near_key(rng: random.Random, names: Names, fact: Fact) -> tuple[str, str]:
    """An (entity, attribute) that shares the entity or the attribute with `fact`, half the time
    with the other one a near miss: the same kind ("Iron mill" for "Hollow mill") or the same
    head noun ("backup code" for "gate code"), which only a name or modifier tells apart."""
    near = rng.random() < 0.5
    if rng.random() < 0.5:
        return fact.entity, names.attribute(like=fact.attribute if near else None)[0]
    return names.entity(like=fact.entity if near else None), fact.attribute


def blurred(key: tuple[str, str], other: tuple[str, str]) -> bool:
    """Whether a reader could take one (entity, attribute) key for the other: in each part the
    same words, or one the other with words in front. Asked for "the extension" of a case whose
    "skat extension" the document gives, a reader answers with it: such a pair is neither a
    distractor nor an absent fact, and only keys that differ in a modifier, a head or a name are."""
    return all(a == b or a.endswith(" " + b) or b.endswith(" " + a) for a, b in zip(key, other))


def wrapped(rng: random.Random, text: str) -> list[str]:
    """`text` with its prose paragraphs hard-wrapped (lists and tables kept), one piece per paragraph."""
    width, indent = rng.randint(60, 80), rng.choice(("", "", "   "))
    paragraphs = [p if p.startswith(("|", "- ")) else  # lines break at spaces only, as fmt and editors do
                  textwrap.fill(p, width, initial_indent=indent, subsequent_indent=indent,
                                break_on_hyphens=False, break_long_words=False)
                  for p in text.split("\n\n")]
    return [("\n\n" + p if i else p.lstrip()) for i, p in enumerate(paragraphs)]  # as render_document


def _join(sentences: list[str], first: bool) -> list[str]:
    """A paragraph's sentences with their separators (the first after a blank line)."""
    return [("" if first and i == 0 else "\n\n" if i == 0 else " ") + s for i, s in enumerate(sentences)]


def _prose_fact(rng: random.Random, fact: Fact) -> str:
    return rng.choice(PROSE_FACTS).format(attr=fact.attribute, Attr=_capitalised(fact.attribute),
                                          ent=fact.entity, val=fact.value)


def _capitalised(words: str) -> str:
    """The first letter up, the rest as it is ("PIN code" stays, where str.capitalize lowers it)."""
    return words[:1].upper() + words[1:]


def _prose_question(rng: random.Random, attr: str, ent: str) -> str:
    return rng.choice(PROSE_QUESTIONS).format(attr=attr, ent=ent) + rng.choice(QUESTION_TAILS)


def absent_answer(attribute: str, entity: str) -> str:
    """The answer when the document lacks the fact. It restates the key, as a found fact's answer
    does, so the model decides "absent" after reading the key back, not at the answer's second token."""
    return Fact(entity, attribute, ABSENT_VALUE).sentence()


def answered_value(answer: str) -> str | None:
    """The value in an answer "The {attribute} for the {entity} is {value}." (None: not that form);
    NOT_FOUND for either way of saying the document lacks it."""
    if answer == NOT_FOUND or answer.endswith(f" is {ABSENT_VALUE}."):
        return NOT_FOUND
    head, sep, value = answer.partition(" is ")
    return value[:-1] if sep and head.startswith("The ") and value.endswith(".") else None

def tokenizer_corpus(seed: int = 0, n: int = 4000) -> list[str]:
    """Text for training the demo tokenizer: the training prose pool, many facts about open-ended
    names in it, and the synthetic examples (their word lists are not made single tokens)."""
    from cpchat.demo.prose import load_pool

    rng = random.Random(seed)
    lines = [" ".join(p) for source in load_pool("train") for p in source.paragraphs]
    for _ in range(n):
        for ex in (make_example(rng, n_filler=8, n_questions=2),
                   make_prose_example(rng, "train", 600, n_questions=2)):
            lines.append(ex.messages()[0]["content"])
            lines += [a for _, a in ex.turns]
    return lines
