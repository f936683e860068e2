"""Baselines: saving a run's figures, and judging a new run against them."""

from __future__ import annotations

import json
import math
import statistics

import pytest
from factories import (
    make_bench,
    make_bitwise_result,
    make_could_not_run_result,
    make_fingerprint,
    make_report,
    make_tolerance_result,
)

from suite.errors import UsageError
from suite.harness.baseline import (
    MAX_RUNS_PER_PRESET,
    MIN_CHANGE,
    compare,
    load_baseline,
    save_baseline,
)
from suite.harness.fingerprint import fingerprint_class
from suite.harness.render import render_comparison


def rmsnorm_run(*, arm_ms: float = 0.25, reference_ms: float = 1.0, noise_floor: float = 0.01,
                peers: dict | None = None, **report_kwargs):
    """One rmsnorm result with one bench case; the same seeds give the same round medians."""
    bench = make_bench("fwd", reference_ms=reference_ms, arm_ms=arm_ms, noise_floor=noise_floor,
                       peers=peers, seed=7)
    return make_report(results=[make_tolerance_result(benches=[bench])], skipped=[], **report_kwargs)


def statuses(cmp) -> dict[tuple[str, str], str]:
    return {(e.case, e.contender): e.status for e in cmp.entries}


def test_save_then_compare_with_itself_is_all_same(tmp_path):
    report = make_report()
    paths = save_baseline(report, tmp_path)
    assert paths == [tmp_path / "nvidia-h200" / "rmsnorm.json", tmp_path / "nvidia-h200" / "muon.json"]
    assert sorted(p.name for p in (tmp_path / "nvidia-h200").glob("*.json")) == ["muon.json", "rmsnorm.json"]

    baseline = load_baseline(paths[0])
    assert baseline.gate == "rmsnorm" and [r.preset for r in baseline.runs] == ["medium"]
    run, = baseline.runs_of("medium")
    assert (run.run_id, run.command, run.fingerprint) == (report.run_id, report.command, report.fingerprint)
    assert baseline.fingerprint_class == fingerprint_class(report.fingerprint)
    timed = {(e.preset, e.case, e.mode, e.contender) for e in baseline.entries}
    assert timed == {("medium", case, mode, c) for case, mode in (("fwd", "graph"), ("fwd", "eager"), ("fwd+bwd", "graph"))
                     for c in ("reference", "arm", "torch_compile")}  # liger was unavailable
    arm = next(e for e in baseline.entries if e.case == "fwd" and e.mode == "graph" and e.contender == "arm")
    source = report.results[0].bench[0].contenders[1]
    assert (arm.median_ms, arm.round_medians_ms, arm.gbps) == (source.median_ms, source.round_medians_ms, source.gbps)
    assert arm.noise_floor == 0.01 and arm.run_id == report.run_id

    cmp = compare(report, tmp_path)
    assert cmp.passed
    assert len(cmp.entries) == 11  # 9 rmsnorm (two cases, fwd in both modes) + 2 muon
    assert {e.status for e in cmp.entries} == {"same"}
    assert all(e.ratio == pytest.approx(1.0) for e in cmp.entries)


def test_figures_timed_another_way_than_their_mode_are_not_saved(tmp_path):
    report = rmsnorm_run()
    bench = report.results[0].bench[0]
    fallback = "eager calls (capture failed for reference: AcceleratorError: ...)"
    bench.contenders = [c.model_copy(update={"method": fallback}) if c.role == "arm" else c for c in bench.contenders]
    path, = save_baseline(report, tmp_path)
    assert {e.contender for e in load_baseline(path).entries} == {"reference", "torch_compile"}
    save_baseline(rmsnorm_run(), tmp_path / "full")
    statuses_now = statuses(compare(report, tmp_path / "full"))
    assert statuses_now[("fwd", "arm")] == "missing"  # never judged against a replay's figure


def test_a_20_percent_slower_arm_with_a_1_percent_floor_regresses(tmp_path):
    save_baseline(rmsnorm_run(), tmp_path)
    slow = rmsnorm_run(arm_ms=0.25 * 1.2, noise_floor=0.01)
    cmp = compare(slow, tmp_path)
    assert not cmp.passed
    assert statuses(cmp)[("fwd", "arm")] == "regressed"
    assert statuses(cmp)[("fwd", "reference")] == "same"
    arm = next(e for e in cmp.entries if e.contender == "arm")
    assert arm.ratio == pytest.approx(1.2)
    assert arm.ci_low > 1.15 and arm.ci_high < 1.25  # the arm's rounds spread 0.5%
    assert arm.threshold == pytest.approx(MIN_CHANGE)  # the 1% floor is under the minimum
    assert arm.baseline_runs == 1 and "one saved run" in arm.note and "--add" in arm.note
    md = render_comparison(cmp)
    assert "**FAILED**: 1 arm timing(s) regressed" in md
    assert "**REGRESSED**" in md and "+20.0%" in md


