"""Small mlx-lm model directories built offline: config, seeded random
weights and a byte-level BPE tokenizer with a ChatML chat template.

Tests use these for every architecture cpchat supports; the demo model
falls back to one when no trained model ships in assets/.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOS_TOKEN = "<|im_end|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A long document is split into
chunks, and every rank holds two of them: one from the head and one from the
tail, so that causal attention costs every rank the same. Keys and values
travel around the ring while queries stay at home. The answer is 42.
What is the access code for the vault? The access code is 4812-KX.
def main():\n    print("hello, world")\n    return 0\n
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000. Names: Orion, Lyra, Vega, Altair.
"""


def train_tokenizer(
    path: Path, vocab_size: int = 512, corpus: Iterable[str] | None = None, digit_group: int = 0
) -> int:
    """Write tokenizer.json and tokenizer_config.json into `path`; return the vocabulary size.

    `digit_group` n > 0 cuts runs of digits into pieces of at most n digits, left to right
    (2: "48125" is "48", "12", "5"): a number becomes a few tokens from a larger alphabet, so
    "the token after this one" is less ambiguous when a model copies it.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if digit_group:
        digits = pre_tokenizers.Split(Regex(rf"\d{{1,{digit_group}}}"), behavior="isolated")
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.pre_tokenizer = pre_tokenizers.Sequence([digits, byte_level])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(corpus) if corpus is not None else _CORPUS.splitlines(), trainer)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "chat_template": CHAT_TEMPLATE,
                "eos_token": EOS_TOKEN,
                "pad_token": "<|endoftext|>",
                "bos_token": None,
                "model_max_length": 1 << 20,
            },
            indent=2,
        )
    )
    return tok.get_vocab_size()


def model_config(
    arch: str,
    vocab_size: int,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 1 << 17,
    tie_embeddings: bool = False,
    rope_theta: float = 10000.0,
) -> dict:
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {arch!r}; choose from {', '.join(ARCHITECTURES)}")
    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise ValueError("hidden_size must divide by num_heads, and num_heads by num_kv_heads")
    config = {
        "model_type": arch,
        "hidden_size": hidden_size,
        "num_hidden_layers": num_layers,
        "intermediate_size": intermediate_size or 2 * hidden_size,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": hidden_size // num_heads,
        "rms_norm_eps": 1e-5,
        "vocab_size": vocab_size,
        "max_position_embeddings": max_position_embeddings,
        "rope_theta": rope_theta,
        "tie_word_embeddings": tie_embeddings,
    }
    if arch == "qwen2":
        config["attention_bias"] = True  # qwen2 always has q/k/v biases
    return config


def write_model(
    path: str | Path,
    arch: str = "llama",
    seed: int = 0,
    vocab_size: int = 512,
    weight_scale: float = 4.0,
    dtype: str = "float32",
    **sizes: int,
) -> Path:
    """Build an mlx-lm model directory with seeded random weights.

    `weight_scale` multiplies the final norm so random logits are peaked,
    which keeps greedy decoding clear of near-ties.
    """
    from mlx_lm.utils import _get_classes

    path = Path(path)
    vocab = train_tokenizer(path, vocab_size)
    config = model_config(arch, vocab, **sizes)
    config["eos_token_id"] = vocab_size_index(path, EOS_TOKEN)
    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    weights = dict(tree_flatten(model.parameters()))
    for name in weights:
        if name == "model.norm.weight":
            weights[name] = weights[name] * weight_scale
        elif name.endswith("bias"):
            weights[name] = mx.random.normal(weights[name].shape) * 0.1
    weights = tree_map(lambda w: w.astype(getattr(mx, dtype)), weights)
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def vocab_size_index(path: Path, token: str) -> int:
    vocab = json.loads((path / "tokenizer.json").read_text())["added_tokens"]
    return next(t["id"] for t in vocab if t["content"] == token)
