"""Direct reads: a prefill's KV cache moved into real shared memory, read by another process,
and the scheduler holding a direct handoff's blocks until its ticket is gone."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import msgspec
import pytest
import torch
from vllm.v1.outputs import KVConnectorOutput

from testbed.handshake_ranks import rank_meta
from testbed.vllm_harness import free_blocks, make_request, make_scheduler, meta, params_of, step
from testbed.worker_processes import vllm_kv_caches
from vllm_qaic_connector.kv.copy_pool import CopyPool
from vllm_qaic_connector.kv.token_copies import block_runs, gather_tokens
from vllm_qaic_connector.layout import KVGeometry, get_layout
from vllm_qaic_connector.protocol import side_channel
from vllm_qaic_connector.protocol.wire import (
    PROTOCOL_VERSION,
    HandshakeReply,
    ReleaseRequest,
    SharedCache,
    TransportEndpoint,
    direct_problem,
)
from vllm_qaic_connector.region_headers import new_incarnation
from vllm_qaic_connector.transports import staging_name
from vllm_qaic_connector.transports.nixl import NixlTransport
from vllm_qaic_connector.transports.shared_cache import host_identity
from vllm_qaic_connector.transports.shm import move_into_shm
from vllm_qaic_connector.worker import direct_reads
from vllm_qaic_connector.worker.direct_reads import (
    DirectReader,
    PeerCache,
    cache_endpoint,
    plan_cache_reads,
)

GEO = KVGeometry(num_heads=2, head_size=32, block_size=16, dtype=torch.float16)
LAYERS, BLOCKS, TOKENS = 3, 12, 150  # 10 blocks, the last one partly used


def vllm_like_cache(kind: str, device: str = "cpu") -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One int8 backing allocation viewed as each layer's tensor, as vLLM allocates it."""
    layout = get_layout(kind)
    shape = layout.physical_shape(BLOCKS, GEO)
    per_layer = torch.Size(shape).numel()
    raw = torch.zeros(LAYERS * per_layer * 2, dtype=torch.int8, device=device)
    flat = raw.view(torch.float16)
    layers = [flat[i * per_layer : (i + 1) * per_layer].view(shape) for i in range(LAYERS)]
    return raw, [layout.layer_view(t) for t in layers]


def test_block_runs_merge_blocks_consecutive_on_both_sides():
    assert block_runs([4, 5, 6, 9, 1], [0, 1, 2, 3, 7]) == [(4, 0, 3), (9, 3, 1), (1, 7, 1)]
    assert block_runs([], []) == []


def test_layers_of_separate_storages_are_not_shared():
    assert move_into_shm([torch.zeros(4, 8), torch.zeros(4, 8)]) is None


@pytest.mark.parametrize("kind", ["vllm_cpu_vec", "LBNHC", "LBHNC", "mla_latent"])
def test_another_process_copies_the_blocks_out_of_the_shared_cache(kind, tmp_path):
    """Moved into shm in place: vLLM's views of the cache (made before the move) write into
    it, and a second process maps it through /proc and copies the blocks it was named."""
    raw, layers = vllm_like_cache(kind)
    cache = move_into_shm(layers)
    assert cache is not None and raw.untyped_storage().is_shared()
    gen = torch.Generator().manual_seed(7)
    for t in layers:  # written after the move, through views made before it
        t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
    src_blocks = torch.randperm(BLOCKS, generator=gen)[:10].tolist()
    dst_blocks = torch.randperm(BLOCKS, generator=gen)[:10].tolist()
    out = tmp_path / "copied.pt"
    script = f"""
import torch, msgspec
from vllm_qaic_connector.kv.copy_pool import CopyPool
from vllm_qaic_connector.worker.direct_reads import DirectReader
from vllm_qaic_connector.layout import KVGeometry, get_layout
from vllm_qaic_connector.kv.token_copies import gather_tokens
from vllm_qaic_connector.protocol.wire import SharedCache
cache = msgspec.json.decode({msgspec.json.encode(cache)!r}, type=SharedCache)
geo = KVGeometry(2, 32, 16, torch.float16)
layout = get_layout({kind!r})
reader = DirectReader(CopyPool())
src = reader.peer("prefill/0", cache, layout, geo)
ours = [layout.allocate({BLOCKS}, geo) for _ in src.layers]
dst = [layout.kv_views(t, geo) for t in ours]
copied = reader.copy(src, {src_blocks}, ours, {dst_blocks})
torch.save(([gather_tokens(kv, {dst_blocks}, {TOKENS}) for kv in dst], copied), {str(out)!r})
"""
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    copied_kv, nbytes = torch.load(out)
    layout = get_layout(kind)
    for t, (k, v) in zip(layers, copied_kv, strict=True):
        want_k, want_v = gather_tokens(layout.kv_views(t, GEO), src_blocks, TOKENS)
        assert torch.equal(k, want_k) and torch.equal(v, want_v)
    assert nbytes == LAYERS * 10 * GEO.bytes_per_block


