"""`weightpull simulate` and the spelling of `bench fanout`, from the command line."""

from __future__ import annotations

import json

import pytest

from weightpull.integrations.cli import _old_bench_spelling, main, parser
from weightpull.simulate import simulate

MiB = 1 << 20


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


# -- forms: whole or delta, bf16 or fp8 ---------------------------------------------------------


def test_each_form_moves_its_measured_share_of_the_bf16_bytes():
    from weightpull.integrations.simulate import MODELS, Fractions, wire_bytes

    b8, t1 = MODELS["8b"], MODELS["1t"]
    assert wire_bytes(b8, "full") == b8.nbytes == 16_400_000_000  # the presets as they were
    assert wire_bytes(t1, "fp8") == t1.nbytes == 1_000_000_000_000
    assert wire_bytes(t1, "full") == 2_000_000_000_000
    assert wire_bytes(b8, "fp8") == round(16.4e9 * 0.576)  # docs/guides/bytes.md: fp8 with its scales
    assert wire_bytes(b8, "delta") == round(16.4e9 * 0.0381)  # sparse16, one RL step
    assert wire_bytes(t1, "fp8-delta") == round(2e12 * 0.0142)
    assert wire_bytes(t1, "delta", Fractions(delta=0.05)) == round(2e12 * 0.05)


def _times(form, fraction=None, replicas=1):
    from weightpull.integrations.simulate import Fractions, Model, Params, one_read_s, scenario

    model = Model("test", 1 << 30, 1, 64 * MiB)
    p = Params(bandwidth=1e9)  # 10 us a read, 100 us a bucket
    fractions = Fractions(delta=fraction) if fraction else Fractions()
    s = scenario(model, replicas, p, relays=replicas > 1, form=form, fractions=fractions)
    return s, (one_read_s(s) if replicas == 1 else simulate(s).all_serve_s)


def test_a_delta_is_faster_in_proportion_where_bytes_dominate_and_per_read_costs_dominate_when_tiny():
    full_s, full = _times("full")
    assert full == pytest.approx((1 << 30) / 1e9 + 16 * 110e-6)
    big, delta = _times("delta", 0.25)
    assert len(big.buckets) == 4 and delta / full == pytest.approx(0.25, rel=0.01)  # bytes dominate
    tiny, delta = _times("delta", 1e-6)  # 1074 bytes: one piece
    assert len(tiny.buckets) == 1 and delta == pytest.approx(110e-6, rel=0.02)  # its read and bucket dominate
    _, fp8 = _times("fp8")
    assert fp8 / full == pytest.approx(0.576, rel=0.01)  # fp8 scales the bytes
    # relays: a whole version is forwarded bucket by bucket, a delta relayed once patched
    assert full_s.forward and not tiny.forward
    relayed, three = _times("delta", 1e-6, replicas=3)
    assert three == pytest.approx(2 * 110e-6, rel=0.05)  # trainer -> r1, then trainer -> r2 and r1 -> r3


def test_simulate_by_form_prints_the_1t_goals_met_or_not(capsys, monkeypatch):
    from weightpull.integrations import simulate as sim

    monkeypatch.setattr(sim, "GOALS", ((1, "128 GPUs", 1.0), (10, "10 replicas", 1.5)))  # 10,000 takes long
    status, out, _ = run(capsys, "simulate", "--model", "1t", "--replicas", "1,10", "--form", "fp8,fp8-delta")
    assert status == 0
    lines = out.splitlines()
    assert "fp8-delta 0.0142" in lines[1]
    fp8_one = next(line.split() for line in lines if line.split()[:4] == ["1t", "fp8", "1000.00", "1"])
    assert fp8_one[4] == "1.351"  # as the preset's default row
    goals = [line.split() for line in lines if line.startswith("  fp8")]
    assert goals[0][:4] == ["fp8", "to", "128", "GPUs"] and goals[0][-2:] == ["NOT", "met"]
    # the fp8 delta: its wire time, then each host's patch and check of its 62.5 GB on its 16
    # cores, as measured on the H200 machine: not met, and the rate that would meet it
    fp8_delta = next(line for line in lines if line.startswith("  fp8-delta  to 128 GPUs"))
    assert goals[2][0] == "fp8-delta"
    assert "goal <= 1 s  NOT met  (wire 0.038 s, then per hop patch 1.671 s + check 3.434 s: 12.24 GB/s" in fp8_delta
    assert "needs patch + check >= 65 GB/s together" in fp8_delta
    assert any("patch and check of each host's whole version included" in line for line in lines)
    assert any(line.startswith("deltas: each hop patches") for line in lines)
    argv = ("simulate", "--model", "1t", "--replicas", "1", "--form", "delta", "--json")
    status, out, _ = run(capsys, *argv)
    result = json.loads(out.splitlines()[-1])
    row = result["rows"][0]
    assert row["form"] == "delta" and row["wire_bytes"] == round(2e12 * 0.0381)
    one, ten = result["goals"]  # 10 replicas, not among the rows, simulated for the goal
    assert one["s"] == pytest.approx(row["one_s"]) and not one["met"]
    assert one["s"] == pytest.approx(one["wire_s"] + row["patch_s"] + row["check_s"], abs=1e-3)
    assert row["patch_s"] == pytest.approx(125e9 / 39.5e9, abs=1e-3)  # a host's 125 GB of bf16, on its cores
    assert ten["replicas"] == 10 and one["s"] < ten["s"] and not ten["met"]
    assert one["wire_s"] < ten["wire_s"] <= 1.5  # on the wire alone both were met
    # at the rate a goal needs, it is met; a little under it, not
    need = one["need_gbs"]
    assert need == pytest.approx(125 / (1.0 - one["wire_s"]), rel=1e-3)
    for rate, met in (
        (need * 2 * 1.01, True),
        (need * 2 * 0.98, False),
    ):  # patch and check each at twice: need together
        status, out, _ = run(capsys, *argv, "--patch-rate", str(rate), "--check-rate", str(rate))
        got = json.loads(out.splitlines()[-1])["goals"][0]
        assert got["met"] is met and got["rate_gbs"] == pytest.approx(rate / 2, rel=1e-3)
    need = ten["need_gbs"]
    for rate, met in ((need * 2 * 1.02, True), (need * 2 * 0.9, False)):
        status, out, _ = run(capsys, *argv, "--patch-rate", str(rate), "--check-rate", str(rate))
        assert json.loads(out.splitlines()[-1])["goals"][1]["met"] is met


