"""benchmarks/targets.py, which turns stored benchmark runs into the verdicts the README reports:
each row's ratio to its target, its floors, and met / impossible / unmet."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import targets  # noqa: E402


def _rows(rows):
    return [dict(zip(("devices", "bytes", "case", "seconds"), row)) for row in rows]


def _run(rows, in_loop_rows):
    """A stored run of allreduce.py with these (devices, bytes, case, seconds) rows."""
    return {"rows": _rows(rows), "in_loop_rows": _rows(in_loop_rows)}


def test_in_process_rows_ratios_against_the_target_and_floors():
    mib = 1 << 20
    run = _run(
        [(4, mib, "jaxring.reduce_scatter", 1.1e-3), (4, mib, "lax.psum_scatter", 1.0e-3),
         (4, mib, "effect floor[reduce_scatter]", 0.9e-3),
         (4, 4, "effect floor[reduce_scatter]", 0.3e-3),
         (4, mib, "native floor[reduce_scatter]", 1.05e-3),
         (4, mib, "read floor[reduce_scatter]", 0.7e-3),
         (4, 16 * mib, "jaxring.all_gather", 4.0e-3), (4, 16 * mib, "lax.all_gather", 5.0e-3),
         (4, 16 * mib, "copy floor[all_gather]", 3.0e-3),
         (4, 16 * mib, "effect floor[all_gather]", 2.0e-3),
         (4, 4, "effect floor[all_gather]", 0.2e-3)],
        [(4, 16 * mib, "jaxring.all_gather", 3.6e-3), (4, 16 * mib, "lax.all_gather", 4.0e-3),
         (4, 16 * mib, "synced native floor[all_gather]", 3.4e-3)])
    rows = targets.in_process_rows(run)
    ratio, floors = rows[("lone", "reduce_scatter", 4, mib)]
    assert ratio == pytest.approx(1.1)
    # No read floor: this run does not record read_floor_streams (the early single-run reads).
    assert floors == pytest.approx({"effect": 0.9, "launch": 0.3, "native": 1.05})
    ratio, floors = rows[("lone", "all_gather", 4, 16 * mib)]
    assert ratio == pytest.approx(4.0 / (5.0 * 0.8))  # 0.8x the twin from 16 MiB
    # From huge_page_bytes (8 MiB) outputs the effect floor does not count; the launch (the
    # least effect floor up to this size) does. An all_gather's copy floor bounds nothing (a
    # read-once all-gather reads less than it copies).
    assert floors == pytest.approx({"launch": 0.2 / 4.0})
    # A run of large sizes alone (--min-bytes 256MiB) has no launch floor: an effect floor whose
    # output pages in 4 KiB at a time is no launch (run 93's "launch" was 1.29x the target where
    # jaxring's whole call was 0.70x).
    large = _run([(4, 16 * mib, r["case"], r["seconds"]) for r in run["rows"]
                  if r["bytes"] == 16 * mib], [])
    assert targets.in_process_rows(large)[("lone", "all_gather", 4, 16 * mib)][1] == {}
    ratio, floors = rows[("loop", "all_gather", 4, 16 * mib)]
    assert ratio == pytest.approx(3.6 / 3.2)
    # No all_gather native floor: this run does not record gather_floor_piece_bytes (the early
    # floor read its input n times).
    assert floors == {}
    run["read_floor_streams"] = 4
    run["gather_floor_piece_bytes"] = 256 << 10
    rows = targets.in_process_rows(run)
    assert rows[("lone", "reduce_scatter", 4, mib)][1]["read"] == pytest.approx(0.7)
    assert rows[("loop", "all_gather", 4, 16 * mib)][1] == \
        pytest.approx({"synced native": 3.4 / 3.2})


def _verdict(per_run_ratios, per_run_floors):
    key = ("lone", "all_reduce", 2, 4)
    return targets.judge([{key: (r, f)} for r, f in zip(per_run_ratios, per_run_floors)])[0]


def test_judge_takes_medians_and_the_largest_floor_that_stands():
    met = _verdict([0.9, 1.2, 0.95], [{"effect": 0.5}] * 3)
    assert (met["verdict"], met["ratio"], met["met_runs"]) == ("met", 0.95, 2)

    # The floor's median (1.1) exceeds the target but not jaxring's median (1.2): impossible.
    impossible = _verdict([1.2, 1.3, 1.1], [{"effect": 1.0, "native": 1.1},
                                            {"effect": 1.05, "native": 1.15},
                                            {"effect": 0.95, "native": 1.05}])
    assert impossible["verdict"] == "impossible"
    assert (impossible["floor_kind"], impossible["floor"]) == ("native", 1.1)

    # A floor slower than jaxring is refuted and bounds nothing; the one left is below 1.
    unmet = _verdict([1.1, 1.1, 1.1], [{"effect": 1.3, "native": 0.9}] * 3)
    assert unmet["verdict"] == "unmet"
    assert unmet["refuted"] == {"effect": 1.3}
    assert (unmet["floor_kind"], unmet["floor"]) == ("native", 0.9)


def test_judge_takes_a_floor_at_its_median_over_the_runs_that_measured_it():
    verdict = _verdict([1.2, 1.2, 1.2, 1.2], [{}, {}, {"synced read": 1.05},
                                              {"synced read": 1.15}])
    assert verdict["floor"] == pytest.approx(1.1)
    assert verdict["floors"] == {"synced read": [1.05, 1.15]}
    assert verdict["verdict"] == "impossible"
    no_floor = _verdict([1.2, 1.3], [{}, {}])
    assert (no_floor["floor"], no_floor["verdict"]) == (None, "unmet")


def test_judge_takes_each_row_over_the_runs_that_measured_it():
    """Row b (a size some runs leave out, as 256 MiB) is judged over the run that has it alone,
    and row a over both; neither is dropped, and b's one run counts as one of one."""
    a, b = ("lone", "all_reduce", 2, 4), ("lone", "all_reduce", 2, 16)
    verdicts = targets.judge([{a: (0.9, {}), b: (0.9, {})}, {a: (1.1, {})}])
    assert [v["key"] for v in verdicts] == [list(a), list(b)]
    assert verdicts[0]["ratio"] == pytest.approx(1.0) and verdicts[0]["ratios"] == [0.9, 1.1]
    assert verdicts[1]["ratios"] == [0.9] and verdicts[1]["met_runs"] == 1
    assert verdicts[1]["verdict"] == "met"


