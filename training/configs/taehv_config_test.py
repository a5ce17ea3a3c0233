"""Tiny config for tests and smoke runs: a few steps at 32x32 on the demo clips
(the from-scratch preset, without the demo's crops and validation size, and without EMA:
over 4 steps its average says nothing, and it costs a run of this size a sixth of its time,
in loading diffusers' EMA and a third copy of the weights in every checkpoint; the tests
whose subject includes it, exact resumes, skipped windows and validation with its weights,
turn it on with ``--use_ema=true``)."""

from taehv_train.training.configs.taehv_config_scratch import config as scratch

config = scratch.replace(
    output_dir="output/test",
    data_root="demo_output/data",
    annotation_file="demo_output/data/annotations_train.json",
    val_annotation_file="demo_output/data/annotations_val.json",
    width=32,
    train_batch_size=1,
    mixed_precision="no",  # the same on every machine (the from-scratch preset takes bf16 where it is native)
    frame_cache_mb=0,  # reads the files, as the bad-file and data-gone tests need
    learning_rate=1e-3,
    max_train_steps=4,
    dataloader_num_workers=0,
    log_every=1,
    validation_every=2,
    num_validation_samples=2,
    image_log_every=2,
    checkpointing_steps=2,
    use_ema=False,
)
