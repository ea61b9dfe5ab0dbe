"""docs/design.md §6, trust: the cluster token on every RPC (control and ring), TLS, and validation of
every frame and request; a refused caller changes nothing and the rank keeps serving."""

from __future__ import annotations

import ast
import json
import subprocess
from pathlib import Path

import grpc
import pytest
from helpers import random_prompt, run_raw
from hypothesis import given, settings
from hypothesis import strategies as st
from rankprocs import CPCHAT, loaded_ring, make_certs, start_ranks, stop_all, write_token
from references import reference_generate, reference_tokenizer

from cpchat.client.cluster import Cluster
from cpchat.client.generation import GenerationRequest, TokenOut
from cpchat.errors import BackendError, BadInput
from cpchat.protocol import cpchat_pb2 as pb
from cpchat.protocol import cpchat_pb2_grpc as pb_grpc
from cpchat.rank.transport.wire import CHUNK_BYTES, DTYPES

TOKEN = "s3cret-cluster-token"
AUTH = (("x-cpchat-token", TOKEN),)
DENIED = "missing or wrong cluster token"
BAD_METADATA = [(), (("x-cpchat-token", "wrong"),), (("x-cpchat-token", TOKEN + "x"),),
                (("x-cpchat-token", ""),), (("authorization", TOKEN),)]


@pytest.fixture(scope="module")
def secured(model_dir, tmp_path_factory):
    """Two ranks on loopback that demand the token, as a loaded ring."""
    tmp = tmp_path_factory.mktemp("secured")
    ranks = start_ranks(2, tmp, token_file=write_token(tmp / "token"))
    with loaded_ring(ranks, model_dir("llama"), token=TOKEN) as cluster:
        yield cluster


def assert_still_serves(cluster: Cluster, path: Path, seed: int = 1) -> None:
    """The ring (both ranks, their link included) still gives mlx-lm's exact tokens."""
    ids = random_prompt(path, 13, seed=seed)
    got, _, _ = run_raw(cluster, path, ids, "pass_kv", 4)
    assert [t for t, _ in got] == [t for t, _ in reference_generate(path, ids, 4)]


def refused(call, code: grpc.StatusCode) -> str:
    with pytest.raises(grpc.RpcError) as err:
        result = call()
        if not isinstance(result, pb.HealthReply | pb.ConfigureReply | pb.LinkClosed | pb.ShutdownReply):
            list(result)  # a response stream reports its status while it is read
    assert err.value.code() == code, err.value.details()
    return err.value.details()


def link_frame(cluster: Cluster, **fields) -> pb.Frame:
    """A well-formed one-chunk KV frame from rank 1 to rank 0 of `cluster`'s ring."""
    frame = pb.Frame(ring_id=cluster.ring_id, request_id="intruder", layer=0, step=0, kind=pb.KV,
                     source_rank=1, tensor_index=0, tensor_count=1, chunk_index=0, chunk_count=1,
                     dtype="float32", shape=[4], data=bytes(16))
    for name, value in fields.items():
        if name == "shape":
            del frame.shape[:]
            frame.shape.extend(value)
        else:
            setattr(frame, name, value)
    return frame


