"""How `import hf_chainflow` hooks into `model.generate`, narrowly.

transformers has no registry for third-party candidate generators.  Two class attributes of
`transformers.GenerationMixin` are wrapped, and both wrappers return the original behaviour untouched unless
`assistant_model` is a ChainFlow or Lafa drafter (or `custom_generate` is `hf_chainflow.speculative_generate`):

- `generate`: reads the drafting settings once (`hf_chainflow.generation.settings.SpeculativeSettings`) and checks the call
  up front (`validate_speculative_call`, before anything changes), then either lets transformers' assisted-decoding
  loop run (chain drafting on dense targets) or routes the call to hf_chainflow's own loop through transformers'
  `custom_generate` hook (tree mode, a lookup branch, a Lafa drafter, hybrid/stateful targets, stop strings and
  custom stopping criteria, which a multi-token commit in transformers' loop could overshoot; a batch of more than
  one prompt or a left-padded one), handing either loop the settings; a batch above the drafter's
  `max_speculative_batch_size` runs plain `generate` (the same output) and says so in `drafter.last_stats`.
- `_get_candidate_generator`: returns a `ChainFlowCandidateGenerator` for a ChainFlow drafter.

Both wrappers bind their arguments against transformers' own signatures (`inspect.signature`), so every argument
reaches transformers as it was given; `install` refuses a transformers whose signatures lack a parameter they read.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import functools
import inspect

import torch
from transformers import GenerationConfig, StoppingCriteriaList
from transformers.generation.stopping_criteria import StopStringCriteria
from transformers.generation.utils import GenerationMixin

from hf_chainflow.generation.candidate_generator import ChainFlowCandidateGenerator
from hf_chainflow.generation.loop import speculative_generate
from hf_chainflow.generation.settings import SpeculativeSettings, is_fused_drafter, validate_speculative_call
from hf_chainflow.generation.stats import SpeculativeStats


def is_chainflow_drafter(obj) -> bool:
    """True for objects that draft the ChainFlow way (`ChainFlowDrafter`, `OracleDrafter`)."""
    return getattr(obj, "is_chainflow_drafter", False) is True


def runs_in_chainflow(obj) -> bool:
    """True for the assistants whose `generate` calls hf_chainflow runs: ChainFlow drafters, and fused-forward
    drafters (`LafaDrafter`, always in hf_chainflow's own loop: its drafts come out of the verify forward)."""
    return is_chainflow_drafter(obj) or is_fused_drafter(obj)


def effective_generation_config(model, generation_config: GenerationConfig | None, kwargs: dict) -> GenerationConfig:
    """The generation config `generate` will use: transformers' own merge (the given config, its unset fields
    filled from `model.generation_config`, then matching kwargs), so a model default such as `stop_strings` is seen
    here too. `kwargs` is not changed."""
    config, _ = model._prepare_generation_config(copy.copy(generation_config), **dict(kwargs))
    return config


@contextlib.contextmanager
def bound_for_the_call(model, drafter):
    """Bind an unbound drafter to the target calling `generate`, for the call and after it; a call that raises (one of
    hf_chainflow's checks, or transformers refusing an argument) leaves the drafter unbound again, as it came.

    A drafter made for another kind of target fails to bind (`bind_target` compares fingerprints); one already bound
    to another target object is refused by `validate_speculative_call`.
    """
    bound_here = not getattr(drafter, "is_bound", True)
    if bound_here:
        drafter.bind_target(model)
    try:
        yield
    except BaseException:
        if bound_here:
            drafter.unbind_target()
        raise


_original_generate = GenerationMixin.generate
_original_get_candidate_generator = GenerationMixin._get_candidate_generator
# The wrappers bind their arguments against transformers' own signatures, so every argument reaches transformers as
# it was given. The names below are the ones the wrappers read or change (checked by `install`, and in
# tests/test_generate_api.py against the whole parameter lists).
_GENERATE = inspect.signature(_original_generate)
_GET_CANDIDATE_GENERATOR = inspect.signature(_original_get_candidate_generator)
_GENERATE_PARAMETERS_USED = ("inputs", "generation_config", "stopping_criteria", "assistant_model", "streamer",
                             "custom_generate", "kwargs")
_GET_CANDIDATE_GENERATOR_PARAMETERS_USED = ("generation_config", "logits_processor", "assistant_model")
# The settings of the ChainFlow `generate` call running transformers' assisted loop in this context, for its
# candidate generator: (drafter, SpeculativeSettings).
_CALL_SETTINGS: contextvars.ContextVar = contextvars.ContextVar("hf_chainflow_call_settings", default=None)


@functools.wraps(_original_generate)
def _generate(self, *args, **kwargs):
    call = _GENERATE.bind(self, *args, **kwargs).arguments  # the named parameters given, by name
    call.pop("self")
    extra = call.pop("kwargs", {})  # the rest: model kwargs and generation-config fields
    custom_generate, drafter = call.get("custom_generate"), call.get("assistant_model")
    direct = custom_generate is speculative_generate  # direct use of the own loop: `drafter=` among the kwargs
    if direct:
        drafter = extra.get("drafter")
        if drafter is None:
            raise ValueError("`speculative_generate` needs `drafter=` (a ChainFlowDrafter).")
    elif not runs_in_chainflow(drafter):
        return _original_generate(self, *args, **kwargs)
    elif custom_generate is not None:
        raise ValueError("`custom_generate` cannot be combined with a ChainFlow `assistant_model`.")
    if "chainflow_settings" in extra:
        raise ValueError("`chainflow_settings` is set by `generate` itself from `drafter.generation_config`; omit it "
                         "and set the drafter's generation config instead.")
    inputs = call.get("inputs")
    input_ids = inputs if inputs is not None else extra.get("input_ids")
    config = effective_generation_config(self, call.get("generation_config"), extra)
    settings = SpeculativeSettings.from_drafter(drafter, config)  # the drafting settings, read and checked once
    batch, padded = _batch_shape(input_ids, extra.get("attention_mask"))
    own = direct or batch > 1 or padded or settings.needs_own_loop(self, config, call.get("stopping_criteria"))
    with bound_for_the_call(self, drafter):
        validate_speculative_call(self, drafter, config, input_ids, {**extra, "streamer": call.get("streamer")},
                                  own_loop=own)
        if settings.max_batch_size is not None and batch > settings.max_batch_size:
            return _generate_without_drafting(self, call, extra, drafter, settings, batch, direct)
        if not own:  # transformers' assisted loop; its candidate generator takes the settings from here
            token = _CALL_SETTINGS.set((drafter, settings))
            try:
                return _original_generate(self, *args, **kwargs)
            finally:
                _CALL_SETTINGS.reset(token)
        call["stopping_criteria"] = _with_stop_strings(config, call.get("stopping_criteria"), extra)
        if not direct:
            call.update(custom_generate=speculative_generate, assistant_model=None)
            extra["drafter"] = drafter
        streamer = call.pop("streamer", None)  # transformers hands a `custom_generate` loop no streamer
        return _original_generate(self, **call, chainflow_streamer=streamer, chainflow_settings=settings, **extra)


def _batch_shape(input_ids, attention_mask) -> tuple[int, bool]:
    """Rows in the call, and whether its attention mask pads any of them."""
    if input_ids is None or input_ids.dim() != 2:
        return 1, False
    padded = attention_mask is not None and isinstance(attention_mask, torch.Tensor) and not bool(attention_mask.all())
    return int(input_ids.shape[0]), padded


def _generate_without_drafting(model, call: dict, extra: dict, drafter, settings, batch: int, direct: bool):
    """Plain `generate` for a batch above `max_speculative_batch_size` (the same output: speculative decoding is
    exact); `drafter.last_stats` says so."""
    call = {k: v for k, v in call.items() if k not in ("assistant_model", "custom_generate")}
    extra = {k: v for k, v in extra.items() if not (direct and k in ("drafter", "gdn_method"))}
    stats = SpeculativeStats(mode=settings.mode, loop="plain", batch_size=batch, speculative=False,
                             reason=f"batch of {batch} > drafter.generation_config.max_speculative_batch_size="
                                    f"{settings.max_batch_size}: decoded without drafting")
    drafter.last_stats = stats
    out = _original_generate(model, **call, **extra)
    sequences = out if isinstance(out, torch.Tensor) else out.sequences
    inputs = call.get("inputs") if call.get("inputs") is not None else extra.get("input_ids")
    new = sequences[:, inputs.shape[1]:]  # (B, n): a row that ended on EOS is filled after it
    eos = effective_generation_config(model, call.get("generation_config"), extra).eos_token_id
    if eos is not None and new.shape[1]:
        ended = torch.isin(new, torch.tensor(eos if isinstance(eos, list) else [eos], device=new.device))
        after = ended.long().cumsum(1) - ended.long() > 0  # positions after a row's first EOS
        stats.new_tokens = int((~after).sum())
    else:
        stats.new_tokens = int(new.numel())
    return out


def _with_stop_strings(config: GenerationConfig, stopping_criteria, kwargs: dict):
    """For the own loop: transformers drops `tokenizer` for `custom_generate` callables, so the stop-string
    criterion is built here (and `stop_strings` / `tokenizer` taken out of `kwargs`)."""
    if config.stop_strings is None:
        return stopping_criteria
    tokenizer = kwargs.pop("tokenizer", None)
    if tokenizer is None:
        raise ValueError("`stop_strings` needs the model's tokenizer: pass `tokenizer=` to `generate`.")
    stop = StopStringCriteria(stop_strings=config.stop_strings, tokenizer=tokenizer)
    kwargs["stop_strings"] = None
    return StoppingCriteriaList([*(stopping_criteria or []), stop])


@functools.wraps(_original_get_candidate_generator)
def _get_candidate_generator(self, *args, **kwargs):
    call = _GET_CANDIDATE_GENERATOR.bind(self, *args, **kwargs).arguments
    drafter = call.get("assistant_model")
    if not is_chainflow_drafter(drafter):
        return _original_get_candidate_generator(self, *args, **kwargs)
    checked = _CALL_SETTINGS.get()
    settings = checked[1] if checked is not None and checked[0] is drafter else None
    return ChainFlowCandidateGenerator(drafter, call["generation_config"], call.get("logits_processor"),
                                       settings=settings)


def install() -> None:
    """Install the two narrow wrappers (idempotent). Raises `RuntimeError` when transformers' `generate` or
    `_get_candidate_generator` lacks a parameter the wrappers read (another transformers version)."""
    if getattr(GenerationMixin.generate, "_chainflow", False):
        return
    for name, signature, used in (("generate", _GENERATE, _GENERATE_PARAMETERS_USED),
                                  ("_get_candidate_generator", _GET_CANDIDATE_GENERATOR,
                                   _GET_CANDIDATE_GENERATOR_PARAMETERS_USED)):
        missing = [p for p in used if p not in signature.parameters]
        if missing:
            import transformers

            raise RuntimeError(f"`GenerationMixin.{name}` of transformers {transformers.__version__} has no parameters "
                               f"{missing}, which hf_chainflow's `generate` hook reads; install the transformers "
                               f"version hf_chainflow requires.")
    _generate._chainflow = True
    GenerationMixin.generate = _generate
    GenerationMixin._get_candidate_generator = _get_candidate_generator
