"""The demo data generator and the shipped demo model (assets/demo-model)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from cpchat.demo.data import NOT_FOUND, make_example, render_user_turn, write_sample_document

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "assets" / "demo-model"
SAMPLE_DOC = ROOT / "assets" / "sample-doc.txt"
SAMPLE_QA = [
    ("What is the access code for the Orion vault?", "The access code for the Orion vault is 4812-KX."),
    ("What is the director for the Lyra observatory?", "The director for the Lyra observatory is Grace Hopper."),
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


def test_user_turn_format() -> None:
    turn = render_user_turn("a.txt", "Some text.\n", "What?")
    assert turn == '<document name="a.txt">\nSome text.\n</document>\n\nWhat?'


def test_sample_document_is_reproducible(tmp_path: Path) -> None:
    qa = write_sample_document(tmp_path / "doc.txt")
    assert (tmp_path / "doc.txt").read_text() == SAMPLE_DOC.read_text()
    assert qa[:3] == SAMPLE_QA


@pytest.fixture(scope="module")
def demo_model():
    from mlx_lm import load

    return load(str(MODEL))


def _prefill_shared(model, tokenizer, doc_text: str, questions: list[str]) -> list[str]:
    """Greedy answers to several questions about one document, prefilling the document once."""
    import copy

    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": render_user_turn(SAMPLE_DOC.name, doc_text, q)}],
            add_generation_prompt=True,
        )
        for q in questions
    ]
    common = 0
    while all(len(p) > common and p[common] == prompts[0][common] for p in prompts):
        common += 1
    base = make_prompt_cache(model)
    mx.eval(model(mx.array([prompts[0][:common]]), cache=base))
    eos = tokenizer.eos_token_id
    answers = []
    for prompt in prompts:
        cache = copy.deepcopy(base)
        logits = model(mx.array([prompt[common:]]), cache=cache)
        out: list[int] = []
        for _ in range(40):
            token = int(mx.argmax(logits[0, -1]).item())
            if token == eos:
                break
            out.append(token)
            logits = model(mx.array([[token]]), cache=cache)
        answers.append(tokenizer.decode(out).strip())
    return answers


def test_demo_model_answers_sample_questions(demo_model) -> None:
    model, tokenizer = demo_model
    answers = _prefill_shared(model, tokenizer, SAMPLE_DOC.read_text(), [q for q, _ in SAMPLE_QA])
    assert answers == [a for _, a in SAMPLE_QA]


def test_demo_model_generate_matches(demo_model) -> None:
    """The plain mlx_lm.generate path (what evaluate.py uses) gives the same answer."""
    from cpchat.demo.evaluate import mlx_generate_fn

    fn = mlx_generate_fn(MODEL)
    question, answer = SAMPLE_QA[0]
    assert fn(SAMPLE_DOC.name, SAMPLE_DOC.read_text(), question).strip() == answer
