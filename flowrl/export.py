"""``flowrl export CHECKPOINT OUT_DIR [model overrides]``: a DCP checkpoint → a plain HF model dir.

    flowrl export outputs/run/checkpoints/step_000010 exported/        # model config from the ckpt
    flowrl export ckpt/step_000010 exported/ model.dtype=bfloat16       # the recorded model, changed
    flowrl export ckpt/step_000010 exported/ model=tiny                 # or from Hydra overrides
    flowrl export ckpt/step_000010 adapter/ --adapter-only              # LoRA run: the PEFT dir

A LoRA run (``model.lora``) is exported merged (``W0 + (alpha/r) B A``: a plain model of the base
architecture), or with ``--adapter-only`` as the PEFT adapter directory
(``peft.PeftModel.from_pretrained(base, OUT_DIR)``).

The result loads with ``AutoModelForCausalLM.from_pretrained(OUT_DIR)`` (safetensors + config +
tokenizer). Works for checkpoints of any world size (DCP re-shards on load) in one process.
"""
from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Optional


def _check_exists(ckpt: Path) -> None:
    """Before any slow import (torch, transformers): a mistyped path answers at once."""
    if not ckpt.is_dir():
        near = sorted(p.name for p in ckpt.parent.glob("step_*")) if ckpt.parent.is_dir() else []
        raise FileNotFoundError(f"export: no checkpoint at {ckpt} (not found" + (
            f"; {ckpt.parent} has {', '.join(near)})" if near else ")"))


def check_out_dir(out: Path, overwrite: bool) -> None:
    """``OUT_DIR`` before anything loads: a file there, or a folder that already holds files
    (an earlier export a new one would silently replace), is refused unless ``overwrite``.

    Raises:
        ValueError: naming the path and what is in it.
    """
    from flowrl.runtime.io.rundir import file_in_the_way

    blocker = file_in_the_way(out.absolute())
    if blocker == out.absolute():
        raise ValueError(f"export: {out} is a file, not a directory: choose a new directory")
    if blocker is not None:
        raise ValueError(f"export: {out} cannot be created: {blocker} is a file")
    held = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if held and not overwrite:
        shown = ", ".join(held[:4]) + (f", ... ({len(held)} in all)" if len(held) > 4 else "")
        raise ValueError(f"export: {out} already holds {shown}: choose a new or empty directory, "
                         "or pass --overwrite to write over it")