def test_a_floor_of_jaxrings_own_call_is_shown_but_never_makes_a_row_impossible():
    verdict = _verdict([1.2, 1.2, 1.2], [{"local": 1.1, "effect": 0.8}] * 3)
    assert verdict["verdict"] == "unmet"
    assert (verdict["floor_kind"], verdict["floor"]) == ("effect", 0.8)
    assert verdict["diagnostic"] == {"local": pytest.approx(1.1)}


def test_a_row_met_in_any_run_is_not_impossible():
    """The floor (median 1.2) stands against jaxring (1.3) and is above the target, but run 2
    met the target."""
    once = _verdict([1.3, 0.99, 1.3], [{"effect": 1.2}, {"effect": 0.99}, {"effect": 1.25}])
    assert once["floor"] == pytest.approx(1.2) and once["met_runs"] == 1
    assert once["verdict"] == "unmet"


def test_a_floor_is_refuted_against_jaxring_over_the_runs_that_measured_it():
    """The floor was timed in the last two runs only, where jaxring took 1.5 and 1.6; jaxring's
    median over all four runs (1.3) is below the floor's (1.45), but over those two (1.55) it is
    not, so the floor stands."""
    verdict = _verdict([1.1, 1.1, 1.5, 1.6], [{}, {}, {"native": 1.4}, {"native": 1.5}])
    assert verdict["refuted"] == {}
    assert (verdict["floor"], verdict["verdict"]) == (pytest.approx(1.45), "impossible")
    refuted = _verdict([1.5, 1.6, 1.1, 1.1], [{}, {}, {"native": 1.4}, {"native": 1.5}])
    assert refuted["refuted"] == {"native": pytest.approx(1.45)}
    assert refuted["verdict"] == "unmet"


def test_issue3_over_the_fixed_harness_lists_only_the_rows_whose_verdict_moved():
    """A row met over every run (an early run's mpi4py faulted its output in) but unmet over the
    fixed harness's run is listed with both verdicts; a row whose verdict stays is not."""
    moved, kept = ("lone", 64 << 20), ("lone", 4)
    every = targets.judge([{moved: (0.9, {}), kept: (2.0, {"effect": 1.5})},
                           {moved: (0.95, {}), kept: (2.1, {"effect": 1.6})},
                           {moved: (2.1, {}), kept: (2.2, {"effect": 1.7})}])
    fixed = targets.judge([{moved: (2.1, {}), kept: (2.2, {"effect": 1.7})}])
    lines = targets.fixed_harness_lines({"n4": every}, {"n4": fixed}, {"n4": 1})
    rows = [line for line in lines if line.startswith("| n4 |")]
    assert rows == ["| n4 | lone | 64 MiB | 0.95, met | 2.10 | 2.10 | - | unmet |"]
