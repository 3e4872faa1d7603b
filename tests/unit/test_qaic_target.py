"""The QAIC decode target in host shm: slot writes touch only their slot, over real segments."""

from __future__ import annotations

import itertools
import os
import uuid
from collections.abc import Iterable, Iterator
from contextlib import closing

import msgspec
import pytest
import torch

from testbed.shm_objects import segments
from vllm_qaic_connector.kv.staging_format import StagingFormat
from vllm_qaic_connector.kv.token_copies import gather_tokens
from vllm_qaic_connector.layout import KVGeometry, get_layout
from vllm_qaic_connector.protocol.names import LAYOUT_KINDS
from vllm_qaic_connector.protocol.wire import CONVERTIBLE_DTYPES
from vllm_qaic_connector.qaic.target import BufferSpec, Manifest, SlotTarget, torch_dtype
from vllm_qaic_connector.transports.shm import SHM_DIR

H, CTX, D = 2, 16, 8
DT = torch.float16
NON_KV = [
    BufferSpec("vision_embeds_RetainedState", (4, 3, 8), "float16"),
    BufferSpec("pixel_values", (1, 3, 4, 4), "float32"),
    BufferSpec("image_idx", (1, 1), "int64"),
    BufferSpec("deepstack_features", (0, 5), "bfloat16"),  # empty buffers exist too
]


def kv_specs(
    layers: Iterable[int], prefix: str | None, suffix: str, slots: int
) -> list[BufferSpec]:
    infix = f"_{prefix}" if prefix else ""
    return [
        BufferSpec(f"past_{kind}.{i}{infix}{suffix}", (slots, H, CTX, D), "float16")
        for i in layers
        for kind in ("key", "value")
    ]


@pytest.fixture
def shm_prefix() -> Iterator[str]:
    """A unique segment-name prefix; after the test nothing with it may remain in /dev/shm."""
    prefix = f"qaic_kv_test_target_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    yield prefix
    assert _segments(prefix) == []


def _segments(prefix: str) -> list[str]:
    return sorted(segments(prefix))


def _randomize(target: SlotTarget, manifest: Manifest) -> None:
    """Random bytes everywhere, so "untouched" cannot be faked by zeros staying zeros."""
    gen = torch.Generator().manual_seed(0)
    for p, specs in enumerate(manifest.programs):
        for spec in specs:
            raw = target.buffer(p, spec.name).view(-1).view(torch.uint8)
            raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))


def _snapshot(target: SlotTarget, manifest: Manifest) -> dict[tuple[int, str], torch.Tensor]:
    return {
        (p, s.name): target.buffer(p, s.name).clone()
        for p, specs in enumerate(manifest.programs)
        for s in specs
    }


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _request_kv(layers: int, tokens: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)

    def one() -> torch.Tensor:
        return torch.randn(H, tokens, D, generator=gen).to(DT)

    return [(one(), one()) for _ in range(layers)]


def _assert_only_slots_changed(target: SlotTarget, before: dict, written: dict[int, list]) -> None:
    """Every byte equals the snapshot, except tokens [0, n) of the written slots' KV."""
    want = {key: t.clone() for key, t in before.items()}
    key_of = {target.buffer(*key).data_ptr(): key for key in before if before[key].numel()}
    for slot, layer_kv in written.items():
        for layer, kv in enumerate(layer_kv):
            for dst, src in zip(target.kv(layer), kv, strict=True):
                want[key_of[dst.data_ptr()]][slot, :, : src.shape[1]] = src
    for key, t in want.items():
        assert _same_bytes(target.buffer(*key), t), f"buffer {key} differs"


def _fill_all(target: SlotTarget, n: int, seed: int) -> dict[int, list]:
    written = {}
    for _ in range(target.num_slots):
        slot = target.allocate_slot()
        written[slot] = _request_kv(target.num_layers, n, seed + slot)
        _write_slot(target, slot, written[slot], n)
    return written


