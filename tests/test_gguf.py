"""GGUF checkpoints: written from small mlx-lm models as llama.cpp's converter writes them (tests/ggufs.py),
converted back by cpchat and compared with the model they came from, block by block against the `gguf`
package's own dequantization, token by token against the tokenizers they were made from, and through
real ranks against mlx-lm on the converted directory."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import gguf
import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
import sentencepiece
from gguf import GGMLQuantizationType as T
from ggufs import random_blocks, sentencepiece_fields, write_foreign_gguf, write_gguf, write_vocabulary
from helpers import one_line_error, run, run_raw
from references import low_precision_noise, reference_generate
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from cpchat.checkpoints import CheckpointError
from cpchat.checkpoints.gguf_config import mlx_config
from cpchat.checkpoints.gguf_convert import DONE, converted_dir
from cpchat.checkpoints.gguf_file import read_gguf
from cpchat.checkpoints.gguf_tokenizer import LLAMA3, QWEN2, TEKKEN, tokenizer_files
from cpchat.checkpoints.gguf_weights import EXACT_BITS, affine_groups, convert_tensor
from cpchat.families import LLAMA3_ROPE_SCALING
from cpchat.smallmodels import write_model

DATA = Path(__file__).parent / "data"
TEXTS = json.loads((DATA / "smollm2-llamacpp-tokens.json").read_text(encoding="utf-8"))["texts"]
# a long English text with code and numbers in it: the README of November 2026, kept as it was
CORPUS = (Path(__file__).parent / "data" / "cpchat-notes.md").read_text(encoding="utf-8").splitlines()


def quiet(_line: str) -> None:
    pass


def convert(path: Path, cache: Path, **kwargs) -> Path:
    return converted_dir(path, cache, say=quiet, **kwargs)


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """made(arch, **options) -> a float32 mlx-lm model of that family (built once each)."""
    root = tmp_path_factory.mktemp("gguf-models")
    built: dict[str, Path] = {}

    def get(arch: str, **options) -> Path:
        key = f"{arch}-{len(built)}" if options else arch
        if key not in built:
            built[key] = write_model(root / key, arch, seed=len(built), **options)
        return built[key]

    return get


@pytest.mark.parametrize("arch, options", [
    ("llama", {}), ("mistral", {}), ("qwen2", {}), ("qwen3", {}), ("gemma3_text", {}),
    ("llama", {"rope_scaling": LLAMA3_ROPE_SCALING}),
], ids=["llama", "mistral", "qwen2", "qwen3", "gemma3", "llama3-rope"])
def test_every_architecture_comes_back_as_it_was_written(made, tmp_path, arch, options):
    """F32 GGUF -> mlx-lm directory: the same logits as the model it was written from, the same
    tokens from its tokenizer, the same chat prompt, and the same end-of-turn token."""
    source = made(arch, **options)
    target = convert(write_gguf(source, tmp_path / "model.gguf"), tmp_path / "cache")
    original, original_tokenizer = mlx_lm.load(str(source))
    converted, tokenizer = mlx_lm.load(str(target))
    ids = mx.array([list(range(3, 70))])
    assert mx.allclose(converted(ids), original(ids), atol=1e-5).item()
    for text in TEXTS:
        assert tokenizer.encode(text) == original_tokenizer.encode(text)
    chat = [{"role": "user", "content": "What is the gate code?"}]
    assert tokenizer.apply_chat_template(chat, add_generation_prompt=True) == \
        original_tokenizer.apply_chat_template(chat, add_generation_prompt=True)
    assert tokenizer.eos_token_ids == original_tokenizer.eos_token_ids
    config = json.loads((target / "config.json").read_text())
    if options:
        assert config["rope_scaling"] == pytest.approx(LLAMA3_ROPE_SCALING)


@pytest.mark.parametrize("kind", list(EXACT_BITS), ids=lambda k: k.name)
def test_affine_block_types_are_repacked_value_for_value(tmp_path, kind):
    """Every value of Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K is scale·q + bias exactly, as the `gguf`
    package dequantizes it, and MLX's packed form gives that back with the scales in float16."""
    if kind in (T.Q4_K, T.Q5_K):
        raw = random_blocks(kind, 8, 512)
    else:
        raw = gguf.quants.quantize(np.random.default_rng(0).normal(size=(8, 512)).astype(np.float32), kind)
    expected = gguf.quants.dequantize(raw, kind)
    q, scale, bias = affine_groups(raw, kind)
    assert q.max() < 2 ** EXACT_BITS[kind]
    np.testing.assert_array_equal((scale[..., None] * q + bias[..., None]).reshape(expected.shape), expected)
    f = one_tensor_file(tmp_path, kind, raw)
    arrays, note = convert_tensor(f, f.tensors["blk.0.attn_q.weight"])
    assert note is None
    got = mx.dequantize(arrays["weight"], arrays["scales"].astype(mx.float32),
                        arrays["biases"].astype(mx.float32), 32, EXACT_BITS[kind])
    half = lambda x: x.astype(np.float16).astype(np.float32)  # noqa: E731
    exact_in_half = (half(scale)[..., None] * q + half(bias)[..., None]).reshape(expected.shape)
    np.testing.assert_allclose(np.array(got), exact_in_half, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("kind, bits", [(T.Q6_K, 8), (T.Q3_K, 5), (T.Q2_K, 4), (T.IQ4_NL, 6)],
                         ids=lambda k: getattr(k, "name", str(k)))
def test_other_types_are_requantized_and_say_so(tmp_path, kind, bits):
    raw = random_blocks(kind, 8, 512)
    expected = gguf.quants.dequantize(raw, kind)
    f = one_tensor_file(tmp_path, kind, raw)
    arrays, note = convert_tensor(f, f.tensors["blk.0.attn_q.weight"])
    assert note == f"{kind.name} -> {bits}-bit"
    got = np.array(mx.dequantize(arrays["weight"], arrays["scales"].astype(mx.float32),
                                 arrays["biases"].astype(mx.float32), 32, bits))
    groups = expected.reshape(8, -1, 32)
    step = (groups.max(-1) - groups.min(-1)) / (2 ** bits - 1)  # MLX's grid over each group of 32
    error = np.abs(got - expected).reshape(8, -1, 32).max(-1)
    assert (error <= step + 1e-3 * np.abs(groups).max(-1)).all()  # within a step, scales in float16


@pytest.mark.slow
def test_mixed_quantized_gguf_through_ranks_equals_mlx_lm(clusters, made, tmp_path):
    """A file of several block types (the embedding Q8_0, attention Q5_0, MLP Q4_1, the head Q5_1)
    becomes a model of 8-, 5- and 4-bit layers; greedy tokens through 2 and 3 ranks are mlx-lm's,
    and logprobs within 1.5x of mlx-lm's own low-precision noise."""
    types = {"token_embd": "Q8_0", "attn": "Q5_0", "ffn": "Q4_1", "output": "Q5_1"}
    path = convert(write_gguf(made("llama"), tmp_path / "mixed.gguf", types), tmp_path / "cache")
    model, tokenizer = mlx_lm.load(str(path))
    assert {layer.bits for layer in (model.layers[0].self_attn.q_proj, model.layers[0].mlp.up_proj,
                                     model.model.embed_tokens, model.lm_head)} == {5, 4, 8}
    ids = tokenizer.encode("The access code for the Orion vault is 4812-KX. " * 6)
    expected = reference_generate(path, ids, 8)
    noise = low_precision_noise(path, ids, expected)
    for ranks, algorithm in ((2, "pass_kv"), (3, "ulysses")):
        got, _, _ = run_raw(clusters.get(ranks, path), path, ids, algorithm, 8)
        assert [t for t, _ in got] == [t for t, _ in expected]
        assert max(abs(a - b) for (_, a), (_, b) in zip(got, expected, strict=True)) <= 1.5 * noise


def _byte_level(pre: str) -> Tokenizer:
    """A byte-level BPE trained with the pre-tokenizer that llama.cpp's name `pre` stands for."""
    splits = {"gpt-2": [], "smollm": [r"\p{N}"], "llama-bpe": [LLAMA3], "qwen2": [QWEN2], "tekken": [TEKKEN]}
    tokenizer = Tokenizer(models.BPE(ignore_merges=pre in ("llama-bpe", "tekken")))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in splits[pre]]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre in ("gpt-2", "smollm"))])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=900, show_progress=False,
                                  special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(CORPUS, trainer)
    return tokenizer


