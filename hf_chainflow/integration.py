"""How `import hf_chainflow` hooks into `model.generate`, narrowly.

transformers has no registry for third-party candidate generators.  Two class attributes of
`transformers.GenerationMixin` are wrapped, and both wrappers return the original behaviour untouched unless
`assistant_model` is a ChainFlow drafter (or `custom_generate` is `hf_chainflow.speculative_generate`):

- `generate`: checks a ChainFlow call up front (one place, before anything changes), then either lets
  transformers' assisted-decoding loop run (chain drafting on dense targets) or routes the call to
  hf_chainflow's own loop through transformers' `custom_generate` hook (tree mode, hybrid/stateful targets,
  stop strings and custom stopping criteria, which a multi-token commit in transformers' loop could overshoot).
- `_get_candidate_generator`: returns a `ChainFlowCandidateGenerator` for a ChainFlow drafter.
"""

from __future__ import annotations

import contextlib
import copy
import functools

from transformers import DynamicCache, GenerationConfig, StoppingCriteriaList
from transformers.generation.stopping_criteria import StopStringCriteria
from transformers.generation.utils import GenerationMixin

from .candidate_generator import ChainFlowCandidateGenerator
from .hybrid import GDN_METHODS, check_forkable_target
from .hybrid import is_hybrid_target as has_recurrent_layers
from .lookup import lookup_settings
from .modeling_chainflow import check_num_flow_steps

_UNSUPPORTED_CACHES = ("static", "offloaded", "offloaded_static", "quantized", "sliding_window", "hybrid",
                       "mamba", "hybrid_chunked", "paged")  # paged: transformers would switch to continuous batching
_SUPPORTED_ATTN = ("sdpa", "eager")


def is_chainflow_drafter(obj) -> bool:
    """True for objects that draft the ChainFlow way (`ChainFlowDrafter`, `OracleDrafter`)."""
    return getattr(obj, "is_chainflow_drafter", False) is True


def is_hybrid_target(model) -> bool:
    """A target with recurrent (linear-attention / state-space) layers whose state cannot be cropped."""
    return bool(getattr(model, "_is_stateful", False))


def effective_generation_config(model, generation_config: GenerationConfig | None, kwargs: dict) -> GenerationConfig:
    """The generation config `generate` will use: transformers' own merge (the given config, its unset fields
    filled from `model.generation_config`, then matching kwargs), so a model default such as `stop_strings` is seen
    here too. `kwargs` is not changed."""
    config, _ = model._prepare_generation_config(copy.copy(generation_config), **dict(kwargs))
    return config


def draft_settings(drafter) -> dict:
    """The drafting settings of `drafter.generation_config`, validated."""
    g = drafter.generation_config
    mode = getattr(g, "draft_mode", "chain")
    if mode not in ("chain", "tree"):
        raise ValueError(
            f"`drafter.generation_config.draft_mode` must be 'chain' or 'tree', got {mode!r}."
        )
    settings = {
        **lookup_settings(g),
        "mode": mode,
        "num_tokens": g.num_assistant_tokens,
        "tree_width": getattr(g, "tree_width", 8),
        "tree_depth": getattr(g, "tree_depth", 4),
        "tree_budget": getattr(g, "tree_budget", None),
        "num_flow_steps": getattr(g, "num_flow_steps", None),
    }
    check_num_flow_steps(settings["num_flow_steps"], "drafter.generation_config.num_flow_steps")
    # transformers' assistant-model knobs that a ChainFlow drafter does not implement: refused, not ignored.
    schedule = getattr(g, "num_assistant_tokens_schedule", None)
    if schedule not in (None, "constant"):
        raise ValueError(
            f"`drafter.generation_config.num_assistant_tokens_schedule` is {schedule!r}, but a ChainFlow drafter "
            f"drafts a fixed `num_assistant_tokens` ({g.num_assistant_tokens}) every round. Set it to 'constant' "
            f"and choose `num_assistant_tokens` (or `draft_mode='tree'` with `tree_budget`)."
        )
    threshold = getattr(g, "assistant_confidence_threshold", None)
    if threshold is not None:
        raise ValueError(
            f"`drafter.generation_config.assistant_confidence_threshold` is {threshold!r}, but a ChainFlow drafter "
            f"does not stop a draft on its own confidence. Set it to None (a tree with `tree_budget` keeps the "
            f"drafter's most probable nodes instead)."
        )
    max_depth = drafter.max_draft_depth
    for name, value in (("num_assistant_tokens", settings["num_tokens"]), ("tree_depth", settings["tree_depth"]),
                        ("tree_width", settings["tree_width"])):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"`drafter.generation_config.{name}` must be a positive integer, got {value!r}.")
    budget = settings["tree_budget"]
    if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool) or budget < 1):
        raise ValueError(
            f"`drafter.generation_config.tree_budget` must be None (keep all tree_width x tree_depth nodes) or a "
            f"positive integer (keep that many nodes of highest path probability), got {budget!r}."
        )
    for name in ("num_tokens", "tree_depth"):
        if settings[name] > max_depth:
            label = "num_assistant_tokens" if name == "num_tokens" else "tree_depth"
            raise ValueError(
                f"`drafter.generation_config.{label}` is {settings[name]}, but this drafter predicts at most "
                f"{max_depth} positions per pass. Use a value in [1, {max_depth}]."
            )
    return settings


