"""`weightpull simulate` and the spelling of `bench fanout`, from the command line."""

from __future__ import annotations

import json

import pytest

from weightpull.integrations.cli import _old_bench_spelling, main, parser


def run(capsys, *argv):
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def test_simulate_prints_both_modes_and_relays_win_at_scale(capsys):
    status, out, _ = run(capsys, "simulate", "--model", "8b", "--replicas", "1,64", "--json")
    assert status == 0
    rows = {r["replicas"]: r for r in json.loads(out.splitlines()[-1])["rows"]}
    assert rows[1]["direct_s"] == pytest.approx(rows[1]["one_s"])
    assert rows[64]["direct_s"] == pytest.approx(64 * rows[1]["direct_s"], rel=0.02)  # one link, 64 copies
    assert rows[64]["relays_s"] < 3 * rows[1]["one_s"]


def test_simulate_draws_a_png(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "fanout.png"
    status, out, _ = run(capsys, "simulate", "--model", "1t", "--replicas", "1,10", "--plot", str(png))
    assert status == 0 and f"plot: {png}" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def validated(capsys, tmp_path, measured):
    """`simulate --measured` of a run whose direct half is `measured`: its rows by replicas."""
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"direct": measured}))
    status, out, _ = run(capsys, "simulate", "--measured", str(path), "--json")
    assert status == 0
    return {r["replicas"]: r for r in json.loads(out.splitlines()[-1])["validation"]["direct"]}


def test_simulate_beside_a_measured_run(capsys, tmp_path):
    measured = {
        "size_bytes": 256 << 20,
        "bucket_bytes": 16 << 20,
        "rows": [{"replicas": 1, "all_serve_s": 2.0}, {"replicas": 4, "all_serve_s": 8.4}],
    }
    rows = validated(capsys, tmp_path, measured)
    assert rows[4]["simulated_s"] == pytest.approx(8.0, rel=0.001)
    assert rows[4]["error"] == pytest.approx(8.0 / 8.4 - 1, abs=0.001)
    assert "cpus" not in rows[4]  # no CPU measured: the links alone


def test_a_measured_run_with_cpu_figures_shares_the_runs_cores(capsys, tmp_path):
    # one reader: 2.0 s, of which its check took 0.25 s on a core after the last byte, so
    # the link moves the version in 1.75 s; trainer 0.5 and reader 0.5 core-s for the bytes
    # (0.57 cores while moving: the link binds); two readers end their reads at 3.5 s and
    # check at once on the one core: 0.5 s more (0.25 s with cores enough)
    measured = {
        "size_bytes": 256 << 20,
        "bucket_bytes": 16 << 20,
        "relays": False,
        "cpus": 1,
        "rows": [
            {"replicas": 1, "all_serve_s": 2.0, "trainer_cpu_s": 0.5, "replica_cpu_s": [0.75], "verify_cpu_s": 0.25},
            {"replicas": 2, "all_serve_s": 4.4, "procs_cpu_s": 2.6},
        ],
    }
    rows = validated(capsys, tmp_path, measured)
    assert rows[1]["simulated_s"] == pytest.approx(2.0, abs=0.001)
    assert rows[2]["simulated_s"] == pytest.approx(4.0, abs=0.001)
    assert rows[2]["enough_cpus_s"] == pytest.approx(3.75, abs=0.001)
    assert rows[2]["demand_cpu_s"] == pytest.approx(2.5) and rows[2]["measured_cpu_s"] == 2.6
    assert rows[2]["error"] == pytest.approx(4.0 / 4.4 - 1, abs=0.001)
    status, out, _ = run(capsys, "simulate", "--measured", str(tmp_path / "run.json"))
    assert "direct:" in out and "-9.1%" in out


def test_a_measured_run_of_tensor_parallel_replicas_is_modelled_as_slices(capsys, tmp_path):
    # two ranks a replica: the one-replica row's two slices share the trainer's link (2.0 s);
    # relayed, each rank's slice is offered once whole, the same rank of another replica
    # reads it, and the trainer's slot takes two ranks at once: 2.5 copies' time for three
    one = {"replicas": 1, "all_serve_s": 2.0}
    run_ = {"size_bytes": 256 << 20, "bucket_bytes": 16 << 20, "tp": 2, "cap": 1, "origin_cap": 2}
    path = tmp_path / "tp.json"
    direct = {**run_, "relays": False, "cap": None, "origin_cap": None}
    relays = {**run_, "relays": True}
    path.write_text(
        json.dumps(
            {
                "direct": {**direct, "rows": [one, {"replicas": 3, "all_serve_s": 6.6}]},
                "relays": {**relays, "rows": [one, {"replicas": 3, "all_serve_s": 5.5}]},
            }
        )
    )
    status, out, _ = run(capsys, "simulate", "--measured", str(path), "--json")
    assert status == 0
    checked = json.loads(out.splitlines()[-1])["validation"]
    assert checked["direct"][1]["simulated_s"] == pytest.approx(6.0, rel=0.001)
    assert checked["relays"][1]["simulated_s"] == pytest.approx(5.0, rel=0.001)
    assert checked["relays"][1]["error"] == pytest.approx(5.0 / 5.5 - 1, abs=0.001)


