"""The README's worked example of `cpchat plan`'s cost model past these machines: a Llama-3.1-8B-shaped
4-bit model at 1M tokens over 8 hosts of a stated speed and link, with K/V in bfloat16 and with
--kv-bits 4.

    python scripts/plan_example.py

What a forward's activations take per token is measured here, as a rank measures it when it loads a
model, on two layers of the 8B's widths (4-bit, converted by mlx_lm.convert as published checkpoints
are): a layer's activations are freed before the next layer runs, so two layers show them; the K/V of
all 32 are counted apart. The hosts' speeds are stated (HOST), not measured.
Everything else is cpchat.core: memory (prefill_needs), heuristics (prefill and decode estimates).
"""

from __future__ import annotations

import sys
from dataclasses import replace

from cpchat import blas
from cpchat.bench.models import in_form
from cpchat.client.launcher import rank_environment
from cpchat.core.estimate import PrefillCost
from cpchat.core.heuristics import Measured, Workload, decode_estimates, prefill_estimates, transfer_seconds
from cpchat.core.memory import ForwardMemory, kv_bytes_per_token, prefill_needs
from cpchat.core.quantized_kv import QUANTIZED_KV_START, KVFormat
from cpchat.dirs import cache_dir
from cpchat.format import human_bytes, human_duration
from cpchat.rank.engine import Engine
from cpchat.smallmodels import write_model

# Llama-3.1-8B's shape
LAYERS, HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 32, 4096, 14336, 32, 8, 128, 128256
LAYER_PARAMS = HIDDEN * (2 * HIDDEN + 2 * KV_HEADS * HEAD_DIM) + 3 * HIDDEN * INTERMEDIATE
PARAMS = LAYERS * LAYER_PARAMS + 2 * VOCAB * HIDDEN  # untied embedding and head
BYTES_PER_PARAM = 0.5 + 2 * 2 / 64  # 4-bit in groups of 64, a bfloat16 scale and bias per group
# Stated hosts: products at 10 TFLOP/s and attention at 5 TFLOP/s (a large Apple-silicon or one-GPU
# box in half precision), memory read at 800 GB/s (a decode step reads every weight once), 128 GiB each,
# 1 GiB of it the runtime's; 10 Gb Ethernet between them.
HOST = {"products_flops": 10e12, "attention_flops": 5e12, "memory_bytes_per_s": 800e9, "memory": 128 << 30,
        "runtime": 1 << 30, "link_bytes_per_s": 1.25e9, "latency_s": 50e-6}
CONTEXT, RANKS, ANSWER = 1 << 20, 8, 256


def measured_forward() -> ForwardMemory:
    """A forward's activations on two layers of the 8B's widths (a small vocabulary: the head runs on
    one token)."""
    path = cache_dir() / "plan-example-8b-widths-l2"
    if not (path / "config.json").exists():
        write_model(path, "llama", hidden_size=HIDDEN, num_layers=2, num_heads=HEADS, num_kv_heads=KV_HEADS,
                    intermediate_size=INTERMEDIATE, vocab_size=512)
    engine = Engine()
    engine.load(str(in_form(path, "q4g64")))
    line = engine.forward_memory
    print(f"activations: {human_bytes(line.fixed_bytes)} + {human_bytes(line.per_token_bytes)} a token")
    return line


def main() -> None:
    blas.rerun_preloaded([__file__, *sys.argv[1:]], rank_environment(threads=blas.usable_cores()))
    forward = measured_forward()
    weights = PARAMS * BYTES_PER_PARAM
    cost = PrefillCost(0.0, 2 * LAYERS * LAYER_PARAMS / HOST["products_flops"],
                       4 * HEADS * HEAD_DIM * LAYERS / HOST["attention_flops"],
                       weights / HOST["memory_bytes_per_s"])
    measured = Measured(cost.per_pair_s, HOST["link_bytes_per_s"], HOST["latency_s"], 2 * HOST["latency_s"])
    free = HOST["memory"] - HOST["runtime"] - weights
    print(f"| K/V | weights | K/V | prefill need | peak | of {human_bytes(HOST['memory'])} | algorithm "
          "| TTFT | decode tok/s |\n|---|---:|---:|---:|---:|---|---|---:|---:|")
    for kv_format in (KVFormat(), KVFormat(4, 64, QUANTIZED_KV_START)):
        w = Workload(CONTEXT, 0, RANKS, HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM, 2, LAYERS, kv_format)
        estimates = prefill_estimates(w, measured)
        algorithm = min(estimates, key=estimates.get)
        need = prefill_needs(w, algorithm, [forward] * RANKS, [int(free)] * RANKS, ANSWER)[0]
        kv = (CONTEXT + ANSWER) / RANKS * kv_bytes_per_token(w)
        ttft = cost.seconds(CONTEXT, 0, RANKS, HEADS // KV_HEADS) + transfer_seconds(w, measured, algorithm)
        step = cost.step_s + cost.per_pair_s * CONTEXT / RANKS
        step += decode_estimates(replace(w, new_tokens=1, cached_tokens=CONTEXT), measured)["exchange"]
        label = "bfloat16" if not kv_format.quantized else f"--kv-bits {kv_format.bits}"
        peak = HOST["runtime"] + weights + need.total
        print(f"| {label} | {human_bytes(weights)} | {human_bytes(kv)} | {human_bytes(need.total)} "
              f"| {human_bytes(peak)} | {'fits' if need.fits else 'does not fit'} "
              f"| {algorithm} | {human_duration(ttft)} | {1 / step:.0f} |")


if __name__ == "__main__":
    main()