# Assistant settings transformers takes from the assistant's generation config only; given to `generate` they would
# be ignored without a word.
_ASSISTANT_CONFIG_FIELDS = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold",
                            "assistant_lookbehind", "target_lookbehind")


def validate_speculative_call(model, drafter, generation_config: GenerationConfig, input_ids, kwargs: dict,
                              own_loop: bool) -> None:
    """Every check of a ChainFlow `generate` call, before anything runs. Raises `ValueError`."""
    drafter.check_target(model)
    draft_settings(drafter)  # checks every drafting field of `drafter.generation_config`
    if input_ids is not None and input_ids.dim() == 2 and input_ids.shape[0] != 1:
        raise ValueError(
            f"ChainFlow speculative generation supports batch size 1 (as transformers' assisted decoding does), "
            f"got a batch of {input_ids.shape[0]}. Call `generate` once per prompt."
        )
    if (generation_config.num_beams or 1) > 1:
        raise ValueError(
            f"`num_beams` must be 1 with a ChainFlow drafter (speculative decoding is greedy or sampling), "
            f"got {generation_config.num_beams}."
        )
    if generation_config.prompt_lookup_num_tokens is not None:
        raise ValueError(
            f"`prompt_lookup_num_tokens` ({generation_config.prompt_lookup_num_tokens}) cannot be combined with "
            f"`assistant_model`: choose prompt lookup or the ChainFlow drafter."
        )
    if generation_config.assistant_early_exit is not None or getattr(generation_config, "use_mtp", False):
        name = "assistant_early_exit" if generation_config.assistant_early_exit is not None else "use_mtp"
        raise ValueError(
            f"`{name}={getattr(generation_config, name)!r}` (from the call or the target's generation config) selects "
            f"transformers' own self-speculative drafting, which cannot be combined with a ChainFlow `assistant_model`. "
            f"Leave `{name}` unset for ChainFlow drafting, or call `generate` without `assistant_model`."
        )
    if kwargs.get("assistant_tokenizer") is not None:
        raise ValueError(
            "`assistant_tokenizer` is not used by a ChainFlow drafter: it is bound to the target and drafts in the "
            "target's own vocabulary. Omit `assistant_tokenizer`."
        )
    for name in _ASSISTANT_CONFIG_FIELDS:  # transformers reads these from the assistant's config, never the call's
        if kwargs.get(name) is not None:
            raise ValueError(
                f"`{name}={kwargs[name]!r}` was passed to `generate`, where an assistant model ignores it: the drafter "
                f"reads its drafting settings from its own generation config (as transformers' assistants do). Set "
                f"`drafter.generation_config.{name}` instead."
            )
    if (generation_config.num_return_sequences or 1) > 1:
        raise ValueError(
            f"`num_return_sequences` must be 1 with a ChainFlow drafter, got {generation_config.num_return_sequences}."
        )
    if generation_config.use_cache is False or kwargs.get("use_cache") is False:
        raise ValueError(
            "`use_cache=False` cannot be combined with a ChainFlow drafter: verification scores the drafts against "
            "the target's cache and then crops it. Leave `use_cache` unset (True)."
        )
    cache_impl = generation_config.cache_implementation
    if cache_impl is not None and cache_impl in _UNSUPPORTED_CACHES:
        raise ValueError(
            f"`cache_implementation={cache_impl!r}` is not supported with a ChainFlow drafter: verification crops "
            f"and gathers the cache. Use the default dynamic cache (leave `cache_implementation` unset)."
        )
    if generation_config.guidance_scale is not None and generation_config.guidance_scale != 1:
        raise ValueError(
            f"`guidance_scale={generation_config.guidance_scale}` cannot be combined with a ChainFlow drafter: "
            f"classifier-free guidance keeps a per-call state that scoring several draft positions at once would "
            f"corrupt. Leave `guidance_scale` unset (or 1), or generate without `assistant_model`."
        )
    if is_hybrid_target(model) or (own_loop and has_recurrent_layers(model)):
        check_forkable_target(model)  # the own loop forks recurrent state per node: Gated DeltaNet layers only
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if cache is not None and type(cache) is not DynamicCache and not is_hybrid_target(model):
        raise ValueError(
            f"A ChainFlow drafter needs a `DynamicCache`, got {type(cache).__name__}. Pass no cache, or a "
            f"`DynamicCache`."
        )
    if cache is not None and cache.get_seq_length() > 0:
        raise ValueError(
            f"The cache passed to `generate` already holds {cache.get_seq_length()} tokens; ChainFlow speculative "
            f"generation prefills the whole prompt itself. Pass an empty cache (or none) with the full prompt."
        )
    if own_loop and kwargs.get("inputs_embeds") is not None:
        raise ValueError(
            f"`inputs_embeds` (shape {tuple(kwargs['inputs_embeds'].shape)}) is not supported by hf_chainflow's own "
            f"speculative loop (tree mode, a lookup branch, hybrid targets, stop strings); pass `input_ids`."
        )
    gdn_method = kwargs.get("gdn_method", "chunk")
    if gdn_method not in GDN_METHODS:
        raise ValueError(f"`gdn_method` must be one of {GDN_METHODS} (the Gated DeltaNet tree back-end), got "
                         f"{gdn_method!r}.")
    attn = model.config._attn_implementation
    if own_loop and attn not in _SUPPORTED_ATTN:
        raise ValueError(
            f"Tree verification and hybrid targets need an attention implementation that takes a 4-D mask, one of "
            f"{_SUPPORTED_ATTN}; the target uses {attn!r}. Load it with `attn_implementation='sdpa'`."
        )
    if own_loop:
        for flag in ("output_scores", "output_logits", "output_attentions", "output_hidden_states"):
            if getattr(generation_config, flag, False):
                raise ValueError(
                    f"`{flag}=True` is not supported by hf_chainflow's own speculative loop (tree mode, hybrid "
                    f"targets, stop strings); `return_dict_in_generate=True` returns `sequences`."
                )


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


