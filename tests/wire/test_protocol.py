"""The wire codec on exact bytes: every message type both ways, framing, and malformed input."""

from __future__ import annotations

import contextlib
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server import wire as p


def frame(tag: bytes, body: bytes) -> bytes:
    return tag + struct.pack("!i", len(body) + 4) + body


# Each case: message, exact encoding. Decoding the encoding must give the message back.
FRONTEND = [
    (p.Query("SELECT 1"), b"Q\x00\x00\x00\x0dSELECT 1\x00"),
    (p.Parse("s1", "SELECT $1", (23,)),
     frame(b"P", b"s1\x00SELECT $1\x00\x00\x01\x00\x00\x00\x17")),
    (p.Parse("", "SELECT 1"), frame(b"P", b"\x00SELECT 1\x00\x00\x00")),
    (p.Bind("p", "s1", (1,), (b"\x00\x00\x00\x2a", None), (0, 1)),
     frame(b"B", b"p\x00s1\x00\x00\x01\x00\x01\x00\x02\x00\x00\x00\x04\x00\x00\x00\x2a\xff\xff\xff\xff"
                 b"\x00\x02\x00\x00\x00\x01")),
    (p.Describe(b"S", "s1"), frame(b"D", b"Ss1\x00")),
    (p.Describe(b"P", ""), frame(b"D", b"P\x00")),
    (p.Execute("p", 100), frame(b"E", b"p\x00\x00\x00\x00\x64")),
    (p.Close(b"S", "s1"), frame(b"C", b"Ss1\x00")),
    (p.Sync(), b"S\x00\x00\x00\x04"),
    (p.Flush(), b"H\x00\x00\x00\x04"),
    (p.Terminate(), b"X\x00\x00\x00\x04"),
    (p.PasswordMessage(b"secret\x00"), frame(b"p", b"secret\x00")),
    (p.CopyData(b"1\t2\n"), frame(b"d", b"1\t2\n")),
    (p.CopyDone(), b"c\x00\x00\x00\x04"),
    (p.CopyFail("stop"), frame(b"f", b"stop\x00")),
    (p.FunctionCall(b"\x00\x00\x00\x01"), frame(b"F", b"\x00\x00\x00\x01")),
]

BACKEND = [
    (p.Authentication(p.AUTH_OK), b"R\x00\x00\x00\x08\x00\x00\x00\x00"),
    (p.Authentication.sasl(["SCRAM-SHA-256"]),
     frame(b"R", b"\x00\x00\x00\x0aSCRAM-SHA-256\x00\x00")),
    (p.Authentication(p.AUTH_SASL_CONTINUE, b"r=abc"), frame(b"R", b"\x00\x00\x00\x0br=abc")),
    (p.Authentication(p.AUTH_MD5, b"salt"), frame(b"R", b"\x00\x00\x00\x05salt")),
    (p.ParameterStatus("server_version", "16.2"), frame(b"S", b"server_version\x0016.2\x00")),
    (p.BackendKeyData(7, 9), b"K\x00\x00\x00\x0c\x00\x00\x00\x07\x00\x00\x00\x09"),
    (p.ReadyForQuery(b"T"), b"Z\x00\x00\x00\x05T"),
    (p.RowDescription((p.FieldDescription("n", 0, 0, 20, 8, -1, 1),)),
     frame(b"T", b"\x00\x01n\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x14\x00\x08\xff\xff\xff\xff\x00\x01")),
    (p.DataRow((b"42", None, b"")),
     frame(b"D", b"\x00\x03\x00\x00\x00\x0242\xff\xff\xff\xff\x00\x00\x00\x00")),
    (p.CommandComplete("SELECT 3"), frame(b"C", b"SELECT 3\x00")),
    (p.EmptyQueryResponse(), b"I\x00\x00\x00\x04"),
    (p.ErrorResponse((("S", "ERROR"), ("C", "42501"), ("M", "no"))),
     frame(b"E", b"SERROR\x00C42501\x00Mno\x00\x00")),
    (p.NoticeResponse((("S", "NOTICE"), ("M", "hi"))), frame(b"N", b"SNOTICE\x00Mhi\x00\x00")),
    (p.ParseComplete(), b"1\x00\x00\x00\x04"),
    (p.BindComplete(), b"2\x00\x00\x00\x04"),
    (p.CloseComplete(), b"3\x00\x00\x00\x04"),
    (p.NoData(), b"n\x00\x00\x00\x04"),
    (p.ParameterDescription((23, 25)), frame(b"t", b"\x00\x02\x00\x00\x00\x17\x00\x00\x00\x19")),
    (p.PortalSuspended(), b"s\x00\x00\x00\x04"),
    (p.NotificationResponse(5, "ch", "x"), frame(b"A", b"\x00\x00\x00\x05ch\x00x\x00")),
    (p.CopyResponse(b"H", 0, (0, 0)), frame(b"H", b"\x00\x00\x02\x00\x00\x00\x00")),
    (p.CopyData(b"row\n"), frame(b"d", b"row\n")),
    (p.CopyDone(), b"c\x00\x00\x00\x04"),
]


