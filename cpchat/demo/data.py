"""Seeded generator of document question-answering examples for the demo model.

A document is prose with a few facts scattered in it ("The access code for the
Orion vault is 4812-KX."). The user asks about one fact; the model answers with
the fact as one sentence, or "The document does not say." when the document
holds no such fact. Two kinds: `make_prose_example` puts facts about open-ended
names, in several phrasings, into real prose (cpchat.demo.prose, .names), which
is what the model learns from; `make_example` is the earlier synthetic kind
(a small grammar of filler and fixed word lists), kept as a second test set.
A document and a question become a user message as the app sends them
(cpchat.prompt): the app and the training data agree on it exactly.
"""

from __future__ import annotations

import random
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from cpchat.demo.names import Names, kind_of
from cpchat.prompt import user_message

if TYPE_CHECKING:
    from cpchat.demo.prose import Source

NOT_FOUND = "The document does not say."
ABSENT_VALUE = "not in the document"  # prose answers restate the key first: see absent_answer
POSITIONS = ("start", "middle", "end")

NAMES = (
    "Orion", "Lyra", "Vega", "Altair", "Rigel", "Sirius", "Deneb", "Antares", "Polaris", "Castor", "Pollux",
    "Mira", "Electra", "Atlas", "Hydra", "Draco", "Cygnus", "Perseus", "Andromeda", "Cassia", "Juno",
    "Ceres", "Vesta", "Pallas", "Titan", "Rhea", "Tethys", "Dione", "Janus", "Phoebe", "Nova", "Zephyr",
    "Aurora", "Borealis", "Kestrel", "Falcon", "Osprey", "Heron", "Raven", "Sparrow", "Willow", "Cedar",
    "Aspen", "Maple", "Birch", "Juniper", "Hazel", "Rowan", "Alder", "Laurel", "Granite", "Basalt",
    "Quartz", "Cobalt", "Amber", "Onyx", "Jasper", "Garnet", "Topaz", "Opal", "Meridian", "Horizon",
    "Summit", "Harbor", "Beacon", "Citadel", "Bastion", "Lantern", "Compass", "Anchor",
)
KINDS = (
    "vault", "station", "archive", "lab", "depot", "tower", "bridge", "garden", "museum", "library",
    "clinic", "school", "factory", "harbor", "observatory", "mill", "warehouse", "theater",
)
# attribute -> kind of value
ATTRIBUTES = {
    "access code": "code",
    "password": "code",
    "serial number": "number",
    "room number": "number",
    "phone extension": "number",
    "budget": "money",
    "opening year": "year",
    "director": "person",
    "caretaker": "person",
    "main contact": "person",
    "home city": "city",
    "supplier": "company",
    "signal color": "color",
    "opening date": "date",
}
FIRST = (
    "Ada", "Alan", "Grace", "Linus", "Marie", "Niels", "Emmy", "Paul", "Rosa", "Carl", "Lise", "Max",
    "Hedy", "Kurt", "Jane", "Omar", "Priya", "Wei", "Kenji", "Sofia", "Ingrid", "Tomas", "Elena", "Yusuf",
    "Amara", "Diego", "Hana", "Lars", "Mei", "Nadia", "Oscar", "Ravi", "Sara", "Tariq", "Vera",
)
LAST = (
    "Lovelace", "Turing", "Hopper", "Curie", "Bohr", "Noether", "Dirac", "Parks", "Gauss", "Meitner",
    "Planck", "Lamarr", "Godel", "Goodall", "Haddad", "Patel", "Zhang", "Tanaka", "Rossi", "Berg", "Novak",
    "Petrova", "Kaya", "Okafor", "Ruiz", "Sato", "Lund", "Chen", "Haddou", "Wilde", "Rao", "Lindqvist",
    "Aziz", "Moreau",
)
CITIES = (
    "Lisbon", "Oslo", "Kyoto", "Lima", "Nairobi", "Quebec", "Dublin", "Porto", "Tunis", "Hanoi", "Bergen",
    "Cusco", "Dakar", "Seville", "Tartu", "Zagreb", "Malmo", "Perth", "Leeds", "Graz", "Turin", "Bilbao",
    "Gdansk", "Quito", "Accra", "Riga", "Lyon", "Basel", "Cork", "Split",
)
COMPANIES = (
    "Acme", "Globex", "Initech", "Umbrella", "Vandelay", "Hooli", "Stark", "Wayne", "Tyrell", "Cyberdyne",
    "Soylent", "Wonka", "Aperture", "Massive", "Dynamic", "Oscorp", "Gringotts", "Monarch", "Nakatomi",
    "Virtucon",
)
COLORS = (
    "red", "blue", "green", "amber", "violet", "orange", "white", "black", "silver", "golden", "teal",
    "crimson", "indigo", "yellow",
)
MONTHS = (
    "January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
    "November", "December",
)