def test_the_new_runs_noise_floor_decides(tmp_path):
    save_baseline(rmsnorm_run(noise_floor=0.01), tmp_path)
    # 4% slower is a regression against a 1% floor, but noise against a 5% floor
    assert statuses(compare(rmsnorm_run(arm_ms=0.26, noise_floor=0.01), tmp_path))[("fwd", "arm")] == "regressed"
    noisy = compare(rmsnorm_run(arm_ms=0.26, noise_floor=0.05), tmp_path)
    assert noisy.passed and statuses(noisy)[("fwd", "arm")] == "same"
    # under the 2% minimum even a tight floor calls it the same
    tight = compare(rmsnorm_run(arm_ms=0.25 * 1.015, noise_floor=0.001), tmp_path)
    assert statuses(tight)[("fwd", "arm")] == "same"


def test_faster_arm_is_improved_and_a_slower_reference_does_not_fail(tmp_path):
    save_baseline(rmsnorm_run(), tmp_path)
    cmp = compare(rmsnorm_run(arm_ms=0.2, reference_ms=1.3), tmp_path)
    assert statuses(cmp)[("fwd", "arm")] == "improved"
    assert statuses(cmp)[("fwd", "reference")] == "regressed"
    assert cmp.passed  # only the arm's regressions fail
    assert "passed" in render_comparison(cmp).splitlines()[0]


def test_new_and_missing_entries_do_not_fail(tmp_path):
    save_baseline(rmsnorm_run(), tmp_path)
    changed = rmsnorm_run(peers={"liger": 0.2})  # torch_compile gone, liger now timed
    cmp = compare(changed, tmp_path)
    assert cmp.passed
    assert statuses(cmp)[("fwd", "liger")] == "new"
    assert statuses(cmp)[("fwd", "torch_compile")] == "missing"
    missing = next(e for e in cmp.entries if e.status == "missing")
    assert missing.new_ms is None and missing.baseline_ms is not None

    # a gate without any baseline file: everything is new
    other = make_report(results=[make_bitwise_result()], skipped=[])
    cmp = compare(other, tmp_path)
    assert cmp.passed and {e.status for e in cmp.entries} == {"new"}
    assert cmp.entries[0].note == "no baseline file"
    assert cmp.baselines == {}


def test_a_different_torch_minor_is_refused_unless_forced(tmp_path):
    save_baseline(rmsnorm_run(fingerprint=make_fingerprint(torch="2.11.0+cu130")), tmp_path)
    newer = rmsnorm_run(fingerprint=make_fingerprint(torch="2.12.1+cu130"))
    with pytest.raises(UsageError) as err:
        compare(newer, tmp_path)
    message = str(err.value)
    assert "torch 2.11 (baseline) vs 2.12 (this run)" in message
    assert "rmsnorm.json" in message and "force" in message

    cmp = compare(newer, tmp_path, force=True)
    assert cmp.forced and "torch 2.11 (baseline) vs 2.12 (this run)" in cmp.mismatches["rmsnorm"]
    assert all(e.note.startswith("fingerprint differs: torch 2.11") for e in cmp.entries)
    assert "forced past a fingerprint mismatch" in render_comparison(cmp)


def test_a_patch_release_or_new_driver_is_comparable(tmp_path):
    save_baseline(rmsnorm_run(fingerprint=make_fingerprint(torch="2.11.0+cu130")), tmp_path)
    patched = rmsnorm_run(fingerprint=make_fingerprint(torch="2.11.1+cu130", driver="590.1", git_sha="e" * 40))
    assert compare(patched, tmp_path).mismatches == {}


def test_save_refuses_a_run_whose_parity_failed(tmp_path):
    report = make_report(results=[make_tolerance_result(parity_passed=False), make_bitwise_result()])
    with pytest.raises(UsageError, match=r"parity failed for rmsnorm/medium"):
        save_baseline(report, tmp_path)
    assert not tmp_path.joinpath("nvidia-h200").exists()
    # the passed gate alone may still be saved
    assert save_baseline(report, tmp_path, ["muon"]) == [tmp_path / "nvidia-h200" / "muon.json"]


