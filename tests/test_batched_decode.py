"""Answers decoded together through real ranks (cpchat.client.batch over cpchat.rank.batch_step): each
one's tokens and logprobs are mlx-lm's for that prompt alone, whatever the others in the batch do —
joining late, ending early, cancelled mid-answer."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from conftest import DEMO_MODEL
from helpers import VARIANTS, assert_same, prefill_event, random_prompt, raw_session
from references import MlxReference, reference_generate

from cpchat.client.batch import Answer, Batch, until_batched
from cpchat.client.events import Done, Token
from cpchat.client.held import HeldConversations
from cpchat.client.messages import step_request
from cpchat.core.quantized_kv import FULL_PRECISION, KVFormat
from cpchat.protocol import cpchat_pb2 as pb
from cpchat.smallmodels import write_model

LENGTHS = (1, 9, 40, 75)  # prompts of different lengths (1: a lone token; none divisible by 2N but 40)
ANSWERS = (7, 12, 4, 10)  # and answers that end at different steps


def forms(tmp_path_factory, model_dir, form: str):
    if form == "kv4":
        return DEMO_MODEL, KVFormat(4, 32, 60)  # the longest prompts cross into quantized K/V as they decode
    if VARIANTS.get(form, (None, {}))[1]:  # a variant with options of its own
        arch, options = VARIANTS[form]
        return write_model(tmp_path_factory.mktemp(form) / form, arch, **options), FULL_PRECISION
    return model_dir(form), FULL_PRECISION


def expected(path, kv: KVFormat, prompts: list[list[int]], answers: tuple[int, ...]) -> list[list]:
    if not kv.quantized:
        return [reference_generate(path, ids, n) for ids, n in zip(prompts, answers, strict=True)]
    reference = MlxReference(path, kv)
    try:
        return [reference(ids, n)[0] for ids, n in zip(prompts, answers, strict=True)]
    finally:
        reference.close()


def start(session, ids: list[int], n: int, batch: Batch, out: list) -> Answer | None:
    """Read a prompt up to its first token and add its answer to the batch; its tokens to `out`."""
    answer = until_batched(session.generate(ids, n, batched=True),
                           lambda e: out.append((e.id, e.logprob)) if isinstance(e, Token) else None)
    if answer is not None:
        batch.add(answer)
    return answer


def step(batch: Batch, outs: dict[int, list]) -> list[Done]:
    ended = []
    for answer, event in batch.step():
        if isinstance(event, Token):
            outs[answer.turn].append((event.id, event.logprob))
        else:
            ended.append(event)
    return ended


@pytest.mark.parametrize("form, ranks", [("llama", 2), ("llama", 1), ("mistral-sliding", 2), ("kv4", 2),
                                         ("qwen3_next", 2), ("nemotron_h", 1)])
def test_answers_decoded_together_are_each_mlx_lms_alone(clusters, model_dir, tmp_path_factory, form, ranks):
    """Four prompts of different lengths: two start together, a third joins after two steps, the fourth
    after four; each answer ends at its own length, and each is mlx-lm's for its prompt alone."""
    path, kv = forms(tmp_path_factory, model_dir, form)
    prompts = [random_prompt(path, n, seed=60 + i) for i, n in enumerate(LENGTHS)]
    want = expected(path, kv, prompts, ANSWERS)
    cluster = clusters.get(ranks, path, kv=kv)
    session = raw_session(cluster, path, "auto", 1)
    session.conversations = HeldConversations(limit=8)
    batch, outs, ended = Batch(session), {i: [] for i in range(4)}, []
    start(session, prompts[0], ANSWERS[0], batch, outs[0])
    start(session, prompts[1], ANSWERS[1], batch, outs[1])
    joins = {2: 2, 4: 3}  # after so many steps, this prompt joins
    steps = 0
    while batch.answers:
        ended += step(batch, outs)
        steps += 1
        if steps in joins:
            start(session, prompts[joins[steps]], ANSWERS[joins[steps]], batch, outs[joins[steps]])
    for i in range(4):
        assert_same(outs[i], want[i])
    assert len(ended) == 4 and not session.conversations.busy
    # each conversation holds what the ranks hold: its prompt and the answer's tokens read
    stats = cluster.stats_once()
    assert all(s.sequences == 4 for s in stats)
    if form == "llama":
        assert sum(s.kv_tokens for s in stats) == session.conversations.tokens


