"""antidistill's findings on synthetic points: a temperature sweep, an ADS line that hurts its students
(10 points below temperature at equal teacher accuracy), one that helps them, three seeds each; the
verdicts, the matched comparison, the paper's crossing and the attackers against their shared control."""

from __future__ import annotations

import pytest

from opdkit.jobs.antidistill import findings as f
from opdkit.notebook import verdicts

SEEDS = (42, 43, 44)
NOISE = {42: -0.01, 43: 0.0, 44: 0.012}  # moves every point of a seed together (shared noise)
TEMPERATURE = {1.0: (0.93, 0.80), 1.2: (0.85, 0.70), 1.4: (0.75, 0.55)}  # τ: (teacher, student)


def temperature_student(teacher: float) -> float:
    xs = sorted(v[0] for v in TEMPERATURE.values())
    ys = [dict(TEMPERATURE.values())[x] for x in xs]
    return verdicts.interpolate(xs, ys, teacher)


def point(method: str, lam: float, tau: float, teacher: float, student: float, **more) -> dict:
    runs = [
        {"seed": s, "teacher_accuracy": teacher, "student_accuracy": student + NOISE[s], **more.get(s, {})}
        for s in SEEDS
    ]
    return {
        "name": f"{method}-lam{lam:g}-tau{tau:g}",
        "method": method,
        "lam": lam,
        "temperature": tau,
        "runs": runs,
    }


def synthetic(ads_shift: float = -0.10, answer_shift: float = 0.05) -> list[dict]:
    pts = [point("temperature", 0.0, tau, *ts) for tau, ts in TEMPERATURE.items()]
    for lam, teacher in ((0.05, 0.88), (0.1, 0.78)):
        pts.append(point("ads", lam, 1.0, teacher, temperature_student(teacher) + ads_shift))
    pts.append(point("ads-answer", 0.03, 1.0, 0.80, temperature_student(0.80) + answer_shift))
    return pts


def test_lines_follow_the_sweep_and_start_at_lambda_zero():
    lines = f.lines(synthetic())
    assert list(lines) == ["temperature", "ADS (τ=1)", "ADS, answer-token gradient (τ=1)"]
    assert [p["temperature"] for p in lines["temperature"]] == [1.0, 1.2, 1.4]
    assert [p["lam"] for p in lines["ADS (τ=1)"]] == [0.0, 0.05, 0.1]


def test_points_carry_means_and_intervals_over_their_runs():
    p = f.with_intervals(synthetic()[0])
    assert p["student_accuracy"] == pytest.approx(0.80 + sum(NOISE.values()) / 3)
    low, high = p["student_accuracy_ci"]
    assert low < p["student_accuracy"] < high and p["teacher_accuracy_ci"] == [0.93, 0.93]
    assert "opd_student_accuracy" not in p  # not measured: no entry


def test_each_ads_point_against_temperature_at_its_own_teacher_accuracy():
    gaps = {g["name"]: g for g in f.point_gaps(synthetic())}
    ads = gaps["ads-lam0.05-tau1"]
    assert ads["mean"] == pytest.approx(-0.10) and ads["word"] == "holds" and ads["n"] == 3
    assert gaps["ads-answer-lam0.03-tau1"]["word"] == "does not hold"
    assert "less accurate than temperature sampling" in ads["claim"]


def test_a_gap_within_the_seed_noise_is_said_so():
    pts = synthetic(ads_shift=0.0)
    for p in pts:  # the ADS points alone move with seeds: their gaps carry the noise
        if p["method"] == "ads":
            for r, d in zip(p["runs"], (-0.03, 0.0, 0.035)):
                r["student_accuracy"] += d
    word = {g["name"]: g["word"] for g in f.point_gaps(pts)}["ads-lam0.05-tau1"]
    assert word == "within noise at 3 seeds"


def test_matched_teacher_accuracy_is_one_every_line_reaches():
    m = f.matched(synthetic())
    assert m["teacher_accuracy"] == pytest.approx(0.80)  # the answer line's lowest: the highest of the lowest
    by = {line["label"]: line for line in m["lines"]}
    assert by["temperature"]["mean"] == pytest.approx(temperature_student(0.80) + sum(NOISE.values()) / 3)
    assert by["ADS (τ=1)"]["vs_temperature"]["word"] == "holds"
    line = [0.80, temperature_student(0.88) - 0.10, temperature_student(0.78) - 0.10]  # λ 0, 0.05, 0.1
    ads_at = verdicts.interpolate([0.93, 0.88, 0.78], line, 0.80)  # the line itself, interpolated
    assert by["ADS (τ=1)"]["vs_temperature"]["mean"] == pytest.approx(ads_at - temperature_student(0.80))
    assert by["ADS, answer-token gradient (τ=1)"]["vs_temperature"]["word"] == "does not hold"
    assert "vs_temperature" not in by["temperature"]


def test_the_papers_crossing_interpolated_seed_by_seed():
    before = 0.60
    cross = {c["label"]: c for c in f.crossings(synthetic(), before)}
    t = cross["temperature"]
    expected = [
        0.85 + (0.75 - 0.85) * (0.70 + NOISE[s] - before) / ((0.70 + NOISE[s]) - (0.55 + NOISE[s]))
        for s in SEEDS
    ]
    assert t["by_seed"] == pytest.approx(expected) and t["reached"] == 3 and t["ci"] is not None
    assert t["mean"] == pytest.approx(sum(expected) / 3)
    answer = cross["ADS, answer-token gradient (τ=1)"]  # never falls to 60 % in its sweep
    assert (
        answer["reached"] == 0 and answer["mean"] is None and answer["lowest_teacher"] == pytest.approx(0.80)
    )
    assert f.crossings(synthetic(), None) == []