def needs_own_loop(model, drafter, generation_config: GenerationConfig, stopping_criteria) -> bool:
    settings = draft_settings(drafter)
    return (
        settings["mode"] == "tree"
        or settings["lookup_num_tokens"] is not None
        or is_hybrid_target(model)
        or generation_config.stop_strings is not None
        or bool(stopping_criteria)
    )


_original_generate = GenerationMixin.generate
_original_get_candidate_generator = GenerationMixin._get_candidate_generator


@functools.wraps(_original_generate)
def _generate(self, inputs=None, generation_config=None, logits_processor=None, stopping_criteria=None,
              prefix_allowed_tokens_fn=None, synced_gpus=None, assistant_model=None, streamer=None,
              negative_prompt_ids=None, negative_prompt_attention_mask=None, custom_generate=None, **kwargs):
    from .decoding import speculative_generate

    call = functools.partial(
        _original_generate, self, inputs, generation_config, logits_processor, stopping_criteria,
        prefix_allowed_tokens_fn, synced_gpus, negative_prompt_ids=negative_prompt_ids,
        negative_prompt_attention_mask=negative_prompt_attention_mask,
    )
    if custom_generate is speculative_generate:  # direct use of the loop: keep the streamer
        config = effective_generation_config(self, generation_config, kwargs)
        stopping_criteria = _with_stop_strings(config, stopping_criteria, kwargs)
        with bound_for_the_call(self, kwargs.get("drafter")):
            return _original_generate(
                self, inputs, generation_config, logits_processor, stopping_criteria, prefix_allowed_tokens_fn,
                synced_gpus, negative_prompt_ids=negative_prompt_ids,
                negative_prompt_attention_mask=negative_prompt_attention_mask, custom_generate=custom_generate,
                chainflow_streamer=streamer, **kwargs,
            )
    if not is_chainflow_drafter(assistant_model):
        return call(assistant_model=assistant_model, streamer=streamer, custom_generate=custom_generate, **kwargs)
    if custom_generate is not None:
        raise ValueError("`custom_generate` cannot be combined with a ChainFlow `assistant_model`.")
    input_ids = inputs if inputs is not None else kwargs.get("input_ids")
    config = effective_generation_config(self, generation_config, kwargs)
    own = needs_own_loop(self, assistant_model, config, stopping_criteria)
    with bound_for_the_call(self, assistant_model):
        validate_speculative_call(self, assistant_model, config, input_ids, kwargs, own_loop=own)
        if own:
            stopping_criteria = _with_stop_strings(config, stopping_criteria, kwargs)
            return _original_generate(
                self, inputs, generation_config, logits_processor, stopping_criteria, prefix_allowed_tokens_fn,
                synced_gpus, negative_prompt_ids=negative_prompt_ids,
                negative_prompt_attention_mask=negative_prompt_attention_mask, custom_generate=speculative_generate,
                drafter=assistant_model, chainflow_streamer=streamer, **kwargs,
            )
        return call(assistant_model=assistant_model, streamer=streamer, **kwargs)


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
def _get_candidate_generator(self, generation_config, input_ids, inputs_tensor, logits_processor, model_kwargs,
                             assistant_model=None, target_tokenizer=None, assistant_tokenizer=None):
    if is_chainflow_drafter(assistant_model):
        return ChainFlowCandidateGenerator(assistant_model, generation_config, logits_processor)
    return _original_get_candidate_generator(
        self, generation_config, input_ids, inputs_tensor, logits_processor, model_kwargs,
        assistant_model=assistant_model, target_tokenizer=target_tokenizer, assistant_tokenizer=assistant_tokenizer,
    )


def install() -> None:
    """Install the two narrow wrappers (idempotent)."""
    if getattr(GenerationMixin.generate, "_chainflow", False):
        return
    _generate._chainflow = True
    GenerationMixin.generate = _generate
    GenerationMixin._get_candidate_generator = _get_candidate_generator
