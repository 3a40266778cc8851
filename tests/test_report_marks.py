"""decoupled_diloco.report marks every fault a run's events.jsonl records on its time axis."""

import json

from decoupled_diloco import report


class _Axis:
    """Records the vertical lines drawn on it."""

    def __init__(self):
        self.lines = []

    def axvline(self, x, label=None, **style):
        self.lines.append((x, label))


def test_a_learner_out_for_good_is_marked(tmp_path):
    """A Ray learner whose restarts ran out (`learner_lost`), one stopped for repeating an
    error (`learner_stopped`, runtime/ray/failures.py) and one down when its membership
    ended (`learner_gone`) were never marked: the plot showed no fault where it died (a
    review found it). Each is read with its time and drawn there, labelled once."""
    events = [
        {"event": "learner_lost", "learner": 1, "step": 40, "error": "", "time": 12.0},
        {"event": "learner_gone", "learner": 1, "step": 40, "life_start": 8, "time": 12.5},
        {
            "event": "learner_stopped",
            "learner": 2,
            "step": 50,
            "error": "boom",
            "time": 20.0,
            "failures": 3,
        },  # fmt: skip
        {"event": "learner_gone", "learner": 2, "step": 50, "life_start": 30, "time": 20.5},
    ]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    ax = _Axis()
    report._marks(ax, report._rows(str(tmp_path), "events.jsonl"))
    assert [x for x, _ in ax.lines] == [12.0, 12.5, 20.0, 20.5]
    labels = [label for _, label in ax.lines]
    assert labels[0].startswith("learner lost") and labels[2].startswith("learner stopped")
    assert labels[1].startswith("learner gone") and labels[3] is None  # (one legend entry)
