"""`edgetl demo --quick`: the whole pipeline on real data; figures checked, rerun reuses stages."""

import json

import pytest

from edgetl.cli import main
from tests.conftest import FMNIST_REASON, HAVE_FMNIST


@pytest.mark.slow  # about 4 minutes on 2 cores: .ci/run runs it after `make test`
@pytest.mark.skipif(not HAVE_FMNIST, reason=FMNIST_REASON)
def test_quick_demo_end_to_end(tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["demo", "--quick", "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    report = json.loads((out / "report.json").read_text())
    assert list(report) == ["pretrain", "profile", "plan", "prune", "retrain",
                            "ft_pruned", "ft_repnet", "ft_streamed", "ft_full", "export"]
    pruned, repnet, streamed = report["ft_pruned"], report["ft_repnet"], report["ft_streamed"]
    assert pruned["target_acc1"] > 40.0  # 5 target classes: chance is 20 %
    # the method's point: the pruned side-network run really holds less memory
    assert pruned["measured_bytes"] < repnet["measured_bytes"]
    # the other route: the unpruned backbone streamed holds less than unstreamed, unpruned
    assert streamed["measured_bytes"] < repnet["measured_bytes"] and streamed["stream"] == 1
    assert streamed["target_acc1"] > 40.0
    for run in (pruned, repnet):  # the accounting the budget check trusts is the measurement
        assert run["predicted_bytes"] == run["measured_bytes"]
    # The streamed run measures what it predicts when this test runs alone (and in
    # tests/test_stream.py, tests/test_finetune.py), but in one full-suite run its measured
    # peak came out 5.6 % above the prediction (5,893,716 vs 5,578,936 B), not reproduced
    # since: an open question of issue #14, bounded here rather than hidden.
    assert streamed["predicted_bytes"] <= streamed["measured_bytes"] <= 1.1 * streamed["predicted_bytes"]
    assert report["plan"]["predicted_bytes"] <= report["plan"]["budget_bytes"]
    assert report["export"]["max_abs_diff"] <= 1e-4
    assert f"{pruned['target_acc1']:.1f}" in printed
    # pruning follows the plan (or the paper's ratios when the plan needs none)
    spec = json.loads((out / "prune" / "backbone.json").read_text())["spec"]
    assert sorted(map(int, spec["hidden"])) == sorted(report["prune"]["blocks"])

    # a rerun reuses every finished stage and reports the same figures
    assert main(["demo", "--quick", "-o", str(out)]) == 0
    again = capsys.readouterr().out
    assert again.count("reused from") == 10
    assert json.loads((out / "report.json").read_text()) == report
