"""Products from quantized weights' stored bytes (cpchat/rank/packed_weights.py): the same numbers as
the weight dequantized in float32, for MLX's affine 4- and 8-bit layouts with float32, bfloat16 and
float16 scales, one row to a prefill block; no float32 weight held; numba's compile cached on disk."""

import json
import os
import subprocess
import sys

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from helpers import CPCHAT, events
from mlx.utils import tree_flatten

from cpchat.rank import packed_kernels, packed_weights
from cpchat.rank.packed_weights import MIN_ROWS, pack, packable

FORMS = [(bits, group, dtype) for bits in (4, 8) for group in (32, 64)
         for dtype in (mx.float32, mx.bfloat16, mx.float16)]


def quantized_linear(bits: int, group: int, dtype: mx.Dtype, inputs=256, outputs=200, bias=True) -> nn.Module:
    mx.random.seed(bits * group)
    linear = nn.Linear(inputs, outputs, bias=bias)
    linear.set_dtype(dtype)
    return nn.QuantizedLinear.from_linear(linear, group_size=group, bits=bits)


def float32_weight(m: nn.Module) -> mx.array:
    """The stored weight dequantized with float32 scales: what a float32 product multiplies by."""
    return mx.dequantize(m["weight"], m["scales"].astype(mx.float32), m["biases"].astype(mx.float32),
                         group_size=m.group_size, bits=m.bits)


@pytest.mark.parametrize("rows", [1, 3, MIN_ROWS + 1])
@pytest.mark.parametrize(("bits", "group", "dtype"), FORMS)
def test_products_equal_the_dequantized_weights(bits, group, dtype, rows):
    layer = quantized_linear(bits, group, dtype)
    weight, bias = float32_weight(layer), layer["bias"].astype(mx.float32)
    x = mx.random.normal((1, rows, 256))
    expected = x @ weight.T + bias
    pack(layer)
    assert type(layer).__name__ == "PackedQuantizedLinear"
    got = layer(x)
    assert got.shape == expected.shape and got.dtype == mx.float32
    assert mx.abs(got - expected).max().item() <= 2e-6 * mx.abs(expected).max().item()
    low = layer(x.astype(dtype))  # in the model's dtype, as a bfloat16 model's activations are
    assert low.dtype == dtype


@pytest.mark.parametrize("bits", [4, 8])
def test_the_threads_share_the_outputs_exactly(bits):
    layer = quantized_linear(bits, 64, mx.bfloat16, inputs=512, outputs=1000)
    pack(layer)
    v = layer._views
    x = np.random.default_rng(0).standard_normal((2, 512)).astype(np.float32)
    xsum = x.reshape(2, -1, 64).sum(-1)
    alone, shared = (np.empty((2, 1000), np.float32) for _ in range(2))
    packed_kernels.products(v.packed, v.scales, v.biases, v.words, v.kind, v.bits, x, xsum, alone)
    packed_kernels.products_parallel(v.packed, v.scales, v.biases, v.words, v.kind, v.bits, x, xsum, shared)
    assert np.array_equal(alone, shared)


@pytest.mark.parametrize(("bits", "group", "dtype"),
                         [(4, 32, mx.float16), (8, 64, mx.bfloat16), (4, 64, mx.float32)])
def test_an_embedding_looks_up_as_mlx_and_multiplies_as_the_head(bits, group, dtype):
    embedding = nn.Embedding(300, 128)
    embedding.set_dtype(dtype)
    table = nn.QuantizedEmbedding.from_embedding(embedding, group_size=group, bits=bits)
    ids = mx.array([[0, 5, 299], [7, 7, 1]])
    rows, weight = table(ids), float32_weight(table)
    x = mx.random.normal((1, 2, 128))
    pack(table)
    assert mx.array_equal(table(ids), rows).item() and table(ids).dtype == rows.dtype
    head = table.as_linear(x)
    assert mx.abs(head - x @ weight.T).max().item() <= 2e-6 * mx.abs(head).max().item()