def test_the_model_is_calibrated_on_the_one_replica_row_alone():
    from weightpull.integrations.simulate import calibrate, validate

    one = {"replicas": 1, "all_serve_s": 2.0, "trainer_cpu_s": 0.2, "replica_cpu_s": [0.5], "verify_cpu_s": 0.1}
    run = {"size_bytes": 1 << 28, "bucket_bytes": 1 << 24, "relays": True, "cap": 1, "cpus": 2, "rows": [one]}
    many = {"replicas": 8, "all_serve_s": 9.0, "trainer_cpu_s": 5.0, "replica_cpu_s": [3.0] * 8, "verify_cpu_s": 1.0}
    more = {**run, "rows": [one, many]}
    cal = calibrate(more)
    assert cal == calibrate(run)  # the row of 8 changes nothing
    assert cal.bandwidth == pytest.approx((1 << 28) / 1.9) and cal.cpus == 2
    assert cal.recv_cpu == pytest.approx(0.4 / (1 << 28)) and cal.verify_cpu == pytest.approx(0.1 / (1 << 28))
    predicted = validate(more)[1]["simulated_s"]
    assert predicted == validate({**more, "rows": [one, {**many, "all_serve_s": 3.0}]})[1]["simulated_s"]


@pytest.mark.parametrize(
    "argv",
    [
        ["--replicas", "0"],
        ["--replicas", "ten"],
        ["--cap", "0"],
        ["--gbit", "-1"],
        ["--fail", "three"],
        ["--model", "70b"],
    ],
)
def test_bad_input_is_a_usage_error(capsys, argv):
    status, _, err = run(capsys, "simulate", *argv)
    assert status == 2 and err.startswith("error: argument")


def test_an_efficiency_above_one_is_refused(capsys):
    status, _, err = run(capsys, "simulate", "--efficiency", "1.5", "--replicas", "1")
    assert status == 2 and "--efficiency" in err


def test_bench_replicas_hosts_is_bench_fanout():
    argv = _old_bench_spelling(["bench", "--replicas", "8", "--hosts", "emulated"])
    assert argv == ["bench", "fanout", "--replicas", "8", "--hosts", "emulated"]
    args = parser().parse_args(argv)
    assert (args.replicas, args.hosts, args.size, args.bucket_size) == (8, "emulated", "256M", "16M")


def test_bench_fanout_prints_each_run_beside_the_links_limit_and_their_ratio():
    from weightpull.integrations.bench.fanout import link_bytes_per_s, table

    assert link_bytes_per_s("1gbit") == 125e6 and link_bytes_per_s("100mbps") == 100e6
    assert link_bytes_per_s(None) is None and link_bytes_per_s("1gibit") is None  # unknown: no limit printed
    row = dict(procs_cpu_s=1.0, busy_cpu_s=2.0, simulated_s=1.0, simulated_error=0.0, hops=1, byte_exact=True)
    run_ = dict(size_bytes=125_000_000, bucket_bytes=1 << 24, rate="1gbit", cpus=2, digest="wsum64", tp=2, hidden=1024)
    runs = {
        "direct": {
            **run_,
            "rows": [{**row, "replicas": 1, "all_serve_s": 1.1}, {**row, "replicas": 4, "all_serve_s": 4.4}],
        },
        "relays": {
            **run_,
            "rows": [{**row, "replicas": 1, "all_serve_s": 1.1}, {**row, "replicas": 4, "all_serve_s": 2.2, "hops": 2}],
        },
    }
    lines = table(runs, cap=1)
    assert "one copy through one link: 1.00 s" in lines[0] and "2 tensor-parallel ranks" in lines[0]
    four = lines[-1].split()
    assert four[:3] == ["4", "4.40", "4.00"] and four[-3:] == ["0.50", "2", "yes"]  # limit: 4 copies; relays/direct


@pytest.mark.parametrize("argv", [["--tp", "5"], ["--tp", "0"], ["--tp", "4", "--replicas", "16"]])
def test_bench_fanout_bounds_its_ranks(capsys, argv):
    status, _, err = run(capsys, "bench", "fanout", *argv)
    assert status == 2 and "--tp must be in [1, 4]" in err
