"""tools/paper_claims.py on a hand-made report.json: every printed number is derived by hand below."""

from __future__ import annotations

import json
import math

import pytest

from tests.tools.load_tool import load_tool

T_975 = {1: 12.706204736174707, 2: 4.302652729749464}
"""97.5% quantiles of Student's t with 1 and 2 degrees of freedom (tables): the 95% intervals of 2 seeds, and of
Welch's difference of two rows of 2 seeds with equal spreads (Welch-Satterthwaite: 2 degrees of freedom)."""
ROW_HALF = T_975[1] * 0.02 / math.sqrt(2)  # a row of 2 seeds with std 0.02: 0.180
DIFF_HALF = T_975[2] * math.sqrt(2 * 0.02**2 / 2)  # two such rows, Welch: 4.30 x 0.02 = 0.086


def _load():
    return load_tool("paper_claims")


def _claims(tmp_path, capsys, report: dict) -> str:
    """The markdown ``paper_claims`` prints for ``report`` (written as report.json)."""
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report))
    assert _load().main([str(path)]) == 0
    return capsys.readouterr().out


def _row(p, c, gain, std, tps, kl=None, ent=None, lam=None):
    steps = [0, 10, 20, 30]
    hist = {}
    if kl:
        hist["mismatch_kl"] = {"step": steps, "mean": kl}
    if ent:
        hist["entropy"] = {"step": steps, "mean": ent}
    if lam:
        hist["mismatch/ais_lambda"] = {"step": steps, "mean": lam}
    return {
        "group": {"rollout.precision": p, "corrector.name": c},
        "val_accuracy_gain": {"mean": gain, "std": std, "n": 2},
        "rollout_tokens_per_s": {"mean": tps, "std": 0.0, "n": 2},
        "histories": hist,
    }


REPORT = {
    "rows": [
        _row("fp32", "none", 0.20, 0.02, 1000),
        _row(
            "fp8",
            "none",
            0.10,
            0.02,
            500,
            kl=[1e-3, 2e-3, 3e-3, 4e-3],
            ent=[2.0, 1.5, 1.0, 0.5],
            lam=[0.1, 0.2, 0.3, 0.4],
        ),
        _row("fp8", "tis", 0.14, 0.02, 500),
        _row("fp8", "mis", 0.16, 0.02, 500),
        _row("fp8", "ais", 0.19, 0.02, 600),
    ]
}


def test_claims_numbers(tmp_path, capsys):
    text = _claims(tmp_path, capsys, REPORT)
    assert (round(ROW_HALF, 3), round(DIFF_HALF, 3)) == (0.180, 0.086)
    # 1: none - fp32 = -0.100 ± 0.086 (Welch), half of the fp32 gain lost; each row ± 0.180 over its 2 seeds
    assert (
        "| fp8 | +0.100 ± 0.180 (2) | +0.200 ± 0.180 (2) | -0.100 ± 0.086 | n/a | 50% |" in text
    )  # nothing to pair
    # 2: gap 0.1; tis (0.14-0.1)/0.1 = 0.4, mis 0.6, ais 0.9, one row each, best first
    gap = "| fp8 (gap +0.100 ± 0.086) |"  # 0.1 > 0.086: not marked
    assert f"{gap} ais | +0.190 ± 0.180 (2) | 2 | +0.090 ± 0.086 | n/a | 0.90 |" in text
    assert f"{gap} tis | +0.140 ± 0.180 (2) | 2 | +0.040 ± 0.086 | n/a | 0.40 |" in text
    assert text.index(f"{gap} ais") < text.index(f"{gap} mis") < text.index(f"{gap} tis")
    # 3: AIS 0.19 vs best mis 0.16 -> +0.030
    assert "| fp8 | +0.190 | mis +0.160 | +0.030 ± 0.086 | n/a |" in text
    # 4: quarters of 4 values = first and last value; lambda falls with entropy: corr -1
    # (no variance amplification history: the correction size is n/a)
    assert (
        "| fp8, none | 1.00e-03 -> 4.00e-03 | 2.000 -> 0.500 | 0.1000 -> 0.4000 | n/a -> n/a | -1.00 |"
        in text
    )
    # 5: fp8 runs average (500 + 500 + 500 + 600) / 4 = 525 -> 0.53x of fp32's 1000
    assert "| fp8 | 525 | 0.53x |" in text