def test_a_patch_takes_time_in_proportion_to_its_deltas_fraction(capsys, monkeypatch):
    from weightpull.integrations import simulate as sim

    monkeypatch.setattr(sim, "GOALS", ((1, "128 GPUs", 1.0),))  # 10,000 takes long
    argv = ("simulate", "--model", "1t", "--replicas", "1", "--form", "fp8-delta", "--json")
    rows = [
        json.loads(run(capsys, *argv, *more)[1].splitlines()[-1])["rows"][0]
        for more in ((), ("--fp8-delta-fraction", "0.0071"))
    ]
    assert rows[1]["patch_s"] == pytest.approx(rows[0]["patch_s"] / 2, rel=1e-3)  # half the words changed
    assert rows[1]["check_s"] == rows[0]["check_s"] == pytest.approx(62.5e9 / 18.2e9, abs=1e-3)  # the whole version


def test_on_the_gpus_each_patches_and_checks_its_ranks_share_and_both_goals_are_met(capsys, monkeypatch):
    from weightpull.integrations import simulate as sim

    monkeypatch.setattr(sim, "GOALS", ((1, "128 GPUs", 1.0), (10, "10 replicas", 1.5)))  # 10,000 takes long
    argv = ("simulate", "--model", "1t", "--replicas", "1", "--form", "fp8-delta", "--patch-on", "gpu")
    status, out, _ = run(capsys, *argv)
    assert status == 0 and "each hop patches on each GPU its rank's share" in out
    assert "(fp8-delta 1677 GB/s: measured on an H200" in out and "(1141 GB/s: wsum64, measured on an H200)" in out
    got = json.loads(run(capsys, *argv, "--json")[1].splitlines()[-1])
    row, (one, ten) = got["rows"][0], got["goals"]
    assert got["patch_on"] == "gpu" and got["check_rate_gbs"] == 1141
    share = 62.5e9 / 8  # a host's 62.5 GB of fp8 over its 8 GPUs, at once
    assert row["patch_s"] == pytest.approx(share / 1677e9, abs=1e-4) and row["check_s"] == pytest.approx(
        share / 1141e9, abs=1e-4
    )
    assert (
        one["met"]
        and ten["met"]
        and one["rate_gbs"] == pytest.approx(share / (one["patch_s"] + one["check_s"]) / 1e9, rel=0.01)
    )
    host = json.loads(run(capsys, *argv[:-2], "--json")[1].splitlines()[-1])
    assert host["patch_on"] == "host" and not host["goals"][0]["met"]  # the same on the host's cores: not met
    assert host["goals"][0]["need_gbs"] == pytest.approx(one["need_gbs"] * 8, rel=0.01)  # a host's bytes, not a GPU's


def test_the_default_rows_are_as_before_forms(capsys):
    status, out, _ = run(capsys, "simulate", "--model", "1t", "--replicas", "1", "--json")
    result = json.loads(out.splitlines()[-1])
    assert set(result) == {"gbit", "cap", "rows"} and "form" not in result["rows"][0]
    assert result["rows"][0]["one_s"] == pytest.approx(1.351, abs=0.001)


