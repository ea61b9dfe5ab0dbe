"""Standard gRPC tooling (grpcurl, Kubernetes gRPC probes, load balancers) can talk to a rank:
grpc.health.v1.Health follows the rank's state, server reflection lists its services, and both
sit behind the cluster token like every other RPC."""

from __future__ import annotations

import grpc
import pytest
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from rankprocs import start_ranks, stop_all, write_token

from cpchat.client.cluster import Cluster
from cpchat.errors import BadInput
from cpchat.protocol import cpchat_pb2 as pb
from cpchat.protocol.channel import TOKEN_HEADER
from cpchat.rank.state import serving

TOKEN = "s3cret-cluster-token"
AUTH = ((TOKEN_HEADER, TOKEN),)
CHECKED = ("", "cpchat.Control")  # the whole server, and the Control service by its full name
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICES = {"cpchat.Control", "cpchat.Ring", "grpc.health.v1.Health",
            "grpc.reflection.v1alpha.ServerReflection"}
NO_OR_WRONG_TOKEN = [(), ((TOKEN_HEADER, "wrong"),), ((TOKEN_HEADER, TOKEN + "x"),),
                     (("authorization", TOKEN),)]


@pytest.fixture
def rank(tmp_path):
    """One fresh rank without a token: no model loaded yet."""
    ranks = start_ranks(1, tmp_path)
    channel = grpc.insecure_channel(ranks[0].address)
    try:
        yield ranks[0].address, channel
    finally:
        channel.close()
        stop_all(ranks)


@pytest.fixture(scope="module")
def secured_channel(tmp_path_factory):
    """A channel to a fresh rank that demands the token."""
    tmp = tmp_path_factory.mktemp("probes-secured")
    ranks = start_ranks(1, tmp, token_file=write_token(tmp / "token", TOKEN))
    channel = grpc.insecure_channel(ranks[0].address)
    try:
        yield channel
    finally:
        channel.close()
        stop_all(ranks)


def health_of(channel: grpc.Channel, service: str, metadata=()) -> int:
    """grpc.health.v1.Health/Check for one service name, as a probe asks."""
    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                     timeout=10, metadata=metadata)
    return reply.status


def statuses(channel: grpc.Channel, metadata=()) -> list[int]:
    """The health status of the whole server and of cpchat.Control."""
    return [health_of(channel, name, metadata) for name in CHECKED]


def listed_services(channel: grpc.Channel, metadata=()) -> set[str]:
    """The services that server reflection lists, as `grpcurl list` asks for them."""
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    replies = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                        timeout=10, metadata=metadata)
    return {s.name for reply in replies for s in reply.list_services_response.service}


@pytest.mark.slow
def test_health_follows_the_rank_state(rank, model_dir):
    """NOT_SERVING until a model is loaded, SERVING once it is, and still SERVING while it generates."""
    address, channel = rank
    assert statuses(channel) == [NOT_SERVING, NOT_SERVING]
    cluster = Cluster([address])
    try:
        cluster.connect()
        assert statuses(channel) == [NOT_SERVING, NOT_SERVING]  # a ring, no model
        cluster.load(str(model_dir("llama")))
        assert statuses(channel) == [SERVING, SERVING]
        # Busy with a generation is still serving: the first event comes after the rank took the
        # request, and it is still busy afterwards (a long generation, cancelled below).
        control = cluster.ranks[0].control
        long_generation = pb.GenerateRequest(request_id="probe", tokens=[1, 2, 3], max_tokens=100_000)
        events = control.Generate(long_generation, timeout=60)
        next(events)
        during = statuses(channel)
        assert control.Health(pb.HealthRequest(), timeout=10).state == "busy"
        assert during == [SERVING, SERVING]
        assert control.Cancel(pb.CancelRequest(request_id="probe"), timeout=10).cancelled
        assert [e.done.cancelled for e in events if e.HasField("done")] == [True]
        assert control.Health(pb.HealthRequest(), timeout=10).state == "ready"
        assert statuses(channel) == [SERVING, SERVING]
    finally:
        cluster.close()


@pytest.mark.slow
def test_a_failed_load_without_a_model_stays_not_serving(rank):
    address, channel = rank
    cluster = Cluster([address])
    try:
        cluster.connect()
        with pytest.raises(BadInput, match="cannot load model"):
            cluster.load("/nonexistent/model")
        assert statuses(channel) == [NOT_SERVING, NOT_SERVING]
    finally:
        cluster.close()


def test_unknown_service_is_not_found(rank):
    _, channel = rank
    with pytest.raises(grpc.RpcError) as err:
        health_of(channel, "cpchat.NoSuchService")
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_reflection_lists_and_describes_the_services(rank):
    _, channel = rank
    assert listed_services(channel) == SERVICES
    # grpcurl's `describe` and request building: whole file descriptors come back over reflection.
    pool = DescriptorPool(ProtoReflectionDescriptorDatabase(channel))
    control = pool.FindServiceByName("cpchat.Control")
    assert {"Configure", "LoadModel", "Generate", "Health", "Shutdown"} <= set(control.methods_by_name)
    assert pool.FindMessageTypeByName("cpchat.GenerateRequest").fields_by_name["tokens"].number == 3
    assert set(pool.FindServiceByName("cpchat.Ring").methods_by_name) == {"Link"}
    assert set(pool.FindServiceByName("grpc.health.v1.Health").methods_by_name) >= {"Check", "Watch"}


@pytest.mark.parametrize("metadata", NO_OR_WRONG_TOKEN)
def test_probes_without_the_token_are_refused(secured_channel, metadata):
    calls = [
        lambda: health_of(secured_channel, "", metadata),
        lambda: health_of(secured_channel, "cpchat.Control", metadata),
        lambda: next(health_pb2_grpc.HealthStub(secured_channel).Watch(
            health_pb2.HealthCheckRequest(service=""), timeout=10, metadata=metadata)),
        lambda: listed_services(secured_channel, metadata),
    ]
    for call in calls:
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, err.value.details()
        assert err.value.details() == "missing or wrong cluster token"


def test_probes_with_the_token_answer(secured_channel):
    assert statuses(secured_channel, AUTH) == [NOT_SERVING, NOT_SERVING]
    watch = health_pb2_grpc.HealthStub(secured_channel).Watch(health_pb2.HealthCheckRequest(service=""),
                                                              timeout=10, metadata=AUTH)
    assert next(watch).status == NOT_SERVING
    watch.cancel()
    assert listed_services(secured_channel, AUTH) == SERVICES


@pytest.mark.parametrize(
    ("state", "model_loaded", "expected"),
    [
        ("idle", False, False),  # fresh rank, or a failed first load
        ("loading", False, False),
        ("loading", True, False),  # replacing a model
        ("ready", True, True),
        ("busy", True, True),  # a generation running is still serving
        ("ready", False, False),
        ("busy", False, False),
        ("idle", True, False),
        ("failed", True, False),  # any state not known to serve
        ("", True, False),
    ],
)
def test_serving_table(state, model_loaded, expected):
    assert serving(state, model_loaded) is expected
