"""The reference store cannot lie: an entry is read back only under the key of everything that made it,
a damaged one is computed again, and a worker's answer in a conversation is the same whether the
conversation was computed in one go or partly read from disk."""

from __future__ import annotations

import json

import mlx_lm
import mlx_reference as oracle
import pytest
import references
from helpers import random_prompt
from references import MlxReference, Store, digest, fields, reference_generate


@pytest.fixture
def store(tmp_path, monkeypatch) -> Store:
    store = Store(tmp_path / "references")
    monkeypatch.setattr(references, "STORE", store)
    return store


@pytest.fixture
def computed(monkeypatch) -> list:
    """The oracle's generate calls, counted."""
    calls = []
    generate = oracle.generate

    def counted(*args, **kwargs):
        calls.append(args)
        return generate(*args, **kwargs)

    monkeypatch.setattr(oracle, "generate", counted)
    return calls


def test_a_reference_is_computed_once_and_then_read(store, computed, model_dir):
    path = model_dir("llama")
    ids = random_prompt(path, 9, seed=1)
    first = reference_generate(path, ids, 5)
    assert len(computed) == 1 and len(first) == 5
    assert reference_generate(path, ids, 5) == first and len(computed) == 1  # within the run
    (entry,) = store.root.iterdir()
    saved = json.loads(entry.read_text())
    assert saved["fields"]["ids"] == ids and saved["fields"]["max_tokens"] == 5  # kept for audit
    assert {"mlx", "mlx_lm", "numpy", "platform", "device", "blas", "code", "model"} <= set(saved["fields"])

    references.STORE = Store(store.root)  # the next run
    assert reference_generate(path, ids, 5) == first and len(computed) == 1
    references.STORE = Store(store.root, fresh=True)  # CPCHAT_TEST_REFERENCES=fresh
    assert reference_generate(path, ids, 5) == first and len(computed) == 2


@pytest.mark.parametrize("damage", ["flip a byte", "truncate", "another value", "another key's fields"])
def test_a_damaged_entry_is_computed_again_and_rewritten(store, computed, model_dir, damage):
    path = model_dir("llama")
    ids = random_prompt(path, 9, seed=2)
    first = reference_generate(path, ids, 4)
    (entry,) = store.root.iterdir()
    whole = entry.read_bytes()
    saved = json.loads(whole)
    if damage == "flip a byte":
        at = whole.index(b'"value"') + 12
        entry.write_bytes(whole[:at] + bytes([whole[at] ^ 0x01]) + whole[at + 1:])
    elif damage == "truncate":
        entry.write_bytes(whole[: len(whole) // 2])
    elif damage == "another value":  # valid JSON, but not what its digest says
        saved["value"][0][1] += 0.5
        entry.write_text(json.dumps(saved))
    else:  # a whole entry of other fields, under this key's name
        saved["fields"]["max_tokens"] = 5
        entry.write_text(json.dumps(saved))

    references.STORE = Store(store.root)
    with pytest.warns(UserWarning, match="damaged"):
        again = reference_generate(path, ids, 4)
    assert again == first and len(computed) == 2
    assert entry.read_bytes() == whole  # rewritten


def test_what_can_change_a_reference_changes_its_key(model_dir, tmp_path, monkeypatch):
    path = model_dir("llama")
    ids = random_prompt(path, 9, seed=3)

    def key(model=path, **changes) -> str:
        return digest(fields("generate", model, "reference", **{"ids": ids, "max_tokens": 5, **changes}))

    copy = tmp_path / "copy"
    copy.mkdir()
    for f in path.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    assert key(copy) == key()  # the same bytes elsewhere: the same reference
    weights = bytearray((copy / "model.safetensors").read_bytes())
    weights[-1] ^= 0x01
    (copy / "model.safetensors").write_bytes(weights)
    keys = {key(), key(copy), key(max_tokens=6), key(ids=ids[:-1])}
    references.machine.cache_clear()
    monkeypatch.setattr(mlx_lm, "__version__", mlx_lm.__version__ + ".post1")
    keys.add(key())
    references.machine.cache_clear()
    assert len(keys) == 5


def test_a_conversations_answers_are_the_same_computed_or_read(store, model_dir):
    """The worker keeps a conversation's prompt cache, so a later turn's answer depends on the turns
    before it. Read from disk, no worker starts; with the last turn missing, the worker goes through
    the earlier turns first and answers it exactly as in one go."""
    path = model_dir("llama")
    first_ids = random_prompt(path, 12, seed=4)
    more = random_prompt(path, 7, seed=5)

    def converse(reference: MlxReference) -> list:
        first = reference(first_ids, 5)
        second = reference(first_ids + [t for t, _ in first[0]] + more, 5)
        return [first, second]

    reference = MlxReference(path)
    in_one_go = converse(reference)
    reference.close()
    last = reference.asked[tuple(first_ids + [t for t, _ in in_one_go[0][0]] + more), 5]
    assert len(last.conversation) == 1  # the second turn is keyed with the first

    references.STORE = Store(store.root)
    reference = MlxReference(path)
    assert converse(reference) == in_one_go and reference.worker is None
    (store.root / f"{digest(reference.fields(last))}.json").unlink()

    references.STORE = Store(store.root)
    reference = MlxReference(path)
    assert converse(reference) == in_one_go and reference.worker is not None
    reference.close()
