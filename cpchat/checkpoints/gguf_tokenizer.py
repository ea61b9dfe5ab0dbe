"""A Hugging Face tokenizer (`tokenizer.json`, `tokenizer_config.json`) from a GGUF file's metadata.

Two kinds of vocabulary are written by llama.cpp's converter:
- `gpt2`: byte-level BPE, the tokens and merges as in the original tokenizer.json; the pre-tokenizer
  is named by `tokenizer.ggml.pre` (its regular expressions are the original tokenizer's, which
  llama.cpp also keeps by name). An unknown name is refused: a guessed split tokenizes wrongly.
- `llama`: SentencePiece BPE, tokens with scores and no merges. Merging the adjacent pair whose
  union is the highest-scored token, as SentencePiece and llama.cpp do, is BPE with merges ranked
  by that score; unknown characters fall back to byte tokens `<0xNN>`.
Control and user-defined tokens become added tokens, matched whole in the text.
"""

from __future__ import annotations

import json

import numpy as np
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from cpchat.checkpoints import CheckpointError
from cpchat.checkpoints.gguf_file import GGUFFile

GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
         r"|\s*[\r\n]+|\s+(?!\S)|\s+")
TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
          r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")


# tokenizer.ggml.pre -> (regular expressions applied in turn, whole-word tokens skip the merges, add BOS)
PRE_TOKENIZERS: dict[str, tuple[list[str], bool, bool]] = {
    **dict.fromkeys(("gpt-2", "phi-2", "mpt", "olmo"), ([GPT2], False, False)),
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell"),
                    ([r"\p{N}", GPT2], False, False)),
    **dict.fromkeys(("llama-bpe", "llama3", "llama-v3", "falcon3", "pixtral"), ([LLAMA3], True, True)),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), ([QWEN2], False, False)),
    "tekken": ([TEKKEN], True, True),
}
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
# Tokens that end a turn in the chat templates of the families converted, besides the file's EOS
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>", "<|end|>")
# tokenizer.ggml.<key>_token_id -> tokenizer_config.json's name for that token
SPECIAL_TOKENS = {"bos": "bos_token", "eos": "eos_token", "unknown": "unk_token", "padding": "pad_token"}


def tokenizer_files(f: GGUFFile) -> dict[str, str]:
    """{"tokenizer.json": ..., "tokenizer_config.json": ...} for the file's vocabulary."""
    meta = f.metadata
    kind = meta.get("tokenizer.ggml.model")
    tokens = list(meta.get("tokenizer.ggml.tokens") or [])
    if not tokens:
        raise CheckpointError(f"{f.path.name} carries no tokenizer (tokenizer.ggml.tokens)")
    types = np.asarray(meta.get("tokenizer.ggml.token_type", np.full(len(tokens), NORMAL)))
    if kind == "gpt2":
        tokenizer, add_bos = _byte_level_bpe(f, tokens)
    elif kind == "llama":
        tokenizer, add_bos = _sentencepiece_bpe(f, tokens, types)
    else:
        raise CheckpointError(f"{f.path.name}: tokenizer model {kind!r} is not supported (cpchat reads "
                              "'gpt2' byte-level BPE and 'llama' SentencePiece vocabularies)")
    tokenizer.add_tokens([AddedToken(tokens[i], special=True, normalized=False)
                          for i in np.flatnonzero(types == CONTROL)])
    tokenizer.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                          for i in np.flatnonzero(types == USER_DEFINED)])
    special = {name: tokens[i] for key, name in SPECIAL_TOKENS.items()
               if (i := int(meta.get(f"tokenizer.ggml.{key}_token_id", len(tokens)))) < len(tokens)}
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", add_bos)) and "bos_token" in special
    if add_bos:
        bos = special["bos_token"]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokens.index(bos))])
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(f.get("context_length", 0) or 1 << 20),
        **special,
    }
    if template := meta.get("tokenizer.chat_template"):
        config["chat_template"] = template
    return {"tokenizer.json": tokenizer.to_str(), "tokenizer_config.json": json.dumps(config, indent=2)}


def end_of_turn_ids(f: GGUFFile) -> list[int]:
    """The ids that end generation: the file's EOS (and end-of-turn ids, where it names them), and the
    control tokens its chat template ends a turn with."""
    meta = f.metadata
    tokens = list(meta.get("tokenizer.ggml.tokens") or [])
    ids = [int(meta[f"tokenizer.ggml.{k}_token_id"]) for k in ("eos", "eot", "eom")
           if f"tokenizer.ggml.{k}_token_id" in meta]
    template = str(meta.get("tokenizer.chat_template", ""))
    ids += [tokens.index(t) for t in END_OF_TURN if t in template and t in tokens]
    return sorted(set(ids))


def _byte_level_bpe(f: GGUFFile, tokens: list[str]) -> tuple[Tokenizer, bool]:
    pre = f.metadata.get("tokenizer.ggml.pre", "")
    if pre not in PRE_TOKENIZERS:
        raise CheckpointError(f"{f.path.name}: pre-tokenizer {pre or '(none)'!r} is not one cpchat knows "
                              f"({', '.join(sorted(PRE_TOKENIZERS))}); guessing would tokenize wrongly")
    patterns, ignore_merges, add_bos = PRE_TOKENIZERS[pre]
    merges = [tuple(m.split(" ", 1)) for m in f.metadata.get("tokenizer.ggml.merges", [])]
    vocab = {t: i for i, t in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab, merges, ignore_merges=ignore_merges))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in patterns]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer, add_bos


def _sentencepiece_bpe(f: GGUFFile, tokens: list[str], types: np.ndarray) -> tuple[Tokenizer, bool]:
    scores = np.asarray(f.metadata.get("tokenizer.ggml.scores", np.zeros(len(tokens))), dtype=np.float64)
    vocab = {t: i for i, t in enumerate(tokens)}
    pieces = {t for t, kind in zip(tokens, types) if kind in (NORMAL, USER_DEFINED, UNUSED)}
    merges = []
    for i in np.argsort(-scores, kind="stable"):
        piece = tokens[i]
        if piece not in pieces:
            continue
        splits = [(piece[:k], piece[k:]) for k in range(1, len(piece))
                  if piece[:k] in pieces and piece[k:] in pieces]
        merges += sorted(splits, key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
    unknown = f.metadata.get("tokenizer.ggml.unknown_token_id")
    tokenizer = Tokenizer(models.BPE(vocab, merges, byte_fallback=True, fuse_unk=True,
                                     unk_token=tokens[int(unknown)] if unknown is not None else None))
    # SentencePiece writes spaces as ▁ and, where the vocabulary asks, starts the text with one; llama.cpp
    # starts every stretch of text after a special token with one, as a normalizer of each stretch does.
    prefix = bool(f.metadata.get("tokenizer.ggml.add_space_prefix", True))
    tokenizer.normalizer = normalizers.Sequence(
        ([normalizers.Prepend("▁")] if prefix else []) + [normalizers.Replace(" ", "▁")])
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tokenizer.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return tokenizer, True
