"""The demo data generator and the shipped demo model (assets/demo-model)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from cpchat.client.events import Token
from cpchat.client.session import SamplingOptions, Session, load_tokenizer
from cpchat.demo.data import NOT_FOUND, POSITIONS, make_example, render_user_turn, write_sample_document
from cpchat.demo.names import HEADS, KINDS, MADE_UP_KINDS, Names, kind_of, pool_of_word
from cpchat.demo.prose import LICENCES, load_pool, pool_of
from cpchat.demo.prose_examples import (
    PROSE_QUESTIONS,
    absent_answer,
    answered_value,
    blurred,
    make_prose_example,
)

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "assets" / "demo-model"
SAMPLE_DOC = ROOT / "assets" / "sample-doc.txt"
SAMPLE_QA = [
    ("What is the access code for the Orion vault?", "The access code for the Orion vault is 4812-KX."),
    ("What is the director for the Lyra observatory?",
     "The director for the Lyra observatory is Grace Hopper."),
    ("What is the opening year for the Cedar library?", "The opening year for the Cedar library is 1927."),
]


def test_generator_is_deterministic() -> None:
    a = [make_example(random.Random(5), 30, n_questions=3) for _ in range(2)]
    assert a[0] == a[1]
    assert make_example(random.Random(6), 30, n_questions=3) != a[0]


def test_answers_come_from_the_document() -> None:
    rng = random.Random(0)
    absent = 0
    for _ in range(300):
        ex = make_example(rng, rng.randint(1, 40), n_questions=3, position=rng.choice((None, "start", "end")))
        text = ex.doc_text
        for question, answer in ex.turns:
            asked = [f for f in ex.facts if f" {f.attribute} " in question and f"the {f.entity}" in question]
            if answer == NOT_FOUND:
                absent += 1
                assert not asked
            else:
                assert [f.sentence() for f in asked] == [answer]
                assert answer.rstrip(".")[4:] in text  # "the X for the Y is V" appears in the document
    assert absent > 50


def test_position_places_the_first_fact() -> None:
    for position, (lo, hi) in {"start": (0, 0.15), "middle": (0.4, 0.6), "end": (0.85, 1.0)}.items():
        ex = make_example(random.Random(1), 200, position=position, p_absent=0.0)
        at = ex.doc_text.index(ex.turns[0][1].rstrip(".")[4:]) / len(ex.doc_text)
        assert lo <= at <= hi, (position, at)


@pytest.mark.slow
def test_prose_pools_split_by_source() -> None:
    train, heldout = load_pool("train"), load_pool("heldout")
    assert not {s.name for s in train} & {s.name for s in heldout}
    assert "licence/Apache-2.0" in {s.name for s in heldout}
    for pool in (train, heldout):  # licences and reference docs in both pools, with plenty of prose
        assert {s.name.split("/")[0] for s in pool} >= {"licence", "python"}
    assert sum(s.chars for s in heldout) > 100_000
    sentences = [x for s in train for p in s.paragraphs for x in p]
    assert not any("\n" in x or x.startswith(">>>") for x in sentences)


def test_held_out_names_use_only_held_out_words() -> None:
    rng = random.Random(3)
    seen: dict[str, set[str]] = {}
    for pool in ("train", "heldout"):
        names = Names(pool, rng)
        entities = [names.entity() for _ in range(300)]
        seen[pool] = set(entities)
        firsts = [e.split()[0].split("-")[0] for e in entities]
        firsts += [names.person().split()[-1].split("-")[0] for _ in range(100)]
        firsts += [a.split()[0] for a, _ in (names.attribute() for _ in range(100)) if a not in HEADS]
        assert {pool_of_word(w) for w in firsts} == {pool}
    assert not seen["train"] & seen["heldout"]


def test_near_names_keep_the_kind() -> None:
    """A near miss ("backup code" or "password" for "gate code", "Iron mill" for "Hollow mill")
    differs from its name and keeps its kind of value, so that only the words tell them apart."""
    names = Names("heldout", random.Random(3))
    other_heads = 0
    for _ in range(200):
        attr, kind = names.attribute()
        near, near_kind = names.attribute(like=attr)
        assert near != attr and near_kind == kind == kind_of(near)
        other_heads += near.split()[-1] != attr.split()[-1]
        entity = names.entity()
        other = names.entity(like=entity)
        assert other != entity and other.split()[-1] == entity.split()[-1]
    assert 30 < other_heads < 120


def test_training_entities_have_made_up_kinds() -> None:
    """Some training entities end in a made-up kind ("the Iron drelk"), which their near misses keep;
    held-out entities keep the listed kinds, so the held-out stream does not change."""
    listed = tuple(" " + k for k in KINDS)
    for pool, share in (("train", MADE_UP_KINDS), ("heldout", 0.0)):
        names = Names(pool, random.Random(5))
        made_up = 0
        for _ in range(400):
            entity = names.entity()
            made_up += not entity.endswith(listed)
            near = names.entity(like=entity)
            assert near != entity and near.split()[-1] == entity.split()[-1]
        assert abs(made_up / 400 - share) < 0.07, (pool, made_up)


def test_prose_answers_come_from_the_document() -> None:
    rng = random.Random(0)
    absent = tables = 0
    for _ in range(150):
        ex = make_prose_example(rng, rng.choice(("train", "heldout")), rng.randint(100, 3000),
                                n_questions=3, position=rng.choice((None, "start", "middle", "end")))
        assert answered_value(ex.turns[0][1]) in (NOT_FOUND, ex.facts[0].value)
        tables += "| Item |" in ex.doc_text
        for question, answer in ex.turns:
            if answered_value(answer) == NOT_FOUND:
                absent += 1
                assert not any(question.startswith(q.format(attr=f.attribute, ent=f.entity))
                               for q in PROSE_QUESTIONS for f in ex.facts)
                attr, ent = answer.removeprefix("The ").split(" is ")[0].split(" for the ")
                assert not any(blurred((ent, attr), f.key) for f in ex.facts), answer
            else:
                fact = next(f for f in ex.facts if f.sentence() == answer)
                assert answered_value(answer) == fact.value
                paragraphs = [" ".join(s.split()) for s in ex.sentences]  # hard-wrapped or not
                assert any(fact.value in p and fact.entity in p for p in paragraphs)
        keys = [f.key for f in ex.facts]
        assert not any(blurred(a, b) for i, a in enumerate(keys) for b in keys[i + 1:]), keys
    assert absent > 30 and tables > 5
    assert make_prose_example(random.Random(4), "heldout", 800) == make_prose_example(
        random.Random(4), "heldout", 800)


def test_keys_a_reader_would_take_for_each_other() -> None:
    """Only a differing modifier, head or name tells two keys apart; one part that merely lacks the
    other's first words ("extension" beside "skat extension") does not."""
    assert blurred(("Hollow mill", "extension"), ("Hollow mill", "skat extension"))
    assert blurred(("Cuget yard", "gate code"), ("Thunder Cuget yard", "gate code"))
    assert not blurred(("Hollow mill", "gate code"), ("Hollow mill", "backup code"))
    assert not blurred(("Hollow mill", "code"), ("Iron mill", "gate code"))
    assert not blurred(("Hollow mill", "password"), ("Hollow mill", "access code"))


