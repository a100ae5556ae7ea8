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


def test_done_line_of_a_grpo_run_says_its_final_mean_reward():
    line = done_line(5.0, 30, 0.01, "out/final", None, resumes=False, newest_checkpoint=None,
                     rewards={"train_reward": 0.25, "train_reward_step": 30, "eval_reward": 0.125})
    assert line.startswith("hftk: done: step 30 in 5 s, final mean reward 0.2500 (step 30), eval reward 0.1250; ")
    assert "perplexity" not in line
    assert "no reward logged" in done_line(5.0, 3, None, "f", None, resumes=False, newest_checkpoint=None, rewards={})


def test_trls_is_gradient_checkpointing_notice_is_quiet_at_its_source():
    """TRL reads transformers' deprecated alias around every generation (DPO's and GRPO's reference forwards too):
    after ``quiet_libraries`` the property warns nothing; transformers' other FutureWarnings still show."""
    import warnings

    from transformers import AutoConfig, AutoModelForCausalLM

    from hftk.core.output import quiet_libraries
    from hftk.data.builtin import materialize_model

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(materialize_model("builtin:gpt2-tiny")))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        quiet_libraries(on_cpu=True)
        assert model.is_gradient_checkpointing is False
        warnings.warn_explicit("`other` is deprecated", FutureWarning, "modeling_utils.py", 1,
                               module="transformers.modeling_utils")
    assert [str(w.message) for w in caught] == ["`other` is deprecated"]