FACT_TEMPLATES = (
    "The {attr} for the {ent} is {val}.",
    "The {attr} for the {ent} is {val}.",
    "Note that the {attr} for the {ent} is {val}.",
    "For the record, the {attr} for the {ent} is {val}.",
    "As agreed, the {attr} for the {ent} is {val}.",
    "Everyone should know that the {attr} for the {ent} is {val}.",
)
QUESTION_TEMPLATES = (
    "What is the {attr} for the {ent}?",
    "What is the {attr} for the {ent}?",
    "Tell me the {attr} for the {ent}.",
    "According to the document, what is the {attr} for the {ent}?",
    "Which {attr} does the document give for the {ent}?",
    "Please look up the {attr} for the {ent}.",
)
# Trailing words vary the distance between the question and the answer, so that copying the key
# from the question has to match content (an induction head, the same one retrieval needs).
QUESTION_TAILS = (
    "", "", "", " Thanks.", " Please answer briefly.", " I need it for the weekly report, so please check.",
    " Quote the document.", " Be exact.", " My colleague asked me about it this morning and I forgot.",
)
ANSWER_TEMPLATE = "The {attr} for the {ent} is {val}."

# Filler prose: a small grammar, so that documents of any length are cheap to make.
SUBJECTS = (
    "The committee", "The old ferry", "A quiet engineer", "The river", "Our neighbour", "The morning train",
    "The council", "A young painter", "The weather", "The museum guide", "The baker", "The city",
    "A tired courier", "The garden", "The orchestra", "Every visitor", "The new intern", "The market",
    "A curious child", "The lighthouse keeper", "The team", "The report", "The storm", "The harbour master",
    "Most of the staff", "The small cafe", "The professor",
)
VERBS = (
    "walked past", "talked about", "looked at", "repaired", "painted", "ignored", "visited", "described",
    "measured", "cleaned", "remembered", "forgot about", "waited near", "argued about", "photographed",
    "counted", "studied", "moved", "praised", "complained about", "returned to", "wrote about",
    "listened to", "organised", "watched",
)
OBJECTS = (
    "the wooden fence", "the long hallway", "a stack of letters", "the northern hills", "the broken clock",
    "a basket of apples", "the narrow street", "the evening news", "a faded map", "the empty platform",
    "the new roof", "an old song", "the village square", "a pile of books", "the quiet lake",
    "the spring festival", "the red door", "a box of tools", "the winter coats", "the green fields",
    "the stone wall", "the last bus", "a cup of tea",
)
TAILS = (
    "", "", "", " before lunch", " after the rain", " on Tuesday", " for a while", " without a word",
    " in the afternoon", " with great care", " once again", " as usual", " at dawn", " late at night",
    " during the break", " for the third time", " near the station", " with some friends", " in silence",
)
EXTRA = (
    "Nobody was in a hurry that day.",
    "It was a long and uneventful week.",
    "Some people found this mildly interesting.",
    "The rest of the story is not important here.",
    "Later, everyone went home.",
    "Then the lights went out for a moment.",
    "This happened more than once.",
    "Nothing else changed for a long time.",
)