def test_save_refuses_a_run_without_bench_results(tmp_path):
    no_bench = make_tolerance_result(benches=[]).model_copy(update={"bench_skipped": "benches need CUDA"})
    report = make_report(results=[no_bench, make_could_not_run_result()], skipped=[])
    with pytest.raises(UsageError) as err:
        save_baseline(report, tmp_path)
    message = str(err.value)
    assert "no passed bench results to save for rmsnorm, moe" in message
    assert "rmsnorm/medium: bench skipped (benches need CUDA)" in message
    assert "moe/medium: could_not_run (CUDA out of memory" in message

    with pytest.raises(UsageError, match="has no gate results"):
        save_baseline(make_report(results=[], skipped=[]), tmp_path)


def test_save_leaves_out_results_that_did_not_pass(tmp_path):
    slow = make_bitwise_result(benches=[make_bench("step", reference_ms=10.0, arm_ms=12.0, peers={})])
    assert slow.status == "failed" and slow.parity.passed
    report = make_report(results=[make_tolerance_result(), slow], skipped=[])
    assert save_baseline(report, tmp_path) == [tmp_path / "nvidia-h200" / "rmsnorm.json"]
    with pytest.raises(UsageError, match=r"muon/small: failed"):
        save_baseline(report, tmp_path, ["muon"])


def test_save_names_unknown_gates(tmp_path):
    with pytest.raises(UsageError, match=r"no results for nope; it ran: rmsnorm, muon, moe"):
        save_baseline(make_report(), tmp_path, ["nope"])


def preset_run(preset: str, run_id: str, arm_ms: float = 0.25, **fingerprint):
    bench = make_bench("fwd", reference_ms=1.0, arm_ms=arm_ms, noise_floor=0.01, peers={}, seed=7)
    return make_report(results=[make_tolerance_result(preset=preset, benches=[bench])], skipped=[],
                       run_id=run_id, fingerprint=make_fingerprint(**fingerprint))


def test_save_replaces_the_presets_it_measured_and_keeps_the_others(tmp_path):
    save_baseline(preset_run("small", "first"), tmp_path)
    save_baseline(preset_run("large", "second", git_sha="b" * 40), tmp_path)
    save_baseline(preset_run("small", "third", arm_ms=0.2), tmp_path)
    folder = tmp_path / "nvidia-h200"
    # no temp files left; the lock file beside the baseline stays
    assert sorted(p.name for p in folder.iterdir()) == [".rmsnorm.json.lock", "rmsnorm.json"]
    baseline = load_baseline(folder / "rmsnorm.json")
    assert {r.preset: r.run_id for r in baseline.runs} == {"large": "second", "small": "third"}
    assert baseline.runs_of("large")[0].fingerprint.git_sha == "b" * 40
    arms = {e.preset: e.median_ms for e in baseline.entries if e.role == "arm"}
    assert arms == {"large": pytest.approx(0.25, rel=0.1), "small": pytest.approx(0.2, rel=0.1)}
    assert len(baseline.entries) == 4

    save_baseline(preset_run("small", "fourth"), tmp_path, replace=True)
    assert [r.run_id for r in load_baseline(folder / "rmsnorm.json").runs] == ["fourth"]


def test_save_keeps_each_contenders_host_time_per_call(tmp_path):
    report = preset_run("small", "first")
    for c in report.results[0].bench[0].contenders:
        c.host_us = {"reference": 12.5, "arm": 40.25}.get(c.name)
    save_baseline(report, tmp_path)
    entries = load_baseline(tmp_path / "nvidia-h200" / "rmsnorm.json").entries
    assert {e.contender: e.host_us for e in entries} == {"reference": 12.5, "arm": 40.25}


def test_save_keeps_the_memory_each_contenders_call_holds_and_the_page_gives_it(tmp_path):
    from suite.harness.render import render_baseline

    report = preset_run("small", "first")
    for c in report.results[0].bench[0].contenders:
        c.call_peak_bytes = {"reference": 3 << 30, "arm": 3 << 29}.get(c.name)
    save_baseline(report, tmp_path)
    baseline = load_baseline(tmp_path / "nvidia-h200" / "rmsnorm.json")
    assert {e.contender: e.call_peak_bytes for e in baseline.entries} == {"reference": 3 << 30, "arm": 3 << 29}
    page = render_baseline(baseline, "rmsnorm.json")
    assert "GiB a call holds (eager)" in page
    assert next(line for line in page.splitlines() if line.startswith("| arm ")).split("|")[-4].strip() == "1.500"


