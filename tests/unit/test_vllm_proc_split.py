"""How VLLMProcessEngine divides a batch and the rank's engine settings (no vLLM needed)."""
import pytest

from flowrl.engines.rollout.vllm_config import VLLMRolloutConfig
from flowrl.engines.rollout.vllm_proc import _child_env, engine_share, split_groups

A, B, C, D = [1], [2], [3], [4]


def test_groups_are_never_split_and_ranges_cover_in_order():
    rows = [A] * 4 + [B] * 4 + [C] * 4 + [D] * 4
    assert split_groups(rows, greedy=False, parts=2) == [(0, 8), (8, 16)]
    assert split_groups(rows, greedy=False, parts=4) == [(0, 4), (4, 8), (8, 12), (12, 16)]
    assert split_groups(rows, greedy=False, parts=3) == [(0, 8), (8, 12), (12, 16)]


def test_fewer_groups_than_engines_gives_fewer_ranges():
    assert split_groups([A] * 8, greedy=False, parts=4) == [(0, 8)]
    assert split_groups([A, B], greedy=False, parts=4) == [(0, 1), (1, 2)]


def test_greedy_rows_are_split_row_by_row():
    # identical greedy prompts are separate requests (vLLM refuses n > 1 when greedy)
    assert split_groups([A] * 6, greedy=True, parts=3) == [(0, 2), (2, 4), (4, 6)]
    assert split_groups([A] * 5, greedy=True, parts=2) == [(0, 3), (3, 5)]


def test_uneven_groups_balance_rows():
    rows = [A] * 6 + [B] * 1 + [C] * 1 + [D] * 2
    assert split_groups(rows, greedy=False, parts=2) == [(0, 6), (6, 10)]


def test_engine_share_divides_the_rank_totals():
    cfg = VLLMRolloutConfig(max_num_seqs=2048, gpu_memory_utilization=0.8, kv_cache_memory_gb=8.0,
                            max_cudagraph_capture_size=1000, seed=5, engine_procs=3)
    s = engine_share(cfg, 3, 2)
    assert (s.max_num_seqs, s.max_cudagraph_capture_size) == (683, 334)
    assert s.gpu_memory_utilization == pytest.approx(0.8 / 3)
    assert s.kv_cache_memory_gb == pytest.approx(8 / 3)
    assert (s.seed, s.engine_procs) == (7, 0)
    assert engine_share(VLLMRolloutConfig(), 2, 0).kv_cache_memory_gb is None


def test_engine_procs_is_validated():
    with pytest.raises(ValueError, match="rollout.vllm.engine_procs"):
        VLLMRolloutConfig(engine_procs=-1)
    with pytest.raises(ValueError, match="max_num_seqs"):
        VLLMRolloutConfig(engine_procs=4, max_num_seqs=2)


def test_child_env_pins_the_parents_device(monkeypatch):
    import torch

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    env = _child_env(torch.device("cuda", 1))
    assert env == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "CUDA_VISIBLE_DEVICES": "6"}
    assert _child_env(torch.device("cpu")) == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def test_cpu_kv_cache_defaults_to_a_fixed_size(monkeypatch):
    from flowrl.engines.rollout.vllm_config import CPU_KV_CACHE_GB

    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    cfg = VLLMRolloutConfig()
    assert cfg.kv_cache_gb_on(True) == CPU_KV_CACHE_GB == 1.0  # not a share of the host's RAM
    assert cfg.kv_cache_gb_on(False) is None  # CUDA: vLLM profiles the device
    assert VLLMRolloutConfig(kv_cache_memory_gb=0.25).kv_cache_gb_on(True) == 0.25
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "4")
    assert cfg.kv_cache_gb_on(True) is None  # vLLM's own knob wins


def test_a_bucket_packs_into_one_flat_buffer_and_comes_back_exactly():
    """Weight sync to engine processes: a bucket crosses as ONE buffer (torch's IPC costs per
    tensor); every tensor comes back bit-exact with its dtype and shape, as a view of the buffer,
    at an aligned offset; the sender's tensors are copied, never shared."""
    import torch

    from flowrl.engines.rollout.vllm_proc import pack_bucket, unpack_bucket

    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, 5, generator=g)
    bucket = [("w", w.to(torch.bfloat16)), ("t", w.t()),  # a non-contiguous view
              ("b", torch.randn(7, generator=g, dtype=torch.float64)),
              ("i", torch.arange(3, dtype=torch.int32)), ("s", torch.tensor(2.5)),
              ("m", torch.tensor([True, False, True]))]
    flat, metas = pack_bucket(bucket)
    # 30, 60, 56, 12, 4, 3 bytes, each rounded up to 64
    assert flat.dtype == torch.uint8 and flat.shape == (6 * 64,)
    assert [(n, off) for n, _, _, off in metas] == [("w", 0), ("t", 64), ("b", 128), ("i", 192),
                                                     ("s", 256), ("m", 320)]
    out = list(unpack_bucket(flat, metas))
    assert [n for n, _ in out] == ["w", "t", "b", "i", "s", "m"]
    for (_, a), (_, b) in zip(bucket, out):
        assert b.dtype == a.dtype and b.shape == a.shape and torch.equal(a, b)
        assert b.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
    flat.zero_()  # the sender's tensors are not the buffer
    assert torch.equal(bucket[0][1], w.to(torch.bfloat16))
    with pytest.raises(ValueError, match="one device per bucket"):
        pack_bucket([("a", torch.ones(1)), ("b", torch.ones(1, device="meta"))])


def test_staging_buffers_refill_each_position_in_place_across_loads():
    """Weight sync to engine processes on CUDA leaked one copy of the weights per load while every
    load exported fresh buffers; the staging buffers are made once per bucket position and
    refilled in place (``fresh`` False: nothing new to export), unless a bucket of another size
    comes to that position."""
    import torch

    from flowrl.engines.rollout.vllm_proc import StagingBuffers, unpack_bucket

    st = StagingBuffers()
    first = [[("a", torch.ones(4)), ("b", torch.zeros(2))], [("c", torch.full((3,), 2.0))]]
    st.begin()
    packed = [st.pack(b) for b in first]
    assert [(i, fresh) for i, _, _, fresh in packed] == [(0, True), (1, True)]
    buffers = [flat for _, flat, _, _ in packed]
    second = [[("a", torch.full((4,), 5.0)), ("b", torch.ones(2))], [("c", torch.full((3,), 7.0))]]
    st.begin()
    again = [st.pack(b) for b in second]
    assert [(i, fresh) for i, _, _, fresh in again] == [(0, False), (1, False)]
    for (_, flat, metas, _), old, bucket in zip(again, buffers, second):
        assert flat is old  # the same storage, refilled
        for (_, got), (_, want) in zip(unpack_bucket(flat, metas), bucket):
            assert torch.equal(got, want)
    # another weight set (a bigger bucket at position 1): a new buffer there, position 0 kept
    st.begin()
    st.pack(second[0])
    index, flat, _, fresh = st.pack([("c", torch.ones(30))])
    assert (index, fresh) == (1, True) and flat is not buffers[1] and st.flats[0] is buffers[0]