def written_tensors(out: Path) -> tuple[int, int]:
    """(tensors, bytes) of the ``*.safetensors`` files in ``out`` (the weights an export wrote;
    a tied weight counts once, as stored)."""
    from safetensors import safe_open

    n = size = 0
    for f in sorted(out.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            n += len(list(st.keys()))
        size += f.stat().st_size
    return n, size


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path, model_cfg=None, *,
                      role: str = "actor", adapter_only: bool = False,
                      overwrite: bool = False, model_overrides: Sequence[str] = ()) -> Path:
    """Load ``role``'s weights from a checkpoint and ``save_pretrained`` them with the tokenizer.

    Args:
        checkpoint: a ``step_XXXXXX`` folder written by :class:`CheckpointManager`.
        out_dir: destination folder (created).
        model_cfg: :class:`flowrl.models.loading.ModelConfig` of the architecture; default: the
            ``model`` entry of the checkpoint's ``trainer_state.json``.
        model_overrides: ``field=value`` settings (``dtype=bfloat16``, ``lora.alpha=32``) applied
            on top of the recorded ``model`` entry (with ``model_cfg`` None).
        role: which trainable engine's weights (``actor``; ``critic`` is a value model, not a LM).
        adapter_only: a LoRA checkpoint: write the PEFT adapter directory instead of the merged
            model.
        overwrite: write into an ``out_dir`` that already holds files (else refused).

    Returns: ``out_dir``.

    Raises:
        FileNotFoundError: no such directory, or not a complete checkpoint. ValueError: no model
            config anywhere, a model override that names no ``ModelConfig`` field or does not fit
            its type, a tampered / corrupt checkpoint
            (``runtime.io.checkpoint.verify_checkpoint``; nothing is loaded, connected or written
            then), a shard whose content does not load, ``adapter_only`` for a checkpoint
            without ``model.lora``, or an ``out_dir`` that is a file or (without ``overwrite``)
            already holds files (:func:`check_out_dir`).
    """
    ckpt = Path(checkpoint)
    _check_exists(ckpt)
    check_out_dir(Path(out_dir), overwrite)

    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from flowrl.models.loading import ModelConfig, load_model, load_tokenizer
    from flowrl.runtime.io.checkpoint import load_tensors, verify_checkpoint

    meta_path = ckpt / "trainer_state.json"
    if not (meta_path.is_file() and (ckpt / ".metadata").is_file()):
        # a run directory (or its checkpoints/ folder) given for one of its checkpoints
        inner = sorted(d for d in (*ckpt.glob("checkpoints/step_*"), *ckpt.glob("step_*"))
                       if (d / "trainer_state.json").is_file() and (d / ".metadata").is_file())
        if inner:
            raise FileNotFoundError(f"export: {ckpt} holds checkpoints but is not one: give one "
                                    f"of them, e.g. {inner[-1]} (the newest of {len(inner)})")
        raise FileNotFoundError(f"export: {ckpt} is not a complete flowrl checkpoint "
                                "(needs trainer_state.json and .metadata)")
    try:  # before anything loads or is written: a tampered index is refused here
        meta = verify_checkpoint(ckpt)
    except ValueError as e:
        raise ValueError(f"export: {e}") from e
    from flowrl.runtime.io.checkpoint import read_metadata

    # the roles with weights: their keys are <role>.model.<name> (rng and optimizer are not)
    held = sorted({k.split(".")[0] for k in read_metadata(ckpt).state_dict_metadata
                   if k.split(".")[1:2] == ["model"]})
    if role not in held:
        raise ValueError(f"export: {ckpt} holds no role {role!r} (--role); its roles: "
                         f"{', '.join(held) or 'none'}")
    if model_cfg is None:
        if "model" not in meta:
            raise ValueError(f"export: {meta_path} records no model config; pass model overrides "
                             "(flowrl export CKPT OUT model=...)")
        try:  # the recorded model, then the command line's model.<field>= settings on it
            model_cfg = OmegaConf.to_object(OmegaConf.merge(
                OmegaConf.structured(ModelConfig), meta["model"],
                OmegaConf.from_dotlist(list(model_overrides))))
        except OmegaConfBaseException as e:
            raise ValueError(f"export: model override {' '.join(f'model.{o}' for o in model_overrides)}"
                             f" does not fit the recorded model: {str(e).splitlines()[0]}") from e
    elif isinstance(meta.get("model"), dict):  # model=<name> given: it must be the trained one
        import dataclasses

        given = dataclasses.asdict(model_cfg)
        diffs = [f"model.{f}" for f in ("path", "gguf_file", "tiny")
                 if f in meta["model"] and meta["model"][f] != given[f]]
        if diffs:  # its tensors would not fit (a size mismatch deep in the load said so)
            trained = [o for o in meta.get("overrides") or [] if str(o).startswith("model=")]
            who = trained[0] if trained else "another model"
            raise ValueError(f"export: {ckpt} was trained with {who}, not the model given here "
                             f"({', '.join(diffs)} differ{'s' * (len(diffs) == 1)}): export "
                             "without model= (the recorded model is used)")
    recorded_lora = isinstance(meta.get("model"), dict) and meta["model"].get("lora") is not None
    if recorded_lora and model_cfg.lora is None:  # its tensors are the base's and the adapters'
        raise ValueError(f"export: {ckpt} was trained with LoRA (its model.lora is recorded): "
                         "export it merged (the default) or with --adapter-only, without "
                         "model.lora=null")
    if adapter_only and model_cfg.lora is None:
        raise ValueError(f"export: --adapter-only needs a LoRA checkpoint; {ckpt} has no model.lora")
    model = load_model(model_cfg)  # the architecture; every weight is replaced below
    peft_model = None
    if model_cfg.lora is not None:  # the base weights are the model config's; adapters are saved
        from flowrl.models.lora import inject_lora

        peft_model = inject_lora(model, model_cfg.lora)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    wanted = {n: t for n, t in model.state_dict().items() if peft_model is None or n in trainable}
    state = {role: {"model": wanted}}
    try:
        load_tensors(ckpt, state)
    except ValueError as e:  # a damaged shard (CorruptCheckpointError): one line, nothing written
        raise ValueError(f"export: {e}") from e
    except RuntimeError as e:  # tensors the model config does not have (DCP's missing key)
        raise ValueError(f"export: {ckpt}'s tensors do not fit the model config "
                         f"({str(e).splitlines()[0][:300]}); export without model overrides to "
                         "use the recorded model") from e
    model.load_state_dict(state[role]["model"], strict=peft_model is None)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if peft_model is None:
        model.save_pretrained(out)
    elif adapter_only:
        peft_model.save_pretrained(out)
    else:
        peft_model.merge_and_unload().save_pretrained(out)
    load_tokenizer(model_cfg).save_pretrained(out)
    from flowrl.models.vision import image_processor, is_vision_config

    if is_vision_config(model_cfg):  # a VLM directory needs its preprocessor_config.json too
        image_processor(model_cfg).save_pretrained(out)
    _umask_mode(out)
    return out


