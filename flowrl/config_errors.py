"""Hydra/OmegaConf composition errors as one line that names the override and what to change.

Hydra reports a bad override over 6-15 lines (the exception, its cause's ``full_key`` /
``object_type`` block, the config search path, the HYDRA_FULL_ERROR hint) and often without
the fix: ``Key 'kl_coeff' not in 'AlgorithmConfig'`` suggests appending with ``+``, which flowrl
then refuses as an unknown key. :func:`explain` turns each kind into one line:

- an unknown group option: ``graph=grpoo: no such option (did you mean graph=grpo?); choose one
  of dapo, ...`` (every group: model, trainer, rollout, placement, cluster, teacher, data, ...);
- an optional group given without ``+``: ``launcher=multinode: ... add it with +launcher=...``;
- an unknown key: ``unknown key algorithm.kl_coeff (did you mean algorithm.kl_coef?)``;
- a key under a section that is null until given: ``model.lora.rank=8: model.lora is null by
  default (off); turn it on with +model.lora.rank=8``, or, where a group option set that section
  (``teacher=tiny`` sets ``teacher.tiny``), ``teacher.tiny has no key vocab_size; add it with
  +teacher.tiny.vocab_size=1000 (its keys: ...)``;
- a dict or a key set over a null ``Dict`` section no given option set: ``model.tiny.model_type=
  llama: model.tiny is null by default (unset), ...; start from an option that sets it, e.g.
  model=tiny ...``;
- a value of the wrong type: ``algorithm.n=2.5: algorithm.n takes an integer, got 2.5``;
- an override that does not parse: ``override 'trainer.total_steps' has no '='``;
- ``placement.pools.*`` without ``placement=partitioned``.

``flowrl train`` (``flowrl.train.main``, where the run's one composition fails) and ``flowrl plan``
print the same line (exit status 2).
"""
from __future__ import annotations

import difflib
import re
from typing import Any, Optional, Sequence

# OmegaConf's "could not be converted to <Type>" → what the field takes
_TYPE_WORDS = {"Integer": "an integer", "Float": "a number", "Boolean": "true or false",
               "String": "a string"}
# groups whose options are files of conf/<group>/, and the way to use something else instead
_OWN = {"graph": " (or graph.path=FILE for your own graph file)",
        "model": " (or model.path=DIR for a local model folder)",
        "data": " (or data.path=FILE for your own prompts)"}


def closest(word: str, options: Sequence[str]) -> Optional[str]:
    """The option ``word`` most likely misspells, or None. difflib's 0.6 similarity first; below
    it, an option sharing the first 3+ letters at 0.5 (``tiniest`` -> ``tiny`` scores 0.55: the
    longer misspelling of a short name). Case is ignored (``SmolLM2`` -> ``smollm2``)."""
    low = {o.lower(): o for o in options}
    close = difflib.get_close_matches(word.lower(), list(low), n=1)
    if close:
        return low[close[0]]
    w = word.lower()
    prefixed = [o for o in low if len(w) >= 3 and o[:3] == w[:3]]
    ratio = {o: difflib.SequenceMatcher(None, w, o).ratio() for o in prefixed}
    best = max(prefixed, key=lambda o: ratio[o], default=None)
    return low[best] if best is not None and ratio[best] >= 0.5 else None


def _group_files(group: str) -> list[str]:
    """The options of a config group that is not in the defaults list (conf/<group>/*.yaml, e.g.
    ``launcher``), sorted; [] for a name that is no folder of conf/."""
    from flowrl.config import REPO_ROOT

    return sorted(f.stem for f in (REPO_ROOT / "conf" / group).glob("*.yaml"))


def _schema():
    from omegaconf import OmegaConf

    from flowrl.config import TrainConfig

    return OmegaConf.structured(TrainConfig)


def _field_type(cls: Any, name: str) -> Optional[type]:
    """The dataclass type of field ``name`` of dataclass ``cls`` (``Optional[X]`` -> X), or None
    when it is not a dataclass."""
    import dataclasses
    import typing

    if cls is None or not dataclasses.is_dataclass(cls):
        return None
    t = typing.get_type_hints(cls).get(name)
    args = [a for a in typing.get_args(t) if a is not type(None)]
    t = args[0] if typing.get_origin(t) is typing.Union and len(args) == 1 else t
    return t if isinstance(t, type) and dataclasses.is_dataclass(t) else None