def test_save_never_merges_across_machine_classes_or_into_an_unreadable_file(tmp_path):
    save_baseline(preset_run("small", "first", torch="2.11.0+cu130"), tmp_path)
    path = tmp_path / "nvidia-h200" / "rmsnorm.json"
    before = path.read_text()
    with pytest.raises(UsageError, match=r"another class of machine \(torch 2.11 \(baseline\) vs 2.12.*--replace"):
        save_baseline(preset_run("large", "second", torch="2.12.0+cu130"), tmp_path)
    assert path.read_text() == before
    path.write_text("garbage")
    with pytest.raises(UsageError, match=r"not a baseline: not valid JSON.*Not merging into it.*--replace"):
        save_baseline(preset_run("large", "second"), tmp_path)
    assert path.read_text() == "garbage"
    save_baseline(preset_run("large", "second"), tmp_path, replace=True)
    assert [r.run_id for r in load_baseline(path).runs] == ["second"]


def test_rtx_profile_runs_keep_a_baseline_of_their_own_beside_the_devices(tmp_path):
    """The rtx profile's tiles are another class of machine: its runs save to and compare
    with <device>-rtx-profile/, and neither class refuses or overwrites the other."""
    save_baseline(preset_run("small", "native"), tmp_path)
    save_baseline(preset_run("small", "rtx", arm_ms=0.3, profile="rtx"), tmp_path)
    native = load_baseline(tmp_path / "nvidia-h200" / "rmsnorm.json")
    rtx = load_baseline(tmp_path / "nvidia-h200-rtx-profile" / "rmsnorm.json")
    assert [r.run_id for r in native.runs] == ["native"] and [r.run_id for r in rtx.runs] == ["rtx"]
    comparison = compare(preset_run("small", "later", arm_ms=0.3, profile="rtx"), tmp_path)
    assert comparison.baselines == {"rmsnorm": str(tmp_path / "nvidia-h200-rtx-profile" / "rmsnorm.json")}
    # the RTX card's own runs (rtx by default, or "auto" in older reports) keep its plain folder
    rtx_card = dict(device_slug="nvidia-geforce-rtx-5090", gpu_name="NVIDIA GeForce RTX 5090",
                    compute_capability="12.0")
    for profile in ("rtx", "auto"):
        save_baseline(preset_run("small", f"card-{profile}", profile=profile, **rtx_card), tmp_path, replace=True)
        card = load_baseline(tmp_path / "nvidia-geforce-rtx-5090" / "rmsnorm.json")
        assert [r.run_id for r in card.runs] == [f"card-{profile}"]
    assert not (tmp_path / "nvidia-geforce-rtx-5090-rtx-profile").exists()


def test_load_baseline_errors_are_clear(tmp_path):
    path = tmp_path / "rmsnorm.json"
    path.write_text(json.dumps({"schema_version": 7, "gate": "rmsnorm"}))
    with pytest.raises(UsageError, match=r"schema_version 7; this suite reads baselines of schema_version 4"):
        load_baseline(path)
    for version in (3, 4):  # schema 3 is upgraded, and what it lacks is still named
        path.write_text(json.dumps({"schema_version": version, "gate": "rmsnorm"}))
        with pytest.raises(UsageError, match=r"not a valid baseline: .*runs: Field required"):
            load_baseline(path)


def test_a_bad_baseline_file_stops_compare_with_its_name(tmp_path):
    save_baseline(rmsnorm_run(), tmp_path)
    (tmp_path / "nvidia-h200" / "rmsnorm.json").write_text("garbage")
    with pytest.raises(UsageError, match=r"rmsnorm\.json is not a baseline: not valid JSON"):
        compare(rmsnorm_run(), tmp_path)


def test_comparison_report_serialises_its_verdict(tmp_path):
    save_baseline(rmsnorm_run(), tmp_path)
    cmp = compare(rmsnorm_run(arm_ms=0.4), tmp_path)
    data = json.loads(cmp.model_dump_json())
    assert data["passed"] is False
    assert type(cmp).model_validate(data) == cmp


def with_arm_rounds(report, rounds: list[float]):
    """The report with its arm's round medians (and median) replaced."""
    bench = report.results[0].bench[0]
    bench.contenders = [c.model_copy(update={"round_medians_ms": rounds, "median_ms": statistics.median(rounds)})
                        if c.role == "arm" else c for c in bench.contenders]
    return report


