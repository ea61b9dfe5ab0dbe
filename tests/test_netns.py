"""Ranks on separate hosts, made real with Linux network namespaces on this machine: each rank
runs in its own namespace at its own address, joined to the others by a bridge; the front end
attaches from the root namespace with the real `cpchat --headless`, and ranks talk to their
neighbours directly. Also with netem delay on the links, and with a link cut mid-generation.

Addresses: only 10.200.0.0/24, on interfaces these tests create (the bridge in the root
namespace is 10.200.0.1; rank i is 10.200.0.(11+i) in its namespace). Everything is removed
in the fixture's teardown."""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import psutil
import pytest
from rankprocs import CPCHAT, RankProc, ranks_started_with, start_ranks, stop_all, wait_gone, write_token
from references import reference_generate, reference_tokenizer

from cpchat.client.cluster import Cluster
from cpchat.client.generation import GenerationRequest, TokenOut
from cpchat.errors import BackendError
from cpchat.protocol import cpchat_pb2 as pb

SUBNET = ipaddress.ip_network("10.200.0.0/24")
RANKS = 3
PORT = 7070
TOKEN = "netns-test-token"
TAG = f"cpct{os.getpid() % 10000}"
PROMPT = ("Keys and values travel around the ring while queries stay at home. " * 12).strip()


def ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = (["ip", "netns", "exec", ns] if ns else []) + list(args)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=check)


class Hosts:
    """A bridge in the root namespace and one namespace (a "host") per rank, joined by veth pairs."""

    def __init__(self, n: int) -> None:
        self.bridge = f"{TAG}br"
        self.namespaces = [f"{TAG}-host{i}" for i in range(n)]
        self.outside = [f"{TAG}v{i}" for i in range(n)]  # the root end of each host's cable
        self.addresses = [str(SUBNET[11 + i]) for i in range(n)]

    def create(self) -> None:
        ip("ip", "link", "add", self.bridge, "type", "bridge")
        ip("ip", "addr", "add", f"{SUBNET[1]}/{SUBNET.prefixlen}", "dev", self.bridge)
        ip("ip", "link", "set", self.bridge, "up")
        for ns, outside, address in zip(self.namespaces, self.outside, self.addresses, strict=True):
            ip("ip", "netns", "add", ns)
            ip("ip", "link", "add", outside, "type", "veth", "peer", "name", "eth0", "netns", ns)
            ip("ip", "link", "set", outside, "master", self.bridge, "up")
            ip("ip", "addr", "add", f"{address}/{SUBNET.prefixlen}", "dev", "eth0", ns=ns)
            ip("ip", "link", "set", "eth0", "up", ns=ns)
            ip("ip", "link", "set", "lo", "up", ns=ns)

    def destroy(self) -> None:
        for ns in self.namespaces:
            ip("ip", "netns", "del", ns, check=False)  # takes its veth pair along
        ip("ip", "link", "del", self.bridge, check=False)

    def shape(self, qdisc: list[str] | None) -> None:
        """Put `qdisc` on every packet a rank sends (None: remove it)."""
        for ns in self.namespaces:
            if qdisc:
                ip("tc", "qdisc", "add", "dev", "eth0", "root", *qdisc, ns=ns)
            else:
                ip("tc", "qdisc", "del", "dev", "eth0", "root", ns=ns, check=False)

    def supports(self, qdisc: list[str]) -> bool:
        """Whether this kernel has the qdisc (a VM kernel may lack sch_netem)."""
        ok = ip("tc", "qdisc", "add", "dev", "lo", "root", *qdisc, ns=self.namespaces[0], check=False)
        ip("tc", "qdisc", "del", "dev", "lo", "root", ns=self.namespaces[0], check=False)
        return ok.returncode == 0


