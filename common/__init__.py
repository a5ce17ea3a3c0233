"""The layer under training and evaluation: what both use, and neither owns.

The training config and its files (``config``), the clip dataset (``clips``, with its clip
table ``clip_table`` and the epoch its draws follow ``epoch_dataset``), reading and writing
video files (``video``), the frozen reference VAE (``reference_vae``), the reconstruction
metrics (``metrics``) and reading what a training run left on disk (``run_files``). It
imports ``base`` and ``models``, nothing from ``training`` or ``evaluation``.
"""