def test_writing_slot_k_touches_nothing_else(shm_prefix):
    m = Manifest([[*NON_KV[:2], *kv_specs(range(2), "P", "_RetainedState", 4), *NON_KV[2:]]])
    with closing(SlotTarget(m, shm_prefix, "P")) as target:
        assert len(_segments(shm_prefix)) == len(m.programs[0])
        _randomize(target, m)
        before = _snapshot(target, m)
        assert [target.allocate_slot() for _ in range(3)] == [0, 1, 2]
        kv = _request_kv(2, 5, seed=1)
        nbytes = _write_slot(target, 2, kv, 5)
        assert nbytes == 2 * 2 * H * 5 * D * DT.itemsize
        _assert_only_slots_changed(target, before, {2: kv})
        k, v = target.kv(1)
        assert torch.equal(k[2, :, :5], kv[1][0]) and torch.equal(v[2, :, :5], kv[1][1])
        # Source longer than num_tokens: only the first num_tokens go in.
        _write_slot(target, 0, _request_kv(2, CTX, seed=2), 3)
        assert _same_bytes(
            target.kv(0)[0][0, :, 3:], before[(0, "past_key.0_P_RetainedState")][0, :, 3:]
        )


def test_refill_a_released_slot_without_touching_the_others(shm_prefix):
    m = Manifest([[*kv_specs(range(2), "P", "", 4), NON_KV[0]]])
    with closing(SlotTarget(m, shm_prefix, "P")) as target:
        written = _fill_all(target, 7, seed=10)
        before = _snapshot(target, m)
        target.release_slot(1)
        assert target.allocate_slot() == 1
        new = _request_kv(2, 12, seed=99)
        _write_slot(target, 1, new, 12)
        _assert_only_slots_changed(target, before, {1: new})
        assert set(written) == {0, 1, 2, 3}


def test_32_slot_batch_refills_4_freed_slots_and_sends_only_their_kv(shm_prefix):
    layers, slots = 3, 32
    m = Manifest([[NON_KV[0], *kv_specs(range(layers), "vllm", "_RetainedState", slots)]])
    with closing(SlotTarget(m, shm_prefix, "vllm")) as target:
        _fill_all(target, CTX, seed=0)
        with pytest.raises(RuntimeError, match="all 32 decode slots are in use"):
            target.allocate_slot()
        before = _snapshot(target, m)
        freed = [3, 9, 17, 30]
        for s in freed:
            target.release_slot(s)
        refilled = sorted(target.allocate_slot() for _ in freed)
        assert refilled == freed
        lengths = {3: 1, 9: 16, 17: 5, 30: 11}
        new = {s: _request_kv(layers, lengths[s], seed=100 + s) for s in refilled}
        total = sum(_write_slot(target, s, new[s], lengths[s]) for s in refilled)
        assert total == sum(layers * 2 * H * n * D * DT.itemsize for n in lengths.values())
        _assert_only_slots_changed(target, before, new)
        # The bytes that changed all lie in the 4 slots; the other 28 compare equal.
        for layer in range(layers):
            for now, name in zip(target.kv(layer), ("key", "value"), strict=True):
                old = before[(0, f"past_{name}.{layer}_vllm_RetainedState")]
                others = [s for s in range(slots) if s not in freed]
                assert _same_bytes(now[others], old[others])


def test_slot_and_token_errors(shm_prefix):
    m = Manifest([kv_specs(range(1), None, "", 4)])
    with closing(SlotTarget(m, shm_prefix, None)) as target:
        kv = _request_kv(1, 4, seed=0)
        for bad in (4, 32, -1):
            with pytest.raises(ValueError, match=rf"slot {bad} out of range \[0, 4\)"):
                _write_slot(target, bad, kv, 4)
            with pytest.raises(ValueError, match=rf"slot {bad} out of range \[0, 4\)"):
                target.release_slot(bad)
        with pytest.raises(ValueError, match="not allocated"):
            _write_slot(target, 0, kv, 4)
        with pytest.raises(ValueError, match="not allocated"):
            target.release_slot(0)
        slot = target.allocate_slot()
        target.release_slot(slot)
        with pytest.raises(ValueError, match="double release"):
            target.release_slot(slot)
        slot = target.allocate_slot()
        with pytest.raises(ValueError, match="num_tokens 17 outside"):
            _write_slot(target, slot, _request_kv(1, CTX + 1, seed=0), CTX + 1)
        with pytest.raises(ValueError, match="blocks of"):
            _write_slot(target, slot, kv, 5)  # source holds only 4 tokens
        with pytest.raises(ValueError, match="2 layers"):
            _write_slot(target, slot, kv * 2, 4)
        fp8 = [tuple(t.to(torch.float8_e4m3fn) for t in kv[0])]  # scaled values: no
        with pytest.raises(ValueError, match="float8_e4m3fn"):
            _write_slot(target, slot, fp8, 4)
        assert _write_slot(target, slot, kv, 0) == 0