@pytest.mark.slow
def test_every_rpc_needs_the_token(secured, model_dir):
    rank = secured.ranks[0]
    ring = pb_grpc.RingStub(rank.channel)
    reconfigure = pb.ConfigureRequest(rank=0, addresses=[rank.address], ring_id="hijack")
    find = pb.FindPrefixesRequest(tokens=[5])
    load = pb.LoadPrefixRequest(prefix_id="0" * 32, num_ranks=1, tokens=1)
    for metadata in BAD_METADATA:
        calls = [
            lambda m=metadata: rank.control.Health(pb.HealthRequest(), timeout=5, metadata=m),
            lambda m=metadata: rank.control.Configure(reconfigure, timeout=5, metadata=m),
            lambda m=metadata: rank.control.Generate(pb.GenerateRequest(tokens=[5], max_tokens=1), timeout=5,
                                                     metadata=m),
            lambda m=metadata: rank.control.LoadModel(pb.LoadModelRequest(model="/nonexistent"), timeout=5,
                                                      metadata=m),
            lambda m=metadata: rank.control.Stats(pb.StatsRequest(once=True), timeout=5, metadata=m),
            lambda m=metadata: rank.control.Heartbeat(pb.HeartbeatRequest(), timeout=5, metadata=m),
            lambda m=metadata: rank.control.Shutdown(pb.ShutdownRequest(), timeout=5, metadata=m),
            lambda m=metadata: rank.control.FindPrefixes(find, timeout=5, metadata=m),
            lambda m=metadata: rank.control.LoadPrefix(load, timeout=5, metadata=m),
            # The ring service too: a valid frame of this very ring, without the token.
            lambda m=metadata: ring.Link(iter([link_frame(secured)]), timeout=5, metadata=m),
        ]
        for call in calls:
            assert refused(call, grpc.StatusCode.UNAUTHENTICATED) == DENIED
    # Nothing a refused caller asked for happened: same ring, still running, same answers.
    assert rank.control.Health(pb.HealthRequest(), timeout=5, metadata=AUTH).state == "ready"
    assert_still_serves(secured, model_dir("llama"))


