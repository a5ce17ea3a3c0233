"""The config check before any heavy work: every component's ``config_errors(config)``, asked in one go.

Every numeric key's range is one table, ``common.config_ranges.RANGES``, checked first: the
components compute with those values. Each component owns the rules that relate its keys to
each other, the variant and the data (sizes and frames, the reference VAE, the losses,
Seraena, optimisation, early stopping, fault handling, trackers); whether a valid config fits this
machine's memory is ``training.loop.memory.check_fits``. This module only asks them all, so
a user sees every problem of a kind at once. The launch script, training, the latent-cache
builder and the tests call ``check``.

The whole pre-flight is ``notes_of``; the launch script runs it once per launch
(``training.launch_check``), and its training processes log its notes without checking again.
"""

from __future__ import annotations

from taehv_train.common import reference_vae
from taehv_train.common.config import TrainConfig, invalid_config, spec_of, type_problems
from taehv_train.common.config_ranges import range_problems
from taehv_train.common.missing_paths import missing_paths
from taehv_train.models.vae_classes import REF_VAE_CLASSES
from taehv_train.models.vae_registry import AUTO_CLASS
from taehv_train.training.data import latent_cache, loading
from taehv_train.training.loop import adversarial, best_model, losses, optimisation, resilience, trackers
from taehv_train.training.loop.feed import feed_notes
from taehv_train.training.loop.memory import check_fits


def check(config: TrainConfig) -> list[str]:
    """Validate a config before any heavy work. Raises UserError listing every problem;
    returns informational notes (e.g. frames the reconstruction loss does not cover)."""
    if errors := type_problems(config) or range_problems(config):  # the components compute with these values
        raise invalid_config(errors)
    if config.variant == "auto":  # with_auto_variant could not tell: say why
        folder_problems = (
            reference_vae.folder_problems(config, "auto")
            if config.ref_vae_path and config.ref_vae_class in (*REF_VAE_CLASSES, AUTO_CLASS)
            else []
        )
        raise invalid_config(
            folder_problems
            or [
                "variant=auto takes the reference VAE's own TAE variant: set "
                "ref_vae_path (and ref_vae_class) to its diffusers folder, or name the variant"
            ]
        )
    spec = spec_of(config)
    errors = [
        *loading.config_errors(config, spec),
        *reference_vae.config_errors(config, spec),
        *losses.config_errors(config),
        *adversarial.config_errors(config, spec),
        *optimisation.config_errors(config),
        *latent_cache.config_errors(config),
        *best_model.config_errors(config),
        *resilience.config_errors(config),
        *trackers.config_errors(config),
        *missing_paths(config),
    ]
    if errors:
        raise invalid_config(errors)
    return [*losses.notes(config, spec), *loading.notes(config)]


def notes_of(config: TrainConfig) -> list[str]:
    """The whole pre-flight: ``check``, whether the config fits this machine
    (``check_fits``) and how its steps will be fed (``feed_notes``); raises UserError,
    returns the notes."""
    return [*check(config), *check_fits(config), *feed_notes(config)]