def _bool_field(path: Sequence[str]) -> Optional[bool]:
    """For a dotted schema path: None when the leaf is not a bool field, else whether it is
    ``Optional[bool]`` (null allowed)."""
    import dataclasses
    import typing

    from flowrl.config import TrainConfig

    cls: Any = TrainConfig
    for part in path[:-1]:
        cls = _field_type(cls, part)
    if cls is None or not dataclasses.is_dataclass(cls):
        return None
    t = typing.get_type_hints(cls).get(path[-1])
    if t is bool:
        return False
    args = typing.get_args(t)
    return True if typing.get_origin(t) is typing.Union and set(args) == {bool, type(None)} else None


def loose_bool_override(overrides: Sequence[str]) -> Optional[str]:
    """One line for a bool field given anything but true or false (or null where the field
    allows it), or None. OmegaConf reads any integer and yes/no/on/off as a bool, so
    ``trainer.engine.gradient_checkpointing=7`` would silently turn it on and ``=0`` off."""
    for o in overrides:
        if o.startswith("~") or "=" not in o:
            continue
        key, value = o.lstrip("+").split("=", 1)
        optional = _bool_field(key.split("."))
        if optional is None:
            continue
        v = value.strip().strip("'\"").lower()
        if v in ("true", "false") or (optional and v == "null") or v.startswith("${"):
            continue  # (an interpolation resolves later, to whatever it names)
        return (f"{key}={value}: {key} takes true or false{' (or null)' if optional else ''}, "
                f"got {value!r}")
    return None


def null_group_override(overrides: Sequence[str]) -> Optional[str]:
    """One line for a key set under a config group whose default is null (``cluster.nodes=2``
    without ``cluster=<option>``: Hydra fails with a bare ``AssertionError: Unexpected type for
    root: NoneType``), or None when no override does that."""
    for o in overrides:
        key = o.split("=", 1)[0]
        if key.startswith(("+", "~")) or "." not in key:
            continue
        group = key.split(".", 1)[0]
        files = _group_files(group)
        if not files or any(x.lstrip("+").split("=", 1)[0] == group for x in overrides):
            continue
        if _default(group, object()) is not None:
            continue
        value = o.split("=", 1)[1] if "=" in o else "VALUE"
        return (f"{key}={value}: {group} is null by default (this machine); choose one first with "
                f"{group}=<option> (options: {', '.join(files)}){key_hint(key)}")
    return None


def null_dict_override(overrides: Sequence[str]) -> Optional[str]:
    """One line for an override into a ``Dict`` section that is null in the schema, with no
    group option given that sets it: a whole dict (``model.tiny={model_type:llama}``: OmegaConf
    cannot merge a dict into a null ``Dict`` field and fails with ``AttributeError: 'NoneType'
    object has no attribute 'get'``) or a key under it (``model.tiny.model_type=llama``: Hydra's
    bare ``Unexpected type for root: NoneType``); it names the group options that set the
    section. None when no override does that."""
    for o in overrides:
        given = o.lstrip("+")
        name, _, value = given.partition("=")
        parts = name.split(".")
        whole = value.lstrip().startswith("{")
        # the section: the override's key itself for a whole dict, else its first null prefix
        candidates = [name] if whole else [".".join(parts[:i]) for i in range(2, len(parts))]
        section = next((c for c in candidates if "." in c and _default(c, object()) is None), "")
        if not section:
            continue
        group, sub = section.split(".", 1)
        if any(x.lstrip("+").split("=", 1)[0] == group for x in overrides):
            continue  # the group option is given (model=tiny): the section is set, not null
        # the group's options whose file sets this section: starting from one, its keys can be set
        options = [f for f in _group_files(group) if _option_sets(group, f, sub)]
        if whole:
            head = (f"{given}: {section} is null by default, and a whole section cannot be set "
                    "over null from the command line")
            example = given
        else:
            if not options:  # a null dataclass section (model.lora): later rules turn it on
                continue
            head = (f"{given}: {section} is null by default (unset), so nothing can be set "
                    "under it from the command line")
            # a key the option's section lacks is new there: Hydra adds it with '+'
            example = given if _option_sets(group, options[0], name.split(".", 1)[1]) \
                else f"+{given}"
        tail = (f"start from an option that sets it, e.g. {group}={options[0]} '{example}' "
                f"(options that set {section}: {', '.join(options)})" if options else
                f"no {group}=<option> sets it: write it in a config file of conf/{group}/")
        return f"{head}; {tail}"
    return None


def _option_sets(group: str, option: str, sub: str) -> bool:
    """Whether conf/<group>/<option>.yaml sets ``sub`` (a dotted key below the group) to a
    non-null value."""
    from omegaconf import OmegaConf

    from flowrl.config import REPO_ROOT

    node = OmegaConf.load(REPO_ROOT / "conf" / group / f"{option}.yaml")
    # a `# @package _global_` file (conf/model/*.yaml) nests its keys under the group's name
    return any(OmegaConf.select(node, k, default=None) is not None for k in (sub, f"{group}.{sub}"))


