"""Multiaddr and peer-ID parsing: good addresses pass through, bad ones name the bad part."""

from __future__ import annotations

import pytest

from p2p_diloco.errors import ConfigError
from p2p_diloco.net.addresses import (
    parse_listen_addresses,
    parse_multiaddr,
    parse_peer_address,
    parse_peer_addresses,
    parse_peer_id,
    peer_id_in,
)

RSA_ID = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
ED25519_ID = "12D3KooWKFgeH8jLUCALNKMbbPPTNLpT6cUhnmk62Egefkk9RuTL"


@pytest.mark.parametrize(
    "text",
    [
        "/ip4/127.0.0.1/tcp/0",
        "/ip4/0.0.0.0/tcp/31337",
        "/ip6/::1/tcp/5",
        "/ip4/203.0.113.7/udp/31337/quic-v1",
        "/dns4/boot.example.org/tcp/31337",
        f"/ip4/10.0.0.1/tcp/1/p2p/{RSA_ID}",
    ],
)
def test_good_addresses_parse_and_round_trip(text):
    assert str(parse_multiaddr(text, what="--listen")) == text


@pytest.mark.parametrize(
    "text, bad_part",
    [
        ("/ip4/1.2.3/tcp/5", "invalid IPv4 address '1.2.3'"),
        ("/ip4/1.2.3.4/tcp/99999", "invalid tcp port '99999'"),
        ("/ip4/1.2.3.4/udp/x/quic-v1", "invalid udp port 'x'"),
        ("/ip6/::g/tcp/5", "invalid IPv6 address '::g'"),
        ("/ip4/1.2.3.4/tcp", "missing value after /tcp"),
        ("ip4/1.2.3.4/tcp/5", "must start with '/'"),
        ("", "it is empty"),
        ("/ip4/1.2.3.4/tcp/5/p2p/QmNotAPeer", "invalid peer id 'QmNotAPeer'"),
        ("/ip4/1.2.3.4/bogus/5", "bogus"),
        ("/ip4//tcp/5", "missing value after /ip4"),
    ],
)
def test_bad_addresses_name_the_bad_part_and_show_a_good_one(text, bad_part):
    with pytest.raises(ConfigError) as err:
        parse_multiaddr(text, what="--initial-peers")
    message = str(err.value)
    assert message.startswith(f"--initial-peers: {text!r} is not a valid multiaddr: ")
    assert bad_part in message
    assert "expected something like /ip4/" in message


def test_the_message_from_the_brief():
    with pytest.raises(
        ConfigError,
        match=r"^--initial-peers: '/ip4/1\.2\.3/tcp/5' is not a valid multiaddr: "
        r"invalid IPv4 address '1\.2\.3'; expected something like /ip4/",
    ):
        parse_peer_address("/ip4/1.2.3/tcp/5", what="--initial-peers")


def test_peer_address_requires_a_p2p_part():
    with pytest.raises(ConfigError, match=r"no /p2p/<peer id> part.*bootstrap address:"):
        parse_peer_address("/ip4/1.2.3.4/tcp/5", what="--initial-peers")
    addr = parse_peer_address(f"/ip4/1.2.3.4/udp/5/quic-v1/p2p/{ED25519_ID}", what="--initial-peers")
    assert peer_id_in(addr) == ED25519_ID
    assert parse_peer_addresses([f" /ip4/1.2.3.4/tcp/5/p2p/{RSA_ID} "], what="x") == [
        f"/ip4/1.2.3.4/tcp/5/p2p/{RSA_ID}"
    ]


def test_listen_addresses_must_not_name_a_peer():
    assert parse_listen_addresses(["/ip4/0.0.0.0/tcp/0"], what="--listen") == ["/ip4/0.0.0.0/tcp/0"]
    with pytest.raises(ConfigError, match="must not contain /p2p/"):
        parse_listen_addresses([f"/ip4/1.2.3.4/tcp/5/p2p/{RSA_ID}"], what="--listen")


@pytest.mark.parametrize("good", [RSA_ID, ED25519_ID])
def test_peer_ids(good):
    assert parse_peer_id(good) == good


@pytest.mark.parametrize(
    "bad, why", [("", "empty"), ("Qm0OIl", "not base58"), ("QmNotAPeer", "not a multihash")]
)
def test_bad_peer_ids_say_why(bad, why):
    with pytest.raises(ConfigError, match=why):
        parse_peer_id(bad, what="to_peer")