@pytest.mark.parametrize(("msg", "wire"), FRONTEND, ids=lambda x: type(x).__name__)
def test_frontend_bytes(msg: p.FrontendMessage, wire: bytes) -> None:
    assert msg.encode() == wire
    assert p.decode_frontend(wire[:1], wire[5:]) == msg


@pytest.mark.parametrize(("msg", "wire"), BACKEND, ids=lambda x: type(x).__name__)
def test_backend_bytes(msg: p.BackendMessage, wire: bytes) -> None:
    assert msg.encode() == wire
    assert p.decode_backend(wire[:1], wire[5:]) == msg


def test_startup_packets() -> None:
    sm = p.StartupMessage({"user": "alice", "database": "demo"})
    wire = sm.encode()
    assert wire == struct.pack("!ii", len(wire), 196608) + b"user\x00alice\x00database\x00demo\x00\x00"
    assert p.decode_startup(wire[4:]) == sm
    assert p.SSLRequest().encode() == b"\x00\x00\x00\x08\x04\xd2\x16\x2f"
    assert p.decode_startup(p.SSLRequest().encode()[4:]) == p.SSLRequest()
    assert p.GSSENCRequest().encode() == b"\x00\x00\x00\x08\x04\xd2\x16\x30"
    assert p.decode_startup(p.GSSENCRequest().encode()[4:]) == p.GSSENCRequest()
    cancel = p.CancelRequest(1234, -5)
    assert cancel.encode() == b"\x00\x00\x00\x10\x04\xd2\x16\x2e\x00\x00\x04\xd2\xff\xff\xff\xfb"
    assert p.decode_startup(cancel.encode()[4:]) == cancel


def test_startup_rejects_other_major_protocols_and_missing_user() -> None:
    for major in (2, 4):
        with pytest.raises(p.UnsupportedProtocol,
                           match=rf"unsupported frontend protocol {major}\.0: server supports "
                                 r"3\.0 to 3\.0"):
            p.decode_startup(struct.pack("!i", major << 16) + b"user\x00a\x00\x00")
    with pytest.raises(p.MissingUserName, match="no PostgreSQL user name"):
        p.decode_startup(struct.pack("!i", 196608) + b"database\x00d\x00\x00")
    # a newer minor version is read (and negotiated down by the session)
    packet = p.decode_startup(struct.pack("!i", 196610) + b"user\x00a\x00_pq_.x\x00y\x00\x00")
    assert isinstance(packet, p.StartupMessage) and packet.protocol == 196610
    assert packet.parameters == {"user": "a", "_pq_.x": "y"}


def test_negotiate_protocol_version_as_postgres_sends_it() -> None:
    # (postmaster.c's SendNegotiateProtocolVersion: the newest version word, then the options)
    msg = p.NegotiateProtocolVersion(196608, ("_pq_.a", "_pq_.bc"))
    assert msg.encode() == b"v" + struct.pack("!iii", 4 + 8 + 7 + 8, 196608, 2) \
        + b"_pq_.a\x00_pq_.bc\x00"
    assert p.decode_backend(b"v", msg.encode()[5:]) == msg


