"""Tests of oomtune.alloc.settings (PYTORCH_CUDA_ALLOC_CONF parse / validate / render).

Expected values come from the PyTorch source (c10/core/AllocatorConfig.{h,cpp},
c10/cuda/CUDAAllocatorConfig.cpp, c10/test/core/AllocatorConfig_test.cpp), hand calculation, or
torch 2.14.1 itself (the subprocess cross-checks below call its parser on CPU).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest
from hypothesis import given, settings as hsettings, strategies as st

from oomtune.alloc import AllocatorSettings, effective_settings, supported_keys, validate_alloc_conf
from oomtune.exceptions import AllocatorConfigError, ConfigError
from oomtune.units import MiB

parse = AllocatorSettings.parse
torch = pytest.importorskip("torch")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def rejected(text: str, *needles: str, **kw) -> str:
    with pytest.raises(AllocatorConfigError) as info:
        parse(text, **kw)
    msg = str(info.value)
    assert "\n" not in msg, msg
    for needle in needles:
        assert needle in msg, msg
    return msg


# --- every key at its boundaries --------------------------------------------------------------

def test_empty_string_is_defaults():
    s = parse("")
    assert s == AllocatorSettings()
    assert s.max_split_size_bytes is None and s.roundup_power2_divisions == (0,) * 16
    assert s.max_non_split_rounding_bytes == 20 * MiB and s.large_segment_size_bytes == 20 * MiB
    assert parse("  \t") == s and s.render() == "" and s.as_mapping() == {}


def test_max_split_size_mb_boundary():
    assert parse("max_split_size_mb:20").max_split_size_bytes == 20 * MiB  # kLargeBuffer / kMB = 20
    rejected("max_split_size_mb:19", "max_split_size_mb", "19", ">= 20")


def test_max_split_size_mb_clamped_like_torch():
    # torch: min(val, SIZE_MAX / kMB); SIZE_MAX / 2**20 = 2**44 - 1
    assert parse("max_split_size_mb:99999999999999").max_split_size_bytes == (2**44 - 1) * MiB
    rejected(f"max_split_size_mb:{2**64}", "max_split_size_mb", "out of range")


def test_max_non_split_rounding_mb_boundary():
    assert parse("max_non_split_rounding_mb:20").max_non_split_rounding_bytes == 20 * MiB
    rejected("max_non_split_rounding_mb:19", "max_non_split_rounding_mb", "19", ">= 20")


@pytest.mark.parametrize("value", ["0.0", "1.0", "0", "1", "1.5", "-0.5", "nan", "inf", "0.5x"])
def test_garbage_collection_threshold_rejected(value):
    rejected(f"garbage_collection_threshold:{value}", "garbage_collection_threshold", "(0.0, 1.0)")


@pytest.mark.parametrize("value, expected", [("0.5", 0.5), ("0.999", 0.999), ("1e-3", 0.001), (".25", 0.25)])
def test_garbage_collection_threshold_accepted(value, expected):
    assert parse(f"garbage_collection_threshold:{value}").garbage_collection_threshold == expected


def test_divisions_single_form():
    assert parse("roundup_power2_divisions:4").roundup_power2_divisions == (4,) * 16
    assert parse("roundup_power2_divisions:1").roundup_power2_divisions == (1,) * 16
    rejected("roundup_power2_divisions:3", "roundup_power2_divisions", "3", "power of 2")
    # the single form checks isPowerOf2_64(value), which is false for 0
    rejected("roundup_power2_divisions:0", "roundup_power2_divisions", "power of 2")


def test_divisions_list_form_by_hand():
    # 256 MiB -> index log2(256) = 8: first entry fills [0, 8) and sets [8] = 1;
    # 512 -> index 9 = 2; '>' fills from last_index + 1 = 10 to 15 with 8.
    expected = (1,) * 9 + (2,) + (8,) * 6
    assert parse("roundup_power2_divisions:[256:1,512:2,>:8]").roundup_power2_divisions == expected


def test_divisions_list_form_old_torch_overwrites_last_entry():
    # torch <= 2.8 (CUDAAllocatorConfig::parseRoundUpPower2Divisions) filled '>' from last_index.
    expected = (1,) * 9 + (8,) * 7
    got = parse("roundup_power2_divisions:[256:1,512:2,>:8]", torch_version="2.8.0").roundup_power2_divisions
    assert got == expected


def test_divisions_list_form_pytorch_unit_test():
    # c10/test/core/AllocatorConfig_test.cpp: divisions(32MB) = 8, 64MB 8, 128MB 2, 256MB 4,
    # 512MB 2, 1024MB 4, 2048/4096/8192MB 1. Index = log2(MB).
    got = parse("roundup_power2_divisions:[64:8,128:2,256:4,512:2,1024:4,>:1]").roundup_power2_divisions
    assert got == (8,) * 7 + (2, 4, 2, 4) + (1,) * 5


def test_divisions_list_values_and_intervals():
    assert parse("roundup_power2_divisions:[256:0,>:4]").roundup_power2_divisions == (0,) * 9 + (4,) * 7
    # boundary 65536 MiB -> log2 = 16, clamped to index 15: [0, 15) and [15] all get 2
    assert parse("roundup_power2_divisions:[65536:2]").roundup_power2_divisions == (2,) * 16
    rejected("roundup_power2_divisions:[256:3]", "roundup_power2_divisions", "256:3", "power of 2 or 0")
    rejected("roundup_power2_divisions:[3:1]", "roundup_power2_divisions", "intervals")
    rejected("roundup_power2_divisions:[0:1]", "intervals")


def test_large_segment_size_mb():
    assert parse("large_segment_size_mb:11").large_segment_size_bytes == 11 * MiB
    rejected("large_segment_size_mb:10", "large_segment_size_mb", "10", "> 10")
    # torch 2.14.1: the max_split / max_non_split minimum is the large segment size, in any order,
    # and max_non_split_rounding defaults to it (pytorch PR #172056)
    rejected("large_segment_size_mb:40,max_split_size_mb:30", "max_split_size_mb", "30", ">= 40")
    rejected("max_non_split_rounding_mb:30,large_segment_size_mb:40", "max_non_split_rounding_mb", ">= 40")
    s = parse("large_segment_size_mb:40")
    assert s.max_non_split_rounding_bytes == 40 * MiB
    assert parse("large_segment_size_mb:11,max_split_size_mb:15").max_split_size_bytes == 15 * MiB


def test_pinned_num_register_threads():
    assert parse("pinned_num_register_threads:128").pinned_num_register_threads == 128
    rejected("pinned_num_register_threads:256", "pinned_num_register_threads", "256", "<= 128")
    rejected("pinned_num_register_threads:3", "pinned_num_register_threads", "power of 2")
    rejected("pinned_num_register_threads:0", "pinned_num_register_threads", "power of 2")


def test_backend():
    assert parse("backend:native").backend == "native"
    assert parse("backend:cudaMallocAsync").backend == "cudaMallocAsync"
    rejected("backend:foo", "backend", "foo", "native and cudaMallocAsync")
    rejected("backend:hipMallocAsync", "hipMallocAsync")  # refused by a CUDA build of torch


BOOL_KEYS = {"expandable_segments": "expandable_segments", "release_lock_on_cudamalloc": "release_lock_on_cudamalloc",
             "pinned_use_cuda_host_register": "pinned_use_cuda_host_register",
             "pinned_use_background_threads": "pinned_use_background_threads",
             "release_lock_on_hipmalloc": "release_lock_on_cudamalloc",
             "pinned_use_hip_host_register": "pinned_use_cuda_host_register"}


@pytest.mark.parametrize("key", sorted(BOOL_KEYS))
def test_booleans_exactly_true_false(key):
    assert getattr(parse(f"{key}:True"), BOOL_KEYS[key]) is True
    assert getattr(parse(f"{key}:False"), BOOL_KEYS[key]) is False
    for bad in ("true", "TRUE", "1", "yes"):
        rejected(f"{key}:{bad}", key, bad, "'True' or 'False'")


def test_whitespace_is_dropped_anywhere_like_torch():
    # ConfigTokenizer skips every std::isspace character, inside keys too
    assert parse(" max_split _size_mb : 512 \n").max_split_size_bytes == 512 * MiB


def test_keys_are_case_sensitive():
    rejected("Max_split_size_mb:512", "Unrecognized key", "Max_split_size_mb", "did you mean 'max_split_size_mb'?")


def test_a_misspelt_key_gets_the_closest_modelled_one_and_a_far_one_none():
    # difflib's ratio, by hand: 'expandable_segment' (18 chars) against 'expandable_segments' (19): 2 x 18 / 37 = 0.97
    rejected("expandable_segment:True", "Unrecognized key 'expandable_segment'", "did you mean 'expandable_segments'?")
    with pytest.raises(AllocatorConfigError) as info:
        parse("foo:1")   # 'foo' shares no run of letters long enough with any key: no guess
    assert "did you mean" not in str(info.value)


def test_roundup_bypass_threshold_is_unrecognized():
    rejected("roundup_bypass_threshold_mb:512", "Unrecognized key", "roundup_bypass_threshold_mb")
    assert "roundup_bypass_threshold_mb" not in supported_keys()


def test_unknown_unmodelled_and_duplicate_keys():
    rejected("foo:1", "Unrecognized key", "'foo'")
    rejected("per_process_memory_fraction:0.5", "per_process_memory_fraction", "not modelled")
    rejected("max_split_size_mb:512,max_split_size_mb:1024", "duplicate", "max_split_size_mb")
    rejected("max_split_size_mb:[1:2]", "max_split_size_mb", "list")


def test_torch_version_gates_keys():
    rejected("large_segment_size_mb:40", "large_segment_size_mb", "2.4", torch_version="2.4.1")
    assert "large_segment_size_mb" not in supported_keys("2.4")
    with pytest.raises(AllocatorConfigError):
        supported_keys("banana")


MALFORMED = [  # torch accepts some of these without a defined meaning (see test_alloc_settings_field.py)
    "max_split_size_mb:",                # trailing ':' -> INTERNAL ASSERT at import torch
    "max_split_size_mb",                 # missing ':' and value
    ":512",                              # empty key
    ",max_split_size_mb:512",            # leading separator
    "max_split_size_mb:512,,expandable_segments:True",  # duplicate separators
    "max_split_size_mb::512",
    "roundup_power2_divisions:[256:1",   # unclosed '['
    "roundup_power2_divisions:[]",
    "roundup_power2_divisions:[256]",
    "roundup_power2_divisions:[256:1]x",
    "max_split_size_mb:512:3",
    "max_split_size_mb=512",
    "max_split_size_mb,512",             # torch ignores checkToken's result and takes 512
    "max_split_size_mb:512 expandable_segments:True",   # missing comma
    "[", "]",
    "max_split_size_mb:20.5",            # stoull would read 20
    "max_split_size_mb:-1",              # stoull would wrap to SIZE_MAX
    "max_split_size_mb:0x40",
]


@pytest.mark.parametrize("text", MALFORMED)
def test_malformed_strings_rejected(text):
    rejected(text)


def test_error_class_is_a_config_error():
    with pytest.raises(ConfigError):
        parse("max_split_size_mb:")
    with pytest.raises(AllocatorConfigError):
        parse(None)  # type: ignore[arg-type]


def test_constructor_validates_bytes():
    with pytest.raises(AllocatorConfigError, match="max_split_size_mb"):
        AllocatorSettings(max_split_size_bytes=20 * MiB + 1)
    with pytest.raises(AllocatorConfigError, match="roundup_power2_divisions"):
        AllocatorSettings(roundup_power2_divisions=(3,) * 16)
    with pytest.raises(AllocatorConfigError, match="roundup_power2_divisions"):
        AllocatorSettings(roundup_power2_divisions=(1,) * 15)


# --- render / mappings -----------------------------------------------------------------------

def test_render_example_and_mapping():
    s = AllocatorSettings(expandable_segments=True, max_split_size_bytes=512 * MiB)
    assert s.render() == "expandable_segments:True,max_split_size_mb:512"
    assert s.as_mapping() == {"expandable_segments": True, "max_split_size_mb": 512}


def test_render_divisions_list_is_version_proof():
    s = parse("roundup_power2_divisions:[256:1,512:2,>:8]")
    # the first interval of the last run (1024 MiB) is named as well as '>', so the string means
    # the same whether '>' fills from last_index (<= 2.8) or last_index + 1
    assert s.as_mapping() == {"roundup_power2_divisions": {"256": 1, "512": 2, "1024": 8, ">": 8}}
    assert parse(s.render(), torch_version="2.8") == s == parse(s.render())


def test_from_mapping_optuna_and_yaml_forms():
    params = {"max_split_size_mb": None, "garbage_collection_threshold": 0.0, "roundup_power2_divisions": 0,
              "expandable_segments": True, "backend": "native"}
    assert AllocatorSettings.from_mapping(params) == AllocatorSettings(expandable_segments=True)
    yaml_like = {"roundup_power2_divisions": {256: 1, 512: 2, ">": 8}, "max_split_size_mb": 512,
                 "garbage_collection_threshold": 0.6}
    s = AllocatorSettings.from_mapping(yaml_like)
    assert s.roundup_power2_divisions == (1,) * 9 + (2,) + (8,) * 6
    assert s.max_split_size_bytes == 512 * MiB and s.garbage_collection_threshold == 0.6
    with pytest.raises(AllocatorConfigError, match="expandable_segments"):
        AllocatorSettings.from_mapping({"expandable_segments": "yes"})
    with pytest.raises(AllocatorConfigError):
        AllocatorSettings.from_mapping([("max_split_size_mb", 512)])  # type: ignore[arg-type]


POW2 = [0, 1, 2, 4, 8, 16]


@st.composite
def valid_settings(draw):
    large = draw(st.sampled_from([20, 11, 64]))
    return AllocatorSettings(
        backend=draw(st.sampled_from(["native", "cudaMallocAsync"])),
        max_split_size_bytes=draw(st.one_of(st.none(), st.integers(large, 1 << 20).map(lambda m: m * MiB))),
        max_non_split_rounding_bytes=draw(st.integers(large, 4096)) * MiB,
        garbage_collection_threshold=draw(st.one_of(st.just(0.0), st.floats(0.0, 1.0, exclude_min=True,
                                                                             exclude_max=True))),
        roundup_power2_divisions=tuple(draw(st.lists(st.sampled_from(POW2), min_size=16, max_size=16))),
        expandable_segments=draw(st.booleans()),
        large_segment_size_bytes=large * MiB,
        release_lock_on_cudamalloc=draw(st.booleans()),
        pinned_use_cuda_host_register=draw(st.booleans()),
        pinned_num_register_threads=draw(st.sampled_from([1, 2, 8, 128])),
        pinned_use_background_threads=draw(st.booleans()),
    )


@hsettings(max_examples=300, deadline=None)
@given(valid_settings())
def test_round_trip_property(s):
    text = s.render()
    assert parse(text) == s
    div_only = AllocatorSettings(roundup_power2_divisions=s.roundup_power2_divisions).render()
    assert parse(div_only, torch_version="2.8").roundup_power2_divisions == s.roundup_power2_divisions
    assert AllocatorSettings.from_mapping(s.as_mapping()) == s
    assert parse(text).render() == text
    assert " " not in text and not text.endswith(",")


# --- cudaMallocAsync ------------------------------------------------------------------------------

def test_cuda_malloc_async_warning_names_inert_keys():
    text = "backend:cudaMallocAsync,max_split_size_mb:512,expandable_segments:True,pinned_use_background_threads:True"
    with pytest.warns(UserWarning, match="cudaMallocAsync") as record:
        s = validate_alloc_conf(text)
    msg = str(record[0].message)
    assert "max_split_size_mb" in msg and "expandable_segments" in msg
    assert "pinned_use_background_threads" not in msg  # host allocator: still used
    assert s.inert_keys() == ["expandable_segments", "max_split_size_mb"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert validate_alloc_conf("max_split_size_mb:512").inert_keys() == []


def test_validate_alloc_conf_uses_installed_torch():
    rejected_msg = None
    try:
        validate_alloc_conf("max_split_size_mb:19")
    except AllocatorConfigError as e:
        rejected_msg = str(e)
    assert rejected_msg is not None and ">= 20" in rejected_msg


# --- cross-checks against the installed torch ------------------------------------------------------

_PROBE = r"""
import json, sys, torch
out = {}
for text in json.loads(sys.argv[1]):
    try:
        torch._C._accelerator_setAllocatorSettings(text)
        out[text] = "ok"
    except Exception as e:
        out[text] = str(e).splitlines()[0]