def test_a_change_counts_only_with_its_ci_clear_of_no_change(tmp_path):
    save_baseline(rmsnorm_run(), tmp_path)
    # median 5% slower, but the rounds range from 20% faster to 40% slower
    scattered = with_arm_rounds(rmsnorm_run(), [0.2, 0.35, 0.2625, 0.21, 0.33, 0.2625, 0.2, 0.34, 0.22, 0.3])
    arm = next(e for e in compare(scattered, tmp_path).entries if e.contender == "arm")
    assert arm.ratio == pytest.approx(1.05, rel=0.01) and arm.ci_low < 1 < arm.ci_high
    assert arm.status == "same"


def test_added_runs_widen_the_bar_by_how_far_they_lie_apart(tmp_path):
    save_baseline(preset_run("small", "monday"), tmp_path)
    # the same code on another lease: 12% slower
    save_baseline(preset_run("small", "tuesday", arm_ms=0.28), tmp_path, add=True)
    baseline = load_baseline(tmp_path / "nvidia-h200" / "rmsnorm.json")
    assert [r.run_id for r in baseline.runs_of("small")] == ["monday", "tuesday"]
    cmp = compare(preset_run("small", "wednesday", arm_ms=0.28), tmp_path)
    arm = next(e for e in cmp.entries if e.contender == "arm")
    assert arm.baseline_runs == 2 and arm.spread == pytest.approx(0.12, abs=0.01)
    assert arm.threshold == pytest.approx(arm.spread)
    assert arm.status == "same" and cmp.passed
    assert arm.baseline_ms == pytest.approx(math.sqrt(0.25 * 0.28), rel=0.01)
    # a run well beyond both still fails
    assert statuses(compare(preset_run("small", "thursday", arm_ms=0.35), tmp_path))[("fwd", "arm")] == "regressed"
    # against Monday's run alone, Wednesday's would have failed
    save_baseline(preset_run("small", "monday"), tmp_path / "one")
    assert statuses(compare(preset_run("small", "wednesday", arm_ms=0.28), tmp_path / "one"))[("fwd", "arm")] == "regressed"
    md = render_comparison(cmp)
    assert "runs apart" in md and "12." in md


def test_add_keeps_the_newest_runs_and_each_run_once(tmp_path):
    for day in range(7):
        save_baseline(preset_run("small", f"day{day}"), tmp_path, add=True)
    save_baseline(preset_run("small", "day6"), tmp_path, add=True)  # saved twice: kept once
    save_baseline(preset_run("large", "other"), tmp_path, add=True)
    baseline = load_baseline(tmp_path / "nvidia-h200" / "rmsnorm.json")
    kept = [r.run_id for r in baseline.runs_of("small")]
    assert kept == [f"day{d}" for d in range(2, 7)] and len(kept) == MAX_RUNS_PER_PRESET
    assert {e.run_id for e in baseline.entries if e.preset == "small"} == set(kept)
    assert [r.run_id for r in baseline.runs_of("large")] == ["other"]
    # without --add the preset holds the new run alone again
    save_baseline(preset_run("small", "fresh"), tmp_path)
    assert [r.run_id for r in load_baseline(tmp_path / "nvidia-h200" / "rmsnorm.json").runs_of("small")] == ["fresh"]
    with pytest.raises(UsageError, match="choose one"):
        save_baseline(preset_run("small", "x"), tmp_path, add=True, replace=True)


def test_add_drops_the_run_that_ran_first_not_the_one_saved_first(tmp_path):
    # run ids begin with the run's start; days stand in for them, saved out of order
    for day in (5, 6, 0, 1, 2, 3):
        save_baseline(preset_run("small", f"day{day}"), tmp_path, add=True)
    kept = [r.run_id for r in load_baseline(tmp_path / "nvidia-h200" / "rmsnorm.json").runs_of("small")]
    assert sorted(kept) == ["day1", "day2", "day3", "day5", "day6"]  # by save order day5 would go
    # the run added stays even where it ran before all the others: it was asked for
    save_baseline(preset_run("small", "day0"), tmp_path, add=True)
    kept = [r.run_id for r in load_baseline(tmp_path / "nvidia-h200" / "rmsnorm.json").runs_of("small")]
    assert sorted(kept) == ["day0", "day2", "day3", "day5", "day6"]


