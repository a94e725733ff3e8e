"""The link's wire format without a network: exact round trips, chunking and its limits, strict
parsing, the generated code is current, and the backoff schedule."""

import filecmp
import os

import numpy as np
import pytest

from islands.link import link_pb2 as pb
from islands.link import wire
from islands.link.client import backoff_s


def _push():
    import jax.numpy as jnp

    from islands.syncer import codec as C
    from islands.syncer.validate import Push

    codec = C.make_codec("int4", 64)
    drift = {"w": (jnp.arange(130, dtype=jnp.float32).reshape(10, 13) - 65) / 100}
    codes = C.to_numpy(C.encode_tree(codec, drift))
    return Push("far:0", 1, codes, base_version=3, epoch=2, c_tokens=1024, c_steps=4,
                incarnation=1, step=9, tokens_done=4096, compute_s=1.25, wire_bytes=77,
                session="abc", fates={"processed": [1, 2]}), codec


def test_a_push_crosses_the_wire_exactly_in_small_chunks():
    push, codec = _push()
    stream = list(wire.chunks(wire.push_to_pb(push), chunk_bytes=32))
    assert len(stream) > 3 and all(len(c.data) <= 32 for c in stream)
    assert stream[0].total_bytes == sum(len(c.data) for c in stream)
    back = wire.push_from_pb(wire.assemble(stream, pb.PushRequest))
    code, original = back.codes["w"], push.codes["w"]
    assert (code.kind, code.shape, code.dtype, code.block_size) == ("int4", (10, 13), "float32", 64)
    # 130 int4 values in 65 bytes, 3 blocks of 64 -> 3 float32 scales
    assert code.payload.dtype == np.uint8 and code.payload.shape == (65,)
    np.testing.assert_array_equal(code.payload, original.payload)
    np.testing.assert_array_equal(code.scales, original.scales)
    assert (back.learner, back.fragment, back.base_version, back.epoch, back.c_tokens,
            back.c_steps, back.incarnation, back.step, back.compute_s, back.session,
            back.fates) == ("far:0", 1, 3, 2, 1024, 4, 1, 9, 1.25, "abc", {"processed": [1, 2]})


def test_replies_and_registrations_keep_dtype_shape_and_values():
    import ml_dtypes

    from islands.syncer.actor import Reply

    params = {"a": np.arange(6, dtype=np.float32).reshape(2, 3),
              "b": np.array([1.5, -2.0], dtype=ml_dtypes.bfloat16)}
    back = wire.reply_from_pb(wire.reply_to_pb(Reply("merged", 2, 5, params, 7)))
    assert (back.status, back.fragment, back.epoch, back.version) == ("merged", 2, 5, 7)
    assert back.params["b"].dtype == ml_dtypes.bfloat16 and back.params["a"].shape == (2, 3)
    np.testing.assert_array_equal(back.params["a"], params["a"])
    refused = wire.reply_from_pb(wire.reply_to_pb(Reply("rejected", 1, 5, None, -1, "too_stale")))
    assert refused.params is None and refused.reason == "too_stale"
    reg = {"epoch": 3, "fragments": [params], "versions": [4], "session": "s"}
    again = wire.registration_from_pb(wire.registration_to_pb(reg))
    assert again["versions"] == [4] and again["session"] == "s"
    np.testing.assert_array_equal(again["fragments"][0]["a"], params["a"])


def test_sizes_are_bounded_before_anything_is_buffered():
    msg = pb.FetchRequest(fragments=list(range(100)))
    with pytest.raises(wire.WireError, match="above the link's limit of 10") as err:
        list(wire.chunks(msg, 16, max_total_bytes=10))
    assert err.value.code == "RESOURCE_EXHAUSTED"
    with pytest.raises(wire.WireError, match="declares 1073741824 bytes") as err:
        wire.assemble([pb.Chunk(total_bytes=1 << 30, data=b"")], pb.FetchRequest, 1 << 20)
    assert err.value.code == "RESOURCE_EXHAUSTED"
    with pytest.raises(wire.WireError, match="more bytes than the 2 declared"):
        wire.assemble([pb.Chunk(total_bytes=2, data=b"ab"), pb.Chunk(data=b"c")], pb.FetchRequest)
    with pytest.raises(wire.WireError, match="1 bytes of the 2 declared"):
        wire.assemble([pb.Chunk(total_bytes=2, data=b"a")], pb.FetchRequest)
    with pytest.raises(wire.WireError, match="empty stream"):
        wire.assemble([], pb.FetchRequest)


def test_malformed_arrays_and_unknown_fields_are_refused():
    with pytest.raises(wire.WireError, match=r"float32\[2, 2\] needs 16 bytes, got 4"):
        wire.array_from_pb(pb.Array(dtype="float32", shape=[2, 2], data=b"abcd"))
    with pytest.raises(wire.WireError, match="dtype 'object' is not allowed"):
        wire.array_from_pb(pb.Array(dtype="object", shape=[1], data=b"x"))
    # A field number this protocol does not have (99, varint 1), nested inside a Fragment.
    nested = pb.Fragment(tensors=[pb.NamedArray(path="a")]).SerializeToString()
    foreign = nested[:-0 or None] + bytes([0x98, 0x06, 0x01])
    with pytest.raises(wire.WireError, match="unknown to link protocol"):
        wire.parse(foreign, pb.Fragment)
    assert wire.parse(nested, pb.Fragment).tensors[0].path == "a"