@pytest.mark.parametrize(
    ("argv", "option"),
    [
        (["--form", "delta", "--delta-fraction", "0"], "--delta-fraction"),
        (["--form", "delta", "--delta-fraction", "1.5"], "--delta-fraction"),
        (["--form", "delta", "--delta-fraction", "-0.1"], "--delta-fraction"),
        (["--form", "delta", "--delta-fraction", "some"], "--delta-fraction"),
        (["--form", "fp8-delta", "--fp8-delta-fraction", "0"], "--fp8-delta-fraction"),
        (["--form", "fp16"], "--form"),
        (["--form", "delta", "--patch-on", "tpu"], "--patch-on"),
        (["--form", "delta", "--patch-rate", "0"], "--patch-rate"),
        (["--form", "delta", "--patch-rate", "-3"], "--patch-rate"),
        (["--form", "delta", "--patch-rate", "nan"], "--patch-rate"),
        (["--form", "delta", "--patch-rate", "inf"], "--patch-rate"),
        (["--form", "delta", "--patch-rate", "fast"], "--patch-rate"),
        (["--form", "fp8-delta", "--check-rate", "0"], "--check-rate"),
        (["--form", "fp8-delta", "--check-rate", "-1e9"], "--check-rate"),
        (["--form", "fp8-delta", "--check-rate", "NaN"], "--check-rate"),
        (["--form", "fp8-delta", "--check-rate", "1e999"], "--check-rate"),
        (["--form", "fp8-delta", "--check-rate", ""], "--check-rate"),
        (["--form", "full,"], "--form"),
    ],
)
def test_bad_forms_and_fractions_are_usage_errors_naming_the_option(capsys, argv, option):
    status, _, err = run(capsys, "simulate", "--replicas", "1", *argv)
    assert status == 2 and err.startswith(f"error: argument {option}")


def test_a_delta_fraction_without_its_form_is_refused(capsys):
    status, _, err = run(capsys, "simulate", "--replicas", "1", "--form", "full", "--delta-fraction", "0.05")
    assert status == 2 and "--delta-fraction applies to --form delta" in err


@pytest.mark.parametrize(("option", "value"), [("--patch-rate", "100"), ("--check-rate", "100"), ("--patch-on", "gpu")])
@pytest.mark.parametrize("forms", [[], ["--form", "full,fp8"]])
def test_a_rate_without_a_delta_form_is_refused(capsys, option, value, forms):
    status, _, err = run(capsys, "simulate", "--replicas", "1", *forms, option, value)
    assert status == 2 and f"{option} applies to --form delta or fp8-delta" in err


def test_a_measured_run_of_deltas_is_modelled_by_its_wire_bytes_and_relayed_whole(capsys, tmp_path):
    # a delta of 8 MiB (8 pieces of 1 MiB) of a 256 MiB version: one replica 0.1 s; relayed
    # with cap 1, r1 reads the trainer, then r2 the trainer and r3 r1, once r1 patched: 0.2 s
    from weightpull.integrations.simulate import calibrate

    one = {"replicas": 1, "all_serve_s": 0.1}
    run_ = {"size_bytes": 256 << 20, "bucket_bytes": 1 << 20, "relays": True, "cap": 1, "origin_cap": 1}
    delta = {**run_, "form": "delta", "wire_bytes": 8 << 20, "rows": [one, {"replicas": 3, "all_serve_s": 0.25}]}
    assert calibrate(delta).bandwidth == pytest.approx((8 << 20) / 0.1)
    assert calibrate({**delta, "form": None, "wire_bytes": None}).bandwidth == pytest.approx((256 << 20) / 0.1)
    rows = validated(capsys, tmp_path, delta)
    assert rows[3]["simulated_s"] == pytest.approx(0.2, abs=0.001)
    assert rows[3]["form"] == "delta" and rows[3]["wire_bytes"] == 8 << 20
    assert rows[3]["error"] == pytest.approx(0.2 / 0.25 - 1, abs=0.001)
    # the same bytes published whole (fp8, say) are forwarded as they arrive: a pipeline, not two rounds
    whole = validated(capsys, tmp_path, {**delta, "form": "fp8"})
    assert whole[3]["simulated_s"] < 0.15 and whole[3]["form"] == "fp8"
    before = validated(capsys, tmp_path, {**run_, "rows": delta["rows"]})  # no form: as before
    assert "form" not in before[3] and before[3]["simulated_s"] < 0.15


def test_a_measured_run_of_an_unknown_form_is_refused(capsys, tmp_path):
    path = tmp_path / "run.json"
    run_ = {"size_bytes": 1 << 20, "bucket_bytes": 1 << 20, "form": "int4", "rows": [{"replicas": 1, "all_serve_s": 1}]}
    path.write_text(json.dumps(run_))
    status, _, err = run(capsys, "simulate", "--measured", str(path))
    assert status == 2 and "form is one of full, delta, fp8, fp8-delta, got 'int4'" in err
