"""What a worker rank learns once, at start-up: who it is (`RankIdentity`, from vLLM's
config), the KV cache vLLM registered with it (`LocalCache`), and what its handshake tells
peers about both."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from vllm_qaic_connector.kv.kv_groups import (
    KVGroup,
    in_layer_order,
    layer_groups,
    layer_starts,
    ordered_layers,
)
from vllm_qaic_connector.kv.layout_probe import resolved_layout
from vllm_qaic_connector.kv.recurrent_state import RecurrentState
from vllm_qaic_connector.kv.staging_format import StagingFormat
from vllm_qaic_connector.layout import KV, KVGeometry, KVLayout
from vllm_qaic_connector.logs import get_logger
from vllm_qaic_connector.model_weights import checkpoint_fingerprint, checkpoint_folder, kv_settings
from vllm_qaic_connector.protocol.wire import (
    RankMetadata,
    SharedCache,
    TransportEndpoint,
    compat_hash,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = get_logger(__name__)


@dataclass(frozen=True)
class RankIdentity:
    """Who this worker is; everything the handshake says besides the layout."""

    engine_id: str
    tp_rank: int
    tp_size: int
    total_kv_heads: int
    model: str
    weights: str = ""  # model_weights.checkpoint_fingerprint ("": none on this host)
    produces: bool = True  # stages KV for others (kv_producer, kv_both)
    ssm_groups: int | None = None  # Mamba2's B/C groups in the model (None: unknown)
    drafter: str = ""  # the speculative drafter's method and weights ("": none)


@dataclass(frozen=True)
class LocalCache:
    """The registered KV cache: what saves read and loads write."""

    layout: KVLayout
    geometry: KVGeometry
    layers: list[KV]  # each attention layer's canonical K and V views
    tensors: list[torch.Tensor]  # physical, as vLLM registered them
    layer_groups: tuple[int, ...]  # each layer's KV cache group
    state: RecurrentState | None = None  # Mamba layers' state, if the model has any
    names: tuple[str, ...] = ()  # each layer's name in vLLM, in the order peers share

    @property
    def device(self) -> torch.device:
        return self.tensors[0].device if self.tensors else torch.device("cpu")

    def group(self, layer: int) -> int:
        return self.layer_groups[layer]

    def staging_format(
        self,
        kind: str,
        geometry: KVGeometry,
        group_starts: tuple[int, ...],
        tp: tuple[int, int] | None = None,
    ) -> StagingFormat:
        """A staged request's format, of this cache's layers (a peer's count is the same:
        the handshake checks it); ``group_starts``: its first staged token per group;
        ``tp``: (size, rank) of the rank that staged it, if not this one."""
        firsts = layer_starts(group_starts, self.layer_groups)
        state = self.state.nbytes(*(tp or (None, None))) if self.state else 0
        return StagingFormat(kind, geometry, len(self.layers), firsts, state)


SSM_GROUP_KEYS = ("mamba_n_groups", "n_groups", "mamba_ngroups")  # spellings in HF configs


def weights_fingerprint(vllm_config: VllmConfig, model_cfg: Any = None) -> str:
    """The fingerprint of the checkpoint this engine loaded (model_weights.py), or of
    ``model_cfg``'s (a drafter's); "" for dummy weights or a checkpoint not on this host."""
    model_cfg, load = model_cfg or vllm_config.model_config, vllm_config.load_config
    folder = checkpoint_folder(str(model_cfg.model), model_cfg.revision, load.download_dir)
    if folder is None or load.load_format == "dummy":
        return ""
    started = time.monotonic()
    settings = kv_settings(
        model_cfg.quantization, model_cfg.hf_text_config, model_cfg.max_model_len
    )
    fingerprint = checkpoint_fingerprint(folder, settings)
    logger.info(
        "QAICConnector: weights fingerprint %s of %s (%.0f ms)",
        fingerprint or "(no weights files)", folder, 1e3 * (time.monotonic() - started),
    )  # fmt: skip
    return fingerprint


def drafter_of(vllm_config: VllmConfig) -> str:
    """The speculative drafter whose KV layers this engine keeps: its method and weights
    ("": none, or one that keeps no KV, such as n-gram lookup)."""
    spec = vllm_config.speculative_config
    draft = getattr(spec, "draft_model_config", None)
    if spec is None or draft is None or draft is spec.target_model_config:
        return ""  # none, or one drafting from the target alone (n-gram, suffix): no KV
    return f"{spec.method}:{weights_fingerprint(vllm_config, draft) or draft.model}"


def rank_of(vllm_config: VllmConfig) -> RankIdentity:
    """This rank's identity."""
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    ktc = vllm_config.kv_transfer_config
    assert ktc is not None
    model_cfg = vllm_config.model_config
    hf = model_cfg.hf_text_config
    return RankIdentity(
        engine_id=str(ktc.engine_id),
        tp_rank=get_tensor_model_parallel_rank(),
        tp_size=vllm_config.parallel_config.tensor_parallel_size,
        total_kv_heads=1 if model_cfg.use_mla else model_cfg.get_total_num_kv_heads(),
        model=str(model_cfg.model).rstrip("/").rsplit("/", 1)[-1],
        weights=weights_fingerprint(vllm_config),
        produces=bool(ktc.is_kv_producer),
        drafter=drafter_of(vllm_config),
        ssm_groups=next(
            (v for k in SSM_GROUP_KEYS if isinstance(v := getattr(hf, k, None), int)), None
        ),
    )