def test_answered_value() -> None:
    assert answered_value("The gate code for the Hollow mill is 7712-MR.") == "7712-MR"
    assert answered_value("The owner of the Lark pier is Ada Lim.") == "Ada Lim"
    assert answered_value(NOT_FOUND) == NOT_FOUND
    assert answered_value(absent_answer("backup code", "Hollow mill")) == NOT_FOUND
    assert answered_value("The gate code for the Hollow mill is") is None


def test_user_turn_format() -> None:
    turn = render_user_turn("a.txt", "Some text.\n", "What?")
    assert turn == '<document name="a.txt">\nSome text.\n</document>\n\nWhat?'


def test_sample_document_is_reproducible(tmp_path: Path) -> None:
    qa = write_sample_document(tmp_path / "doc.txt")
    assert (tmp_path / "doc.txt").read_text() == SAMPLE_DOC.read_text()
    assert qa[:3] == SAMPLE_QA


@pytest.fixture(scope="module")
def sample_answers() -> list[str]:
    """Greedy mlx-lm answers about the sample document, from a child process (evaluate runs with the
    ranks' fast BLAS where installed)."""
    cmd = [sys.executable, "-m", "cpchat.demo.evaluate", "--model", str(MODEL), "--ask-doc", str(SAMPLE_DOC)]
    for question, _ in SAMPLE_QA:
        cmd += ["--question", question]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