@pytest.mark.parametrize("pre", ["gpt-2", "smollm", "llama-bpe", "qwen2", "tekken"])
def test_byte_level_vocabularies_tokenize_as_the_original(tmp_path, pre):
    original = _byte_level(pre)
    spec = json.loads(original.to_str())
    vocab = spec["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    special = {t["id"] for t in spec["added_tokens"]}
    fields = {"model": "gpt2", "pre": pre, "tokens": tokens,
              "token_type": [3 if i in special else 1 for i in range(len(tokens))],
              "merges": [" ".join(m) if isinstance(m, list) else m for m in spec["model"]["merges"]],
              "add_bos_token": False}
    path = write_vocabulary(tmp_path / f"{pre}.gguf", fields, len(tokens))
    converted = Tokenizer.from_str(tokenizer_files(read_gguf(path))["tokenizer.json"])
    for text in TEXTS:
        assert converted.encode(text).ids == original.encode(text).ids, text
        assert converted.decode(converted.encode(text).ids, skip_special_tokens=False) == text


USER_DEFINED = ["<start_of_turn>", "<end_of_turn>"]


def test_sentencepiece_vocabulary_tokenizes_as_sentencepiece(tmp_path):
    """A SentencePiece BPE model (Llama 2, Mistral, Gemma are) written as llama.cpp writes it: scores
    ranked into merges, byte fallback, user-defined tokens matched whole, a space before the text."""
    trained = tmp_path / "spm"
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS), model_prefix=str(trained), vocab_size=1500, model_type="bpe",
        byte_fallback=True, user_defined_symbols=USER_DEFINED, split_digits=True,
        allow_whitespace_only_pieces=True, remove_extra_whitespaces=False, normalization_rule_name="identity",
        minloglevel=2)
    original = sentencepiece.SentencePieceProcessor(model_file=f"{trained}.model")
    fields = sentencepiece_fields(original, USER_DEFINED)
    path = write_vocabulary(tmp_path / "spm.gguf", fields, len(fields["tokens"]))
    files = tokenizer_files(read_gguf(path))
    converted = Tokenizer.from_str(files["tokenizer.json"])
    for text in TEXTS:
        assert converted.encode(text, add_special_tokens=False).ids == original.encode(text), text
        assert converted.decode(converted.encode(text, add_special_tokens=False).ids) == text
    # A user-defined token is matched whole, and the text after it starts with a space, as in llama.cpp
    # (SentencePiece itself would put its space before the token).
    start, end = original.piece_to_id("<start_of_turn>"), original.piece_to_id("<end_of_turn>")
    assert converted.encode("<start_of_turn>user\nHi<end_of_turn>", add_special_tokens=False).ids == \
        [start, *original.encode("user\nHi"), end]
    assert converted.encode("Hi").ids[0] == original.bos_id()  # SentencePiece vocabularies add BOS
    assert json.loads(files["tokenizer_config.json"])["bos_token"] == "<s>"