def test_a_packed_layer_holds_its_stored_bytes_and_no_float32_weight():
    layer = quantized_linear(4, 64, mx.bfloat16, bias=False)
    stored = {k: (v.nbytes, v.dtype) for k, v in tree_flatten(layer.parameters())}
    pack(layer)
    held = {k: (v.nbytes, v.dtype) for k, v in tree_flatten(layer.parameters())}
    assert sum(n for n, _ in held.values()) == sum(n for n, _ in stored.values())
    assert {d for _, d in held.values()} == {mx.int32, mx.uint16}  # the words; bfloat16 scales' bits
    assert not any(isinstance(v, np.ndarray) and v.dtype == np.float32 and v.size >= 256 * 200
                   for v in vars(layer).values())


def test_what_the_kernels_do_not_take_is_left_as_it_was():
    assert not packable(quantized_linear(2, 64, mx.bfloat16))  # 2-bit
    assert not packable(nn.Linear(64, 64))
    mx.random.seed(0)
    fp = nn.QuantizedLinear.from_linear(nn.Linear(64, 64), group_size=32, bits=4, mode="mxfp4")
    assert not packable(fp)


def cache_report(env: dict[str, str]) -> dict:
    code = ("import json; from cpchat.rank import packed_weights as p; from cpchat.core.attention import "
            "one_query_kernel as q; k, why = p.status(); o = q(); "
            "fs = [k.products, k.products_parallel, k.dequantize_parallel, o.keys_pass, o.values_pass]; "
            "print(json.dumps({'why': why, 'hits': sum(sum(f.stats.cache_hits.values()) for f in fs), "
            "'misses': sum(sum(f.stats.cache_misses.values()) for f in fs)}))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.slow
def test_the_kernels_compile_once_a_machine(tmp_path):
    """The first process compiles the kernels into numba's cache; the next reads them all from it."""
    env = os.environ | {"NUMBA_CACHE_DIR": str(tmp_path / "cache")}
    first = cache_report(env)
    assert first["why"] == "" and first["misses"] > 0
    second = cache_report(env)
    assert second == {"why": "", "hits": second["hits"], "misses": 0} and second["hits"] >= first["misses"]


def test_without_numba_the_layers_say_why_and_stay_as_they_were(monkeypatch):
    monkeypatch.setattr(packed_weights, "status", lambda: (None, "packed products unavailable (no numba)"))
    model = nn.Sequential(quantized_linear(4, 64, mx.bfloat16))
    assert packed_weights.pack_model(model) == (0, "packed products unavailable (no numba)")
    assert type(model.layers[0]) is nn.QuantizedLinear


def headless(path, env: dict[str, str]) -> list[dict]:
    args = ["--headless", "--json", "--raw", "--model", str(path), "--ranks", "2", "--max-tokens", "12",
            "--temp", "0", "--no-cache", "--prompt", "Where is the archive of the Hollow mill kept?"]
    out = subprocess.run(CPCHAT + args, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return events(out.stdout)


@pytest.mark.slow
def test_ranks_without_the_kernels_say_why_and_answer_the_same(checkpoint, tmp_path):
    """Ranks that cannot import numba multiply as before (float32 products, MLX's kernels), say so in
    the ready event, and give the answer the packed kernels give."""
    path = checkpoint("q4g64")
    (tmp_path / "numba").mkdir()
    (tmp_path / "numba" / "__init__.py").write_text("raise ImportError('no numba on this machine')\n")
    packed = headless(path, dict(os.environ))
    fallback = headless(path, os.environ | {"PYTHONPATH": str(tmp_path)})
    for ready, expected in ((packed[0], {"packed": 43, "float32": 0}),
                            (fallback[0], {"packed": 0, "float32": 43})):
        assert [r["products"] for r in ready["ranks"]] == [expected] * 2
    assert all("no numba on this machine" in r["products_note"] for r in fallback[0]["ranks"])
    tokens = [[(e["id"], e["logprob"]) for e in run if e["event"] == "token"] for run in (packed, fallback)]
    assert [t for t, _ in tokens[0]] == [t for t, _ in tokens[1]] and len(tokens[0]) > 3
    # both multiply in float32, rounding to the model's bfloat16 in another order: within its noise
    assert max(abs(a - b) for (_, a), (_, b) in zip(*tokens, strict=True)) < 0.1
