"""One valid handshake rank of the shipped model, for every test that needs one."""

from __future__ import annotations

from typing import Any

from testbed.shipped_model import TINY
from vllm_qaic_connector.protocol.wire import RankMetadata, TransportEndpoint, compat_hash
from vllm_qaic_connector.transports import staging_name


def rank_meta(**over: Any) -> RankMetadata:
    """``over`` replaces fields; the compatibility hash follows the model fields, and the
    endpoint is the segment the rank's engine, rank and incarnation imply, unless given."""
    fields: dict[str, Any] = dict(
        engine_id="eng",
        tp_rank=0,
        tp_size=1,
        layout_kind="vllm_cpu_vec",
        block_size=16,
        num_blocks=64,
        num_kv_heads=TINY.kv_heads,
        head_size=TINY.head_size,
        dtype=TINY.dtype,
        num_layers=TINY.layers,
        model=TINY.name,
        incarnation="feedfacefeedface",
    )
    fields.update(over)
    fields.setdefault(
        "compat_hash",
        compat_hash(
            fields["num_layers"],
            fields["num_kv_heads"],
            fields["head_size"],
        ),
    )
    fields.setdefault(
        "endpoint",
        TransportEndpoint(
            "shm",
            staging_name(fields["engine_id"], fields["tp_rank"], fields["incarnation"]),
            1 << 20,
        ),
    )
    return RankMetadata(**fields)