def key_hint(full_key: str) -> str:
    """`` (did you mean algorithm.kl_coef?)`` for a misspelt dotted key, from the schema."""
    from omegaconf import DictConfig, OmegaConf

    parts = full_key.split(".")
    node: Any = _schema()
    for p in parts[:-1]:
        if not isinstance(node, DictConfig) or p not in node:
            return ""
        child = node[p]
        if child is None:  # a null section (cluster, model.lora): its dataclass's keys
            ref = _field_type(OmegaConf.get_type(node), p)
            child = OmegaConf.structured(ref) if ref is not None else None
        node = child
    if not isinstance(node, DictConfig):
        return ""
    if parts[-1] in list(node.keys()):  # the key exists (e.g. under a null section): nothing to suggest
        return ""
    close = closest(parts[-1], [str(k) for k in node.keys()])
    prefix = ".".join(parts[:-1])
    return f" (did you mean {prefix + '.' if prefix else ''}{close}?)" if close else ""


def _default(full_key: str, missing: Any = None) -> Optional[Any]:
    """The schema's default of ``full_key``; ``missing`` when the schema has no such key."""
    from omegaconf import OmegaConf

    try:
        return OmegaConf.select(_schema(), full_key, default=missing, throw_on_missing=False)
    except Exception:  # a key OmegaConf cannot select (interpolation, missing): no example
        return missing


def _is_null_section(full_key: str) -> bool:
    """``full_key`` is a schema field whose default is None (``model.lora``: a section that is
    off until given); a key the schema lacks is not."""
    missing = object()
    return _default(full_key, missing) is None


def _composed_without(key: str, section: str, overrides: Sequence[str]) -> Optional[Any]:
    """``section`` of the composition of ``overrides`` less those setting ``key`` (the one that
    failed), or None when it is null there or that composition fails too."""
    from omegaconf import OmegaConf

    from flowrl.config import compose

    rest = [o for o in overrides if o.lstrip("+~").split("=", 1)[0] != key]
    try:
        return OmegaConf.select(compose(rest), section, default=None)
    except Exception:  # another bad override: nothing to tell from this composition
        return None


def _is_free_form(node: Any) -> bool:
    """``node`` is a mapping section that takes any key (a ``dict`` field such as
    ``model.tiny``), where Hydra's ``+key=value`` adds one; a dataclass section has fixed keys."""
    import dataclasses

    from omegaconf import DictConfig, OmegaConf

    return isinstance(node, DictConfig) and not dataclasses.is_dataclass(OmegaConf.get_type(node))