def subnet_in_use() -> str | None:
    for line in ip("ip", "-4", "route", "show").stdout.splitlines():
        dest = line.split()[0]
        if dest != "default" and ipaddress.ip_network(dest, strict=False).overlaps(SUBNET):
            return line
    return None


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    """Create the namespaces once, or skip the module saying why they cannot be made."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    if not shutil.which("ip") or not shutil.which("tc"):
        pytest.skip("network namespaces need iproute2 (ip, tc)")
    if (route := subnet_in_use()) is not None:
        pytest.skip(f"{SUBNET} is already routed on this machine ({route})")
    h = Hosts(RANKS)
    try:
        try:
            h.create()
        except subprocess.CalledProcessError as e:
            pytest.skip(f"cannot create network namespaces here: {' '.join(e.cmd)}: {e.stderr.strip()}")
        yield h
    finally:
        h.destroy()
        assert not any(ns in ip("ip", "netns", "list").stdout for ns in h.namespaces)


@pytest.fixture(scope="module")
def remote_ranks(hosts, tmp_path_factory):
    """One `cpchat rank --host <its address>` per namespace, as on separate machines."""
    tmp = tmp_path_factory.mktemp("netns")
    token = write_token(tmp / "token", TOKEN)
    ranks = start_ranks(RANKS, tmp, token_file=token, hosts=hosts.addresses, port=PORT,
                        prefix=[["ip", "netns", "exec", ns] for ns in hosts.namespaces])
    yield ranks, token
    stop_all(ranks)


def headless(attach: list[str], token: Path, model: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        CPCHAT + ["--headless", "--token-file", str(token), "--model", str(model), "--raw", "--temp", "0",
                  "--json", "--prompt", PROMPT, *extra]
        + (["--attach", ",".join(attach)] if attach else []),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def run_ok(attach: list[str], token: Path, model: Path, *extra: str) -> list[dict]:
    p = headless(attach, token, model, *extra)
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err
    return [json.loads(line) for line in out.splitlines()]


def expected_tokens(model: Path, max_tokens: int) -> list[int]:
    tokenizer = reference_tokenizer(model)
    return [t for t, _ in reference_generate(model, tokenizer.encode(PROMPT, add_special_tokens=False),
                                             max_tokens)]


def established(ns: str, peer: str) -> bool:
    out = ip("ss", "-Htn", "state", "established", "dst", peer, ns=ns).stdout
    return bool(out.strip())


@pytest.mark.slow
def test_ranks_on_separate_hosts_match_mlx_lm(hosts, remote_ranks, model_dir):
    ranks, token = remote_ranks
    path = model_dir("llama")
    attach = [r.address for r in ranks]
    assert attach == [f"{a}:{PORT}" for a in hosts.addresses]
    evs = run_ok(attach, token, path, "--max-tokens", "12")
    assert [(r["rank"], r["address"]) for r in evs[0]["ranks"]] == list(enumerate(attach))
    assert all(r["blas"] for r in evs[0]["ranks"])  # each host's rank says what it multiplies with
    assert evs[0]["transport"] == "grpc"  # no shared memory between hosts
    assert [e["id"] for e in evs if e["event"] == "token"] == expected_tokens(path, 12)
    print(f"\nunshaped bridge: {timings(evs)}")
    # Each rank holds a direct connection to its next neighbour, namespace to namespace.
    for i, ns in enumerate(hosts.namespaces):
        assert established(ns, attach[(i + 1) % RANKS])


@pytest.mark.slow
def test_ranks_on_separate_hosts_through_mx_distributed(remote_ranks, model_dir):
    """--transport mlx across hosts: the ranks form an mx.distributed ring group over the bridge."""
    ranks, token = remote_ranks
    path = model_dir("llama")
    evs = run_ok([r.address for r in ranks], token, path, "--max-tokens", "12", "--transport", "mlx")
    assert evs[0]["transport"] == "mlx"  # three ranks: each pair are ring neighbours
    assert [e["id"] for e in evs if e["event"] == "token"] == expected_tokens(path, 12)


def test_shared_memory_alone_is_refused_across_hosts(remote_ranks, model_dir):
    ranks, token = remote_ranks
    p = headless([r.address for r in ranks], token, model_dir("llama"), "--transport", "shm")
    out, err = p.communicate(timeout=120)
    assert p.returncode == 2 and [json.loads(line)["event"] for line in out.splitlines()] == ["error"]
    assert err.strip().splitlines()[-1] == ("cpchat: --transport shm needs every rank on one host, "
                                            "but rank 0 reaches rank 1 only over the network")


def timings(evs: list[dict]) -> str:
    prefill = next(e for e in evs if e["event"] == "prefill")
    done = evs[-1]
    return (f"prefill {prefill['new_tokens']} tokens {prefill['ms']:.1f} ms, ttft {done['ttft_ms']:.1f} ms, "
            f"decode {done['decode_tokens_per_s']:.1f} tok/s")


NETEM = ["netem", "delay", "5ms", "rate", "1gbit"]
TBF = ["tbf", "rate", "1gbit", "burst", "256kb", "latency", "50ms"]


@pytest.mark.slow
@pytest.mark.parametrize("qdisc", [NETEM, TBF], ids=["netem-delay-5ms-rate-1gbit", "tbf-rate-1gbit"])
def test_shaped_links_via_hostfile(hosts, remote_ranks, model_dir, tmp_path, qdisc):
    if not hosts.supports(qdisc):
        pytest.skip(f"this kernel has no '{qdisc[0]}' qdisc (sch_{qdisc[0]}): links cannot be shaped with it")
    ranks, token = remote_ranks
    path = model_dir("llama")
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# ring order\n" + "\n".join(f"{r.address}  # host {i}" for i, r in enumerate(ranks)))
    hosts.shape(qdisc)
    try:
        evs = run_ok([], token, path, "--max-tokens", "12", "--hostfile", str(hostfile))
    finally:
        hosts.shape(None)
    assert [e["id"] for e in evs if e["event"] == "token"] == expected_tokens(path, 12)
    print(f"\n{' '.join(qdisc)}: {timings(evs)}")
    if qdisc is NETEM:  # every decoded token crosses at least one delayed hop
        assert 1000 / evs[-1]["decode_tokens_per_s"] >= 5.0


@pytest.mark.slow
@pytest.mark.alone
def test_link_down_is_detected_and_the_host_rejoins(hosts, remote_ranks, model_dir):
    ranks, token = remote_ranks
    path = model_dir("llama")
    attach = [r.address for r in ranks]
    victim = 1
    p = headless(attach, token, path, "--max-tokens", "400")
    t_fault = None
    try:
        for line in p.stdout:
            event = json.loads(line)
            if event["event"] == "token" and t_fault is None:
                ip("ip", "link", "set", hosts.outside[victim], "down")
                t_fault = time.monotonic()
            elif event["event"] == "error":
                detected = time.monotonic() - t_fault
                break
        else:
            raise AssertionError(f"no error event: {p.stderr.read()}")
        print(f"\nlink down detected in {detected:.2f} s: {event['message']}")
        assert detected < 5.0
        assert event["message"].startswith(f"rank 1 ({attach[victim]}) stopped answering during decode")
        assert p.wait(timeout=30) == 3
        assert [ln for ln in p.stderr.read().splitlines() if ln.strip()] == [f"cpchat: {event['message']}"]
        assert psutil.Process(ranks[victim].pid).is_running()  # cut off, not dead
        survivors = [attach[0], attach[2]]
        assert_answers(survivors, path)
    finally:
        p.kill()
        p.wait()
        ip("ip", "link", "set", hosts.outside[victim], "up")
    # The host is back and joins a ring of three again. Under a full-suite load the first ring
    # formed right after the link returns has once timed out in Calibrate (cause not found), so
    # the front end may attach again, as a user would: at most three attempts.
    for attempt in range(1, 4):
        try:
            assert_answers(attach, path)
            break
        except BackendError as e:
            assert attempt < 3, f"the returning host never rejoined: {e}"
            print(f"\nrejoin attempt {attempt} failed: {e}")


def assert_answers(addresses: list[str], path: Path) -> None:
    """A new ring of these ranks (once none is still winding down) gives mlx-lm's tokens."""
    cluster = Cluster(addresses, token=TOKEN)
    try:
        deadline = time.monotonic() + 20
        while any(r.control.Health(pb.HealthRequest(), timeout=10, metadata=cluster.metadata).state == "busy"
                  for r in cluster.ranks):
            assert time.monotonic() < deadline, "a rank never dropped the failed request"
            time.sleep(0.05)
        cluster.connect()
        cluster.load(str(path))
        tokenizer = reference_tokenizer(path)
        ids = tokenizer.encode(PROMPT, add_special_tokens=False)
        request = GenerationRequest(ids, max_tokens=6, stop_tokens=sorted(tokenizer.eos_token_ids))
        got = [e.id for e in cluster.generate(request) if isinstance(e, TokenOut)]
        assert got == [t for t in expected_tokens(path, 6) if t not in tokenizer.eos_token_ids]
    finally:
        cluster.close()