@pytest.mark.parametrize("arch", ["llama", "qwen3_next"])
def test_a_cancelled_answer_leaves_the_batch_and_its_conversation_goes_on_from_memory(clusters, model_dir,
                                                                                     arch):
    """An answer cancelled after three tokens leaves at once; the other ends as alone; the cancelled
    one's next turn continues its conversation from memory (a hybrid's states too), as mlx-lm answers
    the whole of it."""
    path = model_dir(arch)
    a, b, more = (random_prompt(path, n, seed=70 + n) for n in (30, 45, 6))
    want_a, want_b = reference_generate(path, a, 10), reference_generate(path, b, 10)
    cluster = clusters.get(2, path)
    session = raw_session(cluster, path, "auto", 1)
    session.conversations = HeldConversations(limit=8)
    batch, outs = Batch(session), {0: [], 1: []}
    first = start(session, a, 10, batch, outs[0])
    start(session, b, 10, batch, outs[1])
    step(batch, outs)
    step(batch, outs)
    done = batch.cancel(first)
    assert done.generated_tokens == 3 and len(batch.answers) == 1
    while batch.answers:
        step(batch, outs)
    assert_same(outs[0], want_a[:3])
    assert_same(outs[1], want_b)
    read = [t for t, _ in want_a[:2]]  # the third token was sampled, not read
    follow = a + read + [t for t, _ in want_a[2:3]] + more
    events = list(session.generate(follow, 5))
    prefill = prefill_event(events)
    assert (prefill.cache, prefill.cached_tokens) == ("memory", len(a) + 2)
    tokens = [(e.id, e.logprob) for e in events if isinstance(e, Token)]
    assert_same(tokens, reference_generate(path, follow, 5))


@pytest.mark.parametrize("arch", ["llama", "qwen3_next"])
def test_a_step_aborted_on_a_rank_leaves_every_conversation_as_before(clusters, model_dir, arch):
    """A step sent to rank 0 alone waits for rank 1's partials until it is cancelled: rank 0's
    conversations (K/V, a hybrid's states and halos) are as before it, and the answers go on as alone."""
    path = model_dir(arch)
    prompts = [random_prompt(path, n, seed=80 + n) for n in (20, 33)]
    want = [reference_generate(path, ids, 6) for ids in prompts]
    cluster = clusters.get(2, path)
    session = raw_session(cluster, path, "auto", 1)
    session.conversations = HeldConversations(limit=8)
    batch, outs = Batch(session), {0: [], 1: []}
    for i, ids in enumerate(prompts):
        start(session, ids, 6, batch, outs[i])
    step(batch, outs)
    request, rank0 = step_request([a.row() for a in batch.answers]), cluster.ranks[0].control
    with ThreadPoolExecutor(1) as pool:
        call = pool.submit(rank0.Step, request, metadata=cluster.metadata)
        deadline = time.monotonic() + 60
        cancel = pb.CancelRequest(request_id=request.step_id)
        while not rank0.Cancel(cancel, metadata=cluster.metadata).cancelled:
            assert not call.done() and time.monotonic() < deadline, "rank 0 never took the step"
            time.sleep(0.01)
        with pytest.raises(grpc.RpcError) as e:
            call.result()
    assert e.value.code() == grpc.StatusCode.ABORTED
    while batch.answers:
        step(batch, outs)
    for i in range(2):
        assert_same(outs[i], want[i])


def test_a_step_refuses_what_it_cannot_run_by_name(clusters, model_dir):
    """A wrong unread token, a conversation twice, one not held: refused with the reason, before the rank
    is taken (the ranks answer the next request)."""
    path = model_dir("llama")
    cluster = clusters.get(1, path)
    session = raw_session(cluster, path, "auto", 1)
    session.conversations = HeldConversations(limit=8)
    batch = Batch(session)
    answer = start(session, random_prompt(path, 12, seed=3), 5, batch, [])
    control = cluster.ranks[0].control
    good = pb.StepRow(sequence=answer.held.name, token=answer.generated[-1], index=1)
    bad = {
        "reads token": [pb.StepRow(sequence=good.sequence, token=good.token + 1, index=1)],
        "twice": [good, good],
        "no unread token": [pb.StepRow(sequence="nobody", token=1)],
        "no rows": [],
    }
    for reason, rows in bad.items():
        with pytest.raises(grpc.RpcError) as e:
            control.Step(pb.StepRequest(step_id="s", rows=rows), metadata=cluster.metadata)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and reason in e.value.details()
    while batch.answers:
        batch.step()

