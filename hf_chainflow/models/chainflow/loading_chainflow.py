"""Loading a ChainFlow drafter: the checks `ChainFlowDrafter.from_pretrained` runs before transformers loads, and
the drafter's own `generation_config.json`.

Module-level helpers rather than staticmethods of the model class, to keep the class short (issue 63);
`from_pretrained` itself stays on `modeling_chainflow.ChainFlowDrafter`.
"""

from __future__ import annotations

import os

from transformers import GenerationConfig

from hf_chainflow.models.chainflow.configuration_chainflow import ChainFlowConfig


def check_source(source, download_kwargs: dict, *, has_config: bool) -> None:
    """Before transformers: a local folder must hold a config.json (unless `config=` is given) and its JSON files
    must parse; a Hub id that is neither cached nor reachable is refused within seconds (not after a minute of
    retries). With `cache_dir`, `revision` or `local_files_only` the Hub case is left to transformers."""
    from hf_chainflow.fileio import check_local_or_hub, check_model_folder, check_model_json

    if not isinstance(source, (str, os.PathLike)):
        return
    name = "pretrained_model_name_or_path"
    if os.path.isdir(source):
        folder = os.path.join(source, download_kwargs.get("subfolder") or "")
        if has_config:
            check_model_json(name, folder)
        else:
            check_model_folder(name, folder, weights=False)  # transformers names the weight files it missed
    elif not any(key in download_kwargs for key in ("cache_dir", "revision", "local_files_only")):
        check_local_or_hub(name, source)


def saved_generation_config(source, download_kwargs: dict) -> GenerationConfig | None:
    """The drafter's saved generation config, or None when the folder / repo has no generation_config.json (or
    the Hub cannot be reached and it is not cached, which transformers cannot tell apart from missing). A file
    that is there but does not parse raises a `ValueError` naming it (transformers' `OSError` for it reads as
    'missing')."""
    from transformers.utils import cached_file

    from hf_chainflow.fileio import read_json

    resolved = cached_file(source, "generation_config.json", _raise_exceptions_for_missing_entries=False,
                           **download_kwargs)
    if resolved is None:
        return None
    read_json(resolved, what=f"generation config of the drafter {str(source)!r}",
              fix="Copy or download the drafter again, or save its settings again "
                  "(`drafter.generation_config.save_pretrained(folder)`); delete the file only to load the "
                  "default drafting settings (a chain of 3) instead.")
    return GenerationConfig.from_pretrained(os.path.dirname(resolved))


def check_model_type(source, name: str, download_kwargs: dict, config_class=ChainFlowConfig,
                     what: str = "a ChainFlow drafter") -> None:
    """Refuse a folder / Hub repo whose config is another model type than `config_class`'s (transformers would
    only warn, then build a drafter with random weights)."""
    try:
        config_dict, _ = config_class.get_config_dict(source, **download_kwargs)
    except OSError:
        return  # no readable config there: transformers' own loading raises its error for this path
    model_type = config_dict.get("model_type")
    if model_type is not None and model_type != config_class.model_type:
        raise ValueError(
            f"`{name}` ({str(source)!r}) holds a config with model_type={model_type!r}, "
            f"not {config_class.model_type!r}: it is not {what}. Give the folder (or Hub id) of "
            f"a drafter saved with `save_pretrained`; bind the target model with `target=`."
        )


HUB_KEYS = ("cache_dir", "force_download", "proxies", "local_files_only", "token", "revision", "subfolder")


def check_pretrained_source(pretrained_model_name_or_path, kwargs: dict, config_class=ChainFlowConfig,
                            what: str = "a ChainFlow drafter") -> dict:
    """The checks of a drafter's `from_pretrained` before anything loads: the source exists (a folder, or a Hub repo
    reachable or cached) and its config (or `config=` given as a path) is `config_class`'s model type. Returns the
    Hub download arguments among `kwargs`."""
    download_kwargs = {k: kwargs[k] for k in HUB_KEYS if k in kwargs}
    config = kwargs.get("config")
    if pretrained_model_name_or_path is not None:
        check_source(pretrained_model_name_or_path, download_kwargs, has_config=config is not None)
    source = pretrained_model_name_or_path if config is None else config
    if isinstance(source, (str, os.PathLike)):  # not for `config=` given as a config object
        check_model_type(source, "pretrained_model_name_or_path" if config is None else "config",
                         download_kwargs, config_class, what)
    return download_kwargs


__all__ = ["HUB_KEYS", "check_model_type", "check_pretrained_source", "check_source", "saved_generation_config"]