def test_stop_all_reaps_namespaced_ranks(hosts, tmp_path):
    """A rank started through `ip netns exec` is the process we kill (exec, no wrapper left)."""
    ranks = start_ranks(1, tmp_path, token_file=write_token(tmp_path / "t"), hosts=[hosts.addresses[0]],
                        port=PORT + 1, prefix=[["ip", "netns", "exec", hosts.namespaces[0]]])
    rank: RankProc = ranks[0]
    assert psutil.Process(rank.pid).cmdline()[:3] == CPCHAT[:1] + ["-m", "cpchat"]
    stop_all(ranks)
    assert not psutil.pid_exists(rank.pid)


# ---- ranks launched over ssh: a real sshd in each namespace


SSH_PORT = 7171  # where the launched ranks listen (the hand-started ones use PORT)


@pytest.fixture(scope="module")
def sshd(hosts, tmp_path_factory):
    """Debian's sshd in every namespace, taking our test key, except on the last host, which
    refuses it; and an ssh config for the front end (`CPCHAT_SSH`)."""
    if not Path("/usr/sbin/sshd").exists() or not shutil.which("ssh-keygen"):
        pytest.skip("needs openssh-server (sshd) and ssh-keygen")
    tmp = tmp_path_factory.mktemp("sshd")
    for name in ("client", "host", "stranger"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp / name)], check=True)
    Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege-separation directory
    daemons = []
    for i, (ns, address) in enumerate(zip(hosts.namespaces, hosts.addresses, strict=True)):
        key = "stranger" if i == len(hosts.namespaces) - 1 else "client"
        config = tmp / f"sshd{i}.conf"
        config.write_text(f"ListenAddress {address}\nHostKey {tmp / 'host'}\n"
                          f"AuthorizedKeysFile {tmp / key}.pub\nPidFile {tmp}/sshd{i}.pid\n"
                          "PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\n"
                          "StrictModes no\nPermitRootLogin prohibit-password\n")
        daemons.append(subprocess.Popen(["ip", "netns", "exec", ns, "/usr/sbin/sshd", "-D", "-e", "-f",
                                         str(config)], stderr=subprocess.DEVNULL))
    client = tmp / "ssh.conf"
    client.write_text(f"Host *\n  User root\n  IdentityFile {tmp / 'client'}\n  IdentitiesOnly yes\n"
                      "  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n  LogLevel ERROR\n")
    env = {"CPCHAT_SSH": f"ssh -F {client}", "CPCHAT_REMOTE_COMMAND": f"{CPCHAT[0]} -m cpchat"}
    for address in hosts.addresses:  # each daemon answers before any test dials it
        probe = ["ssh", "-F", str(client), "-o", "BatchMode=yes", "-o", "ConnectionAttempts=20", address]
        subprocess.run([*probe, "true"], capture_output=True, timeout=60)
    yield env
    for daemon in daemons:
        daemon.terminate()
        daemon.wait(timeout=10)