def test_correction_size_is_lambda_times_root_chi2(tmp_path, capsys):
    # V = 1 + chi2_A per step [1.04, 1.09, 1.16, 1.25] -> sqrt(chi2) = [0.2, 0.3, 0.4, 0.5];
    # lambda [0.1, 0.2, 0.3, 0.4] -> lambda sqrt(chi2) = [0.02, 0.06, 0.12, 0.20]: first / last quarter 0.02 / 0.2
    report = json.loads(json.dumps(REPORT))
    steps = [0, 10, 20, 30]
    report["rows"][1]["histories"]["ais/variance_amplification"] = {
        "step": steps,
        "mean": [1.04, 1.09, 1.16, 1.25],
    }
    text = _claims(tmp_path, capsys, report)
    assert "| 0.1000 -> 0.4000 | 0.0200 -> 0.2000 | -1.00 |" in text
    size = _load().correction_size(
        {"step": [0, 1, 2], "mean": [0.5, None, 1.0]}, {"step": [0, 1, 2], "mean": [1.25, 1.0, 0.99]}
    )
    assert size == {"step": [0, 2], "mean": [0.25, 0.0]}  # a missing lambda is skipped, V < 1 counts as 0


def test_gap_within_noise_is_marked(tmp_path, capsys):
    rows = [dict(r) for r in REPORT["rows"]]
    rows[1] = _row("fp8", "none", 0.17, 0.02, 500)  # gap 0.03 < 0.086
    text = _claims(tmp_path, capsys, {"rows": rows})
    assert "| fp8 (gap +0.030 ± 0.086 (0 in the gap's 95% interval)) | ais |" in text
    # 3: without a gap the uncorrected run can be the best of none / TIS / MIS: 0.19 - 0.17
    assert "| fp8 | +0.190 | none +0.170 | +0.020 ± 0.086 | n/a |" in text
    # a gap of 3 standard errors (0.06 / 0.02), which "within 2 SE" called resolved, is noise at 2 + 2 seeds
    rows[1] = _row("fp8", "none", 0.14, 0.02, 500)
    assert "| fp8 (gap +0.060 ± 0.086 (0 in the gap's 95% interval)) |" in _claims(
        tmp_path, capsys, {"rows": rows}
    )


def test_option_keyed_reports_leave_other_algorithms_out(tmp_path, capsys):
    """Reports grouped by the options picked (``rollout``, ``corrector``) and holding a Sol-RL row with
    the same rollout and corrector as a GRPO row: the claims read the GRPO one."""

    def keyed(row, algorithm="grpo"):
        group = row["group"]
        return {
            **row,
            "group": {
                "algorithm": algorithm,
                "rollout": group["rollout.precision"],
                "corrector": group["corrector.name"],
            },
        }

    rows = [keyed(r) for r in REPORT["rows"]]
    rows.append(keyed(_row("fp8", "none", 0.90, 0.02, 9000), algorithm="solrl"))  # would change every claim
    text = _claims(tmp_path, capsys, {"rows": rows})
    assert "| fp8 (gap +0.100 ± 0.086) | ais | +0.190" in text and "| fp8 | 525 | 0.53x |" in text


def test_missing_baseline_is_a_clear_error(tmp_path, capsys):
    tool = _load()
    path = tmp_path / "report.json"
    path.write_text(json.dumps({"rows": REPORT["rows"][1:]}))
    assert tool.main([str(path)]) == 2
    assert "fp32 / none" in capsys.readouterr().err


def _with_val(row, means, stds, steps=(0, 25, 50, 75, 100)):
    history = {"step": list(steps), "mean": means, "std": stds, "n": [2] * len(steps)}
    return {**row, "histories": {**row["histories"], "val_accuracy": history}}


