import threading

import mlx.core as mx
import numpy as np

from cpchat.core.quantized_kv import KVFormat, Packed
from cpchat.rank.algorithms import ATTEND
from cpchat.rank.context_parallel import RingPass, StepMeans, StepTiming
from cpchat.rank.gathered import Gathered, pack_new, unpack_new
from cpchat.rank.kvstore import GROW, KVShard
from cpchat.rank.transport.ring import Mailbox, Ring


def kv(n, start=0):
    k = mx.arange(start, start + n, dtype=mx.float32).reshape(1, 1, n, 1) * mx.ones((1, 2, 1, 4))
    return k, -k


def test_a_decode_append_after_a_prefill_writes_into_the_prefills_buffer():
    """A buffer keeps room when it grows, so the first decode steps after a prefill of a whole number
    of steps append in place rather than copy the shard (a quarter of a second at 16K tokens)."""
    shard = KVShard(num_layers=1)
    shard.begin_append(np.arange(GROW))
    shard.append(0, *kv(GROW))
    shard.commit()
    buffer = shard.keys[0]
    for position in range(GROW, 2 * GROW):
        shard.begin_append(np.array([position]))
        shard.append(0, *kv(1, position))
        shard.commit()
        assert shard.keys[0] is buffer
    assert shard.layer(0)[0][0, 0, :, 0].tolist() == list(range(2 * GROW))


def test_a_gather_step_on_a_gpu_attends_over_every_ranks_blocks(monkeypatch):
    """A rank alone on a GPU attends through MLX's fused kernel over its own shard; a gather step runs
    as a ring of one too, but over the other ranks' blocks besides, and attends over them all. (The
    GPU is pretended: this machine has none.)"""
    rng = np.random.default_rng(0)
    k, v = (mx.array(rng.standard_normal((1, 2, 7, 8)).astype(np.float32)) for _ in range(2))
    q = mx.array(rng.standard_normal((1, 4, 1, 8)).astype(np.float32))
    expected = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.5)
    new = KVShard(num_layers=1)
    new.begin_append(np.array([6]))
    new.append(0, k[:, :, 6:], v[:, :, 6:])
    new.commit()
    held = {0: [(k[:, :, :3], v[:, :, :3], np.arange(3)), (k[:, :, 3:6], v[:, :, 3:6], np.arange(3, 6))]}
    ring_pass = RingPass("r", "gather", Ring(0, 1, {}, Mailbox(lambda f, n: None)), new, 6, np.array([6]),
                         np.ones(1, bool), True, threading.Event(), windows=[None], held=held,
                         crossing=ATTEND["gather"])
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.gpu))
    out = ring_pass.attend(0, q, v[:, :, 6:], 0.5, None, None)
    assert mx.abs(out - expected).max().item() < 1e-5


def test_append_grows_past_the_step_and_keeps_order():
    shard = KVShard(num_layers=2)
    total = 0
    for n in (3, GROW, 1, 1):
        shard.begin_append(np.arange(total, total + n) * 10)
        for layer in range(2):
            shard.append(layer, *kv(n, total))
        shard.commit()
        total += n
    k, v, pos = shard.layer(1)
    assert len(shard) == total and k.shape == (1, 2, total, 4)
    assert k[0, 0, :, 0].tolist() == list(range(total)) and mx.array_equal(v, -k).item()
    assert pos.tolist() == [10 * i for i in range(total)]
    assert shard.nbytes == 2 * 2 * total * 2 * 4 * 4  # K and V, 2 layers, 2 heads, dim 4, float32


def test_pending_append_is_visible_before_commit_and_truncate_drops_it():
    shard = KVShard(num_layers=1)
    shard.begin_append(np.array([0, 1]))
    shard.append(0, *kv(2))
    shard.commit()
    shard.begin_append(np.array([7]))
    shard.append(0, *kv(1, 7))
    assert shard.layer(0)[2].tolist() == [0, 1, 7]
    shard.truncate(5)  # an aborted forward: its appended token disappears
    assert len(shard) == 2 and shard.layer(0)[2].tolist() == [0, 1]


def test_truncate_keeps_positions_below_in_any_order():
    shard = KVShard(num_layers=1)
    positions = np.array([0, 1, 6, 7, 2, 9])
    shard.begin_append(positions)
    shard.append(0, *kv(6))
    shard.commit()
    shard.truncate(7)
    k, _, pos = shard.layer(0)
    assert pos.tolist() == [0, 1, 6, 2]
    assert k[0, 0, :, 0].tolist() == [0, 1, 2, 4]