@dataclass(frozen=True)
class Fact:
    entity: str
    attribute: str
    value: str

    @property
    def key(self) -> tuple[str, str]:
        return self.entity, self.attribute

    def sentence(self, template: str = ANSWER_TEMPLATE) -> str:
        return template.format(attr=self.attribute, ent=self.entity, val=self.value)


@dataclass
class Example:
    """One conversation: a document, then one or more question/answer turns."""

    doc_name: str
    sentences: list[str]  # each with its leading separator ("", " " or "\n\n")
    turns: list[tuple[str, str]]  # (question, answer)
    facts: list[Fact] = field(default_factory=list)
    position: str = "middle"  # where the first asked fact sits in the document

    @property
    def doc_text(self) -> str:
        return "".join(self.sentences)

    def messages(self) -> list[dict[str, str]]:
        """Chat messages: the document goes into the first user turn only."""
        out: list[dict[str, str]] = []
        for i, (question, answer) in enumerate(self.turns):
            content = render_user_turn(self.doc_name, self.doc_text, question) if i == 0 else question
            out += [{"role": "user", "content": content}, {"role": "assistant", "content": answer}]
        return out


def render_user_turn(doc_name: str, doc_text: str, question: str) -> str:
    """The user message for a question about an attached document (the format the demo model knows)."""
    return user_message([(doc_name, doc_text)], question)


def random_value(rng: random.Random, kind: str) -> str:
    if kind == "code":
        digits = "".join(rng.choice("0123456789") for _ in range(rng.choice((3, 4, 4, 5))))
        letters = "".join(rng.choice("ABCDEFGHJKLMNPQRSTUVWXYZ") for _ in range(rng.choice((2, 2, 3))))
        return f"{digits}-{letters}" if rng.random() < 0.7 else f"{letters}-{digits}"
    if kind == "number":
        return str(rng.randint(10, 99999))
    if kind == "money":
        return f"{rng.randint(2, 990)},{rng.randint(0, 999):03d} euros"
    if kind == "year":
        return str(rng.randint(1850, 2030))
    if kind == "person":
        return f"{rng.choice(FIRST)} {rng.choice(LAST)}"
    if kind == "city":
        return rng.choice(CITIES)
    if kind == "company":
        return f"{rng.choice(COMPANIES)} {rng.choice(('Ltd', 'Inc', 'Group', 'Works', 'Labs'))}"
    if kind == "color":
        return rng.choice(COLORS)
    if kind == "date":
        return f"{rng.choice(MONTHS)} {rng.randint(1, 28)}"
    raise ValueError(kind)


def filler_sentence(rng: random.Random) -> str:
    if rng.random() < 0.1:
        return rng.choice(EXTRA)
    return f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}{rng.choice(TAILS)}."


def _entity(rng: random.Random) -> str:
    return f"{rng.choice(NAMES)} {rng.choice(KINDS)}"