def test_ring_link_with_the_token_reaches_validation(secured, model_dir):
    """The same frame passes authentication with the token, and only then meets validation."""
    ring = pb_grpc.RingStub(secured.ranks[0].channel)
    details = refused(lambda: ring.Link(iter([link_frame(secured, layer=99)]), timeout=5, metadata=AUTH),
                      grpc.StatusCode.INVALID_ARGUMENT)
    assert "layer 99" in details
    # A stream that sent good frames and then a bad one is cut, and breaks nothing else.
    two_chunks = {"shape": [CHUNK_BYTES // 2], "data": bytes(CHUNK_BYTES), "chunk_count": 2}  # float32
    frames = [link_frame(secured, request_id="partial", **two_chunks),
              link_frame(secured, dtype="pickle")]
    assert "dtype" in refused(lambda: ring.Link(iter(frames), timeout=5, metadata=AUTH),
                              grpc.StatusCode.INVALID_ARGUMENT)
    assert_still_serves(secured, model_dir("llama"), seed=2)


@pytest.mark.parametrize("raw", [b"\x0b", b"\x6a\x10short", b"\x0a\x02\xff\xfe", b"\xff" * 12])
def test_bytes_that_are_no_frame_are_refused(secured, raw):
    """The ring parses frames from raw bytes itself: garbage is a bad frame, not a crash."""
    channel = secured.ranks[0].channel
    link = channel.stream_unary("/cpchat.Ring/Link", response_deserializer=pb.LinkClosed.FromString)
    details = refused(lambda: link(iter([raw]), timeout=5, metadata=AUTH), grpc.StatusCode.INVALID_ARGUMENT)
    assert details.startswith("bad frame: ")
    assert secured.ranks[0].control.Health(pb.HealthRequest(), timeout=5, metadata=AUTH).state == "ready"


def test_oversized_message_is_refused(secured):
    ring = pb_grpc.RingStub(secured.ranks[0].channel)
    huge = link_frame(secured, shape=[5 << 20], data=bytes(20 << 20))
    refused(lambda: ring.Link(iter([huge]), timeout=10, metadata=AUTH), grpc.StatusCode.RESOURCE_EXHAUSTED)


# ---------------------------------------------------------------- property tests

VALID_KINDS = {pb.KV, pb.QUERY, pb.PARTIAL, pb.TOKEN, pb.PROBE, pb.GATHER, pb.HEADS, pb.OUTPUT}
MUTATIONS = {
    "dtype": st.text(max_size=12).filter(lambda d: d not in DTYPES).map(lambda d: {"dtype": d}),
    "bytes": st.tuples(st.lists(st.integers(0, 16), min_size=1, max_size=4), st.integers(-8, 8).filter(bool))
    .filter(lambda t: 4 * _prod(t[0]) + t[1] >= 0)
    .map(lambda t: {"shape": t[0], "data": bytes(4 * _prod(t[0]) + t[1])}),
    "huge_shape": st.lists(st.integers(1 << 12, (1 << 32) - 1), min_size=2, max_size=12).map(
        lambda s: {"shape": s, "data": b""}),
    "layer": st.integers(2, (1 << 32) - 1).map(lambda v: {"layer": v}),  # the model has 2 layers
    "step": st.integers(2, (1 << 32) - 1).map(lambda v: {"step": v}),  # the ring has 2 ranks
    # rank 0 itself, or outside the ring of 2
    "source_rank": st.one_of(st.just(0), st.integers(2, (1 << 32) - 1)).map(lambda v: {"source_rank": v}),
    "ring_id": st.text(max_size=40).map(lambda v: {"ring_id": v}),  # never the cluster's uuid hex
    "kind": st.integers(0, 1000).filter(lambda k: k not in VALID_KINDS).map(lambda v: {"kind": v}),
    "tensor_count": st.sampled_from([0, 13, 1000]).map(lambda v: {"tensor_count": v}),
    "tensor_index": st.integers(1, 100).map(lambda v: {"tensor_index": v}),
    "chunk": st.tuples(st.integers(0, 50), st.integers(0, 50)).filter(lambda c: c != (0, 1))
    .map(lambda c: {"chunk_index": c[0], "chunk_count": c[1]}),
    "request_id": st.integers(129, 1000).map(lambda n: {"request_id": "r" * n}),
    # bytes said to follow through an mx.distributed group, which these ranks have not formed
    "data_plane": st.tuples(st.integers(1, (1 << 64) - 1), st.integers(0, (1 << 64) - 1))
    .map(lambda t: {"data_plane_bytes": t[0], "data_plane_seq": t[1]}),
}


def _prod(values: list[int]) -> int:
    n = 1
    for v in values:
        n *= v
    return n


def test_malformed_frames_are_refused_and_the_ranks_serve_on(secured, model_dir):
    """Every malformed frame is refused by name, and the ranks still answer as mlx-lm afterwards."""

    @settings(max_examples=50, deadline=None)
    @given(st.lists(st.sampled_from(sorted(MUTATIONS)), min_size=1, max_size=3, unique=True).flatmap(
        lambda names: st.tuples(*(MUTATIONS[n] for n in names))))
    def fuzz(mutations):
        fields = {k: v for m in mutations for k, v in m.items()}
        ring = pb_grpc.RingStub(secured.ranks[0].channel)
        details = refused(lambda: ring.Link(iter([link_frame(secured, **fields)]), timeout=10, metadata=AUTH),
                          grpc.StatusCode.INVALID_ARGUMENT)
        assert details.startswith("bad frame: ")
        assert secured.ranks[0].control.Health(pb.HealthRequest(), timeout=5, metadata=AUTH).state == "ready"

    fuzz()
    assert_still_serves(secured, model_dir("llama"), seed=3)


def _generate_requests(vocab: int):
    ids = st.lists(st.integers(0, vocab - 1), max_size=20)
    out_of_vocab = st.tuples(ids, st.integers(vocab, (1 << 32) - 1), ids).map(lambda t: t[0] + [t[1]] + t[2])
    return st.one_of(
        out_of_vocab.map(lambda t: pb.GenerateRequest(tokens=t, max_tokens=1)),
        st.integers(0, 100).map(lambda k: pb.GenerateRequest(tokens=[], max_tokens=k)),
        st.tuples(ids.filter(bool), st.integers(10**6, (1 << 64) - 1)).map(
            lambda t: pb.GenerateRequest(tokens=t[0], keep_tokens=t[1], max_tokens=1)),
        st.integers(129, 1000).map(lambda n: pb.GenerateRequest(request_id="r" * n, tokens=[5])),
    )


MANY_ADDRESSES = [f"10.0.{i // 250}.{i % 250}:7070" for i in range(257)]


def _configure_requests():
    address = st.builds("{}:{}".format, st.sampled_from(["10.0.0.2", "rank-b", "::1"]), st.integers(1, 65535))
    good = st.lists(address, min_size=1, max_size=5)
    return st.one_of(
        good.flatmap(lambda a: st.integers(len(a), 1 << 31).map(
            lambda r: pb.ConfigureRequest(rank=r, addresses=a, ring_id="x"))),
        st.just(pb.ConfigureRequest(rank=0, addresses=[])),
        st.lists(st.text(max_size=30).filter(lambda a: ":" not in a), min_size=1, max_size=3).map(
            lambda a: pb.ConfigureRequest(rank=0, addresses=a)),
        st.just(pb.ConfigureRequest(rank=0, addresses=MANY_ADDRESSES)),
        # an mx.distributed backend cpchat does not form, or addresses that do not match the ring
        good.flatmap(lambda a: st.sampled_from(["jaccl", "mpi", "tcp"]).map(
            lambda b: pb.ConfigureRequest(rank=0, addresses=a, data_plane_backend=b,
                                          data_plane_addresses=a))),
        good.map(lambda a: pb.ConfigureRequest(rank=0, addresses=a, data_plane_backend="ring",
                                               data_plane_addresses=a + ["10.0.0.9:1"])),
    )


def test_malformed_control_requests_are_refused_and_the_ranks_serve_on(secured, model_dir):
    """Every malformed Generate or Configure is refused without a traceback, and the ranks still answer
    as mlx-lm afterwards."""
    control = secured.ranks[0].control
    vocab = secured.model.vocab_size

    @settings(max_examples=50, deadline=None)
    @given(st.data())
    def fuzz(data):
        if data.draw(st.booleans(), label="generate"):
            request = data.draw(_generate_requests(vocab))
            details = refused(lambda: control.Generate(request, timeout=10, metadata=AUTH),
                              grpc.StatusCode.INVALID_ARGUMENT)
        else:
            request = data.draw(_configure_requests())
            details = refused(lambda: control.Configure(request, timeout=10, metadata=AUTH),
                              grpc.StatusCode.INVALID_ARGUMENT)
        assert details and "Traceback" not in details
        health = control.Health(pb.HealthRequest(), timeout=5, metadata=AUTH)
        assert (health.state, health.rank) == ("ready", 0)

    fuzz()
    assert_still_serves(secured, model_dir("llama"), seed=4)


def test_a_rank_that_cannot_load_the_model_says_which_and_why(secured, model_dir):
    with pytest.raises(BadInput) as err:
        secured.load("/nonexistent/model")
    assert str(err.value).startswith(f"rank 0 ({secured.ranks[0].address}): cannot load model "
                                     "'/nonexistent/model': ")
    health = secured.ranks[1].control.Health(pb.HealthRequest(), timeout=5, metadata=AUTH)
    assert health.state == "ready"  # the model it had stays loaded
    secured.load(str(model_dir("llama")))
    assert_still_serves(secured, model_dir("llama"), seed=6)


@pytest.mark.slow
def test_second_front_end_is_refused_while_a_generation_runs(secured, model_dir):
    path = model_dir("llama")
    ids = random_prompt(path, 9, seed=5)
    stream = secured.generate(GenerationRequest(ids, max_tokens=300))
    first = next(e for e in stream if isinstance(e, TokenOut))
    intruder = Cluster([r.address for r in secured.ranks], token=TOKEN)
    try:
        with pytest.raises(BackendError, match=r"rank \d \(127\.0\.0\.1:\d+\).*busy with request"):
            intruder.connect()
    finally:
        intruder.close()
    rest = [e.id for e in stream if isinstance(e, TokenOut)]
    tokenizer = reference_tokenizer(path)
    expected = reference_generate(path, ids, 60)
    if expected[-1][0] in tokenizer.eos_token_ids:
        expected = expected[:-1]  # mlx-lm reports the stop token; the raw request ran on past it
    assert [first.id] + rest[: len(expected) - 1] == [t for t, _ in expected]


# ---------------------------------------------------------------- TLS


@pytest.fixture(scope="module")
def tls_ring(tmp_path_factory):
    """Two ranks serving TLS (certificate for 127.0.0.1) whose ring links verify with the CA."""
    tmp = tmp_path_factory.mktemp("tls")
    certs = make_certs(tmp / "certs", ["127.0.0.1"])
    other = make_certs(tmp / "other", ["127.0.0.1"], name="other-ca")
    token = write_token(tmp / "token")
    ranks = start_ranks(2, tmp, token_file=token, tls=certs)
    yield ranks, certs, other, token
    stop_all(ranks)


def test_tls_refuses_clients_without_the_ca(tls_ring):
    ranks, certs, other, _ = tls_ring
    address = ranks[0].address
    creds = {"plain": None, "system roots": grpc.ssl_channel_credentials(),
             "other CA": grpc.ssl_channel_credentials(other["ca"].read_bytes())}
    for name, cred in creds.items():
        channel = grpc.insecure_channel(address) if cred is None else grpc.secure_channel(address, cred)
        with channel:
            stub = pb_grpc.ControlStub(channel)
            code = refused(lambda s=stub: s.Health(pb.HealthRequest(), timeout=5, metadata=AUTH),
                           grpc.StatusCode.UNAVAILABLE)
            assert code, name
    with grpc.secure_channel(address, grpc.ssl_channel_credentials(certs["ca"].read_bytes())) as channel:
        stub = pb_grpc.ControlStub(channel)
        assert refused(lambda: stub.Health(pb.HealthRequest(), timeout=5), grpc.StatusCode.UNAUTHENTICATED)
        assert stub.Health(pb.HealthRequest(), timeout=5, metadata=AUTH).pid == ranks[0].pid


@pytest.mark.slow
def test_headless_over_tls_matches_mlx_lm(tls_ring, model_dir):
    """The front end verifies the ranks, and each rank verifies its next neighbour (ring over TLS)."""
    ranks, certs, _, token = tls_ring
    path = model_dir("llama")
    result = subprocess.run(
        CPCHAT + ["--headless", "--attach", ",".join(r.address for r in ranks), "--token-file", str(token),
                  "--tls-ca", str(certs["ca"]), "--model", str(path), "--raw", "--temp", "0", "--json",
                  "--max-tokens", "5", "--prompt", "The answer is"],
        capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr
    tokens = [json.loads(ln)["id"] for ln in result.stdout.splitlines() if '"token"' in ln]
    tokenizer = reference_tokenizer(path)
    ids = tokenizer.encode("The answer is", add_special_tokens=False)
    assert tokens == [t for t, _ in reference_generate(path, ids, 5)]


@pytest.mark.slow
@pytest.mark.parametrize("ca, words", [(None, "is unreachable (if it serves TLS, pass --tls-ca)"),
                                       ("other", "failed the TLS check: its certificate is not signed")])
def test_front_end_without_the_ca_names_the_rank(tls_ring, ca, words):
    ranks, _, other, _ = tls_ring
    tls_ca = other["ca"].read_bytes() if ca else None
    cluster = Cluster([r.address for r in ranks], token=TOKEN, tls_ca=tls_ca)
    try:
        with pytest.raises(BackendError) as err:
            cluster.connect(timeout=2.0)
    finally:
        cluster.close()
    assert str(err.value).startswith(f"rank 0 ({ranks[0].address}) {words}"), str(err.value)


def test_rank_option_checks(tmp_path):
    """A loose token file is warned about; TLS on a rank needs the CA for its ring link."""
    token = write_token(tmp_path / "token", mode=0o644)
    result = subprocess.run(CPCHAT + ["rank", "--token-file", str(token), "--tls-cert", str(token),
                                      "--tls-key", str(token)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "readable by others (chmod 600 it)" in result.stderr
    assert "--tls-cert needs --tls-ca" in result.stderr


# ---------------------------------------------------------------- no pickle, no eval

UNSAFE_MODULES = {"pickle", "cPickle", "dill", "cloudpickle", "marshal", "shelve", "joblib"}


def test_no_pickle_or_eval_in_the_package():
    root = Path(__file__).resolve().parents[1] / "cpchat"
    found = []
    for source in root.rglob("*.py"):
        if source.name.endswith("_pb2.py") or source.name.endswith("_pb2_grpc.py"):
            continue
        for node in ast.walk(ast.parse(source.read_text(), str(source))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module.split(".")[0]]
            if UNSAFE_MODULES & set(names):
                found.append(f"{source}:{node.lineno} imports {names}")
            called = node.func.id if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) else ""
            if called in ("eval", "exec"):
                found.append(f"{source}:{node.lineno} calls {node.func.id}")
            if isinstance(node, ast.keyword) and node.arg == "allow_pickle":
                found.append(f"{source}:{node.lineno} allow_pickle")
    assert found == []

