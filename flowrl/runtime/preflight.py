"""What a run reads from disk, checked before any model loads (``flowrl.train.prepare``): the
model folder's tokenizer files, every training and evaluation row, and that the graph has a
verifier for the evaluation. Each problem is one line naming the file, the row and the field."""
from __future__ import annotations

from pathlib import Path


def check_run_inputs(cfg, plan) -> None:
    """Check the run's model folder and prompts (see the module docstring).

    Every training row (and every evaluation row when ``trainer.eval`` runs) must have its
    prompt, ground truth and extra fields (``flowrl.data.files``), and every ground truth must be
    one the graph's verifier can read (``EvalScorer.check_ground_truth``).

    Raises:
        ValueError: one line naming the file, the line/row and the field (``DataError``), the
            model folder and what it lacks, or the evaluation that has nothing to score with.
    """
    from flowrl.data import DataError, load_records
    from flowrl.data.files import load_file_records
    from flowrl.models.loading import check_model_dir
    from flowrl.runtime.evaluate import eval_scorer

    if not cfg.model.uses_bundled_tokenizer:
        check_model_dir(Path(cfg.model.path), cfg.model.gguf_file, tokenizer=True)
    data, ev = cfg.data, cfg.trainer.eval
    scorer = eval_scorer(plan)
    evaluates = (ev.before or ev.after) and ev.limit != 0
    if evaluates and scorer is None:
        raise ValueError("trainer.eval: the graph has no reward.rule or reward.function stage to "
                         "score answers against the ground truth; set trainer.eval.limit=0")
    sources = [(False, data.split, data.limit)] + ([(True, ev.split, ev.limit)] if evaluates else [])
    check = scorer.check_ground_truth if scorer is not None and data.ground_truth_key else None
    for for_eval, split, limit in sources:
        records = load_records(data, split, limit, for_eval=for_eval)
        if check is None:
            continue
        for i, r in enumerate(records):
            try:
                check(r["ground_truth"])
            except ValueError as e:
                path = (data.eval_path or data.path) if for_eval else data.path
                where = f"{data.name}/{split} row {i}" if path is None else load_file_records(
                    path, split, prompt_key=data.prompt_key, ground_truth_key=data.ground_truth_key,
                    extra_keys=tuple(data.extra_keys),
                    split_field="trainer.eval.split" if for_eval else "data.split")[1][i]
                raise DataError(f"{where}: field {data.ground_truth_key!r}: {e} (the graph's "
                                f"{scorer.name})") from None