def test_early_vs_late_and_a_named_baseline(tmp_path, capsys):
    """Claim 6 against hand values, on a report whose baseline is the diffusion family's llada_fp32."""

    def renamed(row):
        p = row["group"]["rollout.precision"]
        return {**row, "group": {**row["group"], "rollout.precision": f"llada_{p}"}}

    rows = [renamed(r) for r in REPORT["rows"][:3]]  # fp32 / none, fp8 / none, fp8 / tis
    rows[0] = _with_val(rows[0], [0.5, 0.55, 0.6, 0.7, 0.8], [0.0, 0.03, 0.0, 0.0, 0.04])
    rows[1] = _with_val(rows[1], [0.5, 0.60, 0.6, 0.6, 0.7], [0.0, 0.04, 0.0, 0.0, 0.03])
    rows[2] = _with_val(rows[2], [0.5, 0.58, 0.6, 0.7, 0.75], [0.0, 0.0, 0.0, 0.0, 0.0])
    text = _claims(
        tmp_path, capsys, {"rows": rows, "baseline": {"precision": "llada_fp32", "corrector": "none"}}
    )
    assert "### 1. Uncorrected low precision vs llada_fp32" in text
    # early = the validation nearest to 100 / 4 = 25; Welch: se^2 = s1^2/2 + s2^2/2, and the degrees of freedom
    # se^4 / ((s1^2/2)^2 + (s2^2/2)^2) = 1.85 (both sides 2 seeds)
    from scipy.stats import t

    va, vb = 0.03**2 / 2, 0.04**2 / 2
    half = t.ppf(0.975, (va + vb) ** 2 / (va**2 + vb**2)) * math.sqrt(va + vb)  # early and late alike
    assert round(half, 3) == 0.164  # t(1.85) = 4.64 x 0.0354
    # no reward curves in these rows: the reward cells say so
    assert (
        f"| llada_fp8 | llada_fp32 | 25 | -0.050 ± {half:.3f} | 100 | +0.100 ± {half:.3f} | n/a | n/a |"
        in text
    )
    # tis has no spread: the interval is none's alone, 1 degree of freedom
    early_tis, late_tis = (T_975[1] * math.sqrt(s**2 / 2) for s in (0.04, 0.03))
    assert f"| llada_fp8 | tis | 25 | -0.020 ± {early_tis:.3f} | 100 | +0.050 ± {late_tis:.3f} |" in text


def test_early_vs_late_reward_quarters(tmp_path, capsys):
    """Claim 6's reward cells: first / last quarter means of the seed-mean reward curves, minus none's."""
    val = ([0.5, 0.6, 0.7, 0.8, 0.9], [0.0] * 5)
    rows = [_with_val(json.loads(json.dumps(r)), *val) for r in REPORT["rows"][:3]]  # fp32, fp8 none, fp8 tis
    rewards = (
        [0.4, 0.6, 0.5, 0.5, 0.7, 0.9, 0.9, 0.9],
        [0.5, 0.5, 0.4, 0.4, 0.6, 0.6, 0.7, 0.9],
        [0.3, 0.3, 0.5, 0.5, 0.6, 0.6, 0.8, 0.8],
    )
    for row, reward in zip(rows, rewards):
        row["histories"]["reward"] = {"step": list(range(8)), "mean": reward}
    text = _claims(tmp_path, capsys, {"rows": rows})
    # quarters of 8 steps are 2 steps: fp32 0.5 / 0.9, none 0.5 / 0.8, tis 0.3 / 0.8
    assert "| fp8 | fp32 | 25 | +0.000 ± 0.000 | 100 | +0.000 ± 0.000 | +0.000 | +0.100 |" in text
    assert "| fp8 | tis | 25 | +0.000 ± 0.000 | 100 | +0.000 ± 0.000 | -0.200 | +0.000 |" in text


@pytest.mark.parametrize(
    "values, expected", [([1.0, 2.0, 3.0], (math.nan, math.nan)), ([1, 2, 3, 4, 5, 6, 7, 8], (1.5, 7.5))]
)
def test_quarter_means(values, expected):
    got = _load().quarter_means({"mean": values})
    for g, e in zip(got, expected):
        assert (math.isnan(g) and math.isnan(e)) or g == pytest.approx(e)


def _with_values(row: dict, seeds: list[str], values: list[float | None]) -> dict:
    row = json.loads(json.dumps(row))
    row["seeds"] = seeds
    row["val_accuracy_gain"]["values"] = values
    return row