def _rewrite(path: Path, out: Path, **changes) -> Path:
    """A copy of a GGUF with metadata changed (None drops a key) or tensors added."""
    f = read_gguf(path)
    reader = gguf.GGUFReader(str(path))
    w = gguf.GGUFWriter(str(out), f.architecture)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        if field.name in changes:
            if changes[field.name] is not None:
                w.add_key_value(field.name, changes[field.name], field.types[0])
            continue
        value = field.contents()
        w.add_key_value(field.name, value, field.types[0], sub_type=field.types[-1] if len(field.types) > 1
                        else None)
    for tensor in reader.tensors:
        w.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
    for name, array in changes.get("tensors", {}).items():
        w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.fixture(scope="module")
def good_gguf(made, tmp_path_factory):
    return write_gguf(made("llama"), tmp_path_factory.mktemp("good") / "llama.gguf", "Q8_0")


@pytest.mark.parametrize("change, words", [
    ({"llama.block_count": None}, "lacks llama.block_count"),
    ({"tokenizer.ggml.pre": "mystery-bpe"}, "pre-tokenizer 'mystery-bpe' is not one cpchat knows"),
    ({"tokenizer.ggml.model": "t5"}, "tokenizer model 't5' is not supported"),
    ({"llama.rope.dimension_count": 8}, "partial rotary"),
    ({"tensors": {"blk.0.ffn_gate_exps.weight": np.zeros((4, 64, 64), np.float32)}},
     "blk.0.ffn_gate_exps.weight has no place in an mlx-lm llama model"),
])
def test_what_cannot_be_converted_is_refused_by_name(good_gguf, tmp_path, change, words):
    bad = _rewrite(good_gguf, tmp_path / "bad.gguf", **change)
    with pytest.raises(CheckpointError, match=words.replace("(", r"\(").replace(")", r"\)")):
        convert(bad, tmp_path / "cache")
    assert not any((tmp_path / "cache").glob("*/config.json"))  # nothing half-written is left to load