def test_attackers_against_their_shared_control_and_damaged_students():
    pts = synthetic()
    start = 0.30
    for p in pts:
        for r in p["runs"]:
            r["opd_plain_student_accuracy"] = 0.50 + NOISE[r["seed"]]
            if p["method"] == "ads":  # λ 0.05: slowed, above its start; λ 0.1: below its start
                r["opd_student_accuracy"] = (0.40 if p["lam"] == 0.05 else 0.20) + NOISE[r["seed"]]
    pts = [f.with_intervals(p) for p in pts]
    found = {a["name"]: a for a in f.attackers(pts, start)}
    assert set(found) == {"ads-lam0.05-tau1", "ads-lam0.1-tau1"}  # λ = 0 points: opd is the control there
    slowed, damaged = found["ads-lam0.05-tau1"], found["ads-lam0.1-tau1"]
    assert slowed["word"] == "holds" and slowed["mean"] == pytest.approx(-0.10) and not slowed["damaged"]
    assert damaged["damaged"] and damaged["below_start"] == "holds"
    assert damaged["control"]["mean"] == pytest.approx(slowed["control"]["mean"])  # the one shared control


def test_one_seed_gives_no_verdict_stronger_than_noise():
    pts = synthetic()
    for p in pts:
        p["runs"] = p["runs"][:1]
    out = f.findings({"points": pts, "student_accuracy_before": 0.6})
    assert out["seeds"] == 1
    assert {g["word"] for g in out["gaps"]} == {"within noise at 1 seed"}
    assert all(
        line.get("vs_temperature", {"word": "within noise at 1 seed"})["word"] == "within noise at 1 seed"
        for line in out["matched"]["lines"]
    )


def _crossing_points(ads: tuple[tuple[float, float], ...]) -> list[dict]:
    """The temperature sweep, an ADS line at τ 1 through `ads` ((teacher, student) per λ 0.05, 0.1) and the
    answer line that never falls to 60 %."""
    pts = [point("temperature", 0.0, tau, *ts) for tau, ts in TEMPERATURE.items()]
    pts += [point("ads", lam, 1.0, *ts) for lam, ts in zip((0.05, 0.1), ads)]
    pts.append(point("ads-answer", 0.03, 1.0, 0.80, 0.675))
    return pts


def test_the_paired_crossing_verdict_against_a_hand_computation():
    """Undistilled level 60 %. Temperature falls to it between (85 %, 70 %+n) and (75 %, 55 %+n): at
    85 - 10·(10+n)/15, i.e. 79.0, 78.333, 77.533 % for the seeds' n = -1, 0, +1.2 points. ADS, between (88 %,
    75 %+n) and (78 %, 45 %+n): at 88 - 10·(15+n)/30, i.e. 83.333, 83.0, 82.6 %. Paired differences 4.3333,
    4.6667, 5.0667 points: mean 4.68889, s 0.367171, half-width t(0.975, 2) 4.302653 × s / √3 = 0.912107."""
    gaps = {
        g["label"]: g
        for g in f.findings(
            {"points": _crossing_points(((0.88, 0.75), (0.78, 0.45))), "student_accuracy_before": 0.60}
        )["crossing_gaps"]
    }
    ads = gaps["ADS (τ=1)"]
    assert ads["word"] == "holds" and ads["n"] == 3 and ads["missing"] == []
    assert ads["claim"] == "ADS (τ=1)'s crossing lies above temperature's"
    assert ads["mean"] == pytest.approx(0.0468889, abs=1e-6)
    assert ads["ci"] == pytest.approx([0.0468889 - 0.00912107, 0.0468889 + 0.00912107], abs=1e-6)
    answer = gaps["ADS, answer-token gradient (τ=1)"]  # never falls to 60 %: no verdict, and why
    assert answer["word"] == "not measured" and answer["mean"] is None
    assert answer["missing"] == [{"label": "ADS, answer-token gradient (τ=1)", "reached": 0, "seeds": 3}]


def test_a_crossing_below_temperature_s_is_reversed_and_a_line_short_of_a_seed_is_named():
    """ADS between (80 %, 70 %+n) and (70 %, 50 %+n): at 80 - 10·(10+n)/20 = 75.5, 75.0, 74.4 %, below
    temperature's 79.0, 78.333, 77.533 % in every seed: the claim does not hold."""
    pts = _crossing_points(((0.80, 0.70), (0.70, 0.50)))
    [ads, _] = f.findings({"points": pts, "student_accuracy_before": 0.60})["crossing_gaps"]
    assert ads["word"] == "does not hold"
    assert ads["mean"] == pytest.approx((-0.035 - 0.0333333 - 0.0313333) / 3, abs=1e-6)
    pts[2]["runs"][0]["student_accuracy"] = 0.65  # temperature's last point, seed 42: stays above 60 %
    [ads, _] = f.findings({"points": pts, "student_accuracy_before": 0.60})["crossing_gaps"]
    assert ads["word"] == "not measured"
    assert ads["missing"] == [{"label": "temperature", "reached": 2, "seeds": 3}]
