"""The order in which `cpchat serve`'s scheduler reads prompts (cpchat.serve.scheduler), on real ranks:
its one thread puts every request's events, so their order is the order it ran them."""

from __future__ import annotations

from helpers import Asked, random_prompt, raw_session

from cpchat.client.events import Token
from cpchat.client.held import HeldConversations
from cpchat.serve.scheduler import Scheduler


def test_prompts_of_one_length_are_read_one_after_another(clusters, model_dir):
    """Two 5,000-token prompts sent together, read 2,048 tokens at a time: the first is read to its
    first token before the second's first chunk (the prompt with the fewest tokens left goes first), so
    its answer does not wait for the other prompt, and the second's for no more than it did."""
    path = model_dir("llama")
    session = raw_session(clusters.get(2, path), path, "auto", 3)
    session.conversations = HeldConversations(limit=8)
    log: list = []
    first, second = (Asked(random_prompt(path, 5000, seed=s), 3, log) for s in (1, 2))
    scheduler = Scheduler(session, max_batch=4, ranks_answer=lambda: None, prefill_chunk=2048)
    try:
        scheduler.submit(first)
        scheduler.submit(second)
        assert first.ended.wait(300) and second.ended.wait(300)
    finally:
        scheduler.stop()
    order = [(asked, type(item)) for asked, item in log]
    first_token = order.index((first, Token))
    assert any(asked is second for asked, _ in order[first_token:]), "the second's prompt is read after"
    assert all(asked is first for asked, _ in order[:first_token]), order[:first_token + 2]
    assert len(first.tokens_out) == len(second.tokens_out) == 3
