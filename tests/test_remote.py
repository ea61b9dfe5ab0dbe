"""Hostfiles for ranks launched over ssh (cpchat/client/remote.py); the launch itself is tested
against real sshd daemons in tests/test_netns.py."""

import pytest

from cpchat.client.remote import Host, parse_hosts


def test_lines_of_hosts_and_ports():
    text = "# ring order\nmac-studio-1:7070  # first\n10.0.0.3\n\nhost-c:0\n"
    assert parse_hosts(text, "hosts.txt") == [Host("mac-studio-1", "mac-studio-1", 7070),
                                             Host("10.0.0.3", "10.0.0.3", 0), Host("host-c", "host-c", 0)]


def test_mlx_launch_json_hostfiles():
    text = '[{"ssh": "m1.local", "ips": ["192.168.1.2", "10.0.0.2"]}, {"ssh": "m2.local"}]'
    assert parse_hosts(text, "hosts.json") == [Host("m1.local", "192.168.1.2"), Host("m2.local", "m2.local")]


@pytest.mark.parametrize("text, message", [
    ("", "hosts: no hosts"),
    ("# nothing\n", "hosts: no hosts"),
    ("a:b\n", "hosts: expected host or host:port, got 'a:b'"),
    ("a:70000\n", "hosts: expected host or host:port, got 'a:70000'"),
    ('[{"ips": ["1.2.3.4"]}]', "hosts: not an mlx.launch hostfile (KeyError: 'ssh')"),
])
def test_bad_hostfiles_are_named(text, message):
    with pytest.raises(ValueError) as e:
        parse_hosts(text, "hosts")
    assert str(e.value) == message
