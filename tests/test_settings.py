"""Settings as typed values: ``AllocatorConfig`` is parsed once at the edge
(a config string, ``WATERWAVE_ALLOC_CONF``, keyword arguments), checks every
value in one setter whichever way it came, and travels as a value."""
import pickle

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

import waterwave as ww
from conftest import make
from waterwave import _C

MiB = 1024**2


def test_string_and_keywords_make_the_same_config():
    text = ww.AllocatorConfig("max_split_size_mb:200,roundup_power2_divisions:[256:1,>:4],"
                              "expandable_segments:True,per_process_memory_fraction:0.5")
    typed = ww.AllocatorConfig(max_split_size_mb=200, roundup_power2_divisions={256: 1, ">": 4},
                               expandable_segments=True, per_process_memory_fraction=0.5)
    assert text == typed
    assert typed.max_split_size == 200 * MiB and typed.expandable_segments
    assert typed.per_process_memory_fraction == 0.5
    assert typed.roundup_power2_divisions == [1] * 9 + [4] * 7
    assert ww.AllocatorConfig().max_split_size is None  # no limit


def test_keywords_apply_on_top_of_the_string_and_replace_copies():
    base = ww.AllocatorConfig("max_split_size_mb:200", max_split_size_mb=64)
    assert base.max_split_size == 64 * MiB
    wider = base.replace(large_segment_size_mb=32)
    assert wider.large_segment_size == 32 * MiB and base.large_segment_size == 20 * MiB


@pytest.mark.parametrize("settings, message", [
    ({"max_split_size_mb": "200"}, "takes a whole number"),
    ({"max_split_size_mb": True}, "takes a whole number"),
    ({"max_split_size_mb": -1}, "must not be negative"),
    ({"max_split_size_mb": 1 << 70}, "too large"),
    ({"max_split_size_mb": (1 << 64) // MiB}, "too large"),
    ({"expandable_segments": 1}, "True or False"),
    ({"per_process_memory_fraction": "half"}, "takes a number"),
    ({"per_process_memory_fraction": 1.5}, "[0.0, 1.0]"),
    ({"roundup_power2_divisions": {256: 3}}, "power of 2"),
    ({"roundup_power2_divisions": "[256:1]"}, "an int or a mapping"),
    ({"max_split_size_mb": 5}, "too small"),
    ({"max_split": 200}, "unrecognized keyword 'max_split'"),
])
def test_a_bad_keyword_is_a_clear_error_and_changes_nothing(settings, message):
    base = ww.AllocatorConfig("max_split_size_mb:100")
    with pytest.raises(ww.ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")
                       .replace("(", r"\(").replace(")", r"\)")):
        base.replace(**settings)
    assert base == ww.AllocatorConfig("max_split_size_mb:100")


def test_sizes_from_a_string_are_overflow_checked():
    with pytest.raises(ww.ConfigError, match="too large"):
        ww.AllocatorConfig("max_split_size_mb:17592186044416")  # 2**44 MiB: 2**64 bytes


def test_the_config_is_a_value():
    c = ww.AllocatorConfig("max_split_size_mb:200,expandable_segments:True")
    assert ww.AllocatorConfig(str(c)) == c
    assert eval(repr(c), {"AllocatorConfig": ww.AllocatorConfig}) == c
    assert pickle.loads(pickle.dumps(c)) == c
    assert c.round_size(MiB + 1) == _C.round_size(MiB + 1, c)


def test_the_environment_names_the_policy_and_the_config(monkeypatch):
    assert _C.parse_settings("policy:pytorch,max_split_size_mb:200") == (
        "pytorch", ww.AllocatorConfig(max_split_size_mb=200))
    with pytest.raises(ww.ConfigError, match="unknown allocator policy 'tlsf'"):
        _C.parse_settings("policy:tlsf")
    with pytest.raises(ww.ConfigError, match="unrecognized key 'policy'"):
        ww.AllocatorConfig("policy:pytorch")  # PYTORCH_CUDA_ALLOC_CONF has no policy key
    monkeypatch.setenv("WATERWAVE_ALLOC_CONF", "policy:pytorch,expandable_segments:True")
    a = ww.Allocator(max_split_size_mb=64)  # keywords on top of the environment's settings
    assert a.policy == "pytorch" and a.config.expandable_segments
    assert a.config.max_split_size == 64 * MiB


def test_an_allocator_takes_a_config_value():
    c = ww.AllocatorConfig(max_split_size_mb=64)
    a = ww.Allocator("waterwave", config=c)
    assert a.config == c and a.stats()["max_split_size"] == 64 * MiB


KEYS = ["max_split_size_mb", "max_non_split_rounding_mb", "large_segment_size_mb",
        "roundup_power2_divisions", "garbage_collection_threshold", "per_process_memory_fraction",
        "expandable_segments", "release_lock_on_cudamalloc", "policy", "bogus"]
TOKENS = st.sampled_from(KEYS + [":", ",", "[", "]", ">", " ", "True", "False", "0", "1", "4",
                                 "12", "64", "256", "0.5", "1.5", "-3", "1e400", "99999999999999999999"])


@given(st.lists(TOKENS, max_size=24).map("".join))
@example("max_split_size_mb:64,roundup_power2_divisions:[64:8,>:4],expandable_segments:True")
@example("large_segment_size_mb:64")  # its canonical form once wrote the default non-split floor
def test_any_string_parses_to_a_canonical_config_or_is_a_config_error(text):
    try:
        c = ww.AllocatorConfig(text)
    except ww.ConfigError:
        return
    assert ww.AllocatorConfig(str(c)) == c  # the canonical form parses back to the same


VALUES = st.one_of(st.none(), st.booleans(), st.integers(-2, 1 << 66), st.floats(allow_nan=True),
                   st.text(max_size=4), st.dictionaries(st.sampled_from([1, 64, ">"]),
                                                        st.integers(-1, 16), max_size=3))


@given(st.dictionaries(st.sampled_from(KEYS[:8] + ["bogus"]), VALUES, max_size=4))
def test_any_keywords_make_a_config_or_a_config_error_and_change_nothing(settings):
    base = ww.AllocatorConfig()
    try:
        c = base.replace(**settings)
    except ww.ConfigError:
        assert base == ww.AllocatorConfig()
        return
    assert ww.AllocatorConfig(str(c)) == c


@given(total_mib=st.integers(10, 144 * 1024), data=st.data())
@example(total_mib=79 * 1024, data=None)  # 646 MiB of 79 GiB: limit / total allows a byte less
def test_fraction_allowing_gives_an_allocator_exactly_the_limit(total_mib, data):
    # Limits of whole 2 MiB pages from 10 MiB, which the allocator takes as
    # one segment of their size.
    total = total_mib * MiB
    limit = (646 if data is None else 2 * data.draw(st.integers(5, total_mib // 2))) * MiB
    fraction = ww.alloc.fraction_allowing(limit, total)
    assert int(fraction * total) == limit
    a = make("pytorch", capacity=total, per_process_memory_fraction=fraction)
    a.alloc(limit)
    with pytest.raises(ww.OutOfMemoryError):
        a.alloc(2 * MiB)


@pytest.mark.parametrize("limit, total", [(0, MiB), (-1, MiB), (2 * MiB, MiB)])
def test_fraction_allowing_refuses_a_limit_outside_the_device(limit, total):
    with pytest.raises(ValueError, match="not within the device's"):
        ww.alloc.fraction_allowing(limit, total)