print(json.dumps(out))
"""


def _torch_verdicts(texts, env=None):
    if not hasattr(torch._C, "_accelerator_setAllocatorSettings"):
        pytest.skip("this torch has no CPU-side allocator-settings parser")
    proc = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(texts)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, **(env or {})})
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_torch_agrees_on_keys_and_values():
    """torch's own parser (on CPU, no CUDA needed) accepts what we accept, refuses what we refuse."""
    accepted = [parse(t).render() for t in (
        "expandable_segments:True,max_split_size_mb:512,garbage_collection_threshold:0.6",
        "roundup_power2_divisions:[256:1,512:2,>:8],max_non_split_rounding_mb:40",
        "large_segment_size_mb:40,pinned_num_register_threads:8,release_lock_on_cudamalloc:True",
        "pinned_use_cuda_host_register:True,pinned_use_background_threads:True,roundup_power2_divisions:4")]
    refused = ["max_split_size_mb:19", "garbage_collection_threshold:1.0", "roundup_power2_divisions:3",
               "expandable_segments:true", "large_segment_size_mb:10", "large_segment_size_mb:40,max_split_size_mb:30",
               "pinned_num_register_threads:256", "roundup_bypass_threshold_mb:512", "backend:foo"]
    probe_keys = sorted(supported_keys() - {"backend"})
    verdicts = _torch_verdicts(accepted + refused + [f"{k}:1" for k in probe_keys])
    for text in accepted:
        assert verdicts[text] == "ok", (text, verdicts[text])
        parse(text, torch_version=torch.__version__)
    for text in refused:
        assert verdicts[text] != "ok", text
        with pytest.raises(AllocatorConfigError):
            parse(text, torch_version=torch.__version__)
    assert "Unrecognized key" in verdicts["roundup_bypass_threshold_mb:512"]
    for key in probe_keys:  # every key we call supported is known to torch (value errors are fine)
        assert "Unrecognized key" not in verdicts[f"{key}:1"], key


def test_import_torch_survives_rendered_string():
    text = parse("expandable_segments:True,roundup_power2_divisions:[256:1,512:2,>:8]").render()
    proc = subprocess.run([sys.executable, "-c", "import torch"], capture_output=True, timeout=300,
                          env={**os.environ, "PYTORCH_CUDA_ALLOC_CONF": text, "PYTORCH_ALLOC_CONF": text})
    assert proc.returncode == 0


# --- effective_settings ------------------------------------------------------------------------------

@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_effective_settings_none_without_cuda():
    assert effective_settings() is None


@pytest.mark.cuda
@cuda
def test_effective_settings_match_parse_on_gpu():
    text = "max_split_size_mb:512,roundup_power2_divisions:[256:1,512:2,>:8]"
    code = "import json; from oomtune.alloc import effective_settings as e; print(json.dumps(e()))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTORCH_CUDA_ALLOC_CONF": text, "PYTORCH_ALLOC_CONF": text})
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    s = parse(text, torch_version=torch.__version__)
    assert got["max_split_size"] == s.max_split_size_bytes
    divisions = got["roundup_power2_divisions"]
    assert tuple(divisions[str(1 << k)] for k in range(16)) == s.roundup_power2_divisions
