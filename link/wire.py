"""The link's wire format: data-path values <-> protobuf messages, and chunked streams.

Pure functions over numpy and the generated ``link_pb2`` messages; no network. Tensors travel as
raw bytes with their dtype name and shape (never pickled); a message larger than one gRPC frame
is serialized once and streamed as ``Chunk``s, and the receiver refuses declared or actual totals
above its limit before it buffers them.
"""

from __future__ import annotations

import json
from typing import Any, Iterable, Iterator, Mapping, Optional

import numpy as np

from . import link_pb2 as pb

PROTOCOL = 1
DEFAULT_CHUNK_BYTES = 1 << 20            # 1 MiB per Chunk message
DEFAULT_MAX_TOTAL_BYTES = 1 << 30        # one request or reply: 1 GiB at most
# Chunk framing (field tags, lengths) on top of its data; the gRPC frame limit covers both.
CHUNK_OVERHEAD_BYTES = 64
DTYPES = frozenset({"float32", "bfloat16", "float16", "int8", "uint8", "int32"})


class WireError(ValueError):
    """A message that cannot be accepted: too large, malformed, or with unknown fields."""

    def __init__(self, message: str, code: str = "INVALID_ARGUMENT"):
        super().__init__(message)
        self.code = code  # the grpc.StatusCode name the server answers with


# -- arrays ---------------------------------------------------------------------------------------
def _dtype(name: str) -> np.dtype:
    if name not in DTYPES:
        raise WireError(f"dtype {name!r} is not allowed on the link; allowed are {sorted(DTYPES)}")
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def array_to_pb(x: Any) -> pb.Array:
    a = np.asarray(x)
    name = "bfloat16" if a.dtype.name == "bfloat16" else a.dtype.name
    _dtype(name)
    return pb.Array(dtype=name, shape=list(a.shape), data=np.ascontiguousarray(a).tobytes())


def array_from_pb(msg: pb.Array) -> np.ndarray:
    """The array a message carries (a read-only view of its bytes).

    Raises:
      WireError: unknown dtype, negative dims, or a byte count that does not match the shape.
    """
    dtype = _dtype(msg.dtype)
    shape = tuple(int(d) for d in msg.shape)
    if any(d < 0 for d in shape):
        raise WireError(f"negative dimension in shape {list(shape)}")
    want = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(msg.data) != want:
        raise WireError(f"{msg.dtype}{list(shape)} needs {want} bytes, got {len(msg.data)}")
    return np.frombuffer(msg.data, dtype=dtype).reshape(shape)


def fragment_to_pb(fragment: Mapping[str, Any]) -> pb.Fragment:
    return pb.Fragment(tensors=[pb.NamedArray(path=k, array=array_to_pb(v))
                                for k, v in fragment.items()])


def fragment_from_pb(msg: pb.Fragment) -> dict[str, np.ndarray]:
    out = {}
    for t in msg.tensors:
        if t.path in out:
            raise WireError(f"tensor {t.path!r} appears twice in a fragment")
        out[t.path] = array_from_pb(t.array)
    return out


# -- pushes and replies ---------------------------------------------------------------------------
def codes_to_pb(codes: Mapping[str, Any]) -> list:
    """``{path: codec.Code}`` (numpy) as ``Code`` messages."""
    return [pb.Code(path=path, kind=c.kind, dtype=str(c.dtype), shape=list(c.shape),
                    block_size=int(c.block_size), payload=array_to_pb(c.payload),
                    scales=array_to_pb(c.scales))
            for path, c in codes.items()]


def codes_from_pb(msgs: Iterable[pb.Code], what: str = "push") -> dict:
    from islands.syncer.codec import Code

    codes = {}
    for c in msgs:
        if c.path in codes:
            raise WireError(f"code {c.path!r} appears twice in a {what}")
        codes[c.path] = Code(kind=c.kind, payload=array_from_pb(c.payload),
                             scales=array_from_pb(c.scales), shape=tuple(int(d) for d in c.shape),
                             dtype=c.dtype, block_size=int(c.block_size))
    return codes


def push_to_pb(push) -> pb.PushRequest:
    """A ``syncer.validate.Push`` whose codes are numpy ``codec.Code``s (a pre-merged push's
    members travel as PushRequests without codes)."""
    return pb.PushRequest(
        learner=push.learner, fragment=push.fragment, codes=codes_to_pb(push.codes),
        base_version=push.base_version, epoch=push.epoch, c_tokens=push.c_tokens,
        c_steps=push.c_steps, incarnation=push.incarnation, step=push.step,
        tokens_done=push.tokens_done, compute_s=push.compute_s, wire_bytes=push.wire_bytes,
        session=push.session, fates_json=json.dumps(push.fates) if push.fates is not None else "",
        members=[push_to_pb(m) for m in push.members], base_shadow=int(push.base_shadow))


