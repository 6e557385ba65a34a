"""`shiftlm schedule`: numbers as JSON, a Gantt chart, and one-line errors for impossible requests."""

import json

from shiftlm.cli import main


def _json(capsys, *argv):
    assert main(["schedule", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_reports_the_1f1b_bubble_formula(capsys):
    report = _json(capsys, "--name", "1f1b", "--pp", "4", "--microbatches", "8")
    assert abs(report["bubble_fraction"] - 3 / 11) < 1e-12
    assert report["peak_activations"] == [4, 3, 2, 1]


def test_costs_are_per_rank_share_so_chunked_schedules_compare_directly(capsys):
    one = _json(capsys, "--name", "1f1b", "--pp", "4", "--microbatches", "8")
    zbv = _json(capsys, "--name", "zb_v", "--pp", "4", "--microbatches", "8")
    # same total work per rank (3m units); ZB-V only removes bubbles
    assert one["makespan"] == 33 and zbv["makespan"] < one["makespan"]
    assert zbv["costs_per_chunk"]["F"] == 0.5


def test_plot_writes_a_png(tmp_path, capsys):
    out = tmp_path / "gantt.png"
    assert (
        main(["schedule", "--name", "bitpipe", "--pp", "4", "--microbatches", "8", "--plot", str(out)]) == 0
    )
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "bubble fraction" in capsys.readouterr().out


def test_impossible_schedule_is_a_one_line_error(capsys):
    assert main(["schedule", "--name", "1f1b", "--pp", "4", "--microbatches", "2", "--json"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("shiftlm schedule: error:") and "\n" not in err
    assert main(["schedule", "--name", "1f1b", "--pp", "2", "--microbatches", "4", "--costs", "1,x,1"]) == 2