def test_sasl_initial_response_round_trip() -> None:
    msg = p.SASLInitialResponse("SCRAM-SHA-256", b"n,,n=,r=abc")
    wire = msg.encode()
    assert wire == frame(b"p", b"SCRAM-SHA-256\x00\x00\x00\x00\x0bn,,n=,r=abc")
    decoded = p.decode_frontend(b"p", wire[5:])
    assert isinstance(decoded, p.PasswordMessage)
    assert p.SASLInitialResponse.parse(decoded) == msg


def test_bind_format_rules() -> None:
    b = p.Bind("", "", (1,), (b"a", b"b"), ())
    assert b.param_format(1) == 1 and b.result_format(3) == 0
    with pytest.raises(p.ProtocolViolation, match="2 parameter formats but 1 parameters"):
        p.decode_frontend(b"B", p.Bind("", "", (0, 0), (b"a",)).encode()[5:])
    with pytest.raises(p.ProtocolViolation, match="unsupported format code"):
        p.decode_frontend(b"B", p.Bind("", "", (2,), (b"a",)).encode()[5:])


@pytest.mark.parametrize(
    ("tag", "body", "message"),
    [
        (b"Q", b"SELECT 1", "unterminated string"),
        (b"Q", b"a\x00b", "trailing bytes"),
        (b"Q", b"\xff\xfe\x00", "invalid byte sequence for encoding utf-8: 0xff"),
        (b"E", b"p\x00", "shorter than"),
        (b"D", b"Xname\x00", "invalid DESCRIBE message subtype"),
        (b"B", b"\x00\x00\x00\x00\x00\x01\xff\xff\xff\xf0\x00\x00", "invalid value length"),
        (b"?", b"", "invalid frontend message type"),
    ],
)
def test_malformed_frontend(tag: bytes, body: bytes, message: str) -> None:
    with pytest.raises(p.ProtocolViolation, match=message):
        p.decode_frontend(tag, body)


def test_strings_in_the_client_encoding() -> None:
    """Strings are read and written in the session's client encoding (a Python codec)."""
    wire = p.Parse("s\xe9", "SELECT 'Z\xfcrich'").encode("latin-1")
    assert wire == b"P" + struct.pack("!i", 25) + b"s\xe9\x00SELECT 'Z\xfcrich'\x00\x00\x00"
    assert p.decode_frontend(b"P", wire[5:], "latin-1") == p.Parse("s\xe9", "SELECT 'Z\xfcrich'")
    with pytest.raises(p.InvalidText) as info:
        p.decode_frontend(b"P", wire[5:])  # not UTF-8
    assert info.value.raw == b"\xe9"
    # SQL the encoding cannot hold is an error for the caller; messages to the client are
    # written with "?" where the encoding has no character
    with pytest.raises(UnicodeEncodeError):
        p.Query("SELECT '\u20ac'").encode("latin-1")
    err = p.ErrorResponse(((p.FIELD_MESSAGE, "\u20ac \xe9"),)).encode("latin-1")
    assert err == b"E" + struct.pack("!i", 10) + b"M? \xe9\x00\x00"
    desc = p.RowDescription((p.FieldDescription("\xe9"),)).encode("latin-1")
    assert desc[7:9] == b"\xe9\x00"
    assert p.CommandComplete("SELECT 1").encode("latin-1") == p.CommandComplete("SELECT 1").encode()


def test_frame_reader_splits_and_limits() -> None:
    r = p.FrameReader(max_size=100)
    data = p.Query("SELECT 1").encode() + p.Sync().encode()
    r.feed(data[:3])
    assert r.next_raw() is None
    r.feed(data[3:])
    assert list(r) == [(b"Q", b"SELECT 1\x00"), (b"S", b"")]
    r.feed(b"Q" + struct.pack("!i", 1000))
    with pytest.raises(p.ProtocolViolation, match="exceeds the limit of 100"):
        r.next_raw()
    r2 = p.FrameReader()
    r2.feed(b"Q" + struct.pack("!i", 2))
    with pytest.raises(p.ProtocolViolation, match="invalid message length 2"):
        r2.next_raw()
    s = p.FrameReader(startup=True)
    s.feed(struct.pack("!i", 100_000))
    with pytest.raises(p.ProtocolViolation, match="invalid length of startup packet"):
        s.next_raw()


