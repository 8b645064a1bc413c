"""`.ci/run` runs the README's test command, then the slow tests in a second, bounded step (issue 13 item 11)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command_then_the_slow_tests_bounded() -> None:
    script = (ROOT / ".ci" / "run").read_text()
    readme = (ROOT / "README.md").read_text()
    command = re.search(r'pip install "torch==2\.13\.0" -e "\.\[test\]" && python -m pytest -q', readme)
    assert command, "the README's quickstart test command"
    assert 'pip install --quiet "torch==2.13.0" -e ".[test]" && python -m pytest -q\n' in script
    slow = re.search(r'timeout "\$SLOW_LIMIT_S" python -m pytest -q -m slow', script)
    assert slow and script.index(command.group(0).split(" && ")[1]) < slow.start()
    limit = int(re.search(r"SLOW_LIMIT_S=(\d+)", script).group(1))
    assert 0 < limit <= 900
    assert "-eq 5" in script.split("-m slow")[1]  # no slow test collected fails too


def test_the_slow_marker_selects_the_long_tests() -> None:
    names = {"test_expert_tensor_and_pipeline_parallel_match_single_process",
             "test_torchrun_shrinks_the_world_when_a_node_is_lost", "test_gpt3_175b_on_1024_a100_completes"}
    found = set()
    for path in (ROOT / "tests").glob("test_*.py"):
        text = path.read_text()
        for m in re.finditer(r"@pytest\.mark\.slow\s*\n(?:@.*\n)*def (\w+)", text):
            found.add(m.group(1))
    assert names <= found