def _first_unparsable(overrides: Sequence[str]) -> tuple[str, str]:
    """The first override Hydra's grammar rejects, and the parser's reason."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    for o in overrides:
        try:
            parser.parse_override(o)
        except Exception as e:  # the grammar's own error types vary by Hydra version
            reason = re.sub(r" expecting \{.*\}", "", str(e).split("See https://")[0])
            return o, " ".join(reason.split())
    return "", ""


def _pools_message(full_key: str, overrides: Sequence[str]) -> str:
    partitioned = any(o.strip() in ("placement=partitioned", "+placement=partitioned")
                      for o in overrides)
    if partitioned:
        return (f"{full_key}: a partitioned placement has exactly two pools, placement.pools.train "
                "and placement.pools.rollout")
    return (f"{full_key}: placement.pools is read only by placement=partitioned: add "
            "placement=partitioned before it (or drop the pools for this placement)")


def explain(e: BaseException, overrides: Sequence[str] = ()) -> str:
    """One line for a Hydra/OmegaConf composition error of ``overrides`` (no trailing period).

    Unknown kinds fall back to the error's own message lines joined with ``; ``."""
    from hydra.errors import MissingConfigException, OverrideParseException
    from omegaconf import DictConfig, ListConfig
    from omegaconf.errors import (
        ConfigAttributeError,
        ConfigKeyError,
        OmegaConfBaseException,
        ValidationError,
    )

    if isinstance(e.__cause__, AssertionError) and (line := null_group_override(overrides)):
        return line  # config.compose re-raised Hydra's bare assert
    if isinstance(e.__cause__, (AttributeError, AssertionError)) and \
            (line := null_dict_override(overrides)):
        return line  # config.compose re-raised OmegaConf's / Hydra's error on a null Dict field
    if isinstance(e, MissingConfigException) and e.missing_cfg_file and "/" in e.missing_cfg_file:
        group, name = e.missing_cfg_file.rsplit("/", 1)
        options = ", ".join(e.options or []) or "(none)"
        close = closest(name, list(e.options or []))
        plus = "+" if f"+{group}={name}" in overrides else ""  # an added group (+launcher=...)
        hint = f" (did you mean {plus}{group}={close}?)" if close else ""
        return (f"{plus}{group}={name}: no such option{hint}; choose one of {options}"
                f"{_OWN.get(group, '')}")
    m = re.match(r"Could not override '([\w/]+)'\. No match in the defaults list", str(e))
    if m and _group_files(m.group(1)):  # an optional group (launcher): it is added, not replaced
        group = m.group(1)
        given = next((o.split("=", 1)[1] for o in overrides if o.startswith(f"{group}=")), "")
        files = _group_files(group)
        pick = given if given in files else closest(given, files)
        fix = f"+{group}={pick}" if pick else f"+{group}=<option>"
        return (f"{group}={given}: the {group} group has no default to replace; add it with "
                f"{fix} (options: {', '.join(files)})")
    if isinstance(e, OverrideParseException):
        bad, reason = _first_unparsable(overrides)
        if bad and "=" not in bad:
            return (f"override '{bad}' has no '=': write {bad}=VALUE (+{bad}=VALUE adds a key, "
                    f"~{bad} removes one)")
        if bad:
            return (f"override '{bad}' cannot be parsed ({reason}): write key=value and quote a "
                    "value holding brackets, commas, '=' or spaces, e.g. key='a,b'")
    cause: Optional[BaseException] = e
    while cause is not None and not isinstance(cause, OmegaConfBaseException):
        cause = cause.__cause__
    if isinstance(cause, OmegaConfBaseException) and cause.full_key:
        key = str(cause.full_key)
        first = str(cause).splitlines()[0] if str(cause) else ""
        if isinstance(cause, ValidationError):
            m = re.search(r"could not be converted to (\w+)", first)
            want = _TYPE_WORDS.get(m.group(1), m.group(1)) if m else None
            value = cause.value
            if want is not None:
                default = _default(key)
                example = f" (e.g. {key}={default})" if default is not None and \
                    not isinstance(default, (dict, list)) else ""
                return f"{key}={value}: {key} takes {want}, got {value!r}{example}"
            if "is not a subclass of" in first:  # a section given a plain value
                return (f"{key}={value}: {key} is a section, not a value; set one of its keys "
                        f"({key}.<name>=VALUE)")
            if "is not Optional" in first or "Incompatible value 'None'" in first:
                default = _default(key)  # null given to a field that has no "off" value
                if isinstance(default, (dict, list, DictConfig, ListConfig)):
                    return (f"{key}=null: {key} is a section that cannot be null; set one of "
                            f"its keys ({key}.<name>=VALUE)")
                shown = str(default).lower() if isinstance(default, bool) else default
                example = f" (its default: {key}={shown})" if default is not None else ""
                return f"{key}=null: {key} takes a value, not null{example}"
            if "is not a ListConfig, list or tuple" in first:  # a list field given one value
                return (f"{key}={value}: {key} takes a list, got {value!r} (e.g. "
                        f"{key}=[{value}]; quote it in a shell that expands brackets: "
                        f"'{key}=[{value}]')")
            return f"{key}: {first}"
        if isinstance(cause, (ConfigKeyError, ConfigAttributeError)):
            if key.startswith("placement.pools"):
                return _pools_message(key, overrides)
            parent = key.rsplit(".", 1)[0] if "." in key else ""
            section_given = any(o.lstrip("+~").split("=", 1)[0] == parent for o in overrides)
            if parent and not section_given and _is_null_section(parent):
                value = next((o.split("=", 1)[1] for o in overrides
                              if o.split("=", 1)[0] == key), "VALUE")
                # null in the schema, but a group option may have set it (teacher=tiny sets
                # teacher.tiny): then the key is new to a set section, not under a null one
                composed = _composed_without(key, parent, overrides)
                if composed is not None and _is_free_form(composed):  # teacher=tiny, teacher.tiny.x
                    name = key.rsplit(".", 1)[1]
                    keys = [str(k) for k in composed.keys()]
                    close = closest(name, keys)
                    hint = f" (did you mean {parent}.{close}?)" if close else ""
                    return (f"{key}={value}: {parent} has no key {name}{hint}; add it with "
                            f"+{key}={value} (its keys: {', '.join(keys) or '(none)'})")
                if composed is None:  # model.lora.rank=8, no '+'
                    return (f"{key}={value}: {parent} is null by default (off); turn it on with "
                            f"+{key}={value} (or {parent}={{{key.rsplit('.', 1)[1]}: {value}}})")
            return (f"unknown key {key}{key_hint(key)}: nothing reads it; `flowrl train --cfg job` "
                    "prints every key")
    from flowrl.config import one_line

    return one_line(e)

