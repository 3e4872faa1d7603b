import pytest
from hypothesis import given
from hypothesis import strategies as st

from vllm_qaic_connector.kv.tp_mapping import head_sources, heads_of_rank


@pytest.mark.parametrize(
    "total,src_tp,dst_tp",
    [(8, 2, 1), (8, 4, 1), (8, 4, 2), (8, 1, 2), (2, 4, 1), (2, 4, 2), (1, 2, 1), (2, 1, 4)],
)
def test_every_needed_head_read_exactly_once(total, src_tp, dst_tp):
    for dst in range(dst_tp):
        want = list(heads_of_rank(total, dst_tp, dst))
        got = []
        for src, h in head_sources(total, src_tp, dst_tp, dst).items():
            have = heads_of_rank(total, src_tp, src)
            got += [have.start + i for i in range(h.start, h.stop)]
            assert list(range(h.dst_start, h.dst_start + h.stop - h.start)) == [
                g - want[0] for g in got[-(h.stop - h.start) :]
            ]
        assert got == want  # no head twice, none missing, in order


def test_gqa_replicated_head_is_read_from_one_rank():
    # 2 KV heads over prefill TP 4: ranks 0,1 hold head 0; ranks 2,3 hold head 1.
    srcs = head_sources(2, 4, 1, 0)
    assert list(srcs) == [0, 2]


def test_uneven_split_is_refused():
    with pytest.raises(ValueError, match="do not split"):
        heads_of_rank(6, 4, 0)


@given(st.sampled_from([1, 2, 4, 8]), st.sampled_from([1, 2, 4]), st.sampled_from([1, 2, 4]))
def test_sources_cover_decode_heads(total, src_tp, dst_tp):
    for dst in range(dst_tp):
        n = sum(h.stop - h.start for h in head_sources(total, src_tp, dst_tp, dst).values())
        assert n == len(heads_of_rank(total, dst_tp, dst))