def test_a_layer_forgets_its_own_keys_and_the_shard_keeps_its_tokens():
    shard = KVShard(num_layers=2)
    shard.begin_append(np.arange(6))
    for layer in range(2):
        shard.append(layer, *kv(6))
    shard.commit()
    full_bytes = shard.nbytes
    shard.forget(1, np.arange(6) < 4)  # a window of 2: positions 0-3 are out of sight from 6 on
    assert len(shard) == 6 and shard.layer(1)[2].tolist() == [4, 5]
    assert shard.layer(0)[2].tolist() == list(range(6))
    assert shard.layer(1)[0][0, 0, :, 0].tolist() == [4, 5] and shard.nbytes == full_bytes * 8 // 12
    shard.begin_append(np.array([6]))
    for layer in range(2):
        shard.append(layer, *kv(1, 6))
    shard.commit()
    assert shard.layer(1)[2].tolist() == [4, 5, 6] and shard.layer(1)[0][0, 0, :, 0].tolist() == [4, 5, 6]
    shard.truncate(5)
    assert len(shard) == 5 and shard.layer(1)[2].tolist() == [4]
    assert shard.layer(0)[2].tolist() == list(range(5))


def test_a_new_tokens_kv_crosses_as_one_flat_block_and_comes_back_whole():
    """A gather step hands the new token's K/V of every layer on as two tensors (a block carries
    few); layers of other head counts and sizes (MLA's values, a linear layer skipped) come back as sent."""
    new = {0: (mx.arange(8.0).reshape(1, 2, 1, 4), -mx.arange(8.0).reshape(1, 2, 1, 4)),
           2: (mx.arange(6.0).reshape(1, 1, 1, 6) + 100, mx.arange(3.0).reshape(1, 1, 1, 3) + 200)}
    block = pack_new(new)
    assert len(block) == 2
    back = unpack_new(block)
    assert sorted(back) == [0, 2]
    for layer, (k, v) in new.items():
        assert back[layer][0].shape == k.shape and back[layer][1].shape == v.shape
        assert mx.array_equal(back[layer][0], k).item() and mx.array_equal(back[layer][1], v).item()


def test_rank_0_reads_every_ranks_kv_in_place_and_keeps_its_share_of_the_answer_at_the_end():
    """A gather decode: rank 0 reads its own shard and the others' blocks as they are, holds the
    answer's K/V apart (its shard does not change under the steps) and takes its own share of them
    into its shard when the answer ends, the tokens before a stop token only."""
    mine, theirs = KVShard(num_layers=2, linear=frozenset({1})), (*kv(3, 10), np.array([2, 3, 4]))
    mine.begin_append(np.array([0, 1, 5]))
    mine.append(0, *kv(3))
    mine.commit()
    gathered = Gathered(mine, {0: [theirs]})
    for position in (6, 7, 8):
        gathered.new.begin_append(np.array([position]))
        gathered.new.append(0, *kv(1, 100 + position))
        gathered.new.commit()
        blocks = gathered.blocks(mine)
        assert list(blocks) == [0] and [b[2].tolist() for b in blocks[0]] == [[0, 1, 5], [2, 3, 4]]
        assert blocks[0][1][0] is theirs[0]  # as it arrived: no copy
    gathered.hand_back(mine, lambda p: p % 2 == 0, below=8)  # 8 was built from a stop token
    k, _, positions = mine.layer(0)
    assert positions.tolist() == [0, 1, 5, 6] and k[0, 0, :, 0].tolist() == [0, 1, 2, 106]
    fmt = KVFormat(4, 32, 0)  # K/V that turn quantized mid-answer: the others' blocks too
    wide = (mx.ones((1, 1, 2, 32)), mx.ones((1, 1, 2, 32)), np.array([0, 1]))
    gathered = Gathered(KVShard(num_layers=1, kv_format=fmt), {0: [wide]})
    assert not gathered.quantized
    gathered.quantize()
    assert all(isinstance(x, Packed) for x in gathered.others[0][0][:2]) and gathered.new.quantized
    quantized = KVShard(num_layers=1, kv_format=fmt)
    quantized.quantize()
    assert Gathered(quantized, {}).quantized


def test_a_decode_answers_ring_steps_are_each_steps_mean_over_its_tokens():
    """Stats reports a decode answer's (layer, step) timings averaged over its tokens, not the last
    token's alone (sub-millisecond waits, mostly noise one token at a time)."""
    means = StepMeans()
    means.add([StepTiming(0, 0, compute_ms=1.0, bytes_sent=100), StepTiming(0, 1, wait_ms=0.5)])
    got = means.add([StepTiming(0, 0, compute_ms=3.0, bytes_sent=300), StepTiming(0, 1, wait_ms=0.1)])
    assert [(t.layer, t.step, t.compute_ms, t.wait_ms, t.bytes_sent) for t in got] == [
        (0, 0, 2.0, 0.0, 200), (0, 1, 0.0, 0.3, 0)]
