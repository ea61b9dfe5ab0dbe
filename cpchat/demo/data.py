"""Seeded generator of document question-answering examples for the demo model.

A document is prose with a few facts scattered in it ("The access code for the
Orion vault is 4812-KX."). The user asks about one fact; the model answers with
the fact as one sentence, or "The document does not say." when the document
holds no such fact. Two kinds: `make_prose_example` (cpchat.demo.prose_examples)
puts facts about open-ended names, in several phrasings, into real prose, which
is what the model learns from; `make_example`, here, is the earlier synthetic
kind (a small grammar of filler and fixed word lists), kept as a second test set.
A document and a question become a user message as the app sends them
(cpchat.prompt): the app and the training data agree on it exactly.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from cpchat.prompt import user_message

if TYPE_CHECKING:
    pass

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