def push_from_pb(msg: pb.PushRequest, member: bool = False):
    from islands.syncer.validate import Push

    codes = codes_from_pb(msg.codes)
    if member and (codes or msg.members):
        raise WireError("a pre-merged push's member carries no codes and no members")
    members = tuple(push_from_pb(m, member=True) for m in msg.members)
    if len({m.learner for m in members}) != len(members):
        raise WireError("a learner appears twice in a pre-merged push")
    fates = parse_json(msg.fates_json, "fates_json") if msg.fates_json else None
    return Push(learner=msg.learner, fragment=int(msg.fragment), codes=codes,
                base_version=int(msg.base_version), epoch=int(msg.epoch),
                c_tokens=int(msg.c_tokens), c_steps=int(msg.c_steps),
                incarnation=int(msg.incarnation), step=int(msg.step),
                tokens_done=int(msg.tokens_done), compute_s=float(msg.compute_s),
                wire_bytes=int(msg.wire_bytes), session=msg.session, fates=fates,
                members=members, base_shadow=int(msg.base_shadow))


def reply_to_pb(reply) -> pb.PushReply:
    """A ``syncer.actor.Reply``. A merged fragment crosses as a full fp32 fragment (a
    ``FullUpdate`` is unwrapped), an encoded downlink's ``DiffUpdate`` as its codes and shadow
    ids (the learner across the link applies them to its own copy, as a local one does)."""
    from islands.syncer.downlink import DiffUpdate, FullUpdate

    params, update = reply.params, reply.update
    if params is None and isinstance(update, FullUpdate):
        params, update = update.params, None
    elif update is not None and not isinstance(update, DiffUpdate):
        raise WireError(f"a reply's update must be a FullUpdate or DiffUpdate, got "
                        f"{type(update).__name__}")
    msg = pb.PushReply(status=str(reply.status), fragment=int(reply.fragment),
                       epoch=int(reply.epoch), version=int(reply.version), reason=reply.reason,
                       detail=reply.detail, has_params=params is not None,
                       has_update=update is not None)
    if params is not None:
        msg.params.CopyFrom(fragment_to_pb(params))
    if update is not None:
        if int(update.version) != int(reply.version):
            raise WireError(f"an update of version {update.version} in a reply of version "
                            f"{reply.version}")
        msg.update_codes.extend(codes_to_pb(update.codes))
        msg.update_from, msg.update_to = int(update.from_id), int(update.to_id)
    return msg


def reply_from_pb(msg: pb.PushReply):
    from islands.syncer.actor import Reply
    from islands.syncer.downlink import DiffUpdate

    if msg.status not in ("merged", "rejected", "dropped"):
        raise WireError(f"unknown reply status {msg.status!r}")
    if msg.has_update and (msg.has_params or msg.status != "merged"):
        raise WireError("an encoded update comes only with a merged reply, and without params")
    params = fragment_from_pb(msg.params) if msg.has_params else None
    update = (DiffUpdate(codes_from_pb(msg.update_codes, "reply"), int(msg.update_from),
                         int(msg.update_to), int(msg.version)) if msg.has_update else None)
    return Reply(msg.status, int(msg.fragment), int(msg.epoch), params, int(msg.version),
                 msg.reason, msg.detail, update=update)


def register_to_pb(learner: str, incarnation: int, adopted: Optional[list], session: str = "",
                   syncer_shard: int = 0) -> pb.RegisterRequest:
    return pb.RegisterRequest(learner=learner, incarnation=incarnation, adopted=[
        pb.AdoptedFragment(version=int(v), fragment=fragment_to_pb(f)) for v, f in adopted or []],
        session=session or "", syncer_shard=int(syncer_shard))


def register_from_pb(msg: pb.RegisterRequest) -> tuple[str, int, list, str, int]:
    """(learner, incarnation, adopted, session ("" for a fresh one), syncer shard)."""
    return (msg.learner, int(msg.incarnation),
            [(int(a.version), fragment_from_pb(a.fragment)) for a in msg.adopted],
            msg.session, int(msg.syncer_shard))


