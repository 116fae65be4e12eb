"""The device catalogue (conf/devices/*.yaml, oomtune/gpu/catalogue.py) and ``oomtune plan gpu=[...]``.

Expected figures are hand-computed from their sources: NVIDIA's MIG user guide (``nvidia-smi mig
-lgip``: A100-SXM4-40GB 1g.5gb 4.75 GiB with 14 SMs; H100 80GB 3g.40gb 39.50 GiB with 60 SMs),
torch printouts of ``get_device_properties`` (A100-SXM4-40GB total_memory=40536MB, torch's MB being
2^20 bytes), CublasHandlePool.cpp's workspace sizes and sdp_utils.cpp's hardware ranges.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from oomtune.exceptions import ConfigError
from oomtune.gpu.catalogue import catalogue, card_named, load_card, resolve_cards

REPO = Path(__file__).resolve().parents[1]


def test_figures_match_their_sources():
    cards = catalogue()
    mig = cards["a100-40gb-1g.5gb"]
    assert mig.total_memory_bytes == 5_100_273_664        # 4.75 GiB = 4.75 x 1,073,741,824
    assert mig.sm_count == 14 and mig.compute_capability == (8, 0) and mig.family == "sm80:14"
    h3 = cards["h100-80gb-3g.40gb"]
    assert h3.total_memory_bytes == 42_412_802_048         # 39.50 GiB
    assert h3.sm_count == 60 and h3.cublas_workspace_bytes == 33_554_432   # 4096 x 8 KiB on sm90
    assert cards["a100-40gb"].total_memory_bytes == 42_505_076_736          # 40,536 x 1,048,576
    t4 = cards["t4"]
    assert t4.compute_capability == (7, 5) and t4.sm_count == 40 and t4.bf16 is False
    assert "flash" not in t4.sdpa_backends and "efficient" in t4.sdpa_backends   # flash needs sm80+
    assert t4.cublas_workspace_bytes == 8_519_680                            # 4096 KiB x 2 + 16 KiB x 8
    assert cards["h200"].total_memory_bytes == 143_156 * 1_048_576
    for card in cards.values():   # every figure names its source; memory outside = the lazy context
        assert card.sources["total_memory_bytes"] and card.sources["outside_allocator_bytes"]
        assert card.outside_allocator_bytes == 287_047_680 - 20 * 1_048_576


def test_every_required_card_is_there_with_memory():
    for name in ("t4", "l4", "a10g", "a100-40gb", "a100-80gb", "h100-80gb", "h200", "a100-40gb-1g.5gb",
                 "h100-80gb-3g.40gb"):
        assert catalogue()[name].total_memory_bytes is not None, name


def test_known_gpus_come_from_the_catalogue():
    from oomtune.capture.gpu_target import KNOWN_GPUS, parse_gpu

    assert KNOWN_GPUS["a100"] == ("A100", 8, 0, 108) and KNOWN_GPUS["t4"] == ("T4", 7, 5, 40)
    assert parse_gpu("a100").key == "a100"               # model.gpu=a100 keeps working
    assert parse_gpu("a100-80gb").key == "a100"          # a catalogue card: its family's kernels
    assert parse_gpu("h200").key == "h100"               # same sm90 kernels, 132 SMs
    assert parse_gpu("A100-SXM4-40GB MIG 1g.5gb").sm_count == 14
    from oomtune.gpu.outside import card_of

    assert card_of("NVIDIA A100-SXM4-40GB") is catalogue()["a100-40gb"]
    assert card_named("nvidia h100 80gb hbm3").name == "h100-80gb"


def _copy(tmp_path: Path, card: str, **changes) -> Path:
    data = yaml.safe_load((REPO / "conf" / "devices" / f"{card}.yaml").read_text())
    data.update(changes)
    for key in [k for k, v in changes.items() if v is ...]:
        del data[key]
    path = tmp_path / "mycard.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_a_user_card_file(tmp_path):
    path = _copy(tmp_path, "l4", name="my-l4-16g", total_memory_bytes=16 << 30)
    (card,) = resolve_cards([str(path)])
    assert card.name == "my-l4-16g" and card.total_memory_bytes == 16 << 30 and card.family == "l4"


@pytest.mark.parametrize("changes, words", [
    ({"sdpa_backends": ["flash", "efficient", "math"], "compute_capability": "7.5", "family": "t4", "bf16": False,
      "sm_count": 40}, "sdpa_backends"),
    ({"bf16": False}, "bf16"),
    ({"cublas_workspace_bytes": 33_554_432}, "cublas_workspace_bytes"),
    ({"total_memory_bytes": ...}, "missing total_memory_bytes"),
    ({"colour": "green"}, "unknown key"),
    ({"family": "sm80:14"}, "family"),
])
def test_a_bad_card_file_is_one_line(tmp_path, changes, words):
    path = _copy(tmp_path, "l4", **changes)
    with pytest.raises(ConfigError) as err:
        load_card(path)
    assert words in str(err.value) and "\n" not in str(err.value) and str(path) in str(err.value)


def test_unknown_card_names_the_choices():
    with pytest.raises(ConfigError, match=r"gpu='a1000': unknown card; choose from .*a100-40gb"):
        resolve_cards(["l4", "a1000"])
    assert [c.name for c in resolve_cards("l4,a100-40gb,l4")] == ["l4", "a100-40gb"]


@pytest.mark.parametrize("value", ["[l4,nosuchcard]", "/nonexistent/card.yaml"])
def test_plan_refuses_a_bad_gpu_in_one_line_exit_2(tmp_path, value):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OOMTUNE_CACHE_DIR": "off"}
    got = subprocess.run([sys.executable, "-m", "oomtune", "plan", "--out", str(tmp_path / "plan.yaml"),
                          "model=mlp", f"gpu={value}"], capture_output=True, text=True, env=env, timeout=120)
    assert got.returncode == 2, got.stderr
    lines = [ln for ln in got.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and ("gpu=" in lines[0] or "device file" in lines[0]), got.stderr
    assert not (tmp_path / "plan.yaml").exists()


@pytest.mark.slow
def test_plan_across_three_cards(tmp_path, monkeypatch):
    """T4 runs the memory-efficient attention kernel, the A100s flash (fp16: flash needs sm80+);
    the two A100s share their captures; the 80 GB card fits at least what the 40 GB one does."""
    from rich.console import Console

    from oomtune.plan.run import plan

    monkeypatch.setenv("OOMTUNE_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "plan.yaml"
    got = plan(["model=transformer", "model.precision=fp16", "gpu=[t4,a100-40gb,a100-80gb]",
                "search.batch_size.high=512", "+plan.batch=200"], out=out,
               console=Console(file=io.StringIO(), width=120))
    by = {r.card.name: r for r in got.results}
    assert set(by["t4"].sdpa) == {"efficient"}
    assert set(by["a100-40gb"].sdpa) == {"flash"} and set(by["a100-80gb"].sdpa) == {"flash"}
    assert by["a100-80gb"].max_batch_size >= by["a100-40gb"].max_batch_size >= by["t4"].max_batch_size
    assert got.captures == by["t4"].fmap.captures + by["a100-40gb"].fmap.captures   # two families, not three
    written = yaml.safe_load(out.read_text())
    assert written["kind"] == "plan_cards" and [c["card"]["name"] for c in written["cards"]] == \
        ["t4", "a100-40gb", "a100-80gb"]
    for entry, r in zip(written["cards"], got.results):
        used = entry["best"]["device_used_bytes"]
        assert used == entry["best"]["peak_reserved_bytes"] + 266_076_160   # reserved + the CUDA context
        assert entry["budget_bytes"] == r.card.total_memory_bytes            # each card's own memory
    small = got.smallest_fitting()
    assert written["smallest_card_fitting_batch"] == (small.card.name if small else None)
    assert small is None or min((r.card.total_memory_bytes for r in got.results if r.fits(200))) == \
        small.card.total_memory_bytes


def test_a_budget_above_the_virtual_gpu_is_checked_against_each_card(tmp_path, monkeypatch):
    """budget=100GiB: above the virtual GPU's default 80 GiB, within the H200's 143,156 MiB (139.80 GiB),
    above the H100 80GB's 81,082 MiB (79.18 GiB). Across cards each card's memory is the bound."""
    from rich.console import Console

    from oomtune.exceptions import DeviceError
    from oomtune.plan.run import plan

    monkeypatch.setenv("OOMTUNE_CACHE_DIR", "off")
    quiet = dict(console=Console(file=io.StringIO(), width=120))
    out = tmp_path / "plan.yaml"
    got = plan(["model=mlp", "gpu=h200", "budget=100GiB", "+plan.batch_sizes=[8]"], out=out, **quiet)
    (only,) = got.results
    assert only.budget_bytes == 100 * 2**30 and only.fits(8)
    assert yaml.safe_load(out.read_text())["cards"][0]["budget_bytes"] == 107_374_182_400
    with pytest.raises(DeviceError, match=r"above NVIDIA H100 80GB HBM3's 79\.18 GiB"):
        plan(["model=mlp", "gpu=[h200,h100-80gb]", "budget=100GiB", "+plan.batch_sizes=[8]"],
             out=tmp_path / "p2.yaml", **quiet)
    with pytest.raises(DeviceError, match=r"above virtual GPU \(CPU\)'s 80\.00 GiB"):   # one card: as before
        plan(["model=mlp", "budget=100GiB", "+plan.batch_sizes=[8]"], out=tmp_path / "p3.yaml", **quiet)


@pytest.mark.parametrize("value, advice", [
    # the L4's catalogue memory: (23,034 - 441) MiB = 22,593 x 1,048,576 = 23,690,477,568 bytes
    ("l4", "use model.gpu=l4 virtual_device_memory=23690477568 (its kernels and its memory in bytes)"),
    ("[l4,h200]", "use model.gpu=NAME for the kernels its captures run"),
])
def test_search_refuses_gpu_in_one_line_exit_2(tmp_path, value, advice):
    """gpu= is plan's list of cards; a search would run without reading it (the default GPU's kernels
    on the default 80 GiB virtual GPU), so it is refused before anything is written."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OOMTUNE_CACHE_DIR": "off"}
    got = subprocess.run([sys.executable, "-m", "oomtune", "search", "model=mlp", f"gpu={value}",
                          f"hydra.run.dir={tmp_path / 'run'}"], capture_output=True, text=True, env=env, timeout=120)
    assert got.returncode == 2, got.stderr
    lines = [ln for ln in got.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "is oomtune plan's list of cards" in lines[0] and advice in lines[0], got.stderr
    assert not (tmp_path / "run").exists()


def test_the_top_of_the_range_reads_as_at_least_and_a_batch_above_it_is_refused(tmp_path, monkeypatch):
    """A card whose every planned size fits has no known limit: the table says ">=N", not N; a
    +plan.batch above the range cannot be answered (no size above search.batch_size.high is planned)."""
    from rich.console import Console

    from oomtune.exceptions import ConfigError
    from oomtune.plan.run import plan

    monkeypatch.setenv("OOMTUNE_CACHE_DIR", "off")
    text = io.StringIO()
    # an MLP at batch <= 16 on 40 GB cards: a few MiB, far below either card's memory
    got = plan(["model=mlp", "gpu=[a100-40gb,l4]", "search.batch_size.high=16"], out=tmp_path / "p.yaml",
               console=Console(file=text, width=160))
    assert all(r.max_batch_size == 16 for r in got.results)
    table = text.getvalue()
    assert ">=16" in table and "none above 16 planned" in table
    with pytest.raises(ConfigError, match=r"^plan.batch=17 is above the planned range \(search.batch_size.high=16\)"):
        plan(["model=mlp", "gpu=[a100-40gb,l4]", "search.batch_size.high=16", "+plan.batch=17"],
             out=tmp_path / "q.yaml", console=Console(file=io.StringIO()))


@pytest.mark.parametrize("width", [80, 60])
def test_the_cards_table_on_a_narrow_console_moves_whole_cells_and_cuts_none(width, tmp_path, monkeypatch):
    """A new user's finding: `oomtune plan gpu=[t4,l4,a100-40gb]` with COLUMNS=80 (CI sets it; an 80-column
    terminal) cut cells to "expanda…", "configu…", "a100…". The table (7 columns, about 100 wide) now folds
    as the trial table does (display.fit_table): every word of every cell and header printed whole."""
    from rich.console import Console

    from oomtune.plan.cards import cards_table
    from oomtune.plan.run import plan

    monkeypatch.setenv("OOMTUNE_CACHE_DIR", "off")
    text = io.StringIO()
    got = plan(["model=mlp", "gpu=[a100-40gb,l4]", "search.batch_size.high=16"], out=tmp_path / "p.yaml",
               console=Console(file=text, width=width))
    out = text.getvalue()
    assert "\u2026" not in out and max(len(line) for line in out.splitlines()) <= width
    printed = out.split()
    table = cards_table(got)
    for column in table.columns:
        for cell in [column.header, *column._cells]:
            assert all(word in printed for word in str(cell).split()), (cell, out)
    assert {r.card.name for r in got.results} <= set(printed)