def test_backoff_doubles_to_its_cap_and_jitter_only_shortens():
    assert [backoff_s(a, 0.25, 4.0) for a in range(7)] == [0.25, 0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    assert backoff_s(10, 0.25, 4.0, jitter=0.2) == pytest.approx(3.2)


def test_the_checked_in_generated_code_is_current(tmp_path):
    pytest.importorskip("grpc_tools")
    from islands.link import codegen

    codegen.generate(str(tmp_path))
    for name in codegen.OUTPUTS:
        assert filecmp.cmp(tmp_path / name, os.path.join(codegen.HERE, name), shallow=False), \
            f"{name} is stale: run python -m islands.link.codegen"


def test_a_merged_full_update_crosses_as_its_fragment_and_a_diff_as_its_codes():
    import numpy as np

    from islands.link import wire
    from islands.syncer import codec as C
    from islands.syncer import downlink
    from islands.syncer.actor import Reply
    from islands.syncer.downlink import DiffUpdate, FullUpdate

    fragment = {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}
    reply = Reply("merged", 1, 3, None, 7, update=FullUpdate(fragment, 7))
    back = wire.reply_from_pb(wire.reply_to_pb(reply))
    assert back.status == "merged" and back.version == 7 and back.update is None
    np.testing.assert_array_equal(back.params["w"], fragment["w"])
    # An encoded update: the learner across the link resolves it to the same bits as the
    # shadow the syncer recorded (the docstring example of syncer/downlink.py).
    settings = downlink.DownlinkSettings(C.make_codec("int2", block_size=4))
    base = {"w": np.array([1.0, 1.0, 1.0, 1.0], np.float32)}
    new = {"w": np.array([1.75, 0.75, 1.0, 1.25], np.float32)}
    update, shadow = downlink.make_update(settings, base, 0, 3, new, 4, 7)
    back = wire.reply_from_pb(wire.reply_to_pb(Reply("merged", 1, 3, None, 4, update=update)))
    assert isinstance(back.update, DiffUpdate) and back.params is None
    assert (back.update.from_id, back.update.to_id, back.update.version) == (0, 7, 4)
    assert downlink.update_bytes(back.update) == downlink.update_bytes(update) == 5
    got, version, new_id = downlink.resolve(back.update, base, 0)
    assert (version, new_id) == (4, 7)
    np.testing.assert_array_equal(got["w"], shadow.params["w"])
    assert got["w"].tolist() == [1.75, 0.75, 1.25, 1.25]
    with pytest.raises(wire.WireError, match="version 4 in a reply of version 5"):
        wire.reply_to_pb(Reply("merged", 1, 3, None, 5, update=update))
    # A push's base shadow crosses too (the syncer checks it against the shadow it holds).
    push, _ = _push()
    import dataclasses

    shadowed = dataclasses.replace(push, base_shadow=(5 << 32) + 9)
    assert wire.push_from_pb(wire.push_to_pb(shadowed)).base_shadow == (5 << 32) + 9
    assert wire.push_from_pb(wire.push_to_pb(push)).base_shadow == 0


def test_a_registration_names_its_syncer_shard_and_session_and_the_reply_its_fragment_ids():
    from islands.link import link_pb2 as pb

    held = [(4, {"w": np.ones(3, np.float32)})]
    msg = wire.parse(wire.register_to_pb("far:0", 2, held, "sess", 1).SerializeToString(),
                     pb.RegisterRequest)
    learner, incarnation, adopted, session, shard = wire.register_from_pb(msg)
    assert (learner, incarnation, session, shard) == ("far:0", 2, "sess", 1)
    assert adopted[0][0] == 4 and adopted[0][1]["w"].tolist() == [1.0, 1.0, 1.0]
    # A shard owning global fragments 1 and 3 answers with them, in its order.
    reg = {"epoch": 5, "fragments": [{"a": np.zeros(2, np.float32)}, {"b": np.ones(1, np.float32)}],
           "versions": [7, 9], "session": "sess", "fragment_ids": [1, 3], "syncer_shard": 1}
    back = wire.registration_from_pb(wire.registration_to_pb(reg))
    assert (back["fragment_ids"], back["versions"], back["syncer_shard"], back["epoch"]) == (
        [1, 3], [7, 9], 1, 5)
    # A single syncer's registration (no ids) counts its fragments from 0.
    single = wire.registration_from_pb(wire.registration_to_pb(
        {"epoch": 0, "fragments": reg["fragments"], "versions": [1, 2], "session": "s"}))
    assert single["fragment_ids"] == [0, 1] and single["syncer_shard"] == 0
    # The fleet clock's schedule count crosses the link, 0 included; none stays None.
    assert single["schedule_step"] is None
    for count in (0, 4744):
        told = wire.registration_from_pb(wire.registration_to_pb({**reg, "schedule_step": count}))
        assert told["schedule_step"] == count
    broken = wire.registration_to_pb(reg)
    del broken.fragment_ids[:]
    with pytest.raises(wire.WireError, match="names 0 ids"):
        wire.registration_from_pb(broken)
