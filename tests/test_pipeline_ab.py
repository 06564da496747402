"""tools/pipeline_ab.py's paired ratio: each arm against the first arm in the same round."""

import importlib.util
import math
from pathlib import Path

spec = importlib.util.spec_from_file_location("pipeline_ab", Path(__file__).parents[1] / "tools" / "pipeline_ab.py")
tool = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tool)


def runs(*speeds):
    return [{"round": r, "decode_tok_s": s} for r, s in enumerate(speeds)]


def test_the_paired_ratio_follows_the_round_not_the_arms_medians():
    """The host halves its speed after two rounds; the arm is 1.1x the first in four rounds, 0.9x in one."""
    base = runs(1000, 1000, 500, 500, 500)
    other = runs(1100, 1100, 550, 550, 450)
    assert math.isclose(tool.paired(other, base)[0], 1.1) and tool.paired(other, base)[1] == 4
    assert tool.paired(base, base) == (1.0, 0)


def test_a_round_the_first_arm_missed_is_left_out():
    base = [{"round": 0, "decode_tok_s": 100.0}]
    assert tool.paired(runs(150, 90), base) == (1.5, 1)
    assert math.isnan(tool.paired(runs(150), [])[0])


def test_the_prompt_figure_pairs_the_same_way():
    base = [{"round": r, "decode_tok_s": 1.0, "prefill_tok_s": s} for r, s in enumerate((60.0, 30.0))]
    other = [{"round": r, "decode_tok_s": 1.0, "prefill_tok_s": s} for r, s in enumerate((75.0, 36.0))]
    assert tool.paired(other, base, "prefill_tok_s") == (1.225, 2) and tool.paired(other, base) == (1.0, 0)