def make_example(
    rng: random.Random,
    n_filler: int,
    n_facts: int | None = None,
    position: str | None = None,
    n_questions: int = 1,
    p_absent: float = 0.15,
) -> Example:
    """A document of `n_filler` filler sentences with facts, and `n_questions` questions about it.

    `position` places the first asked fact at the start, middle or end of the
    document (None: anywhere). Distractor facts share the entity or the
    attribute of a real one, so the model must match both.
    """
    n_facts = n_facts if n_facts is not None else rng.randint(1, 6)
    facts: list[Fact] = []
    keys: set[tuple[str, str]] = set()
    while len(facts) < n_facts:
        if facts and rng.random() < 0.5:  # distractor close to an existing fact
            base = rng.choice(facts)
            ent, attr = (base.entity, rng.choice(list(ATTRIBUTES))) if rng.random() < 0.5 else (
                _entity(rng), base.attribute)
        else:
            ent, attr = _entity(rng), rng.choice(list(ATTRIBUTES))
        if (ent, attr) in keys:
            continue
        keys.add((ent, attr))
        facts.append(Fact(ent, attr, random_value(rng, ATTRIBUTES[attr])))

    sentences = [filler_sentence(rng) for _ in range(n_filler)]
    slots: list[int] = []
    for i in range(n_facts):  # insertion index into the filler list, one per fact
        if i == 0 and position is not None:
            lo, hi = {"start": (0.0, 0.1), "middle": (0.45, 0.55), "end": (0.9, 1.0)}[position]
            slots.append(round(n_filler * rng.uniform(lo, hi)))
        else:
            slots.append(rng.randint(0, n_filler))
    order = sorted(range(n_facts), key=lambda i: (slots[i], i))
    for i in reversed(order):
        sentences.insert(slots[i], facts[i].sentence(rng.choice(FACT_TEMPLATES)))
    pos = position or ("start", "middle", "end")[min(2, int(3 * slots[0] / max(1, n_filler + 1)))]

    text: list[str] = []
    for i, sentence in enumerate(sentences):
        sep = "" if i == 0 else ("\n\n" if rng.random() < 0.15 else " ")
        text.append(sep + sentence)

    turns: list[tuple[str, str]] = []
    asked = [facts[0]] + rng.sample(facts[1:], len(facts) - 1)
    for q in range(n_questions):
        if rng.random() < p_absent:
            ent, attr = _absent_key(rng, facts, keys)
            turns.append((_question(rng, attr, ent), NOT_FOUND))
        else:
            fact = asked[q % len(asked)]
            turns.append((_question(rng, fact.attribute, fact.entity), fact.sentence()))
    return Example(f"notes-{rng.randint(1, 999)}.txt", text, turns, facts, pos)


def _question(rng: random.Random, attr: str, ent: str) -> str:
    return rng.choice(QUESTION_TEMPLATES).format(attr=attr, ent=ent) + rng.choice(QUESTION_TAILS)


def _absent_key(rng: random.Random, facts: list[Fact], keys: set[tuple[str, str]]) -> tuple[str, str]:
    """A (entity, attribute) pair the document does not hold, usually one that looks close to a real one."""
    while True:
        base = rng.choice(facts)
        r = rng.random()
        if r < 0.4:
            key = (base.entity, rng.choice(list(ATTRIBUTES)))
        elif r < 0.8:
            key = (_entity(rng), base.attribute)
        else:
            key = (_entity(rng), rng.choice(list(ATTRIBUTES)))
        if key not in keys:
            return key


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


def write_sample_document(path: str | Path, n_filler: int = 250, seed: int = 7) -> list[tuple[str, str]]:
    """Write a long document with known facts; return sample (question, answer) pairs about it."""
    rng = random.Random(seed)
    sentences = [filler_sentence(rng) for _ in range(n_filler)]
    facts = [
        Fact("Orion vault", "access code", "4812-KX"),
        Fact("Lyra observatory", "director", "Grace Hopper"),
        Fact("Cedar library", "opening year", "1927"),
        Fact("Orion station", "access code", "7305-QD"),
        Fact("Lyra observatory", "home city", "Bergen"),
    ]
    spots = [round(n_filler * f) for f in (0.05, 0.5, 0.93, 0.3, 0.7)]
    for fact, spot in sorted(zip(facts, spots), key=lambda p: -p[1]):
        sentences.insert(spot, fact.sentence())
    paragraphs = [" ".join(sentences[i:i + 8]) for i in range(0, len(sentences), 8)]
    Path(path).write_text("\n\n".join(paragraphs) + "\n")
    qa = [(f"What is the {f.attribute} for the {f.entity}?", f.sentence()) for f in facts[:3]]
    return qa + [("What is the password for the Orion vault?", NOT_FOUND)]


# ---------------------------------------------------------------- facts in real prose, open-ended names
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
