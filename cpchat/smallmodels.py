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

from cpchat.families import ARCHITECTURES, FAMILIES, LAYER_TYPES_SLIDING, alternating_layers

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOS_TOKEN = "<|im_end|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


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
    num_layers: int | None = None,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    max_position_embeddings: int | None = None,
    tie_embeddings: bool | None = None,
    rope_theta: float | None = None,
    sliding_window: int | None = None,
    rope_scaling: dict | None = None,
    overrides: dict | None = None,
) -> dict:
    """The config.json of a small `arch` model; None picks the family's default.

    `sliding_window` sets the window of the families that always slide, and gives
    llama, mistral and ministral3 alternating sliding and full layers (4 unless
    `num_layers` says otherwise). `rope_scaling` replaces the family's (for
    example LLAMA3_ROPE_SCALING). `overrides` replace any keys last (a family's layer pattern, say).
    """
    if arch not in FAMILIES:
        raise ValueError(f"unknown architecture {arch!r}; choose from {', '.join(ARCHITECTURES)}")
    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise ValueError("hidden_size must divide by num_heads, and num_heads by num_kv_heads")
    family = FAMILIES[arch]
    window = sliding_window or family.window
    if window and family.window is None and arch not in LAYER_TYPES_SLIDING:
        raise ValueError(f"{arch} has no sliding-window attention in mlx-lm")
    if num_layers is None:
        num_layers = 4 if window and family.window is None else family.layers
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
        "max_position_embeddings": max_position_embeddings or family.max_positions,
        "rope_theta": rope_theta or family.rope_theta,
        "tie_word_embeddings": family.tie if tie_embeddings is None else tie_embeddings,
    }
    for key, value in family.config.items():
        config[key] = value(config) if callable(value) else value
    if window:
        config["sliding_window"] = window
        if family.window is None:
            config["layer_types"] = alternating_layers(config)
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    return {**config, **(overrides or {})}


def write_model(
    path: str | Path,
    arch: str = "llama",
    seed: int = 0,
    vocab_size: int = 512,
    weight_scale: float = 4.0,
    dtype: str = "float32",
    **options,
) -> Path:
    """Build an mlx-lm model directory with seeded random weights; `options` go to model_config.

    `weight_scale` multiplies the final norm (divided by the family's own logit
    multiplier, such as granite's 1 / logits_scaling) so random logits are
    peaked, which keeps greedy decoding clear of near-ties. Biases get small
    random values, attention sinks random ones, and weights the model class
    starts at zero (router weights, cohere's q/k LayerNorm) a neutral random
    or unit value, so no part of the model is inert.
    """
    from mlx_lm.utils import _get_classes

    path = Path(path)
    vocab = train_tokenizer(path, vocab_size)
    config = model_config(arch, vocab, **options)
    config["eos_token_id"] = vocab_size_index(path, EOS_TOKEN)
    if arch not in ("llama", "mistral", "qwen2", "qwen3"):  # whose configs stay as they were
        # transformers' config classes would otherwise warn about their defaults' ids
        config.update(bos_token_id=None, pad_token_id=vocab_size_index(path, "<|endoftext|>"))
    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    weights = dict(tree_flatten(model.parameters()))
    family = FAMILIES[arch]
    if family.final_norm not in weights:
        raise ValueError(f"{arch}: no final norm {family.final_norm} to scale")
    factors = {suffix: f(config) for suffix, f in family.rescale.items()}
    final_scale = weight_scale / _logit_multiplier(config)
    if config["tie_word_embeddings"]:
        final_scale /= factors.get("embed_tokens.weight", 1.0)  # the head shares the rescaled embeddings
    for name, w in weights.items():
        if factor := next((f for suffix, f in factors.items() if name.endswith(suffix)), None):
            weights[name] = w * factor
        elif name == family.final_norm:
            if config["tie_word_embeddings"]:
                # A tied head scores the current token's own embedding highest; random signs
                # in the final norm stop greedy decoding from repeating it forever.
                w = w * mx.random.normal(w.shape)
            weights[name] = (1.0 + w) * final_scale - 1.0 if family.offset_norms else w * final_scale
        elif name.endswith("bias"):
            weights[name] = mx.random.normal(w.shape) * 0.1
        elif name.endswith("sinks"):
            weights[name] = mx.random.normal(w.shape)
        elif not mx.any(w).item():  # router weights, cohere's q/k LayerNorm
            if "norm" in name:
                weights[name] = mx.ones(w.shape)
            else:
                weights[name] = mx.random.normal(w.shape) * w.shape[-1] ** -0.5
    if config["tie_word_embeddings"]:
        weights.pop("lm_head.weight", None)  # mlx-lm's gemma3_text ties only when there is none
    weights = tree_map(lambda w: w.astype(getattr(mx, dtype)), weights)
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def _logit_multiplier(config: dict) -> float:
    """What the model multiplies its logits by after the head (cohere, granite)."""
    return config.get("logit_scale", 1.0) / config.get("logits_scaling", 1.0)


def vocab_size_index(path: Path, token: str) -> int:
    vocab = json.loads((path / "tokenizer.json").read_text())["added_tokens"]
    return next(t["id"] for t in vocab if t["content"] == token)


def convert_model(source: Path, path: Path, form: str) -> Path:
    """A checkpoint in one of the forms people download, made with mlx_lm.convert as they are:
    "bfloat16" / "float16" from `source`, or "q4g64" (bits, group size) quantized from a bfloat16
    copy (kept beside `path`), as published 4-bit models are quantized from bfloat16 weights."""
    from mlx_lm import convert

    if form in ("bfloat16", "float16"):
        convert(str(source), str(path), dtype=form)
        return path
    bits, group = (int(x) for x in form[1:].split("g"))
    bf16 = path.parent / f"{path.name}-bfloat16"
    if not bf16.exists():
        convert(str(source), str(bf16), dtype="bfloat16")
    convert(str(bf16), str(path), quantize=True, q_bits=bits, q_group_size=group)
    return path