@settings(max_examples=400, deadline=None)
@given(st.binary(min_size=1, max_size=1), st.binary(max_size=64))
def test_frontend_decode_raises_only_protocol_violation(tag: bytes, body: bytes) -> None:
    with contextlib.suppress(p.ProtocolViolation):
        p.decode_frontend(tag, body)


@settings(max_examples=400, deadline=None)
@given(st.binary(min_size=1, max_size=1), st.binary(max_size=64))
def test_backend_decode_raises_only_protocol_violation(tag: bytes, body: bytes) -> None:
    with contextlib.suppress(p.ProtocolViolation):
        p.decode_backend(tag, body)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_startup_decode_raises_only_protocol_violation(body: bytes) -> None:
    with contextlib.suppress(p.ProtocolViolation):
        p.decode_startup(body)


@settings(max_examples=200, deadline=None)
@given(
    st.text(alphabet=st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",)), max_size=20),
    st.lists(st.one_of(st.none(), st.binary(max_size=10)), max_size=5),
    st.lists(st.integers(0, 1), max_size=3),
)
def test_bind_round_trip(name: str, params: list[bytes | None], formats: list[int]) -> None:
    msg = p.Bind(name, name, (), tuple(params), tuple(formats))
    assert p.decode_frontend(b"B", msg.encode()[5:]) == msg


_names = st.text(alphabet=st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",)),
                 max_size=30)
@st.composite
def _binds(draw: st.DrawFn) -> p.Bind:
    params = tuple(draw(st.lists(st.one_of(st.none(), st.binary(max_size=12)), max_size=4)))
    n_formats = draw(st.sampled_from(sorted({0, 1, len(params)})))
    formats = tuple(draw(st.lists(st.integers(0, 1), min_size=n_formats, max_size=n_formats)))
    results = tuple(draw(st.lists(st.integers(0, 1), max_size=3)))
    return p.Bind(draw(_names), draw(_names), formats, params, results)


_frontend_messages = st.one_of(
    st.builds(p.Query, _names),
    st.builds(p.Parse, _names, _names, st.lists(st.integers(0, 2**32 - 1), max_size=4).map(tuple)),
    _binds(),
    st.builds(p.Describe, st.sampled_from([b"S", b"P"]), _names),
    st.builds(p.Close, st.sampled_from([b"S", b"P"]), _names),
    st.builds(p.Execute, _names, st.integers(0, 2**31 - 1)),
    st.builds(p.Sync), st.builds(p.Flush), st.builds(p.Terminate),
    st.builds(p.CopyData, st.binary(max_size=40)), st.builds(p.CopyDone),
    st.builds(p.CopyFail, _names),
)


@settings(max_examples=500, deadline=None)
@given(st.lists(_frontend_messages, min_size=1, max_size=6), st.integers(1, 64))
def test_frontend_stream_round_trips_whatever_the_read_sizes(msgs: list[object], chunk: int) -> None:
    """Messages encoded back to back and fed in arbitrary slices decode to themselves."""
    data = b"".join(m.encode() for m in msgs)  # type: ignore[attr-defined]
    reader = p.FrameReader()
    out = []
    for i in range(0, len(data), chunk):
        reader.feed(data[i : i + chunk])
        while (frame := reader.next_raw()) is not None:
            tag, raw = frame
            out.append(p.decode_frontend(tag, raw[5:]))
    assert out == msgs


@settings(max_examples=300, deadline=None)
@given(st.lists(_frontend_messages, min_size=1, max_size=4), st.data())
def test_frontend_stream_with_a_corrupted_byte_fails_only_as_protocol_violation(
        msgs: list[object], data: st.DataObject) -> None:
    raw_stream = bytearray(b"".join(m.encode() for m in msgs))  # type: ignore[attr-defined]
    i = data.draw(st.integers(0, len(raw_stream) - 1))
    raw_stream[i] = data.draw(st.integers(0, 255))
    reader = p.FrameReader(max_size=1 << 16)
    try:
        reader.feed(bytes(raw_stream))
        while (frame := reader.next_raw()) is not None:
            tag, raw = frame
            p.decode_frontend(tag, raw[5:])
    except p.ProtocolViolation:
        pass