@pytest.mark.parametrize("kind", ["vllm_cpu_vec", "LBNHC"])
@pytest.mark.parametrize("layers", [1, LAYERS])
def test_a_decode_of_another_format_converts_as_it_copies(kind, layers):
    """Out of the mapped cache (16-token blocks) into HND 8-token blocks, from a token
    inside a block: every layer's tokens equal, with one layer or several (two threads)."""
    _, prefill = vllm_like_cache(kind)
    cache = move_into_shm(prefill)
    assert cache is not None
    gen = torch.Generator().manual_seed(11)
    for t in prefill:
        t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
    src_blocks = torch.randperm(BLOCKS, generator=gen)[:10].tolist()
    ours, hnd = KVGeometry(2, 32, 8, torch.float16), get_layout("LBHNC")
    decode = [hnd.kv_views(hnd.allocate(24, ours), ours) for _ in range(layers)]
    dst_blocks = torch.randperm(24, generator=gen)[:19].tolist()
    reader = DirectReader(CopyPool())
    try:
        mapped = reader.peer("prefill/0", cache, get_layout(kind), GEO)
        copied = CopyPool().layers(mapped.layers, src_blocks, decode, dst_blocks, 5, TOKENS)
    finally:
        reader.close()
    assert copied == layers * 2 * 2 * 32 * 2 * (TOKENS - 5)
    for t, kv in zip(prefill[:layers], decode, strict=True):
        want = gather_tokens(get_layout(kind).kv_views(t, GEO), src_blocks, TOKENS)
        got = gather_tokens(kv, dst_blocks, TOKENS)
        for w, g in zip(want, got, strict=True):
            assert torch.equal(w[:, 5:], g[:, 5:]) and not g[:, :5].any()


