"""The README's main job (experiments/demo.py) runs end to end and its report holds its contracts."""

import json

from experiments import demo


def test_demo_runs_and_reports(tmp_path):
  demo.main(["--steps", "3", "--schemes", "rope,learned", "--out", str(tmp_path)])
  report = json.loads((tmp_path / "report.json").read_text())
  checks = report["checks"]
  assert checks["chunked_vs_formula_max_abs"] < 1e-4
  assert checks["decode_vs_full_max_abs"] < 1e-4
  assert abs(checks["rope_score(3,10)"] - checks["rope_score(103,110)"]) < 1e-3
  assert checks["alibi_max_bias_on_past_tokens"] <= 0.0
  assert set(report["final_loss"]) == {"rope", "learned"}
  mla = [r for r in report["kv_cache"] if r["variant"] == "MLA"][0]
  assert mla["numbers_per_token_per_layer"] == 576
