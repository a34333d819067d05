"""``--plot``: generic over sweeps, lazy about matplotlib, and wired into the CLI."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from kvwire.bench import plot
from kvwire.bench.report import Report, Result, Timing, paired_ratio, repeat_interleaved
from kvwire.cli import main
from kvwire.commands import bench as bench_command
from kvwire.errors import ConfigError

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def two_sweeps() -> Report:
    report = Report("demo")
    report.add_sweep(
        "demo.bandwidth_vs_block",
        [4096, 65536, 8 << 20],
        [1.0e9, 5.0e9, 9.0e9],
        xlabel="block size (B)",
        ylabel="B/s",
        y_min=[0.9e9, 4.5e9, 8.0e9],
        y_max=[1.1e9, 5.5e9, 9.5e9],
        series={"memcpy": [2e9, 8e9, 10e9]},
    )
    report.add_sweep("demo/odd name", [1, 2, 3], [3, 2, 1], xlabel="n", ylabel="s")
    return report


def test_write_plots_draws_every_sweep(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="matplotlib is in the dev extra")
    out = tmp_path / "img" / "nested"
    paths = plot.write_plots([two_sweeps(), Report("empty")], out)
    assert sorted(p.name for p in paths) == ["demo.bandwidth_vs_block.png", "demo_odd_name.png"]
    for path in paths:
        assert path.read_bytes()[:8] == PNG_MAGIC


def test_no_sweeps_needs_no_matplotlib(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert plot.write_plots([Report("nothing")], tmp_path) == []


def test_missing_matplotlib_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes the import raise
    with pytest.raises(ConfigError, match="pip install matplotlib"):
        plot.require_matplotlib()


def test_cli_plot_without_matplotlib_fails_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["bench", "wire", "--quick", "--plot", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "pip install matplotlib" in err and err.count("\n") == 1


@pytest.mark.timeout(120)
def test_cli_json_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib", reason="matplotlib is in the dev extra")
    assert main(["bench", "wire", "--quick", "--json", "--plot", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    doc = json.loads(captured.out)  # stdout stays pure JSON; plot paths go to stderr
    assert doc["suite"] == "wire"
    png = tmp_path / "wire.decode_handshake_vs_regions.png"
    assert png.read_bytes()[:8] == PNG_MAGIC
    assert str(png) in captured.err


def test_log_scale_only_when_values_span_decades() -> None:
    assert plot.wants_log([1, 10, 100, 1000])
    assert not plot.wants_log([200_000, 150_000, 90_000])
    assert not plot.wants_log([0, 10, 1000])  # a zero cannot go on a log axis
    assert not plot.wants_log([])


def test_add_sweep_refuses_ragged_columns() -> None:
    report = Report("demo")
    with pytest.raises(ValueError, match="series 'b'"):
        report.add_sweep("demo.x", [1, 2], [1, 2], xlabel="x", ylabel="y", series={"b": [1]})
    with pytest.raises(ValueError, match="y has 1"):
        report.add_sweep("demo.x", [1, 2], [1], xlabel="x", ylabel="y")
    assert report.sweeps == {}


def test_table_shows_the_spread() -> None:
    report = two_sweeps()
    report.add(Result("demo.t_us", 2.0, "us", min=1.5, max=3.0))
    assert "1.5-3" in report.to_table()


def test_paired_ratio_pairs_repetitions() -> None:
    calls: list[str] = []
    timings = repeat_interleaved(
        {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, repeats=3, warmup=1
    )
    assert calls == ["a", "b"] * 4  # turns taken within every repetition
    assert len(timings["a"].samples) == 3
    slow = Timing(4.0, 2.0, 6.0, (2.0, 4.0, 6.0))
    fast = Timing(2.0, 1.0, 3.0, (1.0, 2.0, 3.0))
    assert paired_ratio(slow, fast) == Timing(2.0, 2.0, 2.0, (2.0, 2.0, 2.0))
    with pytest.raises(ValueError):
        paired_ratio(Timing(1.0, 1.0, 1.0), fast)


def test_all_suites_skips_those_not_built_yet(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(bench_command, "SUITES", ("wire", "not_built_yet"))
    assert main(["bench", "--quick", "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["suite"] == "wire"
    assert "'not_built_yet' is not built yet; skipped" in captured.err
    # Named explicitly, a missing suite is still an error.
    assert main(["bench", "not_built_yet"]) == 2


def test_entries_not_in_the_sweep_format_are_skipped_with_a_note(tmp_path: Path) -> None:
    report = two_sweeps()
    report.sweeps["parameters"] = {"model": "Llama-3-70B", "layers": 80}
    report.sweeps["ragged"] = {"x": [1, 2], "y": [1], "xlabel": "x", "ylabel": "y"}
    notes: list[str] = []
    assert plot.write_plots([Report("none")], tmp_path, warn=notes.append) == []
    assert notes == []
    pytest.importorskip("matplotlib", reason="matplotlib is in the dev extra")
    paths = plot.write_plots([report], tmp_path, warn=notes.append)
    assert len(paths) == 2
    assert any("'parameters': missing x, y, xlabel, ylabel" in n for n in notes)
    assert any("'ragged': y has 1 values for 2 x" in n for n in notes)