def test_layer_split_over_two_programs(shm_prefix):
    p0 = [
        BufferSpec("position_ids", (4, 1), "int64"),
        *kv_specs(range(0, 1), "P", "_RetainedState", 4),
    ]
    p1 = [*kv_specs(range(1, 2), "P", "_RetainedState", 4), NON_KV[0]]
    m = Manifest([p0, p1])
    refs = m.kv_buffers("P")
    assert [(k.program, v.program) for k, v in refs] == [(0, 0), (1, 1)]
    with closing(SlotTarget(m, shm_prefix, "P")) as target:
        assert target.segment_names == [f"{shm_prefix}_p0_b{i}" for i in range(3)] + [
            f"{shm_prefix}_p1_b{i}" for i in range(3)
        ]
        _randomize(target, m)
        before = _snapshot(target, m)
        slot = target.allocate_slot()
        kv = _request_kv(2, 9, seed=5)
        _write_slot(target, slot, kv, 9)
        for layer, program in ((0, 0), (1, 1)):
            for kind, src in zip(("key", "value"), kv[layer], strict=True):
                buf = target.buffer(program, f"past_{kind}.{layer}_P_RetainedState")
                assert torch.equal(buf[slot, :, :9], src)
        _assert_only_slots_changed(target, before, {slot: kv})


def test_prefix_rule_on_internal_retained_state(shm_prefix):
    ours = kv_specs(range(2), "P", "_InternalRetainedState", 2)
    theirs = kv_specs(range(2), "PQ", "_InternalRetainedState", 2)  # "P" is a prefix of "PQ"
    bare = kv_specs(range(1), None, "_InternalRetainedState", 2)
    m = Manifest([[*theirs, *ours, *bare]])
    assert [k.spec.name for k, _ in m.kv_buffers("P")] == [
        "past_key.0_P_InternalRetainedState",
        "past_key.1_P_InternalRetainedState",
    ]
    assert [k.spec.name for k, _ in m.kv_buffers("PQ")][0] == "past_key.0_PQ_InternalRetainedState"
    assert [k.spec.name for k, _ in m.kv_buffers(None)] == ["past_key.0_InternalRetainedState"]
    with closing(SlotTarget(m, shm_prefix, "P")) as target:
        _randomize(target, m)
        before = _snapshot(target, m)
        slot = target.allocate_slot()
        kv = _request_kv(2, CTX, seed=3)
        _write_slot(target, slot, kv, CTX)
        _assert_only_slots_changed(target, before, {slot: kv})
        for spec in [*theirs, *bare]:
            assert _same_bytes(target.buffer(0, spec.name), before[(0, spec.name)])