def test_a_cache_that_would_not_fit_twice_in_dev_shm_stays_put(monkeypatch, caplog):
    """Past its size a tmpfs answers a write with SIGBUS: too little room means staging."""
    raw, layers = vllm_like_cache("vllm_cpu_vec")
    room = os.statvfs("/dev/shm")
    small = os.statvfs_result((*room[:4], raw.numel() // room.f_frsize, *room[5:]))
    monkeypatch.setattr(direct_reads.os, "statvfs", lambda path: small)
    assert move_into_shm(layers) is None
    assert not raw.untyped_storage().is_shared() and "stage instead" in caplog.text


def test_a_peer_cache_refuses_paths_and_shapes_it_cannot_trust():
    _, layers = vllm_like_cache("vllm_cpu_vec")
    cache = move_into_shm(layers)
    assert cache is not None
    layout = get_layout("vllm_cpu_vec")
    bad_path = msgspec.structs.replace(cache, path="/dev/shm/someone_elses")
    with pytest.raises(ConnectionError, match="is not /proc/<pid>/fd/<n>"):
        PeerCache(bad_path, layout, GEO)
    gone = msgspec.structs.replace(cache, path="/proc/1/fd/999999")
    with pytest.raises(ConnectionError, match="cannot open"):
        PeerCache(gone, layout, GEO)
    too_far = msgspec.structs.replace(cache, layer_offsets=(cache.size,))
    with pytest.raises(ConnectionError, match="does not fit"):
        PeerCache(too_far, layout, GEO)
    other_object = msgspec.structs.replace(cache, inode=cache.inode + 1)
    with pytest.raises(ConnectionError, match="not the object it advertised"):
        PeerCache(other_object, layout, GEO)
    bigger = msgspec.structs.replace(cache, size=cache.size * 2)
    with pytest.raises(ConnectionError, match="smaller than advertised"):
        PeerCache(bigger, layout, GEO)


def test_block_ids_outside_either_cache_are_refused():
    """The copy goes by address: an id past either cache would read or write outside it."""
    _, layers = vllm_like_cache("vllm_cpu_vec")
    cache = move_into_shm(layers)
    assert cache is not None
    reader = DirectReader(CopyPool())
    peer = reader.peer("p/0", cache, get_layout("vllm_cpu_vec"), GEO)
    ours = [get_layout("vllm_cpu_vec").allocate(4, GEO) for _ in layers]
    with pytest.raises(ValueError, match=f"prefill block ids 0..{BLOCKS} outside 0..{BLOCKS - 1}"):
        reader.copy(peer, [0, BLOCKS], ours, [0, 1])
    with pytest.raises(ValueError, match="our block ids -1..1 outside 0..3"):
        reader.copy(peer, [0, 1], ours, [1, -1])
    mixed = [*ours[:-1], get_layout("vllm_cpu_vec").allocate(5, GEO)]  # one plan serves all layers
    with pytest.raises(ValueError, match="our layers in one shape and stride"):
        reader.copy(peer, [0, 1], mixed, [0, 1])
    assert not any(t.any() for t in ours)
    reader.close()


def test_the_cache_of_a_prefill_that_died_is_unmapped():
    """SIGKILL the process that shared its cache: the reader drops its mapping (which alone
    would keep the dead prefill's whole KV cache in memory) at its next step."""
    script = """
import time, msgspec, torch
from vllm_qaic_connector.transports.shm import move_into_shm
raw = torch.zeros(3 * 12 * 2 * 16 * 64, dtype=torch.float16)
layers = [t.view(12, 2, 16, 64) for t in raw.view(3, -1)]
print(msgspec.json.encode(move_into_shm(layers)).decode(), flush=True)
time.sleep(300)
"""
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    reader = DirectReader(CopyPool())
    try:
        cache = msgspec.json.decode(proc.stdout.readline(), type=SharedCache)
        reader.peer("p/0", cache, get_layout("vllm_cpu_vec"), GEO)
        reader.drop_dead()
        assert list(reader._caches) == ["p/0"]  # alive: kept
    finally:
        proc.kill()
        proc.wait()
    reader.drop_dead()
    assert not reader._caches
    reader.close()


def a_shm_cache() -> SharedCache:
    """What a prefill on this host advertises (its path is never opened here)."""
    return SharedCache(
        size=1, shape=(1,), strides=(1,), layer_offsets=(0,), path="/proc/1/fd/3",
        host=host_identity(),
    )  # fmt: skip


def test_direct_reads_need_one_tp_one_host_and_over_nixl_one_format():
    cache = a_shm_cache()
    prefill = rank_meta(cache=cache)
    decode = rank_meta(engine_id="dec", host=host_identity())
    assert direct_problem(prefill, decode, 1) is None
    assert "does not share" in str(direct_problem(rank_meta(), decode, 1))
    # Over shm the decode's copy converts: another block size or layout still reads directly.
    other_format = msgspec.structs.replace(decode, block_size=32, layout_kind="LBHNC")
    assert direct_problem(prefill, other_format, 1) is None
    assert "TP sizes differ" in str(direct_problem(prefill, decode, 2))
    other = msgspec.structs.replace(decode, host="another-boot|pid:[1]|0")
    assert "same host" in str(direct_problem(prefill, other, 1))
    assert "does not read" in str(direct_problem(prefill, rank_meta(engine_id="dec"), 1))
    nixl_decode = msgspec.structs.replace(decode, endpoint=TransportEndpoint("nixl", "a@0x1", 1))
    assert "transports differ" in str(direct_problem(prefill, nixl_decode, 1))
    # Over NIXL the host does not matter: READs cross hosts.
    nixl_cache = msgspec.structs.replace(cache, path="", host="", address=0x1000)
    nixl_prefill = msgspec.structs.replace(prefill, cache=nixl_cache, endpoint=nixl_decode.endpoint)
    assert direct_problem(nixl_prefill, msgspec.structs.replace(nixl_decode, host="x"), 1) is None
    nixl_other = msgspec.structs.replace(nixl_decode, block_size=32)
    assert "block sizes differ" in str(direct_problem(nixl_prefill, nixl_other, 1))


ON_A_GPU = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")]
ENDS = ["cpu-to-cpu"] + [
    pytest.param(ends, marks=ON_A_GPU) for ends in ("cuda-to-cuda", "cuda-to-cpu", "cpu-to-cuda")
]


@pytest.mark.nixl
@pytest.mark.parametrize("ends", ENDS)
@pytest.mark.parametrize("kind", ["vllm_cpu_vec", "LBHNC", "BLHNC", "mla_latent"])
def test_nixl_reads_the_blocks_out_of_the_registered_cache(kind, ends):
    """Two real NIXL agents: the prefill's cache registered, the decode's too, and one
    transfer of whole blocks (adjacent ones merged) from one into the other over UCX. A
    cross-layer cache (vLLM's own views) moves a block of every layer as one run. A cache
    in GPU memory (`pytest -m cuda`) is registered as VRAM, on either side."""
    import nixl  # noqa: F401  (NIXL missing is a failure, never a skip)

    layout, devices = get_layout(kind), ends.split("-to-")
    if kind == "BLHNC":
        gen = torch.Generator()
        prefill_layers, decode_layers = (vllm_kv_caches(kind, GEO, LAYERS, BLOCKS, gen, device)
                                         for device in devices)  # fmt: skip
    else:
        prefill_layers, decode_layers = (vllm_like_cache(kind, device)[1] for device in devices)
    gen = torch.Generator().manual_seed(3)
    for t in prefill_layers:
        t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
    src_blocks, dst_blocks = [7, 8, 9, 2, 0, 1, 11, 4, 5, 6], [0, 1, 2, 9, 3, 4, 5, 11, 7, 8]
    inc = new_incarnation()
    prefill = NixlTransport(staging_name("p", 0, inc), 1 << 16)
    decode = NixlTransport(staging_name("d", 0, inc), 1 << 16)
    try:
        cache = prefill.share_kv_cache(prefill_layers, True)
        assert cache is not None and decode.share_kv_cache(decode_layers, False) is not None
        assert cache.device == prefill_layers[0].get_device()  # -1: host memory
        runs = plan_cache_reads(cache, layout, decode_layers, (src_blocks, dst_blocks))
        # 6 runs of blocks adjacent on both sides, per layer (K and V share a block in both);
        # cross-layer, the layers of those blocks are one run too
        assert len(runs) == 6 * (1 if kind == "BLHNC" else LAYERS)
        decode.read_into(cache_endpoint(prefill.endpoint(), cache), runs)
    finally:
        decode.close()
        prefill.close()
    for s, d in zip(prefill_layers, decode_layers, strict=True):
        want = gather_tokens(layout.kv_views(s, GEO), src_blocks, TOKENS)
        got = gather_tokens(layout.kv_views(d, GEO), dst_blocks, TOKENS)
        assert all(torch.equal(w.cpu(), g.cpu()) for w, g in zip(want, got, strict=True))


BS = 16


@pytest.fixture
def direct_pair():
    """A prefill scheduler whose rank shares its cache, and a decode on this host that
    answers its handshake with the same format."""
    decode = make_scheduler("kv_consumer", BS, engine_id="dec")
    decode.connector.scheduler.set_rank_metadata([rank_meta(engine_id="dec", host=host_identity())])
    prefill = make_scheduler("kv_producer", BS, {"lease_s": 60.0})
    cache = a_shm_cache()
    prefill.connector.scheduler.set_rank_metadata([rank_meta(cache=cache)])
    yield prefill, decode.connector.scheduler._server.port
    prefill.connector.shutdown()
    decode.connector.shutdown()


def run_until_saved(prefill, rid: str, port: int, num_tokens: int = 70):
    prefill.add_request(
        make_request(
            rid,
            num_tokens,
            {"do_remote_decode": True, "decode_host": "127.0.0.1", "decode_port": port},
        )
    )
    for _ in range(500):  # the request waits for the handshake, then runs
        out, outputs = step(prefill)
        if meta(out).saves:
            return meta(out).saves[0], params_of(outputs, rid)
        time.sleep(0.01)
    raise AssertionError("never saved")


def test_a_direct_handoff_holds_its_blocks_until_the_ticket_is_released(direct_pair):
    prefill, port = direct_pair
    free_before = free_blocks(prefill)
    spec, params = run_until_saved(prefill, "d1", port)
    assert spec.direct and list(params["block_ids"]) == spec.block_ids[0]
    assert len(params["block_ids"]) == 5
    pool = prefill.connector.scheduler.pool
    assert pool.pages_in_use == 1  # the ticket's header, no KV
    out, _ = step(prefill)
    assert free_blocks(prefill) < free_before  # held for the decode
    assert meta(out).release_direct == []
    side_channel.call("127.0.0.1", prefill.connector.scheduler._server.port,
                      ReleaseRequest(["d1"]), None, 5)  # fmt: skip
    out, _ = step(prefill)
    # The worker invalidates the ticket in this step, then reports the request finished.
    assert meta(out).release_direct == ["d1"] and spec.staging_offset in meta(out).invalidate
    assert free_blocks(prefill) < free_before
    step(prefill, KVConnectorOutput(finished_sending={"d1"}))
    assert free_blocks(prefill) == free_before


def test_an_expired_direct_lease_gives_its_blocks_back(direct_pair):
    prefill, port = direct_pair
    free_before = free_blocks(prefill)
    spec, _ = run_until_saved(prefill, "d2", port)
    assert spec.direct
    step(prefill)
    prefill.connector.scheduler.pool.expire(now=time.monotonic() + 61)
    out, _ = step(prefill)
    assert meta(out).release_direct == ["d2"] and spec.staging_offset in meta(out).invalidate
    step(prefill, KVConnectorOutput(finished_sending={"d2"}))
    assert free_blocks(prefill) == free_before


def test_a_decode_on_another_host_gets_staged_kv(direct_pair):
    prefill, _ = direct_pair
    elsewhere = rank_meta(engine_id="dec", host="another-boot|pid:[1]|0")
    server = side_channel.SideChannelServer(
        "127.0.0.1", 0, lambda _msg: HandshakeReply(PROTOCOL_VERSION, [elsewhere]), None
    )
    try:
        spec, params = run_until_saved(prefill, "s1", server.port)
        assert not spec.direct and not params.get("block_ids")
    finally:
        server.close()


def test_past_half_the_kv_cache_held_for_decodes_requests_stage(direct_pair):
    """Held blocks shrink the prefill's cache (64 blocks here): direct handoffs stop at 32
    blocks held, and the next request stages, so no backlog of slow decodes starves it."""
    prefill, port = direct_pair
    kinds = []
    for i in range(8):
        spec, _ = run_until_saved(prefill, f"h{i}", port)
        step(prefill)  # finished: its blocks are held if it went direct
        kinds.append(spec.direct)
    assert kinds == [True] * 6 + [False] * 2  # 6 x 5 blocks held; a 7th would pass 32
