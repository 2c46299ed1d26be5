"""flowrl.runtime.io.transport: batch send/recv, bucketed weight broadcast, dead-peer errors (2 gloo
processes started with torch.multiprocessing)."""
import os
import pickle
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flowrl.runtime.io.transport import (
    PoolPeerError,
    WeightBroadcaster,
    _buckets,
    recv_batch,
    send_batch,
)


def test_buckets_split_per_dtype_and_size():
    meta = [("a", torch.float32, (4,)), ("b", torch.bfloat16, (8,)), ("c", torch.float32, (2, 2)),
            ("d", torch.float32, (100,)), ("e", torch.float32, (1,))]
    # 32-byte buckets: a (16 B) + c (16 B) fill one; d (400 B) is alone; b is its own dtype
    assert _buckets(meta, 32) == [[0, 2], [3], [4], [1]]
    assert _buckets(meta, 2**20) == [[0, 2, 3, 4], [1]]


def _batch():
    g = torch.Generator().manual_seed(0)
    return {"sample.prompt_ids": torch.randint(0, 99, (4, 3), generator=g),
            "rollout.response_mask": torch.rand(4, 5, generator=g) > 0.5,
            "advantage.advantages": torch.randn(4, 5, generator=g),
            "sample.ground_truth": ["1", "2", "3", "4"]}


def _weights():
    g = torch.Generator().manual_seed(1)
    return [("w1", torch.randn(3, 4, generator=g)), ("b1", torch.randn(4, generator=g)),
            ("h", torch.randn(5, generator=g).to(torch.bfloat16)), ("w2", torch.randn(7, 2, generator=g))]


def _worker(rank: int, init: str, queue, mode: str) -> None:
    class q:  # plain pickling: tensors through the mp queue's shared memory vanish with the process
        put = staticmethod(lambda msg: queue.put(pickle.dumps(msg)))

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        group = dist.new_group([0, 1])
        bc = WeightBroadcaster(group, src=0, bucket_mb=1, timeout_s=20)
        if rank == 1:  # the rollout side: two batches, then receive weights (ok) / die (dead)
            p1 = send_batch(_batch(), version=3, step=4, dst=0, metrics={"reward/mean": 0.5})
            if mode == "dead":
                p1.wait()
                os._exit(0)  # abrupt: no teardown, the socket just closes
            version, named = bc.recv()
            p1.wait()
            q.put(("weights", version, [(k, v.clone()) for k, v in named]))
        else:
            got = recv_batch(1, timeout_s=20)
            q.put(("batch", got.version, got.step, got.metrics, got.data))
            if mode == "dead":
                t0 = time.monotonic()
                try:
                    recv_batch(1, timeout_s=20)
                    q.put(("no error",))
                except PoolPeerError as e:
                    q.put(("error", str(e), time.monotonic() - t0))
            else:
                bc.send(_weights(), version=7)
                q.put(("sent", bc.last_bytes, bc.last_buckets))
    finally:
        if mode != "dead":
            dist.destroy_process_group()


def _run(tmp_path, mode: str, n_msgs: int) -> list:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    init = f"file://{tmp_path}/store"
    procs = [ctx.Process(target=_worker, args=(r, init, q, mode)) for r in range(2)]
    for p in procs:
        p.start()
    msgs = [pickle.loads(q.get(timeout=120)) for _ in range(n_msgs)]
    for p in procs:
        p.join(timeout=60)
    return msgs


def test_batch_and_weights_cross_exactly(tmp_path):
    msgs = {m[0]: m for m in _run(tmp_path, "ok", 3)}
    _, version, step, metrics, data = msgs["batch"]
    assert (version, step, metrics) == (3, 4, {"reward/mean": 0.5})
    want = _batch()
    assert list(data) == list(want)
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert data[k].dtype == v.dtype and torch.equal(data[k], v), k
        else:
            assert data[k] == v
    _, v, named = msgs["weights"]
    assert v == 7 and [k for k, _ in named] == [k for k, _ in _weights()]
    for (k, a), (_, b) in zip(named, _weights()):
        assert a.dtype == b.dtype and torch.equal(a, b), k
    # 4·12 + 4·4 + 4·14 fp32 bytes + 2·5 bf16 bytes, in 2 buckets (one per dtype)
    assert msgs["sent"][1:] == (4 * 12 + 4 * 4 + 4 * 14 + 2 * 5, 2)


def test_dead_sender_raises_pool_peer_error(tmp_path):
    msgs = {m[0]: m for m in _run(tmp_path, "dead", 2)}
    assert "error" in msgs, msgs
    _, text, waited = msgs["error"]
    assert text.startswith("rollout pool rank 1 stopped sending (")
    assert waited < 20  # the closed connection is reported, not the timeout


def test_a_peer_dead_before_the_post_is_a_pool_peer_error(monkeypatch):
    """gloo refuses to post an irecv / isend to a peer whose connection already closed (a race
    the two-process test above loses under load: the RuntimeError came from the post, not the
    wait). Both directions name the pool and rank."""
    import pytest

    def closed(*args, **kwargs):
        raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                           "[127.0.0.1]:21400. This is typically caused by a remote worker crashing.")

    monkeypatch.setattr(dist, "irecv", closed)
    monkeypatch.setattr(dist, "isend", closed)
    with pytest.raises(PoolPeerError, match=r"^rollout pool rank 1 stopped sending \(\[gloo/"
                                            r"transport/tcp/pair.cc:553\] Connection closed by peer "
                                            r"\[127.0.0.1\]:21400\. This is typically"):
        recv_batch(1, timeout_s=5)
    with pytest.raises(PoolPeerError, match=r"^train pool \(rank 0\) stopped receiving \(.*"
                                            r"Connection closed by peer"):
        send_batch(_batch(), version=1, step=1, dst=0)
