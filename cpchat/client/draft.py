"""--speculate draft:MODEL on the front end: the draft is found as a model is (a directory, a hub id, a
checkpoint) and refused by name unless its tokenizer's vocabulary is the answer model's, since its
proposals travel as token ids."""

from __future__ import annotations

from collections.abc import Callable

from cpchat.checkpoints.resolve import Report
from cpchat.client.hub import front_end_copy
from cpchat.client.session import load_tokenizer
from cpchat.client.settings import resolve_model
from cpchat.errors import BadInput


def resolve_speculation(speculate: str, tokenizer, model: str, whole_model: bool,
                        report: Report | None = None, say: Callable[[str], None] | None = None) -> str:
    """`speculate` as the ranks take it: a draft model's name resolved ("draft:/abs/dir"), checked
    against `tokenizer`, the tokenizer of `model`; any other mode as it is."""
    mode, _, name = speculate.partition(":")
    if mode != "draft":
        return speculate
    try:
        path, _ = resolve_model(name)
        draft_tokenizer = load_tokenizer(front_end_copy(path, whole_model, report, say))
    except BadInput as e:
        raise BadInput(f"draft model: {e}") from None
    if draft_tokenizer.get_vocab() != tokenizer.get_vocab():
        raise BadInput(f"draft model {name} has another tokenizer than {model} (their vocabularies differ): "
                       "a draft model must share the answer model's tokenizer")
    return f"draft:{path}"