def test_differences_paired_by_seed(tmp_path, capsys):
    """ais - none per seed: 0.05, 0.04, 0.08 -> mean 0.0567, s.d. sqrt(((1/150)^2 + (1/60)^2 + (7/300)^2) / 2)
    = 0.02082, s.e. 0.02082 / sqrt(3) = 0.01202, 95% t-interval (2 degrees of freedom) 4.303 x 0.01202 = 0.05171.
    Only seeds both rows ran, with values, are paired."""
    tool = _load()
    none = _with_values(REPORT["rows"][1], ["0", "1", "2"], [0.10, 0.20, 0.30])
    ais = _with_values(REPORT["rows"][4], ["0", "1", "2"], [0.15, 0.24, 0.38])
    d, half, n = tool.paired_diff(ais, none, "val_accuracy_gain")
    assert (d, half, n) == (pytest.approx(0.17 / 3), pytest.approx(T_975[2] * 0.0120185, abs=1e-6), 3)
    unpaired = _with_values(REPORT["rows"][4], ["0", "1", "5"], [0.15, None, 0.38])
    assert tool.paired_diff(unpaired, none, "val_accuracy_gain")[2] == 1  # seed 1 has no value, 5 no partner
    assert math.isnan(tool.paired_diff(unpaired, none, "val_accuracy_gain")[0])
    rows = [REPORT["rows"][0], none, *REPORT["rows"][2:4], ais]
    assert "| +0.090 ± 0.086 | +0.057 ± 0.052 (3) | 0.90 |" in _claims(tmp_path, capsys, {"rows": rows})


# --lambda-plot: a report grouped by the options picked, AIS at two precisions with lambda near 0 (int8,
# harmless mismatch) and near 1 (fp4, ruinous), plus the baseline / none rows the claims need.
LAMBDA_STEPS = [0, 10, 20, 30]


def _hist(means, std=0.01, n=2):
    return {"step": LAMBDA_STEPS, "mean": means, "std": [std] * len(means), "n": [n] * len(means)}


def _lambda_row(p, c, lam=None, kl=None, ent=None):
    row = _row(p, c, 0.1, 0.02, 500)
    row["group"] = {"algorithm": "grpo", "rollout": p, "corrector": c}
    row["n_runs"] = 2
    hist = {"entropy": _hist(ent or [1.0, 0.9, 0.8, 0.7]), "mismatch_kl": _hist(kl or [1e-3] * 4, std=1e-4)}
    if lam:
        hist["ais_lambda"] = _hist(lam, std=0.02)
    row["histories"] = hist
    return row


LAMBDA_REPORT = {
    "experiment": "lambda-sweep",
    "rows": [
        _lambda_row("fp32", "none"),
        _lambda_row("int8", "none"),
        _lambda_row("fp4", "none"),
        _lambda_row("int8", "ais", lam=[0.10, 0.12, 0.08, 0.10], kl=[2e-3, 3e-3, 2e-3, 1e-3]),
        _lambda_row(
            "fp4", "ais", lam=[0.85, 0.90, 0.92, 0.95], kl=[5e-2, 6e-2, 8e-2, 1e-1], ent=[1.2, 1.0, 0.6, 0.3]
        ),
    ],
}


