"""The line every run ends on."""

from __future__ import annotations

from hftk.core.output import done_line


def test_done_line_says_time_quality_place_and_what_a_rerun_does():
    line = done_line(72.4, 40, 3.0, "out/final", None, resumes=True, newest_checkpoint=40)
    assert line == ("hftk: done: step 40 in 72 s, eval loss 3.0000, perplexity 20.09; the model is in out/final "
                    "(rerunning this command resumes from checkpoint-40)")
    assert "add --resume_from_checkpoint latest" in done_line(1, 40, None, "f", 20, resumes=False, newest_checkpoint=40)
    assert "no held-out data" in done_line(1, 40, None, "f", None, resumes=True, newest_checkpoint=40)
    assert "no checkpoint was saved: rerunning this command starts over" in done_line(
        1, 40, None, "f", None, resumes=True, newest_checkpoint=None)


def test_done_line_of_a_run_that_resumed_at_its_last_step():
    line = done_line(9.0, 40, 3.0, "out/final", 40, resumes=True, newest_checkpoint=40)
    assert line.startswith("hftk: the run was already complete at step 40: nothing left to train (eval loss 3.0000")


def test_done_line_of_a_dpo_run_says_its_loss_and_preference_accuracy_not_a_perplexity():
    line = done_line(5.0, 60, 0.4321, "out/final", None, resumes=True, newest_checkpoint=None, preference_accuracy=0.9)
    assert "eval DPO loss 0.4321, preference accuracy 0.900;" in line and "perplexity" not in line