def test_with_fewer_than_three_others_their_move_is_shown_but_does_not_excuse_the_arm(tmp_path):
    # the reference may share the arm's code (the eager step a captured one replays)
    save_baseline(rmsnorm_run(peers={"torch_compile": 0.3}), tmp_path)
    slower_machine = rmsnorm_run(arm_ms=0.3, reference_ms=1.2, peers={"torch_compile": 0.36})
    cmp = compare(slower_machine, tmp_path)
    arm = next(e for e in cmp.entries if e.contender == "arm")
    assert arm.status == "regressed" and not cmp.passed
    assert arm.others == 2 and arm.others_moved == pytest.approx(1.2, rel=0.01)
    assert arm.beyond_others is None and "machine's drift" not in arm.note


FOUR_PEERS = {"torch_native": 0.5, "torch_compile": 0.3, "liger": 0.28, "quack": 0.27}


def test_a_change_that_three_or_more_others_share_is_the_machine(tmp_path):
    save_baseline(rmsnorm_run(peers=FOUR_PEERS), tmp_path)
    slower = {name: 1.2 * ms for name, ms in FOUR_PEERS.items()}
    cmp = compare(rmsnorm_run(arm_ms=0.3, reference_ms=1.2, peers=slower), tmp_path)
    arm = next(e for e in cmp.entries if e.contender == "arm")
    assert arm.others == 5 and arm.ratio == pytest.approx(1.2, rel=0.01)
    assert arm.beyond_others == pytest.approx(1.0, abs=0.01)
    assert arm.status == "same" and cmp.passed
    assert "regressed outright, same beyond the machine's drift" in arm.note and "+20" in arm.note
    assert "beyond others" in render_comparison(cmp)
    # an arm that lost more than the machine did still regresses
    worse = compare(rmsnorm_run(arm_ms=0.36, reference_ms=1.2, peers=slower), tmp_path)
    arm = next(e for e in worse.entries if e.contender == "arm")
    assert arm.status == "regressed" and arm.beyond_others == pytest.approx(1.2, rel=0.02)
    assert not worse.passed
    # and one that held still while the machine slowed is not called improved
    held = compare(rmsnorm_run(arm_ms=0.25, reference_ms=1.2, peers=slower), tmp_path)
    assert statuses(held)[("fwd", "arm")] == "same"
    arm = next(e for e in held.entries if e.contender == "arm")
    assert "same outright, improved beyond the machine's drift" in arm.note


def test_a_schema_3_baseline_is_read_with_each_entry_named_by_its_presets_run(tmp_path):
    path, = save_baseline(preset_run("small", "first"), tmp_path)
    save_baseline(preset_run("large", "second"), tmp_path)
    data = json.loads(path.read_text())
    data["schema_version"] = 3
    for entry in data["entries"]:
        del entry["run_id"]
    path.write_text(json.dumps(data))
    upgraded = load_baseline(path)
    assert {(e.preset, e.run_id) for e in upgraded.entries} == {("small", "first"), ("large", "second")}
    assert compare(preset_run("small", "later"), tmp_path).passed


def test_an_entry_of_a_run_the_file_does_not_list_is_refused(tmp_path):
    path, = save_baseline(preset_run("small", "first"), tmp_path)
    data = json.loads(path.read_text())
    data["entries"][0]["run_id"] = "elsewhere"
    path.write_text(json.dumps(data))
    with pytest.raises(UsageError, match=r"entries of runs the file does not list: small/elsewhere"):
        load_baseline(path)


def test_a_run_spread_over_two_classes_of_card_is_neither_saved_nor_compared(tmp_path):
    """A run over several GPUs (pytest --suite -n) carries each result's fingerprint: one class
    saves and compares as a one-GPU run does, two classes are refused by both."""
    h200, h100 = make_fingerprint(), make_fingerprint(gpu_name="NVIDIA H100", device_slug="nvidia-h100")
    report = rmsnorm_run(fingerprint=h200)
    second = report.results[0].model_copy(deep=True, update={"gate": "split-muon"})
    report.results = [report.results[0].model_copy(update={"fingerprint": h200.model_copy(update={"device": "cuda:0"})}),
                      second.model_copy(update={"fingerprint": h200.model_copy(update={"device": "cuda:1"})})]
    assert len(save_baseline(report, tmp_path)) == 2 and compare(report, tmp_path).mismatches == {}
    report.results[1].fingerprint = h100.model_copy(update={"device": "cuda:1"})
    for call in (lambda: save_baseline(report, tmp_path / "other"), lambda: compare(report, tmp_path)):
        with pytest.raises(UsageError, match="mixes two classes of card") as err:
            call()
        assert "cuda:1: compute_capability" in str(err.value) and "nvidia-h100" in str(err.value)
