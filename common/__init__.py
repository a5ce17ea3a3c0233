"""The layer under training and evaluation: what both use, and neither owns.

The training config and its files (``config``; its keys' ranges ``config_ranges``, paths
that name nothing ``missing_paths``, the presets ``presets``), user errors and how a command reports them
(``errors``), command-line flags (``flags``), the clip dataset (``clips``, with its clip
table ``clip_table`` and DataLoader ``clip_loader``), reading clip files (``video``), frame
counts from packets (``packet_count``), writing videos (``video_writer``), the frozen
reference VAE (``reference_vae``), the reconstruction metrics (``metrics``) and reading
what a training run left on disk (``run_files``). It imports ``models`` and nothing from
``training`` or ``evaluation``.
"""