@pytest.fixture
def drawn(monkeypatch):
    """The figures the tool closes, kept open for inspection: ``{axes label: axes}`` per figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    yield figures
    monkeypatch.undo()
    for fig in figures:
        plt.close(fig)


def _axes(fig) -> dict:
    return {ax.get_label(): ax for ax in fig.axes}


def _scatter_points(ax) -> list[tuple[float, float]]:
    return [tuple(p) for c in ax.collections for p in c.get_offsets().tolist()]


def _lambda_main(tmp_path, report, *args):
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report))
    return _load().main([str(path), "--lambda-key", "ais_lambda", *args])


def test_lambda_plot_draws_both_precisions(tmp_path, capsys, drawn):
    import matplotlib.image

    tool = _load()
    png = tmp_path / "plots" / "lambda.png"
    assert _lambda_main(tmp_path, LAMBDA_REPORT, "--lambda-plot", str(png)) == 0
    out = capsys.readouterr()
    assert "### 4." in out.out and "wrote" not in out.out  # stdout is the markdown, redirectable
    assert out.err.strip() == f"wrote {png}"
    assert png.stat().st_size > 0
    width, height = (int(x * tool.LAMBDA_DPI) for x in tool.LAMBDA_FIGSIZE)
    assert matplotlib.image.imread(png).shape[:2] == (height, width)  # 800 x 1400

    (fig,) = drawn
    axes = _axes(fig)
    assert "lambda-sweep" in fig.get_suptitle()
    lam, kl = axes["lambda"], axes["mismatch_kl"]
    assert [line.get_label() for line in lam.get_lines()] == ["fp4 (n=2)", "int8 (n=2)"]
    assert [list(line.get_ydata()) for line in lam.get_lines()] == [
        [0.85, 0.90, 0.92, 0.95],
        [0.10, 0.12, 0.08, 0.10],
    ]
    assert len(lam.collections) == 2  # a ± std band per precision (2 runs each)
    # the same colour per precision in (a), (b), (c); steps shared, KL on a log axis
    for name in ("entropy", "mismatch_kl"):
        assert [line.get_color() for line in axes[name].get_lines()] == [
            line.get_color() for line in lam.get_lines()
        ]
        assert axes[name].get_shared_x_axes().joined(axes[name], lam)
    assert kl.get_yscale() == "log"
    # (d): every step of both rows, lambda on 0..1, KL on a log axis, coloured by entropy
    sc = axes["scatter"]
    assert sorted(_scatter_points(sc)) == sorted(
        [
            (5e-2, 0.85),
            (6e-2, 0.90),
            (8e-2, 0.92),
            (1e-1, 0.95),
            (2e-3, 0.10),
            (3e-3, 0.12),
            (2e-3, 0.08),
            (1e-3, 0.10),
        ]
    )
    assert [c.get_label() for c in sc.collections] == ["fp4", "int8"]
    assert list(sc.collections[0].get_array()) == [1.2, 1.0, 0.6, 0.3]  # fp4's entropy per step
    assert sc.get_xscale() == "log" and sc.get_ylim()[0] <= 0 and sc.get_ylim()[1] >= 1
    assert axes["<colorbar>"].get_ylabel() == "entropy (nats)"


def test_lambda_plot_skips_rows_without_lambda(tmp_path, capsys, drawn):
    rows = [json.loads(json.dumps(r)) for r in LAMBDA_REPORT["rows"]]
    del rows[3]["histories"]["ais_lambda"]  # int8 / ais logged no lambda
    png = tmp_path / "lambda.png"
    assert _lambda_main(tmp_path, {**LAMBDA_REPORT, "rows": rows}, "--lambda-plot", str(png)) == 0
    err = capsys.readouterr().err
    assert "skips int8, ais: no 'ais_lambda' history" in err and "fp4" not in err
    (fig,) = drawn
    assert [line.get_label() for line in _axes(fig)["lambda"].get_lines()] == ["fp4 (n=2)"]
    assert len(_scatter_points(_axes(fig)["scatter"])) == 4


@pytest.mark.parametrize(
    "args",
    [
        ["--lambda-corrector", "tis"],  # no row with that corrector
        ["--lambda-key", "mismatch/ais_lambda"],  # the ais rows have no such history
    ],
)
def test_lambda_plot_without_qualifying_rows_is_an_error(tmp_path, capsys, args):
    png = tmp_path / "lambda.png"
    assert _lambda_main(tmp_path, LAMBDA_REPORT, "--lambda-plot", str(png), *args) == 2
    err = capsys.readouterr().err.splitlines()[-1]  # after the rows skipped for want of lambda
    assert err.startswith("paper_claims: error: ") and "--lambda-corrector" in err and "--lambda-key" in err
    assert not png.exists()


def test_lambda_plot_leaves_out_nonpositive_kl(tmp_path, drawn):
    """KL 0, nan (NaN in the JSON) and null (what report.json writes for nan) are left out of the log
    panels; lambda and entropy keep every step."""
    report = json.loads(json.dumps(LAMBDA_REPORT))
    report["rows"][3]["histories"]["mismatch_kl"]["mean"] = [0.0, float("nan"), 2e-3, None]
    report["rows"][4]["histories"]["mismatch_kl"]["mean"] = [5e-2, -1e-3, 8e-2, 1e-1]
    report = json.loads(json.dumps(report))  # nan survives as NaN
    png = _load().plot_lambda_regimes(report, "ais_lambda", "ais", tmp_path / "lambda.png")
    assert png == tmp_path / "lambda.png" and png.stat().st_size > 0
    (fig,) = drawn
    axes = _axes(fig)
    # fp4 keeps 3 steps, int8 1 of 4
    assert sorted(_scatter_points(axes["scatter"])) == [
        (2e-3, 0.08),
        (5e-2, 0.85),
        (8e-2, 0.92),
        (1e-1, 0.95),
    ]
    assert [list(line.get_xdata()) for line in axes["mismatch_kl"].get_lines()] == [[0, 20, 30], [20]]
    assert [len(line.get_xdata()) for line in axes["lambda"].get_lines()] == [4, 4]


def test_gap_recovered_over_the_seeds_a_row_shares(tmp_path, capsys):
    """A row pooled with fewer seeds (AIS on seeds 0, 1 of 0-3) is measured on its own seeds: gap over
    seeds 0, 1 = ((0.20 - 0.10) + (0.30 - 0.20)) / 2 = 0.10, AIS - none = (0.08 + 0.06) / 2 = 0.07 -> 0.70,
    not the ratio of means over different seeds (0.22 - 0.125) / (0.25 - 0.125) = 0.76."""
    tool = _load()
    seeds = ["0", "1", "2", "3"]
    base = _with_values(REPORT["rows"][0], seeds, [0.20, 0.30, 0.10, 0.40])
    none = _with_values(REPORT["rows"][1], seeds, [0.10, 0.20, 0.10, 0.10])
    ais = _with_values(REPORT["rows"][4], ["0", "1"], [0.18, 0.26])
    assert tool.recovered_share(ais, none, base, "val_accuracy_gain") == pytest.approx(0.70)
    same = _with_values(REPORT["rows"][4], seeds, [0.18, 0.26, 0.10, 0.20])  # same seeds: ratio of means
    assert tool.recovered_share(same, none, base, "val_accuracy_gain") == pytest.approx(
        (0.185 - 0.125) / (0.25 - 0.125)
    )
    assert math.isnan(tool.recovered_share(_with_values(ais, ["7"], [0.5]), none, base, "val_accuracy_gain"))
    out = _claims(tmp_path, capsys, {"rows": [base, none, ais]})
    (line,) = [ln for ln in out.splitlines() if "| ais |" in ln]
    assert line.endswith("| 0.70 |")


def test_rows_of_two_forms_of_one_corrector_stay_apart(tmp_path, capsys):
    """A report grouped by a third key (AIS with two spreads): the row that sets it is labelled with it,
    the one that leaves it unset keeps the plain name, and both are scored against the best of none/TIS/MIS."""
    rows = [{**r, "group": {**r["group"], "corrector.spread": None}} for r in REPORT["rows"]]
    exact = _row("fp8", "ais", 0.17, 0.02, 600)
    exact["group"]["corrector.spread"] = "impurity"
    out = _claims(tmp_path, capsys, {"rows": [*rows, exact]})
    assert "| fp8 | +0.190 | mis +0.160 | +0.030 ± 0.086 |" in out  # the plain row, as before
    assert "| fp8, ais (corrector.spread=impurity) | +0.170 | mis +0.160 | +0.010 ± 0.086 |" in out
    assert "| ais (corrector.spread=impurity) | +0.170 ± 0.180 (2) |" in out  # section 2: its own row


def test_lambda_rows_pick_one_form_of_a_corrector():
    """With two AIS forms in one report, --lambda-corrector names the form: its rows only, per precision."""
    exact = _lambda_row("fp4", "ais", lam=[0.95, 0.96, 0.97, 0.98])
    exact["group"]["corrector.spread"] = "impurity"
    report = {**LAMBDA_REPORT, "rows": [*LAMBDA_REPORT["rows"], exact]}
    tool = _load()
    picked = tool.lambda_rows(report, "ais_lambda", "ais (corrector.spread=impurity)")
    assert [(p, row["histories"]["ais_lambda"]["mean"][0]) for p, row in picked] == [("fp4", 0.95)]
    assert [p for p, _ in tool.lambda_rows(report, "ais_lambda", "ais")] == ["fp4", "int8"]  # sorted by name