@pytest.mark.slow
def test_demo_model_answers_sample_questions(sample_answers: list[str]) -> None:
    assert sample_answers == [a for _, a in SAMPLE_QA]


HEADLESS_QA = [*SAMPLE_QA, ("What is the password for the Orion vault?", NOT_FOUND)]


@pytest.fixture(scope="module")
def headless_answers() -> list[str]:
    """The README's first example: the default model, two ranks, the sample document, one
    conversation of several questions (the document is sent with the first)."""
    cmd = [sys.executable, "-m", "cpchat", "--headless", "--json", "--temp", "0", "--ranks", "2",
           "--doc", str(SAMPLE_DOC)]
    out = subprocess.run(cmd, input="".join(f"{q}\n" for q, _ in HEADLESS_QA), cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    events = [json.loads(line) for line in out.stdout.splitlines()]
    assert [e["event"] for e in events].count("done") == len(HEADLESS_QA)
    return ["".join(e["text"] for e in events if e["event"] == "token" and e["turn"] == turn).strip()
            for turn in range(len(HEADLESS_QA))]


@pytest.mark.slow
def test_headless_with_two_ranks_answers_from_the_sample_document(headless_answers: list[str]) -> None:
    assert headless_answers == [a for _, a in HEADLESS_QA]


TRIAL_FACT = "The gate code for the Hollow mill is 7712-MR."


def licence_trial() -> tuple[str, str, str, str]:
    """The README's trial of a text the model never saw: the Apache-2.0 licence (held out) with a fact
    about names it never saw added after line 100 (`sed '100a ...'`). Row: (doc name, text, question,
    answer)."""
    lines = (LICENCES / "Apache-2.0").read_text().splitlines(keepends=True)
    text = "".join([*lines[:100], TRIAL_FACT + "\n", *lines[100:]])
    return "notes.txt", text, "What is the gate code for the Hollow mill?", TRIAL_FACT


def test_the_trial_is_held_out_and_in_the_readme() -> None:
    assert pool_of("licence/Apache-2.0") == "heldout"
    assert {pool_of_word(w) for w in ("Hollow", "gate")} == {"heldout"}
    readme = (ROOT / "README.md").read_text()
    assert f"sed '100a {TRIAL_FACT}' {LICENCES / 'Apache-2.0'} > notes.txt" in readme


@pytest.fixture(scope="module")
def held_out(clusters) -> tuple[list[tuple[str, str, str, str]], list[str], dict[int, list[list[int]]]]:
    """Held-out questions answered greedily through one rank and through four: generated documents of
    about 1.5K tokens (the fact at the start, middle or end), real prose the model never read with
    names it never saw, and the licence trial. Rows: (doc name, text, question, answer)."""
    rng = random.Random(2024)
    generated = [make_example(rng, 130, position=p, p_absent=0.0) for p in POSITIONS * 2]
    prose = [make_prose_example(rng, "heldout", 5000, position=p, p_absent=0.0) for p in POSITIONS * 2]
    rows = [(ex.doc_name, ex.doc_text, *ex.turns[0]) for ex in generated + prose] + [licence_trial()]
    tokenizer = load_tokenizer(str(MODEL))
    tokens: dict[int, list[list[int]]] = {}
    for ranks in (1, 4):
        session = Session(clusters.get(ranks, MODEL), tokenizer, sampling=SamplingOptions(48, 0.0))
        tokens[ranks] = []
        for name, text, question, _ in rows:
            session.reset()
            turn = session.send(render_user_turn(name, text, question))
            tokens[ranks].append([e.id for e in turn if isinstance(e, Token)])
    answers = [tokenizer.decode(t, skip_special_tokens=True).strip() for t in tokens[1]]
    return rows, answers, tokens


@pytest.mark.slow
def test_one_and_four_ranks_give_the_same_answers(held_out) -> None:
    _, answers, tokens = held_out
    assert tokens[1] == tokens[4]
    assert all(answers), "every example got an answer"


def test_held_out_answers_are_right(held_out) -> None:
    rows, answers, _ = held_out
    right = [got == want for (*_, want), got in zip(rows, answers, strict=True)]
    assert sum(right[:6]) >= 5, answers[:6]  # generated documents
    assert sum(right[6:12]) >= 4, answers[6:12]  # real prose
    assert right[12], answers[12]  # the licence trial
