"""The layer under training and evaluation: what both use, and neither owns (the config, the
clip dataset, video files, the reference VAE, the metrics, a run's files on disk). It
imports ``base`` and ``models``, nothing from ``training`` or ``evaluation``. Module by
module: docs/modules.md."""
