"""Writes smollm2-llamacpp-tokens.json: how llama.cpp itself tokenizes a set of texts with the
SmolLM2 GGUF, the reference test_smollm2.py holds cpchat's converted tokenizer to.

Needs llama-cpp-python (which builds llama.cpp; not a test dependency):
    pip install llama-cpp-python==0.3.36
    python tests/data/llamacpp_tokens.py PATH/TO/SmolLM2-135M-Instruct.Q4_1.gguf
"""

import json
import random
import sys
from importlib.metadata import version
from pathlib import Path

from llama_cpp import Llama

TEXTS = [
    "Hello world! 123 Café déjà vu.  multiple   spaces",
    "The capital of France is Paris.",
    "  leading spaces\n\n\ttabs\tand\r\nwindows newlines\n",
    "I'm sure you'll see they've done it, haven't they? WE'LL SEE. It's 3.14159 or 2,718,281.",
    "def f(x):\n    return x**2  # square\n\nprint(f(12345678))",
    "日本語のテキストと中文文本，还有한국어 텍스트.",
    "Emoji: 😀🎉👍🏽 and symbols ©®™ ∑∫√ ≤≥ → ←",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "Ünïcödé àccents — em-dash – en-dash … ellipsis «quotes» „Anführung“",
    "   ",
    "a",
    "\n",
    "URL: https://example.com/path?q=1&b=2#frag  email: someone@example.org",
    "Numbers 0 00 000 0000 12 345 6789 1e10 -42 +7 3/4 50% $100 €20",
    "ALLCAPS WORDS and camelCaseWords and snake_case_words and kebab-case-words",
    "Ελληνικά κείμενο. Русский текст. العربية. עברית. हिन्दी.",
]
rng = random.Random(0)
ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJ 0123456789 .,;:!?'\"-\n\t()[]{}éüß€😀中"
TEXTS += ["".join(rng.choice(ALPHABET) for _ in range(rng.randrange(1, 80))) for _ in range(40)]

model = Llama(sys.argv[1], vocab_only=True, verbose=False)
ids = [model.tokenize(t.encode(), add_bos=False, special=True) for t in TEXTS]
out = Path(__file__).with_name("smollm2-llamacpp-tokens.json")
out.write_text(json.dumps({"made_with": f"llama-cpp-python {version('llama-cpp-python')}", "texts": TEXTS,
                           "ids": ids}, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