def registration_to_pb(reg: Mapping) -> pb.RegisterReply:
    """The dict ``Syncer.register`` returns."""
    ids = reg.get("fragment_ids")
    return pb.RegisterReply(epoch=int(reg["epoch"]), versions=[int(v) for v in reg["versions"]],
                            session=reg["session"],
                            fragments=[fragment_to_pb(f) for f in reg["fragments"]],
                            fragment_ids=[int(p) for p in (ids if ids is not None
                                                           else range(len(reg["fragments"])))],
                            syncer_shard=int(reg.get("syncer_shard") or 0),
                            schedule_step=int(reg.get("schedule_step") or 0),
                            has_schedule_step=reg.get("schedule_step") is not None)


def registration_from_pb(msg: pb.RegisterReply) -> dict:
    if len(msg.fragment_ids) != len(msg.fragments) or len(msg.versions) != len(msg.fragments):
        raise WireError(f"a registration of {len(msg.fragments)} fragments names "
                        f"{len(msg.fragment_ids)} ids and {len(msg.versions)} versions")
    return {"epoch": int(msg.epoch), "fragments": [fragment_from_pb(f) for f in msg.fragments],
            "versions": [int(v) for v in msg.versions], "session": msg.session,
            "fragment_ids": [int(p) for p in msg.fragment_ids],
            "syncer_shard": int(msg.syncer_shard),
            "schedule_step": int(msg.schedule_step) if msg.has_schedule_step else None}


def parse_json(text: str, field: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise WireError(f"{field} is not JSON: {exc}") from exc


# -- chunked streams ------------------------------------------------------------------------------
def chunks(msg, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
           max_total_bytes: int = DEFAULT_MAX_TOTAL_BYTES) -> Iterator[pb.Chunk]:
    """Serializes ``msg`` once and yields it as Chunks of at most ``chunk_bytes`` data bytes; the
    first declares the total. An empty message is one empty chunk.

    Raises:
      WireError: the message is larger than ``max_total_bytes`` (code RESOURCE_EXHAUSTED).
    """
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be > 0, got {chunk_bytes}")
    data = msg.SerializeToString()
    if len(data) > max_total_bytes:
        raise WireError(f"{type(msg).__name__} is {len(data)} bytes, above the link's limit of "
                        f"{max_total_bytes}", "RESOURCE_EXHAUSTED")
    view = memoryview(data)
    yield pb.Chunk(total_bytes=len(data), data=bytes(view[:chunk_bytes]))
    for start in range(chunk_bytes, len(data), chunk_bytes):
        yield pb.Chunk(data=bytes(view[start:start + chunk_bytes]))


def assemble(stream: Iterable[pb.Chunk], message_type, max_total_bytes: int = DEFAULT_MAX_TOTAL_BYTES):
    """Reads one message of ``message_type`` from a stream of Chunks.

    Raises:
      WireError: an empty stream, a declared total above ``max_total_bytes`` (RESOURCE_EXHAUSTED),
        more or fewer bytes than declared, bytes that do not parse, or unknown fields.
    """
    it = iter(stream)
    first = next(it, None)
    if first is None:
        raise WireError(f"empty stream where a {message_type.__name__} was expected")
    total = int(first.total_bytes)
    if total > max_total_bytes:
        raise WireError(f"{message_type.__name__} declares {total} bytes, above the link's limit "
                        f"of {max_total_bytes}", "RESOURCE_EXHAUSTED")
    buf = bytearray(first.data)
    for chunk in it:
        if chunk.total_bytes:
            raise WireError("only the first chunk may declare a total")
        if len(buf) + len(chunk.data) > total:
            raise WireError(f"{message_type.__name__}: more bytes than the {total} declared")
        buf += chunk.data
    if len(buf) != total:
        raise WireError(f"{message_type.__name__}: {len(buf)} bytes of the {total} declared")
    return parse(bytes(buf), message_type)


def parse(data: bytes, message_type):
    """Parses ``data`` strictly: fields this protocol does not know are refused, not kept."""
    msg = message_type()
    try:
        msg.ParseFromString(data)
    except Exception as exc:  # protobuf's DecodeError
        raise WireError(f"{message_type.__name__} does not parse: {exc}") from exc
    check_known_fields(msg)
    return msg


def check_known_fields(msg) -> None:
    """Raises WireError when ``msg`` or a message inside it carries fields unknown to this
    protocol version (a newer or foreign peer: refuse rather than silently drop meaning)."""
    from google.protobuf import unknown_fields

    if len(unknown_fields.UnknownFieldSet(msg)):
        raise WireError(f"{type(msg).__name__} has fields unknown to link protocol {PROTOCOL}")
    for field, value in msg.ListFields():
        if field.message_type is None:
            continue
        for sub in ([value] if hasattr(value, "ListFields") else value):  # one, or repeated
            check_known_fields(sub)