def local_cache(
    kv_caches: dict[str, torch.Tensor],
    identity: RankIdentity,
    geometry: KVGeometry,
    groups: tuple[KVGroup, ...],
    layer_modules: dict[str, Any],
    layout: KVLayout | None = None,
    verify_cpu_layout: bool = True,
    layout_name: str | None = None,
) -> LocalCache:
    """The registered caches in layer order, their layout (``layout``, else the one vLLM
    resolved, ``layout_name``) and, for Mamba layers, their recurrent state. Only the
    groups' layers: vLLM also registers each layer that reads another's KV
    (``kv_sharing_target_layer_name``) under its own name, its target's cache again."""
    state_names = ordered_layers(groups, state=True)
    names = ordered_layers(groups) or in_layer_order(set(kv_caches) - set(state_names))
    if shared := sorted(set(kv_caches) - set(names) - set(state_names)):
        logger.info("QAICConnector: %s read other layers' KV; not moved twice", shared)
    tensors = [kv_caches[n] for n in names]
    layout = layout or resolved_layout(layout_name, geometry, verify_cpu_layout)
    for name, t in zip(names, tensors, strict=True):  # a cache we cannot read: say so
        want = layout.physical_shape(t.shape[layout.block_dim], geometry)
        if t.numel() != math.prod(want):
            raise ValueError(
                f"QAICConnector: layer {name}'s KV cache has shape {tuple(t.shape)}, not the "
                f"{want} of layout {layout.kind} for {geometry}"
            )
    state = None
    if state_names:
        state = RecurrentState.of_layers(
            state_names, kv_caches, layer_modules, layer_groups(groups, state_names),
            identity.ssm_groups, identity.tp_size, identity.tp_rank,
        )  # fmt: skip
    return LocalCache(
        layout, geometry, [layout.kv_views(t, geometry) for t in tensors], tensors,
        layer_groups(groups, names), state, tuple(names),
    )  # fmt: skip


def rank_metadata(
    identity: RankIdentity,
    incarnation: str,
    cache: LocalCache,
    groups: tuple[KVGroup, ...],
    endpoint: TransportEndpoint,
    shared: SharedCache | None,
    host: str,
) -> RankMetadata:
    """What this rank's handshake says."""
    geo, tensors = cache.geometry, cache.tensors
    total_heads = identity.total_kv_heads
    windows = tuple(groups[g].window for g in cache.layer_groups) if groups else ()
    states = cache.state.signature() if cache.state else ()
    return RankMetadata(
        engine_id=identity.engine_id,
        tp_rank=identity.tp_rank,
        tp_size=identity.tp_size,
        layout_kind=cache.layout.kind,
        block_size=geo.block_size,
        num_blocks=tensors[0].shape[cache.layout.block_dim],
        num_kv_heads=total_heads,
        head_size=geo.head_size,
        dtype=str(geo.dtype).removeprefix("torch."),
        num_layers=len(tensors),
        model=identity.model,
        weights=identity.weights,
        compat_hash=compat_hash(len(tensors), total_heads, geo.head_size, windows, states),
        endpoint=endpoint,
        incarnation=incarnation,
        cache=shared,
        host=host,
        layers=cache.names,
        drafter=identity.drafter,
    )
