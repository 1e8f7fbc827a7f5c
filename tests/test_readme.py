"""The README's quick start runs as written (keeps the README true as the code changes)."""

import pathlib
import re

import numpy as np


def test_readme_quick_start_runs():
  text = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
  code = re.search(r"## Quick start\n\n```python\n(.*?)```", text, re.S).group(1)
  scope: dict = {}
  exec(compile(code, "README.md", "exec"), scope)  # noqa: S102 - our own documentation
  assert scope["logits"].shape == (2, 16, 1000)
  assert scope["next_logits"].shape == (2, 1, 1000)
  assert scope["out"].shape == (1, 1024, 8, 64)
  # (8 simulated devices here: the sequence really is split eight ways)
  want = scope["jaxattn"].dot_product_attention(scope["q"], scope["k"], scope["v"], is_causal=True)
  np.testing.assert_allclose(np.asarray(scope["out_cp"]), np.asarray(want), atol=2e-5)
  assert scope["y_next"].shape == (2, 1, 256) and list(scope["paged"].lengths) == [16, 14]
  assert scope["y3"].shape == (2, 3, 256) and (scope["y3"][1, 1:] == 0).all()
  assert scope["ids"].shape == (2, 12)
  results = scope["results"]
  assert sorted(results) == scope["rids"]
  assert [r.size for r in results.values()] == [n + 8 for n in (3, 20, 7, 5, 11)]
  answers = scope["answers"]
  assert sorted(answers) == scope["later"] and all(a.size == 41 + 8 for a in answers.values())
  assert scope["engine"].stats.prefix_hit_tokens == 2 * 2 * 16
  assert scope["ids8"].shape == (2, 12)
  assert scope["engine8"].cache.groups[0][0].key_pool.dtype == np.int8
  assert scope["engine8"].cache.nbytes <= 8 << 20
  np.testing.assert_array_equal(scope["spec"], scope["ids"])        # greedy: generate's tokens
  assert scope["stats"].emitted == 7 and scope["stats"].rounds >= 1
  assert scope["served"].num_draft_tokens == 4


def test_readme_test_command_matches_ci():
  root = pathlib.Path(__file__).parents[1]
  readme, ci = (root / "README.md").read_text(), (root / ".ci" / "run").read_text()
  command = "-m pytest -n 2 --dist worksteal -q"
  assert command in readme and command in ci
  assert 'install -e ".[test,tpu-compile]"' in readme and '-e ".[test,tpu-compile]"' in ci
