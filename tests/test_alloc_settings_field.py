"""Settings strings from the field: accept what torch 2.14.1 accepts with a defined
meaning (normalised), refuse what torch refuses or what has no defined meaning, and say why.

Expected verdicts come from torch's own parser (``torch._C._accelerator_setAllocatorSettings``, run in
a subprocess on CPU) and from c10/core/AllocatorConfig.cpp / c10/cuda/CUDAAllocatorConfig.cpp:
``max_split_size_mb`` must be >= kLargeBuffer / kMB = 20 ("CachingAllocator option max_split_size_mb
too small, must be >= 20"); ``large_segment_size_mb`` must be > kMinLargeAlloc / kMB = 10.
"""

from __future__ import annotations

import pytest

from oomtune.alloc import AllocatorSettings
from oomtune.exceptions import AllocatorConfigError
from oomtune.units import MiB

from test_alloc_settings import MALFORMED, _torch_verdicts

parse = AllocatorSettings.parse

# string as a user writes it -> the canonical string it means (hand-written from torch's grammar)
ACCEPTED = {
    "expandable_segments:True,": "expandable_segments:True",
    "expandable_segments:True,max_split_size_mb:512,": "expandable_segments:True,max_split_size_mb:512",
    " max_split_size_mb : 512 , ": "max_split_size_mb:512",
    "max_split_size_mb:+30": "max_split_size_mb:30",
    "roundup_power2_divisions:[256:1,512:2,]": AllocatorSettings.parse("roundup_power2_divisions:[256:1,512:2]").render(),
}


@pytest.mark.parametrize("text, canonical", ACCEPTED.items())
def test_accepted_like_torch_and_normalised(text, canonical):
    s = parse(text)
    assert s.render() == canonical
    assert not s.render().endswith(",")


def test_trailing_comma_means_the_setting_before_it():
    assert parse("expandable_segments:True,") == AllocatorSettings(expandable_segments=True)
    assert parse("max_split_size_mb:+30").max_split_size_bytes == 30 * MiB


def test_torch_accepts_every_string_we_accept():
    verdicts = _torch_verdicts(list(ACCEPTED) + list(ACCEPTED.values()))
    for text in list(ACCEPTED) + list(ACCEPTED.values()):
        assert verdicts[text] == "ok", (text, verdicts[text])


def test_every_refusal_says_why_and_names_torch_when_torch_would_accept_it():
    verdicts = _torch_verdicts(MALFORMED)
    for text in MALFORMED:
        with pytest.raises(AllocatorConfigError) as info:
            parse(text)
        msg = str(info.value)
        assert "\n" not in msg
        if verdicts[text] == "ok":  # torch takes it without a defined meaning: say what torch would do
            assert "torch" in msg, (text, msg)


@pytest.mark.parametrize("text, minimum", [("max_split_size_mb:0", "20"), ("max_split_size_mb:19", "20"),
                                           ("large_segment_size_mb:0", "11"), ("large_segment_size_mb:10", "11"),
                                           ("large_segment_size_mb:40,max_split_size_mb:30", "40")])
def test_too_small_names_the_minimum(text, minimum):
    with pytest.raises(AllocatorConfigError) as info:
        parse(text)
    assert f"the minimum is {minimum}" in str(info.value), str(info.value)
    assert "not a positive whole number" not in str(info.value)


def test_torch_refuses_what_we_call_too_small():
    verdicts = _torch_verdicts(["max_split_size_mb:0", "max_split_size_mb:19", "max_split_size_mb:20"])
    assert "must be >= 20" in verdicts["max_split_size_mb:0"]
    assert "must be >= 20" in verdicts["max_split_size_mb:19"]
    assert verdicts["max_split_size_mb:20"] == "ok"


@pytest.mark.parametrize("text, torch_reads", [("max_split_size_mb,512", "max_split_size_mb:512"),
                                               ("max_split_size_mb:20.5", "read it as 20"),
                                               ("max_split_size_mb:-1", "wrap"),
                                               ("max_split_size_mb:512,max_split_size_mb:256", "last value"),
                                               ("roundup_power2_divisions:[]", "sets nothing"),
                                               ("roundup_power2_divisions:[256:1]x", "ignores")])
def test_accepted_by_torch_without_a_defined_meaning_says_what_torch_would_do(text, torch_reads):
    with pytest.raises(AllocatorConfigError) as info:
        parse(text)
    assert torch_reads in str(info.value), str(info.value)
