"""QAIC KV buffer names: prefix rules, and matching (table-driven)."""

from __future__ import annotations

import pytest

from vllm_qaic_connector.qaic.buffers import (
    kv_buffer_regex,
    parse_kv_name,
    validate_prefix,
)

VISION = [
    "vision_embeds",
    "vision_embeds_RetainedState",
    "pixel_values",
    "image_idx",
    "image_idx_output",
    "deepstack_features",
    "input_ids",
    "position_ids",
    "batch_index",
    "logits",
]


@pytest.mark.parametrize("prefix", [None, "P", "a", "ab", "vllmKvCache", "0", "A1b2"])
def test_valid_prefixes_pass_unchanged(prefix):
    assert validate_prefix(prefix) == prefix


@pytest.mark.parametrize("bad", ["", "a-b", "a_b", "ä", "a b", "a\n", "a.b", "a/b", "٣", " a"])
def test_invalid_prefix_is_refused_naming_it(bad):
    with pytest.raises(ValueError, match="invalid kv_cache_prefix") as err:
        validate_prefix(bad)
    assert repr(bad) in str(err.value)
    with pytest.raises(ValueError, match="invalid kv_cache_prefix"):
        kv_buffer_regex(bad)  # the selection refuses it the same way


def test_non_string_prefix_is_a_type_error():
    with pytest.raises(TypeError, match="kv_cache_prefix must be a string or None, got int"):
        validate_prefix(7)  # type: ignore[arg-type]


# (name, prefix, expected (layer, kind, suffix) or None)
MATCH_TABLE = [
    ("past_key.0", None, (0, "key", "")),
    ("past_value.1_RetainedState", None, (1, "value", "_RetainedState")),
    ("past_key.10_InternalRetainedState", None, (10, "key", "_InternalRetainedState")),
    ("past_key.0_P", None, None),  # a prefixed name is not selected without a prefix
    ("past_key.0_P_RetainedState", None, None),
    ("past_key.0", "P", None),  # an unprefixed name is not selected with a prefix
    ("past_key.0_RetainedState", "P", None),
    ("past_key.0_P", "P", (0, "key", "")),
    ("past_key.10_P", "P", (10, "key", "")),
    ("past_value.1_P_RetainedState", "P", (1, "value", "_RetainedState")),
    ("past_value.1_P_InternalRetainedState", "P", (1, "value", "_InternalRetainedState")),
    ("past_key.0_p", "P", None),  # case-sensitive prefix
    ("PAST_KEY.0_P", "P", None),
    ("Past_key.0_P", "P", None),
    ("past_key.0_P_retainedstate", "P", None),
    ("past_key.1_P_RetainedStateX", "P", None),
    ("past_key.1_P_RetainedState_", "P", None),
    ("past_key.1_P_", "P", None),
    ("past_key.1_PP", "P", None),
    ("past_keys.1_P", "P", None),
    ("past_keys.1", None, None),
    ("past_key1", None, None),
    ("past_key.", None, None),
    ("past_key.-1", None, None),
    ("past_key.1.0", None, None),
    ("past_key.٣", None, None),  # a non-ASCII digit is not a layer index
    ("past_key.1\n", None, None),
    ("xpast_key.1", None, None),
    ("past_key.1_RetainedState_RetainedState", None, None),
    ("past_key.0_a", "a", (0, "key", "")),
    ("past_key.0_ab", "a", None),  # prefix "a" is a substring of "ab"
    ("past_key.0_ab", "ab", (0, "key", "")),
    ("past_key.0_a", "ab", None),
    ("past_key.0_ba", "a", None),
    ("past_key.0_a_b", "a", None),
    ("past_key.0_a_RetainedState", "ab", None),
    ("past_key.0_ab_RetainedState", "a", None),
    *[(name, None, None) for name in VISION],
    *[(name, "P", None) for name in VISION],
]


@pytest.mark.parametrize("name, prefix, want", MATCH_TABLE)
def test_regex_selects_exactly_the_kv_names(name, prefix, want):
    pattern = kv_buffer_regex(prefix)
    parsed = parse_kv_name(name, pattern)
    assert (tuple(parsed) if parsed else None) == want
    # match/search/fullmatch agree: the pattern is anchored on both ends.
    assert (pattern.match(name) is None) == (pattern.search(name) is None) == (want is None)


def test_layer_index_with_leading_zero_is_refused():
    with pytest.raises(ValueError, match="non-canonical layer index"):
        parse_kv_name("past_key.01", kv_buffer_regex(None))
    assert parse_kv_name("past_key.10", kv_buffer_regex(None)) == (10, "key", "")