def test_write_from_staged_blocks_in_another_layout(shm_prefix):
    """The decode path: a staged region (vLLM CPU layout, block 4) -> slot, via copy_layers."""
    geo = KVGeometry(num_heads=H, head_size=D, block_size=4, dtype=DT)
    fmt = StagingFormat("vllm_cpu_vec", geo, num_layers=2)
    n = 10
    region = torch.randint(0, 256, (fmt.request_bytes(n),), dtype=torch.uint8)
    region.view(DT).copy_(torch.randn(region.numel() // 2).to(DT))  # finite values
    views = fmt.layer_views(region, n)
    blocks = [0, 1, 2]
    m = Manifest([[*kv_specs(range(2), "P", "_RetainedState", 3), NON_KV[0]]])
    with closing(SlotTarget(m, shm_prefix, "P")) as target:
        _randomize(target, m)
        before = _snapshot(target, m)
        target.allocate_slot()
        slot = target.allocate_slot()  # slot 1: a write that ignores `slot` must show
        nbytes = target.write_slot_from_blocks(slot, views, blocks, n)
        assert nbytes == 2 * 2 * H * n * D * DT.itemsize
        want = [gather_tokens(v, blocks, n) for v in views]
        _assert_only_slots_changed(target, before, {slot: want})
        with pytest.raises(ValueError, match="blocks"):
            target.write_slot_from_blocks(slot, views, blocks[:2], n)
    assert get_layout("qaic_slot").physical_shape(3, KVGeometry(H, D, CTX, DT)) == (2, 3, H, CTX, D)


@pytest.mark.parametrize("layout", [k for k in LAYOUT_KINDS if k != "qaic_slot"])
@pytest.mark.parametrize(("staged", "program"), itertools.product(CONVERTIBLE_DTYPES, repeat=2))
def test_a_slot_write_converts_the_dtype_as_it_copies(layout, staged, program, shm_prefix):
    """Every staged layout and every pair of convertible dtypes (a bf16 vLLM prefill, a
    float16 program): the slot holds exactly torch's rounding of the staged values, and
    nothing outside the slot's tokens changes."""
    src_dt, n = torch_dtype(staged), 37
    geo = KVGeometry(num_heads=H, head_size=32, block_size=16, dtype=src_dt)  # amx tiles
    fmt = StagingFormat(layout, geo, num_layers=2)
    region = torch.zeros(fmt.request_bytes(n), dtype=torch.uint8)
    region.view(src_dt).copy_(torch.randn(region.numel() // src_dt.itemsize) * 30)
    views, blocks = fmt.layer_views(region, n), [2, 0, 1]
    specs = [BufferSpec(b.name, (3, H, 48, 32), program) for b in kv_specs(range(2), None, "", 3)]
    m = Manifest([specs])
    with closing(SlotTarget(m, shm_prefix, None)) as target:
        _randomize(target, m)
        before = _snapshot(target, m)
        target.allocate_slot()
        slot = target.allocate_slot()
        target.write_slot_from_blocks(slot, views, blocks, n)
        want = [tuple(t.to(target.dtype) for t in gather_tokens(v, blocks, n)) for v in views]
        _assert_only_slots_changed(target, before, {slot: want})


@pytest.mark.parametrize(
    "programs, match",
    [
        ([[*kv_specs(range(2), "P", "", 2)[:3]]], "missing for layer.*1 value"),
        ([kv_specs([0, 2], "P", "", 2)], "missing for layer.*1 key, 1 value"),
        ([[*kv_specs(range(1), "P", "", 2), *kv_specs(range(1), "P", "_RetainedState", 2)]],
         "layer 0 key is held twice"),
        ([kv_specs(range(1), "P", "", 2), kv_specs(range(1), "P", "_RetainedState", 2)],
         "held twice: program 0 .* and program 1"),
        ([[*kv_specs(range(1), "P", "", 2), BufferSpec("past_key.1_P", (2, H, CTX, 4), "float16"),
           BufferSpec("past_value.1_P", (2, H, CTX, 4), "float16")]], "is \\(2, 2, 16, 4\\)"),
        ([[BufferSpec("past_key.0_P", (2, H, CTX, D), "float32"),
           BufferSpec("past_value.0_P", (2, H, CTX, D), "float16")]], "float16"),
        ([[BufferSpec("past_key.0_P", (2, H, CTX), "float16"),
           BufferSpec("past_value.0_P", (2, H, CTX), "float16")]], r"not \[slots, H, ctx, D\]"),
        ([NON_KV, kv_specs(range(1), "Q", "", 2)], "no KV buffers match kv_cache_prefix 'P'"),
    ],
)  # fmt: skip
def test_manifest_refuses_ambiguous_or_incomplete_kv(programs, match, shm_prefix):
    m = Manifest(programs)
    with pytest.raises(ValueError, match=match):
        m.kv_buffers("P")
    with pytest.raises(ValueError, match=match):
        SlotTarget(m, shm_prefix, "P")  # refused before anything is allocated


def test_manifest_and_spec_validation_and_json_roundtrip():
    with pytest.raises(ValueError, match="more than once"):
        Manifest([[NON_KV[0], NON_KV[0]]])
    with pytest.raises(ValueError, match="unknown dtype"):
        BufferSpec("x", (1,), "float17")
    with pytest.raises(ValueError, match="bad shape"):
        BufferSpec("x", (1, -2), "float16")
    assert BufferSpec("x", [1, 2], "float16").shape == (1, 2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="invalid kv_cache_prefix"):
        Manifest([kv_specs(range(1), None, "", 2)]).kv_buffers("a_b")
    m = Manifest([[*kv_specs(range(1), "P", "", 2), *NON_KV]])
    data = msgspec.json.encode(m)
    assert msgspec.json.decode(data, type=Manifest) == m
    with pytest.raises(msgspec.ValidationError, match="unknown dtype"):
        msgspec.json.decode(data.replace(b'"int64"', b'"int65"'), type=Manifest)


def test_close_unlinks_everything_and_is_idempotent(shm_prefix):
    m = Manifest([[*kv_specs(range(2), "P", "", 2), *NON_KV]])
    target = SlotTarget(m, shm_prefix, "P")
    assert _segments(shm_prefix) == sorted(target.segment_names)
    assert len(_segments(shm_prefix)) == 8
    k, _ = target.kv(0)
    slot = target.allocate_slot()
    kv = _request_kv(2, 3, seed=0)
    _write_slot(target, slot, kv, 3)
    target.close()
    assert _segments(shm_prefix) == []
    target.close()
    # A view handed out before close stays valid (the mapping lives while it does).
    assert torch.equal(k[slot, :, :3], kv[0][0])
    with pytest.raises(RuntimeError, match="closed"):
        target.kv(0)
    with pytest.raises(RuntimeError, match="closed"):
        _write_slot(target, slot, kv, 3)


def test_failed_construction_leaves_nothing_behind(shm_prefix):
    m = Manifest([kv_specs(range(2), "P", "", 2)])
    clash = os.path.join(SHM_DIR, f"{shm_prefix}_p0_b2")
    os.close(os.open(clash, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600))
    try:
        with pytest.raises(FileExistsError):
            SlotTarget(m, shm_prefix, "P")
        assert _segments(shm_prefix) == [f"{shm_prefix}_p0_b2"]  # only the foreign file
    finally:
        os.unlink(clash)


def _write_slot(target, slot, layer_kv, n):
    """A request's per-layer K/V ``[heads, >=n, head_dim]`` as one block each, into ``slot``."""
    return target.write_slot_from_blocks(slot, [(k[None], v[None]) for k, v in layer_kv], [0], n)


def test_every_bf16_value_lands_in_a_float16_slot_exactly_where_float16_can_hold_it(shm_prefix):
    """All 65,536 bf16 bit patterns (NaNs apart) through the slot copy: float16 holds every
    bf16 value of its normal range (8 bits of mantissa in 11) exactly, so there the copy
    loses nothing; beyond 65504 a value is infinite, below 2**-14 rounded, as torch rounds."""
    values = (
        torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    )
    values = values[~values.isnan()]
    tokens = -(-values.numel() // (2 * D))  # a [1, 2, tokens, D] K (and V) holding them all
    k = torch.zeros(2 * tokens * D, dtype=torch.bfloat16)
    k[: values.numel()] = values
    k = k.view(1, 2, tokens, D)
    specs = [BufferSpec(f"past_{kv}.0", (1, 2, tokens, D), "float16") for kv in ("key", "value")]
    with closing(SlotTarget(Manifest([specs]), shm_prefix, None)) as target:
        slot = target.allocate_slot()
        target.write_slot_from_blocks(slot, [(k, k)], [0], tokens)
        got = target.kv(0)[0][slot].reshape(-1)[: values.numel()]
        assert torch.equal(got, values.to(torch.float16))  # torch's rounding, one pass
        size = values.float().abs()  # 65504 is no bf16 value: compared in float32
        normal = (size >= 2**-14) & (size <= 65504)
        assert torch.equal(got[normal].to(torch.bfloat16), values[normal])  # exact
        # 2 signs x 30 exponents (2**-14 .. 2**15) x 128 mantissas of 7 bits
        assert int(normal.sum()) == 2 * 30 * 128 and bool(got[size > 65504].isinf().all())
