"""Link overhead per push: bytes on the wire ÷ codec payload, and the latency the link adds.

A real link server (TLS, bearer token, chunked streams) and a real region-side channel through
the byte-counting relay, on loopback, in one process. The home backend answers each push at once
with the decoded fragment as float32 (what a merge sends back), so the round trip is the link's
cost alone: serialize, chunk, TLS, HTTP/2, parse, and the same for the reply. "direct" is the
same encode/decode of the messages without the network. Fragments: the tiny model's largest
fragment, and a 10M-parameter fragment (int4 codes up, float32 down).

    python benchmarks/link.py [--quick]
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import finish, machine, parser, pyplot, save_figure, table  # noqa: E402

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402


class _EchoHome:
    """Answers every push at once with its decoded fragment (float32), like a merge reply."""

    def __init__(self, codec):
        self.codec = codec

    def epoch(self):
        return 0

    def push(self, push):
        from islands.syncer import codec as C
        from islands.syncer.actor import Reply

        params = {k: np.asarray(v, np.float32) for k, v in
                  C.decode_tree(self.codec, push.codes).items()}
        return Reply("merged", push.fragment, 0, params, 1)


def _fragment(num_params: int, seed: int):
    rng = np.random.default_rng(seed)
    side = 1000
    rows = max(1, num_params // side)
    return {"w": jnp.asarray(rng.normal(0, 1e-3, (rows, side)).astype(np.float32))}


def main() -> None:
    args = parser(__doc__).parse_args()
    from islands.link import link_pb2 as pb
    from islands.link import wire
    from islands.link.client import ClientSettings, LinkClient
    from islands.link.security import throwaway_pki
    from islands.link.server import ServerSettings, serve
    from islands.orchestrator.config import JobConfig
    from islands.syncer import codec as C
    from islands.syncer.validate import Push

    reps = 5 if args.quick else 20
    codec = C.make_codec("int4", 64)
    tiny_params = 119_104 // 4    # the default tiny model's parameters over its 4 fragments
    cases = [("tiny fragment", tiny_params), ("10M fragment", 10_000_000)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        pki = throwaway_pki(tmp)
        config = JobConfig.model_validate({"regions": {"a": {"learners": 1},
                                                       "far": {"learners": 1, "remote": True}},
                                           "link": {"port": 0}})
        settings = ServerSettings(port=0, token="bench", cert_file=pki.server_cert,
                                  key_file=pki.server_key)
        server, port = serve(_EchoHome(codec), config.model_dump_json(), settings)
        client = LinkClient(ClientSettings(home=f"127.0.0.1:{port}", region="far", token="bench",
                                           ca_file=pki.ca_cert, server_name="localhost",
                                           report_every_s=3600))
        try:
            client.hello()
            for label, n in cases:
                codes = C.to_numpy(C.encode_tree(codec, _fragment(n, args.seed)))
                payload = C.tree_wire_bytes(codes)
                push = Push("far:0", 0, codes, 0, 0, 1, 1, wire_bytes=payload)
                reply_payload = int(np.prod(codes["w"].shape)) * 4
                direct, linked, up, down = [], [], [], []
                for i in range(reps + 1):
                    t0 = time.perf_counter()
                    req = wire.assemble(wire.chunks(wire.push_to_pb(push)), pb.PushRequest)
                    answer = _EchoHome(codec).push(wire.push_from_pb(req))
                    wire.reply_from_pb(wire.assemble(wire.chunks(wire.reply_to_pb(answer)),
                                                     pb.PushReply))
                    t1 = time.perf_counter()
                    before = client.relay.counters()
                    reply = client.push(push)
                    t2 = time.perf_counter()
                    after = client.relay.counters()
                    assert reply.status == "merged", reply
                    if i == 0:
                        continue  # the first call warms the jitted decode and the connection
                    direct.append(t1 - t0)
                    linked.append(t2 - t1)
                    up.append(after["up"] - before["up"])
                    down.append(after["down"] - before["down"])
                rows.append({"fragment": label, "params": int(np.prod(codes["w"].shape)),
                             "payload_up_B": payload, "wire_up_B": statistics.median(up),
                             "up_ratio": statistics.median(up) / payload,
                             "payload_down_B": reply_payload,
                             "wire_down_B": statistics.median(down),
                             "down_ratio": statistics.median(down) / reply_payload,
                             "direct_ms": 1e3 * statistics.median(direct),
                             "link_ms": 1e3 * statistics.median(linked),
                             "added_ms": 1e3 * (statistics.median(linked)
                                                - statistics.median(direct))})
        finally:
            client.close()
            server.stop(0)
    print(table(rows, ["fragment", "params", "payload_up_B", "wire_up_B", "up_ratio",
                       "payload_down_B", "wire_down_B", "down_ratio", "direct_ms", "link_ms",
                       "added_ms"]))
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    x = np.arange(len(rows))
    ax.bar(x - 0.2, [r["up_ratio"] for r in rows], 0.4, label="up: wire ÷ int4 payload")
    ax.bar(x + 0.2, [r["down_ratio"] for r in rows], 0.4, label="down: wire ÷ fp32 reply")
    ax.set_xticks(x, [r["fragment"] for r in rows])
    ax.set_ylabel("bytes on the wire ÷ payload")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.legend()
    ax.set_title("gRPC link overhead per push (TLS, loopback)")
    fig.tight_layout()
    save_figure(fig, args.out, "link_overhead.png")
    finish("link", {"benchmark": "link", "quick": args.quick, "reps": reps, "rows": rows,
                    "machine": machine()}, args.out)


if __name__ == "__main__":
    main()
