"""Config strings follow PYTORCH_CUDA_ALLOC_CONF (docs/design/pytorch-policy.md, Config grammar)."""
import pytest

import waterwave as ww
from waterwave import _C

MiB = 1024**2


def roundup_table(text):
    canon = ww.parse_config(text)
    part = canon.split("roundup_power2_divisions:[")[1].split("]")[0]
    return [int(kv.split(":")[1]) for kv in part.split(",")]


@pytest.mark.parametrize(
    "text, table",
    [
        ("roundup_power2_divisions:[256:1,512:2,1024:4,>:8]", [1] * 9 + [2, 4] + [8] * 5),
        ("roundup_power2_divisions:[64:8,256:4,1024:4,>:1]",
         [8] * 7 + [0, 4, 0, 4] + [1] * 5),
        ("roundup_power2_divisions:[>:4]", [0] + [4] * 15),
        ("roundup_power2_divisions:[1:2,>:4]", [2] + [4] * 15),
        ("roundup_power2_divisions:4", [4] * 16),
        ("", [0] * 16),
    ],
)
def test_roundup_tables_match_pytorch(text, table):
    assert roundup_table(text) == table


@pytest.mark.parametrize(
    "text, message",
    [
        ("foo:1", "unrecognized key 'foo'"),
        ("max_split_size_mb:5", "max_split_size_mb too small, must be >= 20"),
        ("max_split_size_mb:abc", "needs a whole number"),
        ("max_split_size_mb", "expected ':' after key 'max_split_size_mb'"),
        ("max_split_size_mb:", "expected a value"),
        ("expandable_segments:true", "must be True or False"),
        ("roundup_power2_divisions:3", "must be a power of 2"),
        ("roundup_power2_divisions:[3:2]", "intervals must be powers of 2"),
        ("roundup_power2_divisions:[64:3]", "power of 2 or 0"),
        ("garbage_collection_threshold:1.5", "(0.0, 1.0)"),
        ("per_process_memory_fraction:2", "[0.0, 1.0]"),
        ("large_segment_size_mb:8", "must be > 10"),
        ("max_split_size_mb:200;expandable_segments:True", "whole number"),
        ("max_split_size_mb:200 max_non_split_rounding_mb:30", "expected ','"),
    ],
)
def test_bad_config_is_a_clear_value_error(text, message):
    with pytest.raises(ValueError) as err:
        ww.parse_config(text)
    assert isinstance(err.value, ww.ConfigError)
    assert message in str(err.value)


def test_expandable_segments_round_trip_and_reach_the_allocator():
    canon = ww.parse_config("expandable_segments:True")
    assert "expandable_segments:True" in canon and ww.parse_config(canon) == canon
    # Pages: PyTorch maps large_segment_size (20 MiB) for its large pool; the
    # waterwave policy maps 2 MiB pages, which move between streams.
    for policy, page in (("pytorch", 20 * MiB), ("waterwave", 2 * MiB)):
        a = ww.Allocator(policy, config="expandable_segments:True")
        assert "expandable_segments:True" in str(a.config)
        p = a.alloc(3 * MiB)
        (seg,) = a.snapshot()
        assert seg["expandable"] and seg["size"] == max(page, 4 * MiB)
        a.free(p)


def test_good_config_round_trips():
    text = ("max_split_size_mb:200,max_non_split_rounding_mb:64,large_segment_size_mb:32,"
            "garbage_collection_threshold:0.5,per_process_memory_fraction:0.8,"
            "release_lock_on_cudamalloc:True,expandable_segments:False")
    canon = ww.parse_config(text)
    assert "max_split_size_mb:200" in canon and "large_segment_size_mb:32" in canon
    assert ww.parse_config(canon) == canon


def test_large_segment_size_lowers_max_split_floor():
    ww.parse_config("large_segment_size_mb:12,max_split_size_mb:12,max_non_split_rounding_mb:12")
    with pytest.raises(ww.ConfigError):
        ww.parse_config("large_segment_size_mb:40,max_split_size_mb:30")


def test_keywords_build_the_string():
    s = ww.config_string("max_split_size_mb:100", roundup_power2_divisions={256: 1, ">": 4},
                         expandable_segments=False)
    assert s == ("max_split_size_mb:100,roundup_power2_divisions:[256:1,>:4],"
                 "expandable_segments:False")
    a = ww.Allocator("pytorch", max_split_size_mb=64)
    assert "max_split_size_mb:64" in str(a.config)
    assert a.stats()["max_split_size"] == 64 * MiB


def test_environment_variable_is_read(monkeypatch):
    monkeypatch.setenv("WATERWAVE_ALLOC_CONF", "max_split_size_mb:48")
    assert "max_split_size_mb:48" in str(ww.Allocator().config)
    monkeypatch.setenv("WATERWAVE_ALLOC_CONF", "bogus:1")
    with pytest.raises(ww.ConfigError, match="bogus"):
        ww.Allocator()


def test_unknown_policy():
    with pytest.raises(ww.ConfigError, match="unknown allocator policy 'tlsf'"):
        ww.Allocator("tlsf")


@pytest.mark.parametrize(
    "config, size, rounded",
    [
        ("", 1, 512),
        ("", 512, 512),
        ("", 513, 1024),
        ("", MiB + 1, 1_049_088),
        ("roundup_power2_divisions:4", 1200, 1536),
        ("roundup_power2_divisions:4", MiB + 1, 1_310_720),
        ("roundup_power2_divisions:4", 12 * MiB + 1, 14 * MiB),
        ("roundup_power2_divisions:4", 8 * MiB, 8 * MiB),
        ("roundup_power2_divisions:1", 12 * MiB + 1, 12 * MiB + 512),
    ],
)
def test_round_size_matches_reference_examples(config, size, rounded):
    assert _C.round_size(size, config) == rounded


@pytest.mark.parametrize(
    "rounded, segment",
    [(512, 2 * MiB), (MiB, 2 * MiB), (MiB + 512, 20 * MiB), (10 * MiB - 512, 20 * MiB),
     (10 * MiB, 10 * MiB), (11 * MiB, 12 * MiB), (21 * MiB, 22 * MiB)],
)
def test_segment_sizes(rounded, segment):
    assert _C.segment_size(rounded) == segment


def test_segment_size_follows_large_segment_size():
    assert _C.segment_size(3 * MiB, "large_segment_size_mb:32") == 32 * MiB