def _umask_mode(out: Path) -> None:
    """Give the weight files the mode of every other file of the export: transformers writes
    each shard to a ``mkstemp`` file (mode 0600) and renames it, so ``model.safetensors`` came
    out readable by its owner only (issue 27)."""
    import os

    mask = os.umask(0)
    os.umask(mask)
    for f in out.iterdir():
        if f.is_file() and f.suffix in (".safetensors", ".bin"):
            f.chmod(0o666 & ~mask)


def export_main(argv: list[str]) -> int:
    """CLI: ``flowrl export CHECKPOINT OUT_DIR [--role actor] [hydra overrides for model]``."""
    import argparse

    p = argparse.ArgumentParser(
        prog="flowrl export", description=__doc__.split("\n")[0],
        usage="flowrl export CHECKPOINT OUT_DIR [--role ROLE] [--adapter-only] [--overwrite] "
              "[model=NAME] [model.FIELD=VALUE ...]")
    p.add_argument("checkpoint", type=Path)
    p.add_argument("out_dir", type=Path)
    p.add_argument("--role", default="actor",
                   help="the trained role whose weights to export (default: actor)")
    p.add_argument("--adapter-only", action="store_true",
                   help="LoRA checkpoint: write the PEFT adapter directory, not the merged model")
    p.add_argument("--overwrite", action="store_true",
                   help="write into OUT_DIR even when it already holds files (else refused)")
    args, overrides = p.parse_known_args(argv)
    options = [o.split("=", 1)[0] for o in overrides if o.startswith("-")]
    if options:  # a mistyped option was read as a model override, and reported as one
        import difflib

        known = [a for act in p._actions for a in act.option_strings if a.startswith("--")]
        near = difflib.get_close_matches(options[0], known, n=1)
        p.error(f"unrecognized option {options[0]}" + (f" (did you mean {near[0]}?)" if near else ""))
    from flowrl.runtime.io.rundir import override_key

    if foreign := [o for o in overrides if not override_key(o).startswith("model")]:
        # only the model section is read; the rest would silently replace the checkpoint's
        # recorded model with the default one (a size mismatch, far from its cause)
        p.error(f"only model settings apply to an export (model=..., model.<field>=...), got "
                f"{' '.join(foreign)}; without any, the checkpoint's recorded model is used")
    _check_exists(args.checkpoint)
    check_out_dir(args.out_dir, args.overwrite)  # before composing or loading anything
    model_cfg: Optional[object] = None
    fields: list[str] = []
    if overrides and not any(override_key(o) == "model" for o in overrides):
        # only model.<field>= settings: they change the checkpoint's recorded model (composed
        # alone they would apply to the default model: a size mismatch at load)
        if dropped := [o for o in overrides if o.startswith("~")]:
            p.error(f"{dropped[0]}: a recorded model's field cannot be deleted; set another "
                    f"value instead ({dropped[0][1:].split('=', 1)[0]}=...)")
        fields = [o.lstrip("+").split(".", 1)[1] for o in overrides]
    elif overrides:  # model=<name> [model.<field>=...]: the model config as flowrl train composes it
        from flowrl.config import compose, to_train_config

        cfg = compose(overrides)
        cfg.trainer.output_dir = str(args.out_dir)  # no Hydra run dir when composing
        model_cfg = to_train_config(cfg).model
    import time

    from flowrl.models.loading import progress_bars_off

    t0 = time.perf_counter()
    with progress_bars_off(not sys.stderr.isatty()):  # a bar garbles a log file: one line instead
        out = export_checkpoint(args.checkpoint, args.out_dir, model_cfg, role=args.role,
                                adapter_only=args.adapter_only, overwrite=args.overwrite,
                                model_overrides=fields)
    n, size = written_tensors(out)
    print(f"exported {args.checkpoint} ({args.role}) to {out} ({n} tensors, "
          f"{size / 2**30:.3g} GiB) in {time.perf_counter() - t0:.1f} s")
    if args.adapter_only:  # the base it needs: a path of this machine (a GGUF's: its cache)
        import json

        base = json.loads((out / "adapter_config.json").read_text()).get("base_model_name_or_path")
        print(f"adapter base: {base} (this machine's copy of the model it was trained on; "
              "export without --adapter-only for weights that stand alone)")
    return 0