def launched_ranks() -> list[psutil.Process]:
    """The rank processes listening on SSH_PORT, in any namespace."""
    return ranks_started_with("--port", lambda value: value == str(SSH_PORT))


def launch(sshd_env: dict, hostfile: Path, model: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        CPCHAT + ["--headless", "--launch", "--hostfile", str(hostfile), "--model", str(model), "--raw",
                  "--temp", "0", "--json", "--prompt", PROMPT, *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=os.environ | sshd_env)


@pytest.mark.slow
@pytest.mark.parametrize("stages", [1, 2])
def test_launch_over_ssh_matches_mlx_lm_and_stops_the_ranks(hosts, sshd, model_dir, tmp_path, stages):
    """Two hosts as one ring of two context ranks, or as two pipeline stages (each host reads half the
    layers, and the hidden states cross between the hosts)."""
    path = model_dir("llama")
    hostfile = tmp_path / "hosts.json"  # mlx.launch's form
    hostfile.write_text(json.dumps([{"ssh": a, "ips": [a]} for a in hosts.addresses[:2]]))
    p = launch(sshd, hostfile, path, "--max-tokens", "12", "--stages", str(stages))
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err
    evs = [json.loads(line) for line in out.splitlines()]
    assert [r["address"].rsplit(":", 1)[0] for r in evs[0]["ranks"]] == hosts.addresses[:2]
    assert evs[0]["transport"] == "grpc" and evs[0]["stages"] == stages
    if stages == 2:
        assert [(r["stage"], r["layers"]) for r in evs[0]["ranks"]] == [(0, [0, 1]), (1, [1, 2])]
    assert [e["id"] for e in evs if e["event"] == "token"] == expected_tokens(path, 12)
    assert wait_gone(launched_ranks) == [], "a launched rank outlived the front end"


@pytest.mark.slow
def test_a_host_that_refuses_ssh_is_named_and_nothing_is_left(hosts, sshd, model_dir, tmp_path):
    refusing = hosts.addresses[-1]
    hostfile = tmp_path / "hosts"
    hostfile.write_text(f"{hosts.addresses[0]}:{SSH_PORT}\n{refusing}:{SSH_PORT}  # refuses our key\n")
    p = launch(sshd, hostfile, model_dir("llama"))
    out, err = p.communicate(timeout=120)
    assert p.returncode == 3
    assert err.strip().splitlines()[-1] == (f"cpchat: cannot start a rank on {refusing} over ssh: "
                                            f"root@{refusing}: Permission denied (publickey).")
    assert wait_gone(launched_ranks) == []


@pytest.mark.slow
@pytest.mark.alone
def test_a_launched_rank_killed_mid_answer_is_named_and_the_rest_stop(hosts, sshd, model_dir, tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("".join(f"{a}:{SSH_PORT}\n" for a in hosts.addresses[:2]))
    p = launch(sshd, hostfile, model_dir("llama"), "--max-tokens", "400")
    try:
        for line in p.stdout:
            event = json.loads(line)
            if event["event"] == "token":
                victim = next(r for r in launched_ranks() if hosts.addresses[1] in r.cmdline())
                victim.kill()
                break
        out, err = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == 3
    assert err.strip().splitlines()[-1].startswith(f"cpchat: rank 1 ({hosts.addresses[1]}:{SSH_PORT})")
    assert wait_gone(launched_ranks) == []
