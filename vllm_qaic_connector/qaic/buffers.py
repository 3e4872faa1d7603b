"""QAIC KV buffer names: prefix validation and selection by regex.

A QAIC decode program keeps each layer's KV in retained-state buffers named
``past_key.{i}`` / ``past_value.{i}``. The output side is ``..._RetainedState``, or
``..._InternalRetainedState`` in programs exported with ONNX subfunctions (layer split).
QEfficient's ``kv_cache_prefix`` P inserts ``_P`` after the layer index so a connector can
select the LLM's KV and never touch vision/multimodal buffers (``vision_embeds_RetainedState``,
``pixel_values``, ...). Pure: no I/O, no vLLM.

Rules (docs/design.md, "The QAIC decode target"):

* A prefix is ASCII letters and digits only, at least one character.
* With a prefix P, only ``past_{key,value}.{i}_P[_RetainedState|_InternalRetainedState]``
  is KV; unprefixed KV names are *not* selected (they may belong to another model in the
  same program). Without a prefix, only unprefixed names are KV.
* Matching is exact and case-sensitive: ``past_key.1`` never matches ``past_key.10``,
  P="a" never matches ``_ab``, ``PAST_KEY.0`` is not KV, and no trailing text is allowed.
"""

from __future__ import annotations

import re
from typing import NamedTuple

_PREFIX_RE = re.compile(r"[A-Za-z0-9]+", re.ASCII)


def validate_prefix(prefix: str | None) -> str | None:
    """Return ``prefix`` unchanged if valid (None means "no prefix"), else raise ValueError
    (TypeError where it is not a string)."""
    if not isinstance(prefix, str | None):  # named: it comes from an operator's config
        raise TypeError(f"kv_cache_prefix must be a string or None, got {type(prefix).__name__}")
    # fullmatch + ASCII: "a\n" (a `$` loophole) and "ä" (str.isalnum loophole) are refused.
    if prefix is not None and not _PREFIX_RE.fullmatch(prefix):
        raise ValueError(
            f"invalid kv_cache_prefix {prefix!r}: must be one or more ASCII letters or digits "
            "(no '_', '-', spaces or other characters), as in QEfficient's kv_cache_prefix"
        )
    return prefix


def kv_buffer_regex(prefix: str | None) -> re.Pattern[str]:
    """The one regex that selects KV buffers for ``prefix``.

    Groups: ``kind`` (key|value), ``layer`` (digits), ``suffix`` (retained-state suffix or
    None). Anchored with ``\\A``/``\\Z`` so ``match``, ``fullmatch`` and ``search`` agree
    and a trailing newline never slips through.
    """
    prefix = validate_prefix(prefix)
    infix = "" if prefix is None else "_" + re.escape(prefix)
    return re.compile(
        rf"\Apast_(?P<kind>key|value)\.(?P<layer>[0-9]+){infix}"
        r"(?P<suffix>_RetainedState|_InternalRetainedState)?\Z"
    )


class KVName(NamedTuple):
    layer: int
    kind: str  # "key" | "value"
    suffix: str  # "", "_RetainedState" or "_InternalRetainedState"


def parse_kv_name(name: str, pattern: re.Pattern[str]) -> KVName | None:
    """Parse ``name`` with a ``kv_buffer_regex`` pattern; None if it is not KV.

    A layer index with leading zeros (``past_key.01``) raises ValueError: it would alias
    ``past_key.1`` and nothing emits it, so it is a broken program, not a non-KV buffer.
    """
    if (m := pattern.fullmatch(name)) is None:
        return None
    digits = m["layer"]
    if len(digits) > 1 and digits[0] == "0":
        raise ValueError(f"KV buffer {name!r} has a non-canonical layer index {digits!r}")
    return KVName(int(digits), m["kind"], m["suffix"] or "")