def test_unknown_architecture_is_refused_by_name(good_gguf, tmp_path):
    with pytest.raises(CheckpointError, match="architecture 'bert' is not one cpchat converts"):
        mlx_config(read_gguf(write_foreign_gguf(tmp_path / "bert.gguf")))


@pytest.mark.slow
@pytest.mark.parametrize("make, words", [
    (lambda good, bad: bad.write_text("not a model\n"), "is not a GGUF file"),
    (lambda good, bad: bad.write_bytes(good.read_bytes()[:5000]), "is truncated"),
    (lambda good, bad: bad.write_bytes(good.read_bytes()[:-4096]), "is truncated: tensor"),
], ids=["not-gguf", "header-cut", "data-cut"])
def test_a_bad_file_exits_2_with_one_line(good_gguf, tmp_path, make, words):
    bad = tmp_path / "model.gguf"
    make(good_gguf, bad)
    one_line_error(run(["--headless", "--model", str(bad), "--prompt", "hi"], timeout=60), 2, words)
    for mode in ([], ["--algorithms", "pass_kv"]):  # the bench too, in both its modes
        out = str(tmp_path / "bench")
        one_line_error(run(["bench", *mode, "--model", str(bad), "--out", out], timeout=60), 2, words)


def test_conversion_is_cached_keyed_and_made_once(good_gguf, tmp_path):
    cache, said = tmp_path / "cache", []
    results: list[Path] = []
    def one() -> None:
        results.append(converted_dir(good_gguf, cache, say=said.append))

    threads = [threading.Thread(target=one) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(results)) == 1 and (results[0] / DONE).exists()
    assert sum("converting" in line for line in said) == 1  # three at once: one converted, two waited
    stamp = (results[0] / DONE).stat().st_mtime_ns
    assert convert(good_gguf, cache) == results[0] and (results[0] / DONE).stat().st_mtime_ns == stamp
    tokenizer_only = convert(good_gguf, cache, tokenizer_only=True)
    assert tokenizer_only != results[0] and not list(tokenizer_only.glob("*.safetensors"))
    copy = tmp_path / "llama.gguf"
    copy.write_bytes(good_gguf.read_bytes())  # same bytes, another file time: converted again
    assert convert(copy, cache) != results[0]
    assert sorted(p.name for p in cache.iterdir() if not p.name.startswith(".")) == sorted(
        p.name for p in (results[0], tokenizer_only, convert(copy, cache)))


def one_tensor_file(tmp_path: Path, kind: T, raw: np.ndarray):
    """A GGUF file holding `raw` blocks of `kind` (rows of bytes) as one matrix, read back."""
    w = gguf.GGUFWriter(str(tmp_path / "blocks.gguf"), "llama")
    w.add_tensor("blk.0.attn_q.weight", raw, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return read_gguf(tmp_path / "blocks.gguf")
